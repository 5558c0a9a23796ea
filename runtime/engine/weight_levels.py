"""Rows at a weight precision of their own in the batch engine (`EngineRequest.weights`).

A request may ask a lower weight level than the one the decoder runs at (a vote tier of
`VoteOptions.tier_weights`: routine questions in int4, say). A forward runs one level for all
its rows, so it runs the level every row asks, or where rows ask different ones the most
precise of them (the least measured quality loss): a row never runs below what it asked, and
never at a level the quality guard refuses (the artifact's `weight_level` checks that when a
request is queued).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rbcompile.errors import UserError


@dataclass(frozen=True)
class WeightLevel:
    """A weight level a forward can run at: its step (the decoder's signature; None: the
    engine's own step) and its quality loss measured on held-out text (0: the full path)."""
    name: str
    step: Callable | None
    loss: float


class WeightLevels:
    """The levels an engine's requests ask. `find(name)` gives a `WeightLevel` or raises a
    one-line UserError (never measured, over the guard, no executor to run it; None: the
    engine runs its own level only); `default` is the level of the engine's own step."""

    def __init__(self, default: WeightLevel, find: Callable[[str], WeightLevel] | None = None):
        self.default, self.find = default, find
        self.levels = {default.name: default}

    def check(self, weights: str | None) -> None:
        """Refuse (UserError) a level this engine cannot run `weights` at; once found, a level
        is kept for the engine's steps."""
        if weights is None or weights in self.levels:
            return
        if self.find is None:
            raise UserError(f"{weights} weights per request need the onnxruntime executor "
                            f"(this engine decodes at {self.default.name} only)")
        self.levels[weights] = self.find(weights)

    def level_for(self, weights: list[str | None]) -> WeightLevel:
        """The level a forward over rows asking `weights` runs (None: the default's): the one
        they all ask, else the most precise one asked."""
        asked = {self.levels[name or self.default.name] for name in weights}
        return min(asked, key=lambda level: level.loss)

    def cache_key(self, weights: list[str | None], gates):
        """What K/V a forward over rows asking `weights` writes are cached under: its `gates`,
        with its level's name where that is not the default's (one level's K/V are not
        another's)."""
        level = self.level_for(weights)
        return gates if level is self.default else (level.name, gates)

    def least_precise(self, names: list[str | None]) -> WeightLevel:
        """The least precise of levels `names` that forwards ran (None: none; the default if
        none ran)."""
        ran = [self.levels[name] for name in names if name is not None]
        return max(ran, key=lambda level: level.loss, default=self.default)

    def step_for(self, requests: list, own: Callable, fallback: str | None = None) -> Callable:
        """The step of a forward over `requests` (`EngineRequest`s, each asking its `weights`,
        else `fallback`: a controller's level) at their `level_for` (`own`, the engine's step,
        at the default level); each notes the least precise level it ran (`weights_run`)."""
        level = self.level_for([request.weights or fallback for request in requests])
        for request in requests:
            ran = request.weights_run
            if ran is None or level.loss > self.levels[ran].loss:
                request.weights_run = level.name
        return own if level.step is None else level.step
