"""A choice's text as its tokens arrive, cut before the first stop string: what a stream may
send so far. The work per token is linear in the stop strings' length (never quadratic), so a
long stop string cannot stall the event loop that runs it."""
from __future__ import annotations

from typing import Callable


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` up to its first stop string (excluded), and whether one was found."""
    found = [index for s in stop if (index := text.find(s)) >= 0]
    return (text[:min(found)], True) if found else (text, False)


class StopPrefix:
    """The longest end of a text that begins `stop` (a stop string that may be completed by
    the next tokens), found by the Knuth-Morris-Pratt automaton of `stop` run over the text's
    last len(stop) - 1 characters: O(len(stop)) a call."""

    def __init__(self, stop: str):
        self.stop = stop
        self.fallback = [0] * len(stop)   # longest proper border of stop[:i + 1]
        border = 0
        for i in range(1, len(stop)):
            while border and stop[i] != stop[border]:
                border = self.fallback[border - 1]
            if stop[i] == stop[border]:
                border += 1
            self.fallback[i] = border

    def length(self, text: str) -> int:
        """k < len(stop), the largest with text.endswith(stop[:k])."""
        stop, matched = self.stop, 0
        for char in text[max(0, len(text) - len(stop) + 1):]:   # shorter than stop
            while matched and char != stop[matched]:
                matched = self.fallback[matched - 1]
            if char == stop[matched]:
                matched += 1
        return matched


class TextStream:
    """One row's text as its tokens arrive: each call returns the text not sent yet, cut
    before a stop string and holding back what may begin one (or an undecodable byte sequence
    so far). The row's whole tokens are decoded each time: a later token can re-tokenise the
    end of the text."""

    def __init__(self, decode: Callable[[list], str], stop: list[str]):
        self.decode, self.stop, self.tokens, self.sent = decode, stop, [], ""
        self.prefixes = [StopPrefix(s) for s in stop]

    def add(self, token) -> str:
        self.tokens.append(token)
        text, _ = cut_at_stop(self.decode(self.tokens), self.stop)
        return self._delta(text[:len(text) - self.held_back(text)])

    def finish(self) -> str:
        return self._delta(cut_at_stop(self.decode(self.tokens), self.stop)[0])

    def held_back(self, text: str) -> int:
        """Characters at the end of `text` not to stream yet."""
        if text.endswith("\ufffd"):
            return 1
        return max((prefix.length(text) for prefix in self.prefixes), default=0)

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent):  # a re-tokenised prefix: wait for a stable one
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
