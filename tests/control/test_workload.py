"""Tidal traces: the rate swings 17x, the hard share by 43 points, only intended repeats repeat."""
from collections import Counter

import pytest

from rbcompile.runtime.control.workload import tidal_rate, tidal_trace


def _trace(**kwargs):
    easy, hard = list(range(0, 20_000)), list(range(20_000, 40_000))
    return tidal_trace(easy, hard, duration=100.0, night_rate=20.0, seed=3, **kwargs)


def test_rate_and_hard_share_swing_over_the_day():
    trace = _trace()
    night = [r for r in trace if r.time < 5 or r.time > 95]
    midday = [r for r in trace if 45 <= r.time < 55]
    assert tidal_rate(50, 100, 20) == pytest.approx(17 * 20)
    assert len(midday) / len(night) == pytest.approx(17, rel=0.15)   # both windows 10 s long
    night_hard = sum(r.hard for r in night) / len(night)
    midday_hard = sum(r.hard for r in midday) / len(midday)
    assert night_hard == pytest.approx(0.2, abs=0.06)
    assert midday_hard - night_hard == pytest.approx(0.43, abs=0.08)
    assert all(r.hard == (r.item >= 20_000) for r in trace)
    assert set(Counter(r.qos for r in trace)) == {"interactive", "standard", "batch"}


def test_only_intended_repeats_share_an_input():
    with_repeats, without = _trace(repeat_share=0.1), _trace(repeat_share=0.0)
    assert len({r.item for r in without}) == len(without)   # fresh draws never collide
    repeats = len(with_repeats) - len({r.item for r in with_repeats})
    assert repeats / len(with_repeats) == pytest.approx(0.1, abs=0.02)


def test_small_pools_are_reused_evenly_and_bad_arguments_fail():
    trace = tidal_trace([0, 1, 2], [3, 4], duration=10.0, night_rate=5.0, repeat_share=0.0)
    counts = Counter(r.item for r in trace if not r.hard)
    assert max(counts.values()) - min(counts.values()) <= 1      # without replacement per cycle
    with pytest.raises(ValueError):
        tidal_trace([], [1], duration=1.0, night_rate=1.0)
    with pytest.raises(ValueError):
        tidal_trace([0], [1], duration=1.0, night_rate=1.0, swing=0.5)
