"""KV-cached text generation on a decoder step, with optional speculative decoding.

The step is the generated decoder module's calling convention:
`step(input_ids [B,T], attention_mask [B,max_len], position_ids [B,T], cache_position [T],
logit_positions [K], kv) -> logits [B,K,vocab]`, writing the K/V of the T tokens into `kv` at
slots `cache_position` and projecting only the K positions asked for onto the vocabulary.

A vLLM-like engine in miniature, calls going one way: the `Scheduler` (one request's loop:
prefill, then decode steps, finished rows leave the batch) asks a speculation policy which
drafter to use, the drafter proposes tokens (n-gram lookup, or the light path run on the same
cache), the `ModelRunner` runs the full step on [last token + drafts], `verify` keeps the drafts
the full path agrees with, and the `StaticKVCache` commits the kept slots. All rows share the
cache's slot index, and each row keeps its own drafts: the batch advances past the most kept,
and the cache masks, per row, the slots of drafts that row rejected (no K/V moves; positions are
tracked per row).
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable, Iterator

import torch

from .drafters import Drafter, NGramProposer, SelfDrafter
from .errors import UserError
from .kv_cache import CachePool, DecoderShape, StaticKVCache, padded_rows
from .sampling import SamplingConfig, verify

SPECULATE_MODES = ("off", "ngram", "self", "auto")


@dataclass
class GenerationStats:
    """Counters of one request. Token counts are summed over rows."""
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0            # engine time, not counting a stream consumer's time
    forward_calls: int = 0          # step and draft-step calls, prefill included
    drafted: int = 0                # draft tokens sent to verification
    accepted: int = 0               # drafts kept (each step keeps the batch minimum)
    decode_steps: int = 0           # full-path steps after prefill
    step_tokens: int = 0            # tokens per row emitted by those steps, summed
    rows_per_step: list[int] = field(default_factory=list)   # batch of each full step
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

    def record_step(self, mode: str, rows: int, tokens: float, drafted: int, kept: float) -> None:
        """A full-path step: `tokens` emitted and `kept` drafts kept per row (means)."""
        self.decode_steps += 1
        self.step_tokens += tokens
        self.drafted += drafted * rows
        self.accepted += round(kept * rows)
        self.steps_by_mode[mode] = self.steps_by_mode.get(mode, 0) + 1


@dataclass
class GenerationResult:
    """Per input row: the new tokens (EOS included, nothing past a stop string), the prompt's
    tokens followed by them, and the new text (cut at the stop string's end) when a `decode`
    was given."""
    tokens: list[list[int]]
    sequences: list[list[int]]
    texts: list[str] | None
    stats: GenerationStats


class ModelRunner:
    """Runs the full step, or the draft step (light path), on the cache's next slots."""

    def __init__(self, step: Callable, draft_step: Callable | None, cache: StaticKVCache,
                 stats: GenerationStats, unpadded_prefill: bool = False):
        self.step, self.draft_step, self.cache, self.stats = step, draft_step, cache, stats
        self.unpadded_prefill = unpadded_prefill

    def forward(self, tokens: torch.Tensor, offset: int = 0, light: bool = False,
                last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, 1, vocab] with `last_only`) of `tokens` [B, T] written
        from slot `length + offset` on (the cache's idle rows run copies of the last row). With
        `unpadded_prefill`, a step from the first slot of rows without padding passes the mask
        as None (the artifact's decoder then attends causally without it)."""
        attention_mask, position_ids, cache_position = self.cache.inputs(tokens.shape[1], offset)
        if self.unpadded_prefill and self.cache.length + offset == 0:
            attention_mask = None
        rows, count = tokens.shape
        logit_positions = self.cache.slots[count - 1 if last_only else 0:count]
        step = self.draft_step if light else self.step
        if rows < self.cache.batch:  # a batch bucket's idle rows (CUDA graphs)
            tokens = tokens[padded_rows(rows, self.cache.batch, tokens.device)]
        with torch.no_grad():
            logits = step(tokens, attention_mask, position_ids, cache_position, logit_positions,
                          self.cache.tensors)
        self.stats.forward_calls += 1
        if not light:
            self.stats.rows_per_step.append(rows)
        return logits[:rows]


class FixedPolicy:
    """Always the same mode."""

    def __init__(self, mode: str):
        self.mode = mode

    def choose(self) -> str:
        return self.mode

    def record(self, mode: str, tokens: int, seconds: float, drafted: int, kept: int) -> None:
        pass


class AutoPolicy:
    """Per-request choice among 'off' and drafters by measured tokens per second.

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

    def text(self, row: RowTokens) -> str:
        return self.decode(row.tokens)[:row.text_end]

    def reason(self, row: RowTokens) -> str:
        """OpenAI's finish_reason for a finished row: 'stop' (EOS or a stop string) or 'length'."""
        return "stop" if row.text_end is not None or row.tokens[-1] in self.eos else "length"


class Scheduler:
    """One request: prefill, then decode steps in the mode the policy chooses, until every row
    is done; finished rows leave the batch. Iterate for (row, token) as tokens are accepted,
    then call `result()`."""

    def __init__(self, runner: ModelRunner, prompt_ids: torch.Tensor, prompts: list[list[int]], *,
                 sampling: SamplingConfig, generator, criteria: StopCriteria,
                 drafters: dict[str, Drafter], policy, draft_tokens: int):
        self.runner, self.cache, self.stats = runner, runner.cache, runner.stats
        self.prompt_ids, self.prompts = prompt_ids, prompts
        self.sampling, self.generator, self.criteria = sampling, generator, criteria
        self.drafters, self.policy, self.draft_tokens = drafters, policy, draft_tokens
        self.all_rows = [RowTokens(index) for index in range(len(prompts))]
        self.rows = list(self.all_rows)
        self.pending = None      # [B] each running row's last token, not yet in the cache
        self.stats.prompt_tokens = sum(len(prompt) for prompt in prompts)
        self._resumed = 0.0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(row, token) as tokens are accepted; the cache is released when the loop ends (or
        the iterator is closed)."""
        try:
            self._resumed = perf_counter()
            logits = self.runner.forward(self.prompt_ids, last_only=True)
            self.cache.commit(self.prompt_ids.shape[1])
            first = self.sampling.choose(logits[:, -1], self.generator)
            yield from self._emit(self._advance([[token] for token in first.tolist()], first))
            while self.rows:
                mode = self.policy.choose()
                started = perf_counter()
                # kept: mean per row; last: each row's last token on the device, or None
                emitted, drafted, kept, last = self._decode_step(self.drafters.get(mode))
                self.policy.record(mode, kept + 1, perf_counter() - started, drafted, kept)
                self.stats.record_step(mode, len(self.rows), kept + 1, drafted, kept)
                yield from self._emit(self._advance(emitted, last))
            self.stats.seconds += perf_counter() - self._resumed
        finally:
            self.cache.release()

    def result(self) -> GenerationResult:
        """The outputs and stats, once iteration is over."""
        if self.rows or self.pending is None:
            raise RuntimeError("generation is not finished")
        self.stats.new_tokens = sum(len(row.tokens) for row in self.all_rows)
        tokens = [row.tokens for row in self.all_rows]
        texts = [self.criteria.text(row) for row in self.all_rows] if self.criteria.decode else None
        return GenerationResult(tokens, [p + t for p, t in zip(self.prompts, tokens)], texts, self.stats)

    def _decode_step(self, drafter: Drafter | None):
        """Run one full step; (tokens each row emits, drafts per row, mean drafts kept per
        row, each row's last token as a device tensor when the step has one). Each row keeps
        its own drafts (the cache masks what a row rejected)."""
        budget = min(self.draft_tokens,
                     max(self.criteria.max_new_tokens - len(row.tokens) for row in self.rows) - 1)
        drafts = drafter.propose(self.pending, budget) if drafter and budget > 0 else None
        if drafts is None:
            logits = self.runner.forward(self.pending[:, None])
            self.cache.commit(1)
            chosen = self.sampling.choose(logits[:, -1], self.generator)
            return [[token] for token in chosen.tolist()], 0, 0.0, chosen
        logits = self.runner.forward(torch.cat([self.pending[:, None], drafts.tokens], 1))
        verdicts = [verify(self.sampling, logits[row], drafts.tokens[row],
                           None if drafts.probs is None else drafts.probs[row], self.generator)
                    for row in range(len(self.rows))]
        kept = [row_kept for row_kept, _ in verdicts]
        emitted = [draft[:row_kept] + [following]
                   for draft, (row_kept, following) in zip(drafts.tokens.tolist(), verdicts)]
        self.cache.commit_rows(kept)
        return emitted, drafts.tokens.shape[1], sum(kept) / len(kept), None

    def _advance(self, emitted: list[list[int]], last: torch.Tensor | None = None
                 ) -> list[tuple[int, int]]:
        """Append each row's emitted tokens up to where it finishes; drop finished rows.
        `last`: each row's last emitted token, already on the device (the next step's input
        without a copy from the host). Returns the (row, token) events."""
        events, keep = [], []
        for position, (row, tokens) in enumerate(zip(self.rows, emitted)):
            for token in tokens:
                row.tokens.append(token)
                events.append((row.index, token))
                if self.criteria.finished(row):
                    break
            else:
                keep.append(position)
        for drafter in self.drafters.values():
            drafter.observe(emitted)
        if last is not None and len(keep) == len(self.rows):
            self.pending = last
        else:
            self.pending = torch.tensor([emitted[position][-1] for position in keep],
                                        dtype=torch.long, device=self.prompt_ids.device)
        if len(keep) < len(self.rows):
            self.rows = [self.rows[position] for position in keep]
            if keep:
                self.cache.keep_rows(torch.tensor(keep))
                for drafter in self.drafters.values():
                    drafter.keep_rows(keep)
        return events

    def _emit(self, events):
        """Yield events; the consumer's time between them is not the engine's."""
        for event in events:
            self.stats.seconds += perf_counter() - self._resumed
            yield event
            self._resumed = perf_counter()


def stream(step: Callable, input_ids, attention_mask=None, *, shape: DecoderShape,
           max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
           eos_token_ids=(), stop: list[str] | None = None, decode: Callable | None = None,
           speculate: str = "off", draft_step: Callable | None = None, max_len: int | None = None,
           draft_tokens: int = 4, draft_threshold: float = 0.5,
           draft_cost: float = 1.0, cache_pool: CachePool | None = None,
           unpadded_prefill: bool = False) -> Scheduler:
    """Generate from left-padded prompts `input_ids` [B, P] (or [P]); iterate the result for
    (row, token) as tokens are accepted, then call its `result()`.

    `speculate`: 'off' (one token per step), 'ngram' (prompt lookup), 'self' (the light path
    `draft_step`, same interface as `step`, drafts on the same cache), or 'auto' (per request,
    whichever of those measures fastest). `draft_tokens`: at most this many drafts per step;
    `draft_threshold`: the light path stops drafting below this top probability; `draft_cost`:
    what a light-path forward costs next to a full one, for 'auto' (0 for a light plan that
    calibration measured to pay: its first step may run at once). `stop`
    strings need `decode` (token ids -> text). `max_len`: the cache length (default: prompt +
    max_new_tokens; with a `cache_pool`, the K/V tensors come from it, that length rounded up
    to its `slots`). `unpadded_prefill`: `step` takes the mask as None for a prefill from the
    first slot without padding (`Decoder.unpadded_prefill`). Bad input raises a one-line
    `UserError` before anything runs."""
    prompt_ids, pads = _check_prompts(input_ids, attention_mask)
    max_len = check_lengths(prompt_ids.shape[1], max_new_tokens, shape.max_positions, max_len)
    _check_speculation(speculate, draft_step, draft_tokens)
    check_stop(stop, decode)
    eos_token_ids = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)

    stats = GenerationStats()
    if cache_pool is not None:
        max_len = cache_pool.slots(max_len, shape.max_positions)
    cache = StaticKVCache(shape.layers, shape.kv_heads, shape.head_dim, max_len, pads,
                          shape.dtype, shape.device, pool=cache_pool)
    runner = ModelRunner(step, draft_step, cache, stats,
                         unpadded_prefill=unpadded_prefill and not pads.any())
    prompts = [row[pad:] for row, pad in zip(prompt_ids.tolist(), pads.tolist())]
    generator = sampling.generator(shape.device)
    drafters: dict[str, Drafter] = {}
    if speculate in ("ngram", "auto"):
        drafters["ngram"] = NGramProposer(prompts)
    if speculate in ("self", "auto") and draft_step is not None:
        drafters["self"] = SelfDrafter(runner, sampling, generator, draft_threshold)
    # before its first step a drafter may lose what it adds to a plain step: nothing for n-gram
    # lookup, `draft_tokens` light-path forwards for self-drafting
    first_loss = {"self": draft_tokens * draft_cost}
    policy = AutoPolicy(["off", *drafters], first_loss) if speculate == "auto" else FixedPolicy(speculate)
    scheduler = Scheduler(runner, prompt_ids.to(shape.device), prompts, sampling=sampling,
                          generator=generator, criteria=StopCriteria(max_new_tokens, eos_token_ids, stop or [], decode),
                          drafters=drafters, policy=policy, draft_tokens=draft_tokens)
    weakref.finalize(scheduler, cache.release)  # a stream dropped before its first token too
    return scheduler


def generate(step: Callable, input_ids, attention_mask=None, **options) -> GenerationResult:
    """Generate to the end; the options are `stream`'s."""
    events = stream(step, input_ids, attention_mask, **options)
    for _ in events:
        pass
    return events.result()


def _check_prompts(input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids [B, P], left-pad count per row)."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).cpu()
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise UserError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise UserError("the prompt is empty (0 tokens)")
    mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask).long().cpu()
    mask = mask[None] if mask.dim() == 1 else mask
    if mask.shape != input_ids.shape:
        raise UserError(f"attention_mask shape {tuple(mask.shape)} differs from input_ids' {tuple(input_ids.shape)}")
    lengths = mask.sum(-1)
    if (lengths == 0).any():
        raise UserError(f"prompt row {int((lengths == 0).nonzero()[0])} is empty (0 tokens)")
    pads = input_ids.shape[1] - lengths
    if not torch.equal(mask, (torch.arange(input_ids.shape[1])[None] >= pads[:, None]).long()):
        raise UserError("attention_mask must be left padding: per row, 0s then 1s")
    return input_ids, pads


def check_stop(stop: list[str] | None, decode: Callable | None) -> None:
    """Stop strings need a decode function, and none may be empty."""
    if stop and decode is None:
        raise UserError("stop strings need a decode function (token ids -> text)")
    if any(not s for s in stop or ()):
        raise UserError("stop strings must not be empty")


def check_lengths(prompt_length: int, max_new_tokens: int, max_positions: int, max_len) -> int:
    """The cache length; a one-line UserError when the prompt or max_new_tokens do not fit."""
    if prompt_length >= max_positions:
        raise UserError(f"the prompt has {prompt_length} tokens; the model allows fewer than "
                        f"{max_positions} positions")
    left = max_positions - prompt_length
    if not 1 <= max_new_tokens <= left:
        raise UserError(f"max_new_tokens must be between 1 and the {left} positions left after the "
                        f"{prompt_length}-token prompt (max positions {max_positions}), got {max_new_tokens}")
    needed = prompt_length + max_new_tokens
    if max_len is not None and max_len < needed:
        raise UserError(f"max_len={max_len} is less than the prompt ({prompt_length}) plus "
                        f"max_new_tokens ({max_new_tokens})")
    return needed if max_len is None else max_len


def _check_speculation(speculate: str, draft_step, draft_tokens: int) -> None:
    if speculate not in SPECULATE_MODES:
        raise UserError(f"unknown speculate={speculate!r}; valid: {', '.join(SPECULATE_MODES)}")
    if speculate == "self" and draft_step is None:
        raise UserError("speculate='self' needs a draft_step (the light path)")
    if draft_tokens < 1:
        raise UserError(f"draft_tokens must be >= 1, got {draft_tokens}")
