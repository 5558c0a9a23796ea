"""PPO policy: a small actor-critic trained offline in the serving simulator (runtime/control/simulator.py)
and run at serving time as an INT8 network.

Network: the 12 `PolicyState.vector()` features -> 64 -> 64 (tanh) -> one categorical head per
action component (budget level, width cap, cache use) and a value head. Training: PPO with the
clipped surrogate objective, generalised advantage estimation (GAE), a value loss and an entropy
bonus; see `PPOConfig` for the constants.

Serving (`PPOPolicy`): decisions are deterministic (argmax per head). With `quantized=True` (the
default) the trunk and the action heads run on int8 weights (symmetric, one float scale per
output row) and int8 activations (symmetric, one dynamic scale per layer input); the int8 values
are multiplied and accumulated in int32 and rescaled once: `y = (W_q @ x_q) * w_scale * x_scale
+ b`. `quantized=False` runs the same layers in fp32. Files: `policy.safetensors` (fp32 weights,
quantised at load) and `policy.json` (features, action levels, simulator summary, training log,
reward constants). Nothing is pickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rbcompile.errors import UserError, first_line
from rbcompile.runtime.control.policy import FEATURES, BasePolicy, Decision, PolicyState
from rbcompile.runtime.control.simulator import ActionLevels, ServingSimulator

WEIGHTS_FILE, META_FILE = "policy.safetensors", "policy.json"
POLICY_FORMAT = "rbcompile-ppo-policy"
HIDDEN = 64


class ActorCritic(nn.Module):
    """Features -> 64 -> 64 -> one logit vector per action component, and a state value."""

    def __init__(self, head_sizes: tuple[int, ...], hidden: int = HIDDEN):
        super().__init__()
        self.head_sizes = tuple(head_sizes)
        self.trunk = nn.Sequential(nn.Linear(len(FEATURES), hidden), nn.Tanh(),
                                   nn.Linear(hidden, hidden), nn.Tanh())
        self.heads = nn.ModuleList(nn.Linear(hidden, size) for size in head_sizes)
        self.value = nn.Linear(hidden, 1)

    def forward(self, features: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        hidden = self.trunk(features)
        return [head(hidden) for head in self.heads], self.value(hidden).squeeze(-1)


@dataclass
class PPOConfig:
    """PPO constants (chosen on the synthetic simulator of tests/control/test_ppo.py: these learned an
    adaptive policy from every seed tried)."""
    rollout: int = 256          # decisions collected per iteration
    epochs: int = 10            # passes over each rollout
    minibatch: int = 128
    learning_rate: float = 3e-3
    gamma: float = 0.8          # discount per decision
    gae_lambda: float = 0.9
    clip: float = 0.2           # PPO ratio clip
    value_weight: float = 0.5
    entropy_weight: float = 0.01
    max_grad_norm: float = 0.5


def _log_prob_and_entropy(logits: list[torch.Tensor], actions: torch.Tensor):
    """Joint log-probability of the factorised actions [n, heads] and the summed entropy."""
    log_prob, entropy = 0.0, 0.0
    for index, head in enumerate(logits):
        log_p = torch.log_softmax(head, dim=-1)
        log_prob = log_prob + log_p.gather(-1, actions[..., index:index + 1]).squeeze(-1)
        entropy = entropy - (log_p.exp() * log_p).sum(-1)
    return log_prob, entropy


def _advantages(rewards, values, dones, last_value, gamma, lam):
    """GAE advantages and returns; `dones[t]` ends the episode after step t."""
    advantages = torch.zeros(len(rewards))
    running, next_value = 0.0, last_value
    for t in reversed(range(len(rewards))):
        alive = 0.0 if dones[t] else 1.0
        delta = rewards[t] + gamma * next_value * alive - values[t]
        running = delta + gamma * lam * alive * running
        advantages[t] = running
        next_value = values[t]
    return advantages, advantages + torch.tensor(values)


def train_ppo(simulator: ServingSimulator, steps: int, seed: int = 0,
              progress: Callable[[dict], None] | None = None,
              config: PPOConfig | None = None) -> tuple[ActorCritic, list[dict]]:
    """Train for `steps` decisions (one simulated day per episode, a new trace each day).
    Returns the network and the log: per iteration, steps so far and mean reward per decision.
    Runs on one thread (a 64-wide MLP only loses to thread synchronisation) and leaves torch's
    global random state as it found it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return _train(simulator, steps, seed, progress, config or PPOConfig())
    finally:
        torch.set_num_threads(threads)


def _train(simulator, steps, seed, progress, config) -> tuple[ActorCritic, list[dict]]:
    torch.manual_seed(seed)
    sampler = torch.Generator().manual_seed(seed)
    network = ActorCritic(simulator.levels.sizes)
    optimiser = torch.optim.Adam(network.parameters(), lr=config.learning_rate)
    episode = 0
    state = simulator.reset(seed=seed * 100_003 + episode)
    log, taken = [], 0
    while taken < steps:
        count = min(config.rollout, steps - taken)
        features, actions, log_probs, values, rewards, dones = [], [], [], [], [], []
        for _ in range(count):
            x = torch.tensor(state.vector(), dtype=torch.float32)
            with torch.no_grad():
                logits, value = network(x)
            action = torch.stack([torch.multinomial(torch.softmax(head, -1), 1,
                                                    generator=sampler)[0] for head in logits])
            reward, next_state, _ = simulator.step(simulator.levels.decision(action.tolist()))
            features.append(x)
            actions.append(action)
            log_probs.append(_log_prob_and_entropy(logits, action)[0])
            values.append(float(value))
            rewards.append(reward)
            dones.append(next_state is None)
            if next_state is None:
                episode += 1
                next_state = simulator.reset(seed=seed * 100_003 + episode)
            state = next_state
        taken += count
        with torch.no_grad():
            last_value = 0.0 if dones[-1] else float(network(torch.tensor(state.vector()))[1])
        advantages, returns = _advantages(rewards, values, dones, last_value, config.gamma,
                                          config.gae_lambda)
        advantages = (advantages - advantages.mean()) / (advantages.std(correction=0) + 1e-8)
        batch_x, batch_a = torch.stack(features), torch.stack(actions)
        old_log_p = torch.stack(log_probs)
        for _ in range(config.epochs):
            for chunk in torch.randperm(count, generator=sampler).split(config.minibatch):
                logits, value = network(batch_x[chunk])
                log_p, entropy = _log_prob_and_entropy(logits, batch_a[chunk])
                ratio = (log_p - old_log_p[chunk]).exp()
                clipped = ratio.clamp(1 - config.clip, 1 + config.clip)
                surrogate = torch.min(ratio * advantages[chunk], clipped * advantages[chunk])
                value_loss = (value - returns[chunk]).pow(2).mean()
                loss = (-surrogate.mean() + config.value_weight * value_loss
                        - config.entropy_weight * entropy.mean())
                optimiser.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(network.parameters(), config.max_grad_norm)
                optimiser.step()
        log.append({"iteration": len(log) + 1, "steps": taken, "episodes": episode,
                    "mean_reward": sum(rewards) / count})
        if progress:
            progress(log[-1])
    network.eval()
    return network, log


class _Linear:
    """One layer for serving: fp32, or int8 weights (per-row scales) x int8 activations
    (per-tensor dynamic scale) with an int32 multiply-accumulate."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, quantized: bool):
        weight = weight.detach().numpy().astype(np.float32)
        self.bias = bias.detach().numpy().astype(np.float32)
        self.quantized = quantized
        if quantized:
            self.scale = np.maximum(np.abs(weight).max(axis=1), 1e-12) / 127.0
            self.weight = np.clip(np.rint(weight / self.scale[:, None]), -127, 127).astype(np.int8)
        else:
            self.weight = weight

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if not self.quantized:
            return self.weight @ x + self.bias
        x_scale = max(float(np.abs(x).max()), 1e-12) / 127.0
        x_q = np.clip(np.rint(x / x_scale), -127, 127).astype(np.int8)
        accumulated = self.weight.astype(np.int32) @ x_q.astype(np.int32)
        return accumulated * (self.scale * x_scale) + self.bias


class PPOPolicy(BasePolicy):
    """A trained PPO network deciding by argmax per action head; INT8 unless `quantized=False`.
    `info` is what policy.json records besides the network (simulator summary, training log...)."""
    name = "ppo"

    def __init__(self, network: ActorCritic, levels: ActionLevels, *, quantized: bool = True,
                 info: dict | None = None):
        self.network = network
        self.levels = levels
        self.quantized = quantized
        self.info = info or {}
        heads = network.heads
        self._layers = [_Linear(network.trunk[0].weight, network.trunk[0].bias, quantized),
                        _Linear(network.trunk[2].weight, network.trunk[2].bias, quantized),
                        _Linear(torch.cat([h.weight for h in heads]),   # per-row scales: the
                                torch.cat([h.bias for h in heads]), quantized)]  # heads as one
        self._splits = np.cumsum(network.head_sizes)[:-1]

    def decide(self, state: PolicyState) -> Decision:
        x = np.asarray(state.vector(), dtype=np.float32)
        for layer in self._layers[:-1]:
            x = np.tanh(layer(x))
        logits = np.split(self._layers[-1](x), self._splits)
        return self.levels.decision([int(head.argmax()) for head in logits])

    def save(self, folder) -> Path:
        """Write policy.safetensors and policy.json into `folder` (created if needed)."""

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.network.state_dict().items()},
                  str(folder / WEIGHTS_FILE))
        meta = {"format": POLICY_FORMAT, "version": 1, "features": list(FEATURES),
                "hidden": HIDDEN, "actions": self.levels.to_json(), **self.info}
        (folder / META_FILE).write_text(json.dumps(meta, indent=1))
        return folder

    @classmethod
    def load(cls, folder, quantized: bool = True) -> PPOPolicy:
        """Read a policy folder written by `save`; a UserError names any missing or bad file."""

        folder = Path(folder)
        if not folder.is_dir():
            raise UserError(f"no such policy folder: {folder}")
        meta_path, weights_path = folder / META_FILE, folder / WEIGHTS_FILE
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise UserError(f"{folder}: missing {META_FILE} (not a trained policy)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{meta_path}: corrupt JSON ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != POLICY_FORMAT:
            raise UserError(f"{meta_path}: not an rbcompile PPO policy")
        if meta.get("features") != list(FEATURES):
            raise UserError(f"{meta_path}: trained on other features than this rbcompile's")
        try:
            actions = meta["actions"]
            levels = ActionLevels(tuple(actions["budget"]), tuple(actions["width"]),
                                  tuple(actions["use_cache"]))
            for indices in np.ndindex(*levels.sizes):
                levels.decision(indices)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{meta_path}: bad action levels ({exc})") from None
        if not weights_path.is_file():
            raise UserError(f"{folder}: missing {WEIGHTS_FILE}")
        try:
            tensors = load_file(str(weights_path))
        except Exception as exc:
            first = first_line(exc)
            raise UserError(f"corrupt safetensors file {weights_path}: {first}") from None
        try:
            network = ActorCritic(levels.sizes, int(meta.get("hidden", HIDDEN)))
            network.load_state_dict(tensors)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise UserError(f"{weights_path}: weights do not match {META_FILE} "
                            f"({' '.join(str(exc).split())[:200]})") from None
        network.eval()
        info = {k: v for k, v in meta.items()
                if k not in ("format", "version", "features", "hidden", "actions")}
        return cls(network, levels, quantized=quantized, info=info)
