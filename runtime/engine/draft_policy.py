"""How a group of rows picks its drafter each step: always the same one (`FixedPolicy`), or
whichever measures fastest (`AutoPolicy`, speculate="auto")."""
from __future__ import annotations

from collections import deque


class FixedPolicy:
    """Always the same mode."""

    def __init__(self, mode: str):
        self.mode = mode

    def choose(self) -> str:
        return self.mode

    def record(self, mode: str, tokens: int, seconds: float, drafted: int, kept: int) -> None:
        pass


class AutoPolicy:
    """Per draft group (a generate call's rows, a served choice), the choice among 'off' and
    drafters by measured tokens per second.

    'off' runs first; then the fastest mode over its last `window` steps runs (a mode that is
    not running is judged by its last measurement alone). A drafter must beat 'off' by
    `margin` and keep at least `min_acceptance` of its drafts (so with drafts that never
    match, speculation turns off whatever the timings' noise). A mode that is not running is
    measured one step at a time, at least `retry_after` steps after it last ran, and only while
    what its measurements lost against the running mode, plus what this one may lose, stays
    within its share of `budget` x the time elapsed (the modes share `budget`; one costly
    drafter cannot use up another's share). What a measurement may lose: what the mode's last
    one lost, or before its first, `first_loss[mode]` running-mode steps (n-gram lookup adds
    no forward and loses next to nothing; a light path not measured to pay may lose its k
    draft forwards)."""

    def __init__(self, modes: list[str], first_loss: dict[str, float] | None = None,
                 window: int = 4, margin: float = 1.05, min_acceptance: float = 0.1,
                 retry_after: int = 4, budget: float = 0.04):
        self.modes, self.current = modes, "off"
        self.margin, self.min_acceptance, self.retry_after = margin, min_acceptance, retry_after
        self.share = budget / max(1, len(modes) - 1)
        self.first_loss = first_loss or {}
        self.history = {mode: deque(maxlen=window) for mode in modes}
        self.last_measured = dict.fromkeys(modes, -retry_after)
        self.probe_loss = dict.fromkeys(modes, None)   # what the mode's last measurement lost
        self.lost = dict.fromkeys(modes, 0.0)          # what all its measurements lost
        self.step, self.elapsed = 0, 0.0

    def choose(self) -> str:
        self.step += 1
        if not self.history[self.current]:
            return self.current
        for mode in self.modes:
            if (mode != self.current and self.step - self.last_measured[mode] >= self.retry_after
                    and self.lost[mode] + self._expected_loss(mode) <= self.share * self.elapsed):
                return mode
        return self.current

    def record(self, mode, tokens, seconds, drafted, kept):
        if mode != self.current:
            self.history[mode].clear()   # a re-measurement stands for the mode as it is now
        self.history[mode].append((tokens, seconds, drafted, kept))
        self.last_measured[mode] = self.step
        self.elapsed += seconds
        if mode != self.current:
            rate = self._rate(self.current)
            self.probe_loss[mode] = max(0.0, seconds - tokens / rate) if rate else 0.0
            self.lost[mode] += self.probe_loss[mode]
        self.current = self._best()

    def _expected_loss(self, mode: str) -> float:
        if self.probe_loss[mode] is not None:
            return self.probe_loss[mode]
        history = self.history[self.current]
        return self.first_loss.get(mode, 0.0) * sum(h[1] for h in history) / len(history)

    def _best(self) -> str:
        best, best_rate = "off", self._rate("off") * self.margin
        for mode in self.modes:
            history = self.history[mode]
            drafted = sum(h[2] for h in history)
            if mode == "off" or not drafted or sum(h[3] for h in history) < self.min_acceptance * drafted:
                continue
            if self._rate(mode) > best_rate:
                best, best_rate = mode, self._rate(mode)
        return best

    def _rate(self, mode: str) -> float:
        history = self.history[mode]
        seconds = sum(h[1] for h in history)
        return sum(h[0] for h in history) / seconds if seconds else 0.0
