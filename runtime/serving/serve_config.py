"""How `rbcompile serve` serves: one typed object, built once from the command line
(cli/serve_options.py) and handed unchanged to `create_app` and, pickled, to every Ray replica
and the cluster's controller."""
from __future__ import annotations

from dataclasses import dataclass, field

from rbcompile.artifact.guard import QualityGuard
from rbcompile.runtime.control.admission import Watermarks
from rbcompile.runtime.control.quality_loop import QualityLoopConfig
from rbcompile.runtime.serving.limits import ServeLimits
from rbcompile.runtime.serving.serve_policy import PolicyOptions


@dataclass(frozen=True)
class ServeConfig:
    """`api_key`: with one, every path but /health (and with `public_metrics`, /metrics)
    needs `Authorization: Bearer <api_key>`. `served_model_name`: the model id clients send
    (the source checkpoint's name is accepted too).
    `limits`: what a request may ask (runtime/serving/limits.py). Decoders' completions are
    continuously batched, at most `max_batch` rows at a time (1: one after another), with a
    prefix cache of `prefix_cache_mb` MiB of K/V blocks (0: none) and prompts longer than
    `prefill_chunk` tokens prefilled in chunks of it (None: whole). Encoders' embeddings of
    exact repeats come from a result cache of `result_cache_mb` MiB (0: none). `watermarks`:
    memory levels of admission (runtime/control/admission.py). `policy`: who sets the budget of
    completions that bring none (runtime/serving/serve_policy.py), within `guard` (None: the
    artifact's own) and the live agreement checks of `quality_loop`. `executor`, `weights` and
    `prefill_weights`: what runs the decode steps, at which weight precision, and the precision
    prompts are prefilled at (rbcompile/artifact/executors.py; the CLI applies them, Ray
    replicas when they load the artifact); `tier_weights`: the level
    each consistency tier's votes decode at (`VoteOptions.tier_weights`)."""
    api_key: str | None = None
    served_model_name: str | None = None   # the model id (None: the source checkpoint's name)
    public_metrics: bool = False           # /metrics without the API key
    limits: ServeLimits = field(default_factory=ServeLimits)
    max_batch: int = 16
    prefix_cache_mb: float = 256
    prefill_chunk: int | None = 512
    result_cache_mb: float = 256
    watermarks: Watermarks = field(default_factory=Watermarks)
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    guard: QualityGuard | None = None
    quality_loop: QualityLoopConfig = field(default_factory=QualityLoopConfig)
    executor: str = "auto"
    weights: str = "fp32"
    prefill_weights: str = "fp32"
    tier_weights: dict[int, str] | str | None = None

    @property
    def slo_s(self) -> float:
        """The decode-step latency the controller holds (the policy's objective)."""
        return self.policy.slo_ms / 1000
