"""Monitors: quality and latency statistics on fixed inputs, resource samples, the sampler."""
import math
import threading
import time

import pytest
import torch

from rbcompile.runtime.control.monitors import (
    DEFAULT_PERIOD_S,
    HIGH_ASSURANCE_PERIOD_S,
    LatencyTracker,
    MonitorSampler,
    QualityMonitor,
    ResourceMonitor,
)


def test_quality_snapshot_of_a_known_sequence():
    monitor = QualityMonitor(window=4, ewma_alpha=0.5)
    monitor.record([0.9, 0.5])
    monitor.record([1.0, 0.7, 0.3])  # the window keeps 0.5, 1.0, 0.7, 0.3
    snapshot = monitor.snapshot()
    assert snapshot["count"] == 4
    assert snapshot["mean"] == pytest.approx((0.5 + 1.0 + 0.7 + 0.3) / 4)
    # sorted 0.3 0.5 0.7 1.0: the 10th percentile sits 0.1 * 3 = 0.3 of the way from 0.3 to 0.5
    assert snapshot["p10"] == pytest.approx(0.3 + 0.3 * (0.5 - 0.3))
    ewma = 0.9  # the EWMA starts at the first value and spans every value recorded
    for value in (0.5, 1.0, 0.7, 0.3):
        ewma = 0.5 * value + 0.5 * ewma
    assert snapshot["ewma"] == pytest.approx(ewma) == pytest.approx(0.5375)


def test_quality_defaults_when_empty_and_rejects_values_outside_0_1():
    monitor = QualityMonitor()
    assert monitor.snapshot() == {"mean": 1.0, "p10": 1.0, "ewma": 1.0, "count": 0}
    for bad in ([1.5], [-0.1], [math.nan]):
        with pytest.raises(ValueError):
            monitor.record(bad)
    assert monitor.snapshot()["count"] == 0


def test_latency_percentiles_and_throughput_at_fixed_times():
    tracker = LatencyTracker(rate_window_s=5.0, clock=lambda: 100.0)
    for i in range(1, 41):  # request i completes at 100 + i/4 s after i ms
        tracker.record(i / 1000, now=100 + 0.25 * i)
    snapshot = tracker.snapshot(now=110.0)
    assert snapshot["p50"] == pytest.approx(0.0205)    # position 19.5 of 1..40 ms
    assert snapshot["p99"] == pytest.approx(0.03961)   # position 38.61
    assert snapshot["throughput"] == pytest.approx(20 / 5.0)  # i = 21..40 lie in (105, 110]
    assert snapshot["completed"] == 40 == tracker.completed
    assert tracker.snapshot(now=200.0)["throughput"] == 0.0


def test_latency_window_batches_arrivals_and_the_first_seconds():
    tracker = LatencyTracker(window=4, rate_window_s=5.0, clock=lambda: 0.0)
    assert math.isnan(tracker.snapshot(now=1.0)["p50"])
    tracker.record(0.5, now=0.5)
    tracker.record(0.1, n=4, now=1.0)  # a batch of four: the window now holds only those
    snapshot = tracker.snapshot(now=2.0)
    assert snapshot["p50"] == pytest.approx(0.1) and snapshot["p99"] == pytest.approx(0.1)
    assert snapshot["throughput"] == pytest.approx(5 / 2.0)  # 2 s since creation < 5 s window
    for t in (6.0, 7.0, 8.0, 9.0, 10.0):
        tracker.record_arrival(now=t)
    assert tracker.arrival_rate(now=10.0) == pytest.approx(5 / 5.0)
    assert tracker.arrival_rate(now=13.0) == pytest.approx(2 / 5.0)  # 9.0 and 10.0 remain
    with pytest.raises(ValueError):
        tracker.record(0.1, n=0)


def test_resource_sample_has_sane_fields():
    tracker = LatencyTracker()
    tracker.record(0.2)
    monitor = ResourceMonitor(queue_depth=lambda: 3, latency=tracker)
    sample = monitor.sample()
    assert sample["rss_bytes"] > 0
    assert 0.0 <= sample["memory_fraction"] <= 1.0
    assert sample["memory_percent"] == pytest.approx(100 * sample["memory_fraction"])
    assert 0.0 <= sample["cpu_utilisation"] <= 1.0
    assert sample["queue_depth"] == 3
    assert sample["latency_p50_s"] == pytest.approx(0.2) == sample["latency_p99_s"]
    assert sample["throughput_rps"] > 0
    assert ("gpu_memory_total_bytes" in sample) == torch.cuda.is_available()


def test_resource_sample_without_queue_or_latency_and_with_memory_override():
    sample = ResourceMonitor(memory_override=lambda: 0.65).sample()
    assert sample["memory_fraction"] == 0.65
    assert sample["memory_percent"] == pytest.approx(65.0)
    assert sample["queue_depth"] == 0 and math.isnan(sample["latency_p99_s"])


def test_sampler_rate_latest_listeners_and_stop_joins():
    quality = QualityMonitor()
    quality.record([0.8])
    seen = []
    sampler = MonitorSampler(ResourceMonitor(memory_override=lambda: 0.3), quality,
                             period_s=HIGH_ASSURANCE_PERIOD_S, listeners=[seen.append])
    assert sampler.latest is None
    began = time.perf_counter()
    sampler.start()
    thread = sampler._thread
    time.sleep(0.5)  # about 25 periods
    sampler.stop()
    periods = (time.perf_counter() - began) / HIGH_ASSURANCE_PERIOD_S
    assert not thread.is_alive()
    assert 0.4 * periods <= sampler.samples <= periods + 1  # one sample per period, no bursts
    assert len(seen) == sampler.samples
    latest = sampler.latest
    assert latest["memory_fraction"] == 0.3 and latest["quality_mean"] == pytest.approx(0.8)
    assert latest["quality_count"] == 1 and "time" in latest
    count = sampler.samples
    time.sleep(0.05)
    assert sampler.samples == count  # stopped means stopped


def test_sampler_survives_a_failing_listener_and_works_as_context_manager():
    calls = []

    def broken(snapshot):
        raise RuntimeError("listener bug")

    with MonitorSampler(ResourceMonitor(), period_s=0.01,
                        listeners=[broken, calls.append]) as sampler:
        with pytest.raises(RuntimeError):
            sampler.start()  # already running
        time.sleep(0.1)
        thread = sampler._thread
    assert not thread.is_alive()
    assert len(calls) == sampler.samples >= 3


def test_sampler_overhead_at_default_period_is_under_two_percent():
    assert DEFAULT_PERIOD_S == 0.05
    # Wall time inside a sample also counts time the thread spends preempted, so on a loaded
    # machine one run can read high: a second run is allowed for wall time, not for CPU time.
    wall = []
    for _ in range(2):
        sampler = MonitorSampler(
            ResourceMonitor(queue_depth=lambda: 0, latency=LatencyTracker()), QualityMonitor())
        with sampler:
            time.sleep(1.0)
        assert sampler.samples >= 10
        assert 0 < sampler.cpu_overhead() < 0.02, sampler.cpu_overhead()
        wall.append(sampler.overhead())
        if wall[-1] < 0.02:
            break
    assert 0 < wall[-1] < 0.02, wall


def test_high_assurance_period():
    assert HIGH_ASSURANCE_PERIOD_S == 0.02


def test_latest_is_safe_to_read_while_sampling():
    sampler = MonitorSampler(ResourceMonitor(), period_s=0.005)
    errors = []

    def reader():
        try:
            for _ in range(200):
                latest = sampler.latest
                assert latest is None or latest["rss_bytes"] > 0
        except BaseException as error:
            errors.append(error)

    with sampler:
        readers = [threading.Thread(target=reader) for _ in range(4)]
        for thread in readers:
            thread.start()
        for thread in readers:
            thread.join()
    assert not errors, errors


def test_latency_window_in_seconds_forgets_a_past_burst():
    tracker = LatencyTracker(latency_window_s=5.0, clock=lambda: 0.0)
    tracker.record(2.0, n=50, now=10.0)             # a slow burst
    assert tracker.snapshot(now=12.0)["p99"] == pytest.approx(2.0)
    tracker.record(0.05, now=16.0)                   # quiet: one fast request, burst is 6 s old
    snapshot = tracker.snapshot(now=16.0)
    assert snapshot["p50"] == pytest.approx(0.05) and snapshot["p99"] == pytest.approx(0.05)
    assert math.isnan(tracker.snapshot(now=30.0)["p99"])
    with pytest.raises(ValueError):
        LatencyTracker(latency_window_s=0.0)
