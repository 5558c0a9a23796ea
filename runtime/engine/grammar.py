"""Constrained decoding: a request whose output must follow a grammar (a JSON schema: OpenAI's
`response_format` and tool calls) chooses each token among those the grammar allows next.

The grammar runs in llguidance (`llguidance` on PyPI, no dependencies of its own; xgrammar, the
other candidate, needs triton and tvm-ffi): its matcher gives a bitmask of the vocabulary per
step and advances token by token. A decode step that verifies drafts masks each position as if
the drafts before it had been emitted, then rolls the matcher back: a draft the grammar forbids
has probability 0 where it is verified, so it is rejected there, and the tokens emitted are those
the row emits without drafting.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from rbcompile.errors import UserError


def load_llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise UserError("structured output needs llguidance (the 'serve' extra): pip install "
                        "'rbcompile[serve]'") from None
    return llguidance


class GrammarCompiler:
    """Compiles grammars for one tokenizer (its llguidance view is built once)."""

    def __init__(self, tokenizer):
        self.llguidance = load_llguidance()
        self.tokenizer = self.llguidance.hf.from_tokenizer(tokenizer)

    def json_schema(self, schema: dict) -> "Constraint":
        """A constraint to compact JSON ("," and ":" between items) that validates against
        `schema` (a one-line UserError where llguidance refuses the schema)."""
        matcher_class = self.llguidance.LLMatcher
        # compact separators: with flexible whitespace a small model may indent forever
        grammar = matcher_class.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        error = matcher_class.validate_grammar(grammar, self.tokenizer)   # '' when sound
        if error:
            raise UserError(f"the JSON schema cannot be enforced: {error.splitlines()[0]}")
        return Constraint(matcher_class(self.tokenizer, grammar), self.llguidance,
                          self.tokenizer.vocab_size)


class Constraint:
    """One request's grammar as its tokens are emitted."""

    def __init__(self, matcher, llguidance, vocab: int):
        if sys.byteorder != "little":
            raise UserError("structured output reads llguidance's bitmask as little-endian")
        self.llguidance, self.matcher, self.vocab = llguidance, matcher, vocab
        self.torch_api = llguidance.torch
        self.mask = self.torch_api.allocate_token_bitmask(1, vocab)
        self.seconds = 0.0   # spent computing masks (benchmarks read it)

    def masked(self, logits: torch.Tensor, drafts: list[int] = ()) -> torch.Tensor:
        """`logits` [positions, vocab] with the tokens the grammar forbids at -inf: position j
        as if `drafts[:j]` had been emitted (positions after a forbidden draft are left as they
        are: verification stops at that draft)."""
        # in numpy: small torch ops wait on their thread pool behind onnxruntime's spinning
        # workers (milliseconds per op, benchmarks/bench_structured.py)
        started, scores = time.perf_counter(), logits.float().cpu().numpy().copy()
        # the drafts the grammar allows, in order (consuming a forbidden one would end the
        # matcher in an error state)
        allowed = self.matcher.validate_tokens(list(drafts)) if drafts else 0
        for position in range(allowed + 1):
            self.torch_api.fill_next_token_bitmask(self.matcher, self.mask, 0)
            width = min(self.vocab, scores.shape[1])   # the tokenizer's ids the head scores
            np.putmask(scores[position, :width], ~self._allowed()[:width], -np.inf)
            scores[position, width:] = -np.inf   # the head's padding ids
            if position < allowed:
                self.matcher.consume_token(drafts[position])
        if allowed:
            self.matcher.rollback(allowed)
        self.seconds += time.perf_counter() - started
        return torch.from_numpy(scores).to(logits.device)

    def fork(self) -> "Constraint":
        """A constraint of its own in the same state (one per choice, compiled once)."""
        return Constraint(self.matcher.deep_copy(), self.llguidance, self.vocab)

    def _allowed(self) -> np.ndarray:
        """The bitmask as bools [vocab] (llguidance's own torch apply took ~77 ms a call on
        this CPU)."""
        bits = np.unpackbits(self.mask.numpy().view(np.uint8), bitorder="little")
        return bits[:self.vocab].astype(bool)

    def advance(self, token: int) -> bool:
        """`token` was emitted (one the grammar allowed); whether the grammar has ended (its
        end-of-text consumed, or nothing may follow: the row stops there)."""
        return not self.matcher.consume_token(token) or self.matcher.is_stopped()
