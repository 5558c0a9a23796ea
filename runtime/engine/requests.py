"""What the batch engine (engine.py) is asked and what it counts: a request, the group of rows
that drafts together and its counters, the engine's counters, a long prompt being prefilled in
chunks, and how it batches (`EngineConfig`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable

import torch

from rbcompile.errors import UserError
from rbcompile.runtime.engine.draft_policy import AutoPolicy, FixedPolicy
from rbcompile.runtime.engine.grammar import Constraint
from rbcompile.runtime.engine.penalties import penalize
from rbcompile.runtime.engine.sampling import SamplingConfig
from rbcompile.runtime.engine.stopping import RowTokens

SPECULATE_MODES = ("off", "ngram", "self", "quant", "auto")
FIRST_DRAFT_LENGTH = 4   # a row's drafts in its first speculative step (then: its acceptance)


@dataclass
class GenerationStats:
    """Counters of a group of rows (`DraftGroup`: one `generate` call). Token counts are summed
    over rows."""
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0            # engine time, not counting a stream consumer's time
    forward_calls: int = 0          # step and draft-step calls, prefill included
    drafted: int = 0                # draft tokens sent to verification
    accepted: int = 0               # drafts kept
    decode_steps: int = 0           # full-path steps after prefill
    step_tokens: float = 0.0        # tokens per row emitted by those steps (mean), summed
    rows_per_step: list[int] = field(default_factory=list)   # the group's rows in each full forward
    steps_by_mode: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per row per decode step (1 + accepted drafts; 1.0 without speculation)."""
        return self.step_tokens / self.decode_steps if self.decode_steps else 0.0

    def record_step(self, mode: str, rows: int, drafted: int, kept: int) -> None:
        """A full-path step of `rows` rows that verified `drafted` drafts and kept `kept`."""
        self.decode_steps += 1
        self.step_tokens += 1 + kept / rows
        self.drafted += drafted
        self.accepted += kept
        self.steps_by_mode[mode] = self.steps_by_mode.get(mode, 0) + 1


@dataclass(eq=False)
class DraftGroup:
    """Rows that pick their drafter together each step (one `generate` call's rows, or one
    served choice), and their counters."""
    policy: FixedPolicy | AutoPolicy
    stats: GenerationStats = field(default_factory=GenerationStats)
    mode: str = "off"               # the drafter of the step running


@dataclass(eq=False)
class EngineRequest:
    """One prompt to complete. `on_token(token)` and `on_finish(request)` run on the engine's
    thread; after `on_finish`, `finish_reason` is 'stop', 'length', 'cancelled' or 'error'
    (with `error` set)."""
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    stop: list[str] = field(default_factory=list)
    budget: float | None = None
    priority: int = 1               # lower first (QoS class: 0 interactive, 1 standard, 2 batch)
    client: str | None = None       # who asked: rows are shared fairly among clients (waiting.py)
    speculate: str = "off"          # the drafter: SPECULATE_MODES; drafts verified in the batch step
    drafting: DraftGroup | None = None   # shared with the rows it picks drafters with (None: its own)
    on_token: Callable[[int], None] | None = None
    on_finish: Callable[["EngineRequest"], None] | None = None
    row: RowTokens = field(default_factory=lambda: RowTokens(0))
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=perf_counter)
    first_token_at: float | None = None
    keep_first_logits: bool = False           # keep the prefill's logits (before `on_token`)
    first_logits: torch.Tensor | None = None  # [vocab]: what its first token was drawn from
    drafted: int = 0                # draft tokens verified (with `speculate`)
    accepted: int = 0               # of those, kept
    draft_length: int = FIRST_DRAFT_LENGTH   # most drafts next step (Speculation.record)
    budget_run: float = 0.0         # the largest budget any forward it took part in ran
    weights: str | None = None      # the lowest weight level it allows (None: the decoder's;
    # its forwards run at least as precise: weight_levels.py)
    weights_run: str | None = None  # the least precise level any of its forwards ran
    logprobs: int | None = None     # keep each token's logprob and this many alternatives
    token_logprobs: list = field(default_factory=list)   # logprobs.TokenLogprob per token
    grammar: Constraint | None = None   # what its output must follow (grammar.py)

    @property
    def tokens(self) -> list[int]:
        return self.row.tokens

    @property
    def adjusts(self) -> bool:
        """Whether it chooses from other scores than the raw logits (`scores`)."""
        penalties = self.sampling.penalties
        return self.grammar is not None or (penalties is not None and penalties.active)

    def scores(self, logits: torch.Tensor, drafts: list[int] = ()) -> torch.Tensor:
        """What it chooses its next tokens from: `logits` [positions, vocab] penalized
        (penalties.py) and masked by its grammar, position j as if `drafts[:j]` had been
        emitted after its tokens."""
        logits = penalize(self.sampling.penalties, logits, self.prompt, self.tokens, drafts)
        return logits if self.grammar is None else self.grammar.masked(logits, drafts)

    @property
    def context(self) -> list[int]:
        """What joining the batch prefills: the prompt; after a preemption also the tokens
        but the last, which the next decode step takes as its input."""
        return self.prompt + self.tokens[:-1] if self.tokens else self.prompt


@dataclass
class EngineStats:
    """Counters since the engine started."""
    prefills: int = 0               # prompts prefilled (a group of samples counts once)
    prefill_forwards: int = 0       # forwards that prefilled them (several prompts each)
    prefill_chunks: int = 0         # of those, chunks of prompts longer than `prefill_chunk`
    reused_prompt_tokens: int = 0   # prompt tokens whose K/V came from the prefix cache
    decode_steps: int = 0
    decode_rows: int = 0       # rows summed over decode steps (mean batch = rows / steps)
    speculative_steps: int = 0      # decode steps that verified drafts
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    finished: int = 0
    preempted: int = 0              # rows sent back to the queue for a client under its share
    steps_by_drafter: dict[str, int] = field(default_factory=dict)  # decode steps by the
    # drafters whose drafts they verified ('off': none)


@dataclass(eq=False)
class ChunkedPrefill:
    """A group whose prompt is being prefilled chunk by chunk: K/V [1, kv heads, prompt, head
    dim] per cache tensor, the first `done` tokens' filled, under `gates`."""
    group: list[EngineRequest]
    kv: list[torch.Tensor]
    gates: object
    done: int = 0

    @property
    def prompt(self) -> list[int]:
        return self.group[0].context


@dataclass(frozen=True)
class EngineConfig:
    """How the batch engine batches. `max_batch`: rows decoded together; `block`: the K/V
    cache grows by this many slots; `prefill_tokens`: most padded tokens newcomers prefill in
    one forward (unless one prompt alone is longer); `prefill_chunk`: prompts longer than this
    are prefilled in chunks of it (None: never); `draft_tokens`: most drafts per speculating
    row and step (a row drafts as many as its acceptance earns, `Speculation.record`);
    `verify_tokens`: most tokens (rows x (1 + drafts)) a speculative step runs;
    `batch_buckets`: a decode step runs the next power of two of rows (at most `max_batch`)
    and the cache grows to powers of two of blocks, so that CUDA graphs of the step are one per
    bucket and doubling; `unpadded_prefill`: the step takes the mask as None for a prefill
    from the first slot without padding (`Decoder.unpadded_prefill`); `idle_cache_bytes`: an
    idle engine gives back a cache larger than this."""
    max_batch: int = 16
    block: int = 64
    prefill_tokens: int = 2048
    prefill_chunk: int | None = 512
    draft_tokens: int = 10
    verify_tokens: int = 64
    batch_buckets: bool = False
    unpadded_prefill: bool = False
    idle_cache_bytes: int = 64 << 20

    def __post_init__(self):
        if self.max_batch < 1:
            raise UserError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.prefill_tokens < 1:
            raise UserError(f"prefill_tokens must be >= 1, got {self.prefill_tokens}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise UserError(f"prefill_chunk must be >= 1 (None: never chunk), got "
                            f"{self.prefill_chunk}")
        if self.draft_tokens < 1 or self.verify_tokens < 1:
            raise UserError(f"draft_tokens and verify_tokens must be >= 1, got "
                            f"{self.draft_tokens} and {self.verify_tokens}")
