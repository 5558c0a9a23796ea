"""When a row of generation is done, and the checks of a request's lengths and stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rbcompile.errors import UserError


@dataclass
class RowTokens:
    """One row's new tokens, and how far its text was searched for stop strings."""
    index: int                                   # the row in the caller's batch
    tokens: list[int] = field(default_factory=list)
    searched: int = 0                            # text already searched for stop strings
    text_end: int | None = None                  # where the first stop string ends


class StopCriteria:
    """When a row is done: an EOS token (kept), a stop string in its new text (kept up to the
    token that completes it), or `max_new_tokens`."""

    def __init__(self, max_new_tokens: int, eos_token_ids, stop: list[str], decode):
        self.max_new_tokens, self.eos, self.stop, self.decode = max_new_tokens, set(eos_token_ids), stop, decode

    def finished(self, row: RowTokens) -> bool:
        return (row.tokens[-1] in self.eos or (bool(self.stop) and self._stop_reached(row))
                or len(row.tokens) >= self.max_new_tokens)

    def _stop_reached(self, row: RowTokens) -> bool:
        text = self.decode(row.tokens)
        ends = [found + len(s) for s in self.stop
                if (found := text.find(s, max(0, row.searched - len(s) + 1))) >= 0]
        row.searched = len(text)
        if ends:
            row.text_end = min(ends)
        return bool(ends)

    def reason(self, row: RowTokens) -> str:
        """OpenAI's finish_reason for a finished row: 'stop' (EOS or a stop string) or 'length'."""
        return "stop" if row.text_end is not None or row.tokens[-1] in self.eos else "length"


def check_stop(stop: list[str] | None, decode: Callable | None) -> None:
    """Stop strings need a decode function, and none may be empty."""
    if stop and decode is None:
        raise UserError("stop strings need a decode function (token ids -> text)")
    if any(not s for s in stop or ()):
        raise UserError("stop strings must not be empty")


def check_lengths(prompt_length: int, max_new_tokens: int, max_positions: int) -> None:
    """A one-line UserError when the prompt or max_new_tokens do not fit the model's positions."""
    if prompt_length >= max_positions:
        raise UserError(f"the prompt has {prompt_length} tokens; the model allows fewer than "
                        f"{max_positions} positions")
    left = max_positions - prompt_length
    if not 1 <= max_new_tokens <= left:
        raise UserError(f"max_new_tokens must be between 1 and the {left} positions left after the "
                        f"{prompt_length}-token prompt (max positions {max_positions}), got {max_new_tokens}")
