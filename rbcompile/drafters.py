"""Drafters for speculative decoding: cheap guesses of the next tokens, verified by the full path.

`NGramDrafter` (prompt lookup): a hash index from the n-grams of the request's own tokens
(prompt and output so far) to where they last occurred; the draft is what followed that
occurrence. It costs a dict lookup per step and pays on input-grounded text (summaries,
quotes, code edits, extraction), where the output repeats spans of the prompt.
"""
from __future__ import annotations


class NGramDrafter:
    """Draft continuations of the longest recent n-gram (`max_n` down to `min_n` tokens) that
    occurred before in the row's tokens."""

    def __init__(self, tokens, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens; index every n-gram that now has a token after it."""
        for token in tokens:
            end = len(self.tokens)  # n-grams ending here are followed by `token`
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self._last_end[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram, copied with overlap (LZ77-style: a continuation that runs into the end of the
        tokens goes on with its own start, so a loop is drafted `k` tokens ahead); [] when no
        suffix occurred before."""
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            end = self._last_end.get(tuple(self.tokens[-n:]))
            if end is not None:
                period = len(self.tokens) - end
                return [self.tokens[end + i % period] for i in range(k)]
        return []
