"""Who sets the budget of completions that bring none, for `rbcompile serve` and its Ray
replicas alike: `serve --policy` and its options as one typed object, and the policy built
from them."""
from __future__ import annotations

from dataclasses import dataclass

from rbcompile.errors import UserError
from rbcompile.runtime.control.pid import PIDConfig
from rbcompile.runtime.control.policy import GuardedPolicy, PIDPolicy, StaticPolicy


@dataclass(frozen=True)
class PolicyOptions:
    """`--policy` (static, pid or ppo), `--budget` (static's), `--slo-ms` (pid's decode-step
    latency objective) and `--policy-file` (ppo's folder from train-policy)."""
    policy: str = "static"
    budget: float = 0.0
    slo_ms: float = 100.0
    policy_file: str | None = None


def build_policy(options: PolicyOptions, max_budget: float, levels: tuple[str, ...] = ()):
    """The policy `options` name (runtime/control/policy.py, runtime/control/ppo.py); pid moves
    down the weight `levels` first (levers.precision_ladder), then its budget up to
    `max_budget` (the largest the quality guard allows). A one-line UserError for options that
    do not go together."""
    if not options.slo_ms > 0:
        raise UserError(f"--slo-ms must be > 0, got {options.slo_ms}")
    if (options.policy == "ppo") != bool(options.policy_file):
        raise UserError("--policy-file goes with --policy ppo, and --policy ppo needs it")
    if options.policy == "static":
        return StaticPolicy(options.budget)
    if options.policy == "pid":
        return PIDPolicy(PIDConfig(setpoint=options.slo_ms / 1000, period_s=0.25),
                         max_budget=max_budget, levels=levels)
    from rbcompile.runtime.control.ppo import PPOPolicy  # torch-heavy: only for ppo

    policy = PPOPolicy.load(options.policy_file)
    if policy.info.get("simulator") != "decode-step":
        raise UserError(f"{options.policy_file}: trained for whole requests (AdaptiveServer); "
                        "serve needs a policy from train-policy --simulator decode-step")
    return GuardedPolicy(policy, StaticPolicy(0.0))
