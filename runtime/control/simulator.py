"""A discrete-event serving simulator built from measured per-setting latency and quality tables;
the PPO policy (runtime/control/ppo.py) is trained in it.

Setting: one (plan budget, head-width cap) pair of an artifact. The `ServiceTable` holds, per
setting, the quality drop against the full path (a fraction: 0.01 = 1 point; measured separately
on easy and hard inputs) and a latency model fitted by least squares to measurements of that
setting at a few batch sizes:

    seconds(batch_size, tokens_per_request) = fixed_s + per_row_s * batch_size
                                              + per_token_s * batch_size * tokens

(`tokens_per_request` is the padded length: the longest request of the batch; `per_row_s` is 0
for encoders). Decoder tables (runtime/control/decode_simulator.py) give one engine decode step there
(tokens: the batch's context length), the prefill of newcomers in `prefill_seconds`, and the
top-1 probabilities of the plan's tokens in `confidences`.

Serving: requests arrive on a tidal trace (runtime/control/workload.py); each arrival is a fresh input
with the length, complexity and hard flag of a workload input, except the trace's exact repeats
of a recent request (only those hit the result cache). Whenever the server is free and
requests wait, it takes up to `max_batch` of them (oldest first), asks the policy for a `Decision`
given a `PolicyState`, and serves the batch with the table's latency for that setting. With
`use_cache`, a request whose input is in the result cache is served at `cache_hit_s` and keeps
the quality of the setting that computed it; the others are computed and then cached (LRU of
`cache_capacity` inputs). A request's end-to-end latency is its wait plus its service time.

Reward per decision (one batch of n requests, each normalised by the batch):

    latency_term  = (1/n) * sum_i clip((slo - e2e_i) / slo, -4, 1)
    accuracy_term = 10 * max(0, drop - 0.01)         drop = (1/n) * sum_i drop_i
    switch_term   = 0.05 * (number of action components changed since the previous decision)
    reward        = latency_term - accuracy_term - switch_term

so drops up to one point are free, each further point costs 0.1, and a request at twice the SLO
costs as much as one at zero latency earns.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

import numpy as np

from rbcompile.artifact.plans import within_budget
from rbcompile.runtime.control.policy import FEATURES, BasePolicy, Decision, PolicyState
from rbcompile.runtime.control.workload import tidal_trace

LATENCY_CLIP = (-4.0, 1.0)
ACCURACY_WEIGHT = 10.0
FREE_DROP = 0.01
SWITCH_PENALTY = 0.05
REWARD_CONSTANTS = {"latency_clip": list(LATENCY_CLIP), "accuracy_weight": ACCURACY_WEIGHT,
                    "free_drop": FREE_DROP, "switch_penalty": SWITCH_PENALTY}
TABLE_FORMAT = "rbcompile-service-table"
RECENT = 200                # requests the latency percentiles and confidences look back over
WINDOW_S = 1.0              # arrival rate and CPU utilisation: over the last second, or over
WINDOW_SHARE = 1 / 48       # this share of the simulated day when that is shorter
DISTINCT_INPUTS = 100_000   # fresh inputs a day draws from (copies of the workload's inputs)


def describe_simulator(simulator, kind: str, max_length: int, **simulation) -> dict:
    """What a policy trained on `simulator` needs to know about it (policy.json): its kind, the
    service table, the reward, the day simulated (`simulation` adds fields) and the state's
    scales. Both simulators (`ServingSimulator`, `decode_simulator.DecodeSimulator`) use it."""
    return {"simulator": kind, "table": simulator.table.summary(), "reward": REWARD_CONSTANTS,
            "simulation": {**asdict(simulator.config), "duration_s": simulator.duration_s,
                           "night_rate": simulator.night_rate, **simulation,
                           "workload_inputs": len(simulator.workload)},
            "state": {"features": list(FEATURES), "slo_s": simulator.config.slo_s,
                      "max_length": max_length, "max_queue": PolicyState.max_queue}}


def batch_reward(latencies: list[float], drops: list[float], changed: int, slo_s: float) -> float:
    """The reward of one decision (see the module docstring)."""
    low, high = LATENCY_CLIP
    latency_term = sum(min(high, max(low, (slo_s - e2e) / slo_s)) for e2e in latencies)
    drop = sum(drops) / len(drops)
    return (latency_term / len(latencies) - ACCURACY_WEIGHT * max(0.0, drop - FREE_DROP)
            - SWITCH_PENALTY * changed)


def fit_latency(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(fixed_s, per_token_s) >= 0 of the least-squares line seconds ~ batch * tokens through
    (batch_size, tokens_per_request, seconds) measurements."""
    xs = [b * t for b, t, _ in points]
    ys = [s for _, _, s in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:
        return mean_y, 0.0
    fixed = mean_y - slope * mean_x
    if fixed < 0:  # through the origin instead
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return fixed, slope


def fit_step_latency(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(fixed_s, per_row_s, per_token_s) >= 0 of the least-squares fit seconds ~ fixed + per_row
    * batch + per_token * batch * context through (batch size, context length, seconds) decode
    steps: of the fits on each subset of the three terms whose coefficients are all >= 0, the
    one with the least squared error."""
    columns = {0: [1.0] * len(points), 1: [float(b) for b, _, _ in points],
               2: [float(b * t) for b, t, _ in points]}
    ys = np.array([s for _, _, s in points])
    best, best_error = (float(ys.mean()), 0.0, 0.0), math.inf
    for size in (1, 2, 3):
        for terms in itertools.combinations(range(3), size):
            x = np.array([columns[term] for term in terms]).T
            coefficients = np.linalg.lstsq(x, ys, rcond=None)[0]
            error = float(((x @ coefficients - ys) ** 2).sum())
            if (coefficients >= 0).all() and error < best_error - 1e-15:
                full = [0.0, 0.0, 0.0]
                for term, value in zip(terms, coefficients):
                    full[term] = float(value)
                best, best_error = tuple(full), error
    return best


@dataclass(frozen=True)
class Setting:
    """One (budget, width cap) of the artifact, as measured."""
    budget: float
    width: float
    drop_easy: float        # quality drop vs the full path on easy inputs (fraction)
    drop_hard: float        # ... on hard inputs
    drop: float             # ... on the whole workload
    fixed_s: float
    per_token_s: float
    skipped_share: float = 0.0
    per_row_s: float = 0.0
    prefill_fixed_s: float = 0.0          # decoders: newcomers' prefill forward, fixed +
    prefill_per_token_s: float = 0.0      # per padded prompt token
    confidences: tuple[float, ...] = ()   # decoders: quantiles of the top-1 probability

    def seconds(self, batch_size: int, tokens_per_request: int) -> float:
        return (self.fixed_s + self.per_row_s * batch_size
                + self.per_token_s * batch_size * tokens_per_request)

    def prefill_seconds(self, prompts: int, width: int) -> float:
        """One forward prefilling `prompts` prompts left-padded to `width` tokens."""
        return self.prefill_fixed_s + self.prefill_per_token_s * prompts * width

    def drop_for(self, hard: bool) -> float:
        return self.drop_hard if hard else self.drop_easy


@dataclass
class ServiceTable:
    """Measured settings; `metric` names how the drop was measured, `source` the artifact."""
    settings: list[Setting]
    metric: str = ""
    source: str = ""

    def __post_init__(self):
        self._by_key = {(s.budget, s.width): s for s in self.settings}
        if (0.0, 1.0) not in self._by_key:
            raise ValueError("a service table needs the full path (budget 0, width 1)")

    @property
    def budgets(self) -> tuple[float, ...]:
        return tuple(sorted({s.budget for s in self.settings}))

    @property
    def widths(self) -> tuple[float, ...]:
        """Width caps, 1.0 first."""
        return tuple(sorted({s.width for s in self.settings}, reverse=True))

    @property
    def full(self) -> Setting:
        return self._by_key[(0.0, 1.0)]

    def lookup(self, budget: float, width: float) -> Setting:
        """The setting a decision runs: the largest budget <= `budget` and the smallest width
        cap >= `width` (the narrowest when `width` is below all of them)."""
        level = max(b for b in self.budgets if within_budget(b, budget))
        above = [w for w in self.widths if within_budget(width, w)]
        return self._by_key[(level, min(above) if above else min(self.widths))]

    def within_one_point(self) -> Setting:
        """The largest budget (then narrowest width) whose drop is at most 1 point; when none is
        (early exits alone may cost more), the setting with the least drop."""
        fine = [s for s in self.settings if s.drop <= FREE_DROP + 1e-12]
        if not fine:
            return min(self.settings, key=lambda s: (s.drop, -s.budget))
        return max(fine, key=lambda s: (s.budget, -s.width))

    def to_json(self) -> dict:
        return {"format": TABLE_FORMAT, "version": 1, "metric": self.metric,
                "source": self.source,
                "latency_model": "fixed_s + per_row_s * batch + per_token_s * batch * tokens",
                "settings": [asdict(s) for s in self.settings]}

    @classmethod
    def from_json(cls, data: dict) -> ServiceTable:
        if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
            raise ValueError(f"not an rbcompile service table (format {TABLE_FORMAT!r} expected)")
        try:
            settings = [Setting(**{**s, "confidences": tuple(s.get("confidences", ()))})
                        for s in data["settings"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed service table setting: {exc}") from None
        return cls(settings, data.get("metric", ""), data.get("source", ""))

    def summary(self) -> dict:
        """A short description (for policy.json)."""
        full = self.full
        return {"source": self.source, "metric": self.metric, "budgets": list(self.budgets),
                "widths": list(self.widths), "settings": len(self.settings),
                "full_path": {"fixed_s": full.fixed_s, "per_row_s": full.per_row_s,
                              "per_token_s": full.per_token_s}}


@dataclass(frozen=True)
class WorkloadItem:
    """One real input: its length in tokens, its complexity score and whether it counts as hard."""
    length: int
    complexity: float
    hard: bool


@dataclass(frozen=True)
class ActionLevels:
    """The factorised discrete actions: budget level x width cap x cache use."""
    budgets: tuple[float, ...]
    widths: tuple[float, ...]
    caches: tuple[bool, ...] = (False, True)

    @property
    def sizes(self) -> tuple[int, int, int]:
        return len(self.budgets), len(self.widths), len(self.caches)

    def decision(self, indices) -> Decision:
        budget, width, cache = indices
        return Decision(self.budgets[budget], self.widths[width], self.caches[cache])

    def to_json(self) -> dict:
        return {"budget": list(self.budgets), "width": list(self.widths),
                "use_cache": list(self.caches)}


@dataclass
class SimConfig:
    """Serving and traffic parameters. The trace's peak arrival rate is `peak_load` times what the
    full path serves in full batches of `max_batch` (so the full path falls behind at midday); a
    day holds about `requests_per_day` requests."""
    slo_s: float = 0.1
    max_batch: int = 16
    requests_per_day: int = 1500
    peak_load: float = 1.3
    swing: float = 17.0
    repeat_share: float = 0.1
    cache_capacity: int = 256
    cache_hit_s: float = 5e-5
    max_length: int = 512        # normalises PolicyState.input_length: the model's positions,
                                 # as runtime/control/server.py fills it
    base_memory: float = 0.3     # memory in use with an empty result cache (fraction)
    cache_memory: float = 0.4    # what a full result cache adds


@dataclass
class EpisodeStats:
    """One simulated day under one policy."""
    decisions: int = 0
    requests: int = 0
    total_reward: float = 0.0
    latencies: list[float] = field(default_factory=list)
    drops: list[float] = field(default_factory=list)
    budgets: list[float] = field(default_factory=list)

    def record(self, decision: Decision, reward: float, served: dict) -> None:
        """Count one decision: its reward and what the step served (`latencies`, `drops`)."""
        self.decisions += 1
        self.requests += self.served_requests(served)
        self.total_reward += reward
        self.latencies += served["latencies"]
        self.drops += served["drops"]
        self.budgets.append(decision.budget)

    @staticmethod
    def served_requests(served: dict) -> int:
        """Requests a step finished: one latency each."""
        return len(served["latencies"])

    def summary(self, slo_s: float) -> dict:
        ordered = sorted(self.latencies)
        return {"mean_reward": self.total_reward / max(1, self.decisions),
                "decisions": self.decisions, "requests": self.requests,
                "p50_ms": 1e3 * _percentile(ordered, 0.5),
                "p99_ms": 1e3 * _percentile(ordered, 0.99),
                "slo_violations": sum(x > slo_s for x in ordered) / len(ordered),
                "mean_drop": sum(self.drops) / len(self.drops),
                "mean_budget": sum(self.budgets) / len(self.budgets)}


def padded_length(workload: list[WorkloadItem], batch_size: int) -> float:
    """Expected length of the longest of `batch_size` inputs drawn from the workload (what a
    padded batch computes per request)."""
    lengths, n = sorted(w.length for w in workload), len(workload)
    return sum(length * ((j / n) ** batch_size - ((j - 1) / n) ** batch_size)
               for j, length in enumerate(lengths, 1))


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class ServingSimulator:
    """Simulates one tidal day per episode: `reset(seed)`, then `step(decision)` until done."""

    def __init__(self, table: ServiceTable, workload: list[WorkloadItem],
                 config: SimConfig | None = None):
        self.table = table
        self.workload = workload
        self.config = config or SimConfig()
        easy = [i for i, w in enumerate(workload) if not w.hard]
        hard = [i for i, w in enumerate(workload) if w.hard]
        if not easy or not hard:
            raise ValueError("the workload needs both easy and hard inputs")
        # Request ids: copy * len(workload) + input, so that only exact repeats share an id.
        copies = range(math.ceil(DISTINCT_INPUTS / len(workload)))
        self.easy_ids = [c * len(workload) + i for c in copies for i in easy]
        self.hard_ids = [c * len(workload) + i for c in copies for i in hard]
        self.levels = ActionLevels(table.budgets, table.widths)
        batch = self.config.max_batch
        capacity = batch / table.full.seconds(batch, padded_length(workload, batch))
        self.night_rate = self.config.peak_load * capacity / self.config.swing
        mean_rate = self.night_rate * (1 + (self.config.swing - 1) / 2)
        self.duration_s = self.config.requests_per_day / mean_rate
        self.window_s = min(WINDOW_S, WINDOW_SHARE * self.duration_s)

    def describe(self) -> dict:
        """What a trained policy needs to know about its simulator (for policy.json)."""
        return describe_simulator(self, "requests", self.config.max_length)

    # ---- episode ----------------------------------------------------------------------------

    def reset(self, seed: int) -> PolicyState:
        """Start a new day (a fresh trace drawn with `seed`); the state of the first decision."""
        self.trace = tidal_trace(self.easy_ids, self.hard_ids, duration=self.duration_s,
                                 night_rate=self.night_rate, swing=self.config.swing,
                                 repeat_share=self.config.repeat_share, seed=seed)
        if not self.trace:
            raise ValueError("the trace is empty: raise requests_per_day")
        self.clock = 0.0
        self.next_arrival = 0
        self.queue: deque = deque()
        self.cache: OrderedDict[int, float] = OrderedDict()  # request id -> drop of its result
        self.arrivals: deque = deque()                        # arrival times within the window
        self.busy: deque = deque()                            # (start, end) within the window
        self.busy_s = 0.0                                     # their total duration
        self.recent_latencies: deque = deque(maxlen=RECENT)
        self.recent_drops: deque = deque(maxlen=RECENT)
        self.last_latency = 0.0
        self.previous: Decision | None = None
        self._advance(self.trace[0].time)
        return self._state()

    def step(self, decision: Decision) -> tuple[float, PolicyState | None, dict]:
        """Serve the next batch under `decision`: (reward, next state or None at the end of the
        day, the batch's latencies and drops)."""
        config = self.config
        batch = [self.queue.popleft() for _ in range(min(config.max_batch, len(self.queue)))]
        setting = self.table.lookup(decision.budget, decision.width)
        use_cache = decision.use_cache
        hits = [r for r in batch if use_cache and r.item in self.cache]
        misses = [r for r in batch if not (use_cache and r.item in self.cache)]
        start = self.clock
        lookup_s = config.cache_hit_s * len(batch) if use_cache else 0.0
        compute_s = (setting.seconds(len(misses), max(self._input(r).length for r in misses))
                     if misses else 0.0)
        end = start + lookup_s + compute_s
        latencies, drops = [], []
        for request in hits:
            self.cache.move_to_end(request.item)
            latencies.append(start + config.cache_hit_s - request.time)
            drops.append(self.cache[request.item])
        for request in misses:
            latencies.append(end - request.time)
            drops.append(setting.drop_for(self._input(request).hard))
            if use_cache:
                self.cache[request.item] = drops[-1]
                if len(self.cache) > config.cache_capacity:
                    self.cache.popitem(last=False)
        changed = 0 if self.previous is None else (
            (decision.budget != self.previous.budget) + (decision.width != self.previous.width)
            + (decision.use_cache != self.previous.use_cache))
        reward = batch_reward(latencies, drops, changed, config.slo_s)
        self.previous = decision
        self.recent_latencies.extend(latencies)
        self.recent_drops.extend(drops)
        self.last_latency = sum(latencies) / len(latencies)
        self.busy.append((start, end))
        self.busy_s += end - start
        self._advance(end)
        if not self.queue and self.next_arrival < len(self.trace):
            self._advance(self.trace[self.next_arrival].time)
        done = not self.queue
        return reward, (None if done else self._state()), {"latencies": latencies, "drops": drops}

    def run(self, policy: BasePolicy, seed: int) -> EpisodeStats:
        """One whole day under `policy`."""
        policy.reset()
        stats = EpisodeStats()
        state = self.reset(seed)
        while state is not None:
            decision = policy.decide(state)
            reward, state, served = self.step(decision)
            stats.record(decision, reward, served)
            if state is not None:
                policy.observe(state)
        return stats

    # ---- internals --------------------------------------------------------------------------

    def _input(self, request) -> WorkloadItem:
        return self.workload[request.item % len(self.workload)]

    def _advance(self, time: float) -> None:
        """Move the clock to `time`, queueing the requests that arrived by then."""
        self.clock = max(self.clock, time)
        trace = self.trace
        while self.next_arrival < len(trace) and trace[self.next_arrival].time <= self.clock:
            request = trace[self.next_arrival]
            self.queue.append(request)
            self.arrivals.append(request.time)
            self.next_arrival += 1
        horizon = self.clock - self.window_s
        while self.arrivals and self.arrivals[0] < horizon:
            self.arrivals.popleft()
        while self.busy and self.busy[0][1] < horizon:
            start, end = self.busy.popleft()
            self.busy_s -= end - start

    def _state(self) -> PolicyState:
        config = self.config
        upcoming = [self._input(r) for r in itertools.islice(self.queue, config.max_batch)]
        latencies = sorted(self.recent_latencies)
        confidences = sorted(1.0 - d for d in self.recent_drops)
        horizon = self.clock - self.window_s
        busy_s = self.busy_s - (max(0.0, horizon - self.busy[0][0]) if self.busy else 0.0)
        cache_share = len(self.cache) / config.cache_capacity
        return PolicyState(
            memory=config.base_memory + config.cache_memory * cache_share,
            input_length=sum(w.length for w in upcoming) / len(upcoming),
            complexity=sum(w.complexity for w in upcoming) / len(upcoming),
            queue_depth=len(self.queue),
            arrival_rate=len(self.arrivals) / self.window_s,
            last_latency=self.last_latency,
            latency_p50=_percentile(latencies, 0.5), latency_p99=_percentile(latencies, 0.99),
            confidence_mean=sum(confidences) / len(confidences) if confidences else 1.0,
            confidence_p10=_percentile(confidences, 0.1) if confidences else 1.0,
            cpu_utilisation=min(1.0, busy_s / self.window_s),
            previous_budget=self.previous.budget if self.previous else 0.0,
            slo_s=config.slo_s, max_length=config.max_length)
