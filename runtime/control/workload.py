"""Tidal request traces: the arrival rate swings `swing`x between night and day and the share of
hard requests swings by `hard_swing` (absolute), as one smooth day of `duration` seconds.

    s(t) = (1 - cos(2 pi t / duration)) / 2        0 at night (t = 0, duration), 1 at midday
    rate(t) = night_rate * (1 + (swing - 1) * s(t))
    hard_share(t) = hard_night + hard_swing * s(t)

Arrivals are a Poisson process with that rate (thinning, seeded). A share of requests repeats a
recent one exactly (real traffic repeats; the result cache serves these). The other requests
draw their inputs without replacement (each pool is reshuffled when it runs out), so only the
intended repeats are exact repeats while the pools last.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

QOS_MIX = {"interactive": 0.2, "standard": 0.6, "batch": 0.2}


@dataclass(frozen=True)
class TraceRequest:
    time: float        # arrival, seconds from the start
    item: int          # index into the workload inputs
    hard: bool
    qos: str


def daylight(t: float, duration: float) -> float:
    return (1 - math.cos(2 * math.pi * t / duration)) / 2


def tidal_rate(t: float, duration: float, night_rate: float, swing: float = 17.0) -> float:
    return night_rate * (1 + (swing - 1) * daylight(t, duration))


def hard_share(t: float, duration: float, hard_night: float = 0.2, hard_swing: float = 0.43) -> float:
    return hard_night + hard_swing * daylight(t, duration)


def tidal_trace(easy: list[int], hard: list[int], *, duration: float, night_rate: float,
                swing: float = 17.0, hard_night: float = 0.2, hard_swing: float = 0.43,
                repeat_share: float = 0.1, qos_mix: dict[str, float] | None = None,
                seed: int = 0) -> list[TraceRequest]:
    """Requests over one tidal day; `easy` / `hard` are workload indices to draw inputs from."""
    if not easy or not hard:
        raise ValueError("tidal_trace needs both easy and hard inputs")
    if duration <= 0 or night_rate <= 0 or swing < 1:
        raise ValueError("duration and night_rate must be positive and swing >= 1")
    rng = random.Random(seed)
    mix = qos_mix or QOS_MIX
    classes, weights = list(mix), list(mix.values())
    peak = night_rate * swing
    pools = {True: hard, False: easy}
    decks: dict[bool, list[int]] = {True: [], False: []}

    def draw(is_hard: bool) -> int:
        if not decks[is_hard]:
            decks[is_hard] = rng.sample(pools[is_hard], len(pools[is_hard]))
        return decks[is_hard].pop()

    t, trace = 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return trace
        if rng.random() * peak > tidal_rate(t, duration, night_rate, swing):
            continue  # thinning: accept with probability rate(t) / peak
        qos = rng.choices(classes, weights)[0]
        recent = trace[-50:]
        if recent and rng.random() < repeat_share:
            previous = rng.choice(recent)
            trace.append(TraceRequest(t, previous.item, previous.hard, qos))
            continue
        is_hard = rng.random() < hard_share(t, duration, hard_night, hard_swing)
        trace.append(TraceRequest(t, draw(is_hard), is_hard, qos))
