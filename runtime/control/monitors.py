"""Monitors for the serving runtime: what the policies and the memory watermark see.

- `QualityMonitor`: output confidence of recent requests (mean, 10th percentile, EWMA).
- `LatencyTracker`: request latency percentiles, completion throughput and arrival rate.
- `ResourceMonitor`: process RSS, system memory, system-wide CPU utilisation, queue depth,
  latency, and on CUDA machines GPU memory and utilisation.
- `MonitorSampler`: a daemon thread that merges the resource and quality snapshots every
  `period_s` (50 ms; 20 ms in high-assurance mode), keeps the latest and passes it to listeners.

Overhead budget: sampling may take at most 2% of serving time. One sample reads three /proc
files through psutil: 0.1 ms back to back, 0.4-0.7 ms after the thread has slept (cold caches;
measured on a 2-core VM), so about 1% of a 50 ms period; the 20 ms period costs 2.5x that.
`MonitorSampler` measures its own cost two ways: `overhead()` is wall time inside samples over
wall time running (it includes waiting for the GIL, so it is an upper bound) and
`cpu_overhead()` is the sampler thread's CPU time over the same wall time.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Callable, Iterable

import psutil
import torch

DEFAULT_PERIOD_S = 0.05
HIGH_ASSURANCE_PERIOD_S = 0.02

log = logging.getLogger(__name__)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of ascending values; NaN when empty."""
    if not sorted_values:
        return math.nan
    position = q / 100 * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class QualityMonitor:
    """Output confidences (e.g. top-1 probability) of the last `window` requests, plus an EWMA
    over all of them. With nothing recorded the snapshot reads as full confidence."""

    def __init__(self, window: int = 256, ewma_alpha: float = 0.1):
        if window < 1 or not 0.0 < ewma_alpha <= 1.0:
            raise ValueError("window must be >= 1 and ewma_alpha in (0, 1]")
        self.ewma_alpha = ewma_alpha
        self._values: deque[float] = deque(maxlen=window)
        self._ewma: float | None = None
        self._lock = threading.Lock()

    def record(self, confidences: Iterable[float]) -> None:
        """Add confidences in [0, 1], in order; raises ValueError on anything else (NaN too)."""
        values = [float(c) for c in confidences]
        if not all(0.0 <= v <= 1.0 for v in values):
            raise ValueError(f"confidences must be in [0, 1], got {values!r}")
        with self._lock:
            for value in values:
                self._ewma = value if self._ewma is None else (
                    self.ewma_alpha * value + (1 - self.ewma_alpha) * self._ewma)
            self._values.extend(values)

    def snapshot(self) -> dict[str, float]:
        """`mean`, `p10` and `count` over the window, and `ewma`."""
        with self._lock:
            values, ewma = sorted(self._values), self._ewma
        if not values:
            return {"mean": 1.0, "p10": 1.0, "ewma": 1.0, "count": 0}
        return {"mean": sum(values) / len(values), "p10": percentile(values, 10),
                "ewma": ewma, "count": len(values)}


class LatencyTracker:
    """Latencies of the last `window` requests (only those of the last `latency_window_s`, when
    given: after a burst, a quiet period must not keep reporting the burst's p99), and
    completions and arrivals per second over the last `rate_window_s` (or since creation, when
    that is shorter). Every method takes an optional `now` in `clock` seconds, so tests can
    replay fixed timestamps."""

    def __init__(self, window: int = 512, rate_window_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 latency_window_s: float | None = None):
        if window < 1 or rate_window_s <= 0 or (latency_window_s is not None
                                                 and latency_window_s <= 0):
            raise ValueError("window must be >= 1 and rate_window_s, latency_window_s positive")
        self.rate_window_s = rate_window_s
        self.latency_window_s = latency_window_s
        self.clock = clock
        self.completed = 0
        self._started = clock()
        self._latencies: deque[tuple[float, float]] = deque(maxlen=window)  # (time, seconds)
        self._completions: deque[tuple[float, int]] = deque()  # (time, requests)
        self._arrivals: deque[float] = deque()
        self._lock = threading.Lock()

    def record(self, latency_s: float, n: int = 1, now: float | None = None) -> None:
        """`n` requests completed, each after `latency_s` seconds."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        now = self.clock() if now is None else now
        with self._lock:
            self._latencies.extend([(now, float(latency_s))] * min(n, self._latencies.maxlen))
            self._completions.append((now, n))
            self.completed += n
            self._forget(now)

    def record_arrival(self, now: float | None = None) -> None:
        """One request arrived."""
        now = self.clock() if now is None else now
        with self._lock:
            self._arrivals.append(now)
            self._forget(now)

    def arrival_rate(self, now: float | None = None) -> float:
        """Arrivals per second over the rate window."""
        now = self.clock() if now is None else now
        with self._lock:
            self._forget(now)
            return self._per_second(len(self._arrivals), now)

    def snapshot(self, now: float | None = None) -> dict[str, float]:
        """`p50` and `p99` latency in seconds (NaN before any request), `throughput` and
        `arrival_rate` in requests per second, and `completed`."""
        now = self.clock() if now is None else now
        with self._lock:
            self._forget(now)
            latencies = sorted(latency for _, latency in self._latencies)
            done = sum(n for _, n in self._completions)
            return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                    "throughput": self._per_second(done, now),
                    "arrival_rate": self._per_second(len(self._arrivals), now),
                    "completed": self.completed}

    def _forget(self, now: float) -> None:
        """Drop what lies outside the windows ending at `now`."""
        if self.latency_window_s is not None:
            while self._latencies and self._latencies[0][0] <= now - self.latency_window_s:
                self._latencies.popleft()
        cutoff = now - self.rate_window_s
        while self._completions and self._completions[0][0] <= cutoff:
            self._completions.popleft()
        while self._arrivals and self._arrivals[0] <= cutoff:
            self._arrivals.popleft()

    def _per_second(self, count: int, now: float) -> float:
        span = min(self.rate_window_s, now - self._started)
        return count / span if span > 0 else 0.0


class ResourceMonitor:
    """One `sample()` of the machine and the serving queue. `memory_override`, when given,
    returns the system memory fraction to report instead of psutil's (simulated pressure)."""

    def __init__(self, queue_depth: Callable[[], int] | None = None,
                 latency: LatencyTracker | None = None,
                 memory_override: Callable[[], float] | None = None):
        self.queue_depth = queue_depth
        self.latency = latency
        self.memory_override = memory_override
        self._process = psutil.Process()
        self._cuda = torch.cuda.is_available()
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement

    def sample(self) -> dict[str, float]:
        """rss_bytes, memory_percent, memory_fraction, cpu_utilisation (system-wide, [0, 1]),
        queue_depth, latency_p50_s, latency_p99_s, throughput_rps and, on CUDA,
        gpu_memory_used_bytes, gpu_memory_total_bytes and gpu_utilisation (NaN if unknown)."""
        memory_fraction = self.memory_fraction()
        latency = self.latency.snapshot() if self.latency is not None else {}
        sample = {
            "rss_bytes": self._process.memory_info().rss,
            "memory_percent": 100 * memory_fraction,
            "memory_fraction": memory_fraction,
            "cpu_utilisation": psutil.cpu_percent(interval=None) / 100,
            "queue_depth": self.queue_depth() if self.queue_depth is not None else 0,
            "latency_p50_s": latency.get("p50", math.nan),
            "latency_p99_s": latency.get("p99", math.nan),
            "throughput_rps": latency.get("throughput", 0.0),
        }
        if self._cuda:
            sample.update(self._gpu_sample())
        return sample

    def memory_fraction(self) -> float:
        """System memory in use, [0, 1] (or the override's value): cheap enough per request."""
        if self.memory_override is not None:
            return float(self.memory_override())
        return psutil.virtual_memory().percent / 100

    @staticmethod
    def _gpu_sample() -> dict[str, float]:
        try:
            free, total = torch.cuda.mem_get_info()
            used, total = float(total - free), float(total)
        except Exception:  # a driver error must not stop the monitor
            used = total = math.nan
        try:
            utilisation = torch.cuda.utilization() / 100  # needs pynvml / amdsmi
        except Exception:
            utilisation = math.nan
        return {"gpu_memory_used_bytes": used, "gpu_memory_total_bytes": total,
                "gpu_utilisation": utilisation}


class MonitorSampler:
    """Samples `resource_monitor` (and `quality_monitor`, keys prefixed `quality_`) every
    `period_s` on a daemon thread. `latest` is the last merged snapshot; each one is also passed
    to every listener (a listener that raises is logged and sampling goes on)."""

    def __init__(self, resource_monitor: ResourceMonitor,
                 quality_monitor: QualityMonitor | None = None,
                 period_s: float = DEFAULT_PERIOD_S,
                 listeners: Iterable[Callable[[dict], None]] = ()):
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s!r}")
        self.resource_monitor = resource_monitor
        self.quality_monitor = quality_monitor
        self.period_s = period_s
        self.listeners = list(listeners)
        self.samples = 0
        self._latest: dict | None = None
        self._sampling_s = 0.0       # wall seconds inside samples
        self._cpu_s = 0.0            # CPU seconds of the sampler thread
        self._started: float | None = None
        self._stopped: float | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    @property
    def latest(self) -> dict | None:
        """A copy of the last snapshot (None before the first)."""
        with self._lock:
            return None if self._latest is None else dict(self._latest)

    def start(self) -> MonitorSampler:
        """Start sampling (counters restart); raises RuntimeError when already running."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("MonitorSampler is already running")
        self._stop.clear()
        with self._lock:
            self.samples, self._sampling_s, self._cpu_s = 0, 0.0, 0.0
            self._latest, self._stopped = None, None
            self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="rbcompile-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            with self._lock:
                self._stopped = time.perf_counter()

    def overhead(self) -> float:
        """Wall seconds spent sampling / wall seconds since `start` (until `stop`)."""
        with self._lock:
            return self._share(self._sampling_s)

    def cpu_overhead(self) -> float:
        """CPU seconds of the sampler thread / wall seconds since `start` (until `stop`)."""
        with self._lock:
            return self._share(self._cpu_s)

    def __enter__(self) -> MonitorSampler:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _share(self, seconds: float) -> float:
        if self._started is None:
            return 0.0
        end = self._stopped if self._stopped is not None else time.perf_counter()
        elapsed = end - self._started
        return seconds / elapsed if elapsed > 0 else 0.0

    def _run(self) -> None:
        cpu_start = time.thread_time()
        next_tick = time.perf_counter()
        while not self._stop.is_set():
            began = time.perf_counter()
            try:
                self._sample_once()
            except Exception:  # e.g. a failing queue_depth callable: keep sampling
                log.exception("monitor sample failed")
            now = time.perf_counter()
            with self._lock:
                self._sampling_s += now - began
                self._cpu_s = time.thread_time() - cpu_start
            next_tick += self.period_s
            if next_tick < now:  # fell behind: skip the missed ticks instead of bursting
                next_tick = now + self.period_s
            self._stop.wait(next_tick - now)

    def _sample_once(self) -> None:
        snapshot = {"time": time.monotonic(), **self.resource_monitor.sample()}
        if self.quality_monitor is not None:
            quality = self.quality_monitor.snapshot()
            snapshot.update({f"quality_{name}": value for name, value in quality.items()})
        with self._lock:
            self._latest = snapshot
            self.samples += 1
        for listener in self.listeners:
            try:
                listener(dict(snapshot))
            except Exception:
                log.exception("monitor listener %r failed", listener)
