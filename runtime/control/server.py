"""The serving runtime: QoS priority queue, batching, policies, watermarks, caches, fallback.

Requests enter through `submit` (any thread) and get a `Future`. One worker thread takes the
highest-priority requests (QoS class, then arrival) up to `max_batch`, asks the policy for a
`Decision`, serves exact repeats from the result cache, and runs the rest through the tiered
executor (tiers become regrouped batches inside). A light-path answer whose confidence is below
the preset's threshold is recomputed in the next higher tier that would answer differently, at
most `max_fallback_steps` times (from the probe boundary, with the rows already in that tier),
except while the policy shifts the tier thresholds: then even the largest budget did not hold
the SLO, and retries would only feed the overload.

Memory watermarks (system memory fraction from the resource monitor):
- >= 60%: shrink the result cache to the preset's `cache_keep` share and clear the region cache;
- >= 80%: raise the budget to at least `pressure_budget` and stop admitting the lowest QoS class;
- >= 95%: shed every new request with a clear error. Admitted requests are always served.
Bad requests (empty text, over-long input, unknown QoS class, bad budget) fail alone, with a
`RequestError` on their future; the runtime keeps serving.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from rbcompile.artifact.plans import check_budget
from rbcompile.errors import UserError
from rbcompile.runtime.control.admission import (
    QOS_CLASSES,
    Overloaded,
    Watermarks,
    admit,
    check_qos,
)
from rbcompile.runtime.control.complexity import Tiers
from rbcompile.runtime.control.executor import (
    RowResult,
    TieredExecutor,
    confidence_of,
    pad_batch,
    plan_key,
)
from rbcompile.runtime.control.monitors import (
    DEFAULT_PERIOD_S,
    LatencyTracker,
    MonitorSampler,
    QualityMonitor,
    ResourceMonitor,
)
from rbcompile.runtime.control.policy import BasePolicy, Decision, PolicyState
from rbcompile.runtime.control.result_cache import ResultCache, fingerprint

log = logging.getLogger(__name__)

LATENCY_WINDOW_S = 5.0   # policies see the p50 / p99 latency of the last 5 s


class RequestError(UserError):
    """A request that cannot be served; only that request fails."""


@dataclass(frozen=True)
class Preset:
    """Field-tested settings: accept a light answer at `confidence_threshold` or better, else
    escalate at most `max_fallback_steps` times; keep `cache_keep` of the result cache at the
    60% watermark."""
    confidence_threshold: float
    max_fallback_steps: int
    cache_keep: float


PRESETS = {
    "realtime-chat": Preset(0.65, 2, 0.4),
    "document-summary": Preset(0.78, 3, 0.6),
    "code-generation": Preset(0.72, 1, 0.3),
}


@dataclass
class ServerConfig:
    max_batch: int = 16
    max_queue: int = 10_000
    slo_s: float = 0.1
    preset: Preset = field(default_factory=lambda: PRESETS["realtime-chat"])
    watermarks: Watermarks = field(default_factory=Watermarks)
    tiers: Tiers = field(default_factory=Tiers)
    early_exit: bool = True                # encoders with off-ramps
    max_tokens: int | None = None          # default: the model's positions
    cache_bytes: int = 64 << 20
    monitor_period_s: float = DEFAULT_PERIOD_S


@dataclass
class Response:
    outputs: dict[str, torch.Tensor]
    latency_s: float           # submit to completion
    qos: str
    budget: float
    tier: int
    exit_layer: int
    skipped: float             # share of prunable FLOPs not computed (1.0: a cache hit)
    confidence: float | None
    from_cache: bool
    fallback_steps: int


@dataclass(order=True)
class _Queued:
    priority: int
    sequence: int
    ids: torch.Tensor = field(compare=False)
    qos: str = field(compare=False)
    budget: float | None = field(compare=False)
    submitted: float = field(compare=False)
    future: Future = field(compare=False)


class AdaptiveServer:
    """Serve a CompiledModel under a policy. `start()`, `submit(...)`, `stop()`."""

    def __init__(self, compiled, policy: BasePolicy, config: ServerConfig | None = None, *,
                 memory_override=None):
        self.compiled = compiled
        self.policy = policy
        self.config = config or ServerConfig()
        self.executor = TieredExecutor(compiled, tiers=self.config.tiers,
                                       early_exit=self.config.early_exit)
        self.result_cache = ResultCache(self.config.cache_bytes)
        self.latency = LatencyTracker(latency_window_s=LATENCY_WINDOW_S)
        self.quality = QualityMonitor()
        self.resources = ResourceMonitor(queue_depth=lambda: len(self._queue), latency=self.latency,
                                         memory_override=memory_override)
        self.sampler = MonitorSampler(self.resources, self.quality, self.config.monitor_period_s)
        self.fingerprint = fingerprint(compiled)
        self.max_tokens = min(self.config.max_tokens or compiled.max_positions, compiled.max_positions)
        self.counters = {"admitted": 0, "rejected": 0, "shed": 0, "completed": 0, "failed": 0,
                         "cache_hits": 0, "fallback_steps": 0, "batches": 0, "shrinks": 0,
                         "busy_s": 0.0}
        self.decisions: list[tuple[float, Decision, int]] = []  # (time, decision, queue depth)
        self._queue: list[_Queued] = []
        self._sequence = itertools.count()
        self._cv = threading.Condition()
        self._running = False
        self._worker: threading.Thread | None = None
        self._previous = Decision()
        self._shrunk = False
        self._last_latency = 0.0

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> "AdaptiveServer":
        self._running = True
        self.sampler.start()
        self._worker = threading.Thread(target=self._serve, name="rb-server", daemon=True)
        self._worker.start()
        return self

    def stop(self) -> None:
        """Serve everything admitted, then stop."""
        with self._cv:
            self._running = False
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join()
        self.sampler.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    # ---- admission --------------------------------------------------------------------------

    def memory(self) -> float:
        return self.resources.memory_fraction()

    def submit(self, text: str | None = None, *, input_ids=None, qos: str = "standard",
               budget: float | None = None) -> Future:
        """Queue a request (text, or token ids); the future gets a `Response` or a
        `RequestError` for this request only."""
        future: Future = Future()
        try:
            ids = self._validate(text, input_ids, qos, budget)
            self._admit(qos)
        except RequestError as exc:
            future.set_exception(exc)
            return future
        with self._cv:
            if not self._running:
                future.set_exception(RequestError("the server is not running"))
                return future
            heapq.heappush(self._queue, _Queued(QOS_CLASSES.index(qos), next(self._sequence), ids,
                                                qos, budget, time.monotonic(), future))
            self.counters["admitted"] += 1
            self.latency.record_arrival()
            self._cv.notify()
        return future

    def _validate(self, text, input_ids, qos, budget) -> torch.Tensor:
        try:
            check_qos(qos)
        except UserError as exc:
            raise RequestError(str(exc)) from None
        if budget is not None:
            try:
                check_budget(budget)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of text or input_ids")
        if text is not None:
            if not isinstance(text, str) or not text.strip():
                raise RequestError("empty text")
            ids = self.compiled.tokenizer(text, return_tensors="pt", truncation=False)["input_ids"][0]
        else:
            ids = torch.as_tensor(input_ids)
            if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int64, torch.int32):
                raise RequestError("input_ids must be a non-empty 1-D integer sequence")
            if int(ids.min()) < 0 or int(ids.max()) >= self.compiled.vocab_size:
                raise RequestError(f"token ids must be in [0, {self.compiled.vocab_size})")
        if len(ids) > self.max_tokens:
            raise RequestError(f"input of {len(ids)} tokens exceeds the limit of {self.max_tokens}")
        return ids.long()

    def _admit(self, qos: str) -> None:
        try:
            admit(qos, self.memory(), len(self._queue), self.config.watermarks, self.config.max_queue)
        except Overloaded as exc:
            self.counters[exc.reason] += 1
            raise RequestError(str(exc)) from None

    # ---- serving ----------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._queue and self._running:
                    self._cv.wait()
                if not self._queue:
                    return  # stopped and drained
                batch = [heapq.heappop(self._queue)
                         for _ in range(min(self.config.max_batch, len(self._queue)))]
            started = time.perf_counter()
            try:
                self._serve_batch(batch)
            except Exception as exc:  # never lose an admitted request silently
                log.exception("batch failed")
                for item in batch:
                    if not item.future.done():
                        self.counters["failed"] += 1
                        item.future.set_exception(exc)
            self.counters["busy_s"] += time.perf_counter() - started

    def state(self, batch: list[_Queued]) -> PolicyState:
        latest = self.sampler.latest or {}
        lat = self.latency.snapshot()
        quality = self.quality.snapshot()
        lengths = [len(item.ids) for item in batch] or [0]
        cheap = self.executor.estimator.cheap_score
        complexity = (sum(float(cheap(i.ids[None], torch.ones_like(i.ids[None]))) for i in batch)
                      / len(batch) if batch else 0.0)
        finite = lambda v: v if math.isfinite(v) else 0.0  # noqa: E731
        return PolicyState(
            memory=self.memory(), input_length=sum(lengths) / len(lengths),
            complexity=complexity, queue_depth=len(self._queue), arrival_rate=lat["arrival_rate"],
            last_latency=self._last_latency, latency_p50=finite(lat["p50"]),
            latency_p99=finite(lat["p99"]), confidence_mean=quality["mean"],
            confidence_p10=quality["p10"], cpu_utilisation=latest.get("cpu_utilisation", 0.0),
            previous_budget=self._previous.budget, slo_s=self.config.slo_s,
            max_length=self.compiled.max_positions)

    def _decide(self, state: PolicyState) -> Decision:
        decision = self.policy.decide(state)
        marks = self.config.watermarks
        if state.memory >= marks.shrink and not self._shrunk:
            self.counters["shrinks"] += 1
            self.result_cache.shrink(self.config.preset.cache_keep)
            self.compiled.module.region_cache.clear()
            self._shrunk = True
        elif state.memory < marks.shrink and self._shrunk:
            self.result_cache.restore()
            self._shrunk = False
        if state.memory >= marks.protect and decision.budget < marks.pressure_budget:
            decision = dataclasses.replace(decision, budget=marks.pressure_budget)
        return decision

    def _serve_batch(self, batch: list[_Queued]) -> None:
        state = self.state(batch)
        decision = self._decide(state)
        self._previous = decision
        self.counters["batches"] += 1
        self.decisions.append((time.monotonic(), decision, state.queue_depth))
        pending = []
        for item in batch:
            own = decision if item.budget is None else dataclasses.replace(decision,
                                                                            budget=item.budget)
            key = ResultCache.key(self.fingerprint, plan_key(own), item.ids)
            hit = self.result_cache.get(key) if own.use_cache else None
            if hit is not None:
                self.counters["cache_hits"] += 1
                self._complete(item, own, RowResult(hit, -1, 0.0, -1, 1.0, confidence_of(hit)), True)
            else:
                pending.append((item, own, key))
        groups: dict[Decision, list] = {}
        for entry in pending:
            groups.setdefault(entry[1], []).append(entry)
        for own, entries in groups.items():
            results = self._run([e[0].ids for e in entries], own)
            for (item, _, key), result in zip(entries, results):
                if own.use_cache:
                    self.result_cache.put(key, result.outputs)
                self._complete(item, own, result, False)
        self.policy.observe(self.state([]))

    def _run(self, ids_list, decision: Decision) -> list[RowResult]:
        """Results for a list of requests (padded into one batch), with confidence fallback."""
        ids, mask = pad_batch(ids_list)
        preset = self.config.preset
        # a tier shift means the largest budget did not hold the SLO: no compute for retries
        steps = 0 if decision.tier_shift > 0 else preset.max_fallback_steps
        results = self.executor.run(ids, mask, decision, preset.confidence_threshold, steps)
        self.counters["fallback_steps"] += sum(r.fallback_steps for r in results)
        return results

    def _complete(self, item: _Queued, decision: Decision, result: RowResult,
                  cached: bool) -> None:
        latency = time.monotonic() - item.submitted
        self._last_latency = latency
        self.latency.record(latency)
        if result.confidence is not None:
            self.quality.record([min(1.0, max(0.0, result.confidence))])
        self.counters["completed"] += 1
        item.future.set_result(Response(result.outputs, latency, item.qos, decision.budget,
                                        result.tier, result.exit_layer,
                                        result.skipped, result.confidence,
                                        cached, result.fallback_steps))
