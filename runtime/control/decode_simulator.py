"""The decode-step serving simulator: `rbcompile serve`'s continuous batching (runtime/engine/core.py)
over a tidal day, where the policy of `rbcompile serve --policy ppo` is trained for decoders.

Engine (as `BatchEngine.step`): at most `max_batch` rows. Each engine step first admits waiting
requests, QoS class first (interactive, standard, batch), then by arrival, while rows are free
and the newcomers' padded prefill stays within `prefill_tokens`; they are prefilled together,
`Setting.prefill_seconds(newcomers, longest prompt)`, and each gets its first token. Then one
decode step runs over every running row, `Setting.seconds(rows, context)` with context the
longest running row's prompt + tokens (the batch's rows share their K/V slots), each row gets a
token, and rows with all their new tokens leave. The clock advances by these measured latencies
of the plan of the current budget (`ServiceTable.lookup`); the engine idles until the next
arrival when it has nothing to do. Chunked prefill (prompts over 512 tokens) is not modelled.

Policy: the real `DecodeController` (runtime/control/decode_control.py) runs on the simulator's clock
with this engine model behind it: before an engine step, once `period_s` (0.25 s) has passed
since its last decision, `DecodeController.state()` builds the `PolicyState` exactly as
`rbcompile serve` does (decode-step latency p50 / p99 over 5 s, queue, arrivals, memory, CPU,
top-1 probability of recent tokens, previous budget, `slo_s` the per-step SLO) and the policy
decides. Memory is `config.memory`; CPU the busy share of the clock since the previous decision
(psutil's reading since its previous call, in serve). A row's token confidence is drawn from
the measured top-1 probability quantiles of the plan (`Setting.confidences`).

Traffic: a tidal trace (runtime/control/workload.py) of `day_s` seconds whose arrival rate swings
`swing`x, peaking at `peak_load` x the full path's closed-loop capacity with `capacity_rows`
streams (as benchmarks/bench_serve_tidal.py sets its peak); prompts are the workload's inputs,
each request asks `new_tokens` tokens; QoS classes 30% / 50% / 20%.

Reward per decision (`simulator.batch_reward` over the engine steps run under it): each running
row of a step feels the gap to its next token, the step's decode plus any prefill run before it
in that step, against the per-step SLO; the quality drop is the plan's (1 - teacher-forced
top-1 agreement with the full path); the switching penalty as for encoders.
"""
from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from rbcompile.runtime.control.admission import QOS_CLASSES
from rbcompile.runtime.control.decode_control import DecodeController
from rbcompile.runtime.control.policy import BasePolicy, Decision, PolicyState
from rbcompile.runtime.control.simulator import (
    ActionLevels,
    EpisodeStats,
    ServiceTable,
    WorkloadItem,
    _percentile,
    batch_reward,
    describe_simulator,
)
from rbcompile.runtime.control.workload import tidal_trace

QOS_MIX = {"interactive": 0.3, "standard": 0.5, "batch": 0.2}   # bench_serve_tidal.py's


@dataclass
class DecodeSimConfig:
    """Serving and traffic parameters of the decode-step simulator (see the module docstring)."""
    slo_s: float = 0.1             # per decode step (inter-token latency)
    max_batch: int = 16            # serve's --max-batch
    new_tokens: int = 32           # tokens each request asks for
    day_s: float = 90.0
    peak_load: float = 1.2
    swing: float = 17.0
    capacity_rows: int = 8         # streams of the closed loop the peak is relative to
    prefill_tokens: int = 2048     # BatchEngine's cap on a prefill's padded tokens
    period_s: float = 0.25         # DecodeController's decision period
    max_positions: int = 8192      # the model's positions (normalises input_length)
    memory: float = 0.3            # system memory in use (fraction)


@dataclass
class DecodeEpisodeStats(EpisodeStats):
    """One simulated day: `latencies` are the gaps each row felt per step (what the SLO is
    about), `request_latencies` each request's arrival to last token."""
    request_latencies: list[float] = field(default_factory=list)

    def record(self, decision: Decision, reward: float, served: dict) -> None:
        super().record(decision, reward, served)
        self.request_latencies += served["request_latencies"]

    @staticmethod
    def served_requests(served: dict) -> int:
        """Requests a step finished (its `latencies` are per row and step)."""
        return len(served["request_latencies"])

    def summary(self, slo_s: float) -> dict:
        ordered = sorted(self.request_latencies)
        return {**super().summary(slo_s), "request_p50_ms": 1e3 * _percentile(ordered, 0.5),
                "request_p99_ms": 1e3 * _percentile(ordered, 0.99)}


@dataclass(eq=False)
class _Request:
    """A request in the engine model; `prompt` / `tokens` have the lengths the engine's have
    (all DecodeController.state() reads of them)."""
    arrival: float
    prompt_tokens: int
    priority: int
    produced: int = 0

    @property
    def prompt(self) -> range:
        return range(self.prompt_tokens)

    @property
    def tokens(self) -> range:
        return range(self.produced)


@dataclass
class _Shape:
    max_positions: int


class _Engine:
    """What DecodeController reads and writes of a BatchEngine: running, queued, shape, budget."""

    def __init__(self, max_positions: int):
        self.running: list[_Request] = []
        self.waiting: list[tuple[int, int, _Request]] = []   # a heap: priority, arrival
        self.shape = _Shape(max_positions)
        self.budget: float | None = None
        self.controller = None

    @property
    def queued(self) -> int:
        return len(self.waiting)


class _NoPolicy(BasePolicy):
    """The controller's policy slot: the simulator's caller decides (PPO training steps it)."""

    def decide(self, state: PolicyState) -> Decision:
        raise RuntimeError("the decode simulator's caller decides")


class DecodeSimulator:
    """Simulates one tidal day of decode steps per episode: `reset(seed)`, then `step(decision)`
    until done (the interface of `ServingSimulator`, so `train_ppo` trains in either)."""

    def __init__(self, table: ServiceTable, workload: list[WorkloadItem],
                 config: DecodeSimConfig | None = None):
        if not workload:
            raise ValueError("the decode simulator needs a workload")
        self.table, self.workload = table, workload
        self.config = config = config or DecodeSimConfig()
        self.levels = ActionLevels(table.budgets, (1.0,), (True,))  # serve sets the budget only
        prompt = sum(w.length for w in workload) / len(workload)
        self.capacity_rps = self._closed_loop_rate(config.capacity_rows, prompt)
        self.night_rate = config.peak_load * self.capacity_rps / config.swing
        self.duration_s = config.day_s
        self.easy = [i for i, w in enumerate(workload) if not w.hard]
        self.hard = [i for i, w in enumerate(workload) if w.hard]
        if not self.easy or not self.hard:
            raise ValueError("the workload needs both easy and hard inputs")

    def _closed_loop_rate(self, rows: int, prompt: float) -> float:
        """Requests per second of the full path with `rows` streams in closed loop: each row
        prefilled alone, then new_tokens - 1 decode steps at batch `rows`."""
        full, new = self.table.full, self.config.new_tokens
        context = prompt + new / 2
        seconds = full.prefill_seconds(1, round(prompt)) + (new - 1) * full.seconds(rows, context)
        if not seconds > 0:
            raise ValueError("the service table's full path takes no time")
        return rows / seconds

    def describe(self) -> dict:
        """What a trained policy needs to know about its simulator (for policy.json)."""
        return describe_simulator(self, "decode-step", self.config.max_positions,
                                  capacity_rps=self.capacity_rps)

    # ---- episode ----------------------------------------------------------------------------

    def reset(self, seed: int) -> PolicyState:
        """Start a new day (a fresh trace drawn with `seed`); the state of the first decision."""
        config = self.config
        self.trace = tidal_trace(self.easy, self.hard,
                                 duration=config.day_s, night_rate=self.night_rate,
                                 swing=config.swing, repeat_share=0.0, qos_mix=QOS_MIX, seed=seed)
        if not self.trace:
            raise ValueError("the trace is empty: raise day_s or peak_load")
        self.rng = random.Random(seed)
        self.clock = 0.0
        self.next_arrival = 0
        self.arrivals = itertools.count()
        self.engine = _Engine(config.max_positions)
        self.controller = DecodeController(self.engine, _NoPolicy(), config.slo_s,
                                           lambda: config.memory, config.period_s,
                                           clock=lambda: self.clock, cpu=self._cpu)
        self.busy_since_decision = 0.0
        self.decided_at = 0.0
        self.previous: Decision | None = None
        self.gaps: list[float] = []          # per row, this decision's steps
        self.finished: list[float] = []      # request latencies, this decision's steps
        self.steps_run = 0
        self._advance(self.trace[0].time)
        return self.controller.state()

    def step(self, decision: Decision) -> tuple[float, PolicyState | None, dict]:
        """Run engine steps under `decision` until the controller's next decision is due:
        (reward, next state or None at the end of the day, the rows' gaps and drops)."""
        setting = self.table.lookup(decision.budget, 1.0)
        self.controller.decision = decision
        self.engine.budget = decision.budget or None
        self.decided_at, self.busy_since_decision = self.clock, 0.0
        self.gaps, self.finished, self.steps_run = [], [], 0
        done = False
        while True:
            if not self.engine.running and not self.engine.waiting:
                if self.next_arrival == len(self.trace):
                    done = True
                    break
                self._advance(self.trace[self.next_arrival].time)
            if self.steps_run and self.clock - self.decided_at >= self.config.period_s:
                break
            self._engine_step(setting)
        engine = self.engine
        done = done or not (engine.running or engine.waiting or self.next_arrival < len(self.trace))
        gaps = self.gaps or [0.0]
        drops = [setting.drop] * len(gaps)
        changed = 0 if self.previous is None else int(decision.budget != self.previous.budget)
        reward = batch_reward(gaps, drops, changed, self.config.slo_s)
        self.previous = decision
        served = {"latencies": self.gaps, "drops": [setting.drop] * len(self.gaps),
                  "request_latencies": self.finished}
        return reward, (None if done else self.controller.state()), served

    def run(self, policy: BasePolicy, seed: int) -> DecodeEpisodeStats:
        """One whole day under `policy`."""
        policy.reset()
        stats = DecodeEpisodeStats()
        state = self.reset(seed)
        while state is not None:
            policy.observe(state)   # as DecodeController.before_step: observe, then decide
            decision = policy.decide(state)
            reward, state, served = self.step(decision)
            stats.record(decision, reward, served)
        return stats

    # ---- internals --------------------------------------------------------------------------

    def _cpu(self) -> float:
        elapsed = self.clock - self.decided_at
        return min(1.0, self.busy_since_decision / elapsed) if elapsed > 0 else 0.0

    def _advance(self, time: float) -> None:
        """Move the clock to `time`, queueing the requests that arrived by then."""
        self.clock = max(self.clock, time)
        trace, engine = self.trace, self.engine
        while self.next_arrival < len(trace) and trace[self.next_arrival].time <= self.clock:
            arrival = trace[self.next_arrival]
            request = _Request(arrival.time, self.workload[arrival.item].length,
                               QOS_CLASSES.index(arrival.qos))
            heapq.heappush(engine.waiting, (request.priority, next(self.arrivals), request))
            self.controller.steps.record_arrival(now=arrival.time)
            self.next_arrival += 1

    def _engine_step(self, setting) -> None:
        """One BatchEngine.step: admit and prefill newcomers, then one decode step."""
        engine, config = self.engine, self.config
        newcomers, longest = [], 0
        while engine.waiting and len(engine.running) + len(newcomers) < config.max_batch:
            width = max(longest, engine.waiting[0][2].prompt_tokens)
            if newcomers and (len(newcomers) + 1) * width > config.prefill_tokens:
                break
            newcomers.append(heapq.heappop(engine.waiting)[2])
            longest = width
        prefill_s = setting.prefill_seconds(len(newcomers), longest) if newcomers else 0.0
        self._spend(prefill_s)
        waiting_rows = len(engine.running)
        for request in newcomers:
            engine.running.append(request)
            request.produced += 1
        self._leave_finished()
        if not engine.running:
            return
        context = max(r.prompt_tokens + r.produced for r in engine.running)
        decode_s = setting.seconds(len(engine.running), context)
        self._spend(decode_s)
        confidences = [self.rng.choice(setting.confidences) if setting.confidences else 1.0
                       for _ in engine.running]
        self.controller.step_done(decode_s, confidences)
        # rows that were running before the prefill waited for it too
        self.gaps += [prefill_s + decode_s] * waiting_rows
        self.gaps += [decode_s] * (len(engine.running) - waiting_rows)
        for request in engine.running:
            request.produced += 1
        self._leave_finished()
        self.steps_run += 1

    def _spend(self, seconds: float) -> None:
        self.busy_since_decision += seconds
        self._advance(self.clock + seconds)

    def _leave_finished(self) -> None:
        engine, new = self.engine, self.config.new_tokens
        for request in [r for r in engine.running if r.produced >= new]:
            self.finished.append(self.clock - request.arrival)
        engine.running = [r for r in engine.running if r.produced < new]
