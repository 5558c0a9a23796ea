"""`generate`: the batch engine (engine.py) run on one batch of requests, to the end.

The step is the generated decoder module's calling convention:
`step(input_ids [B,T], attention_mask [B,slots], position_ids [B,T], cache_position [T],
logit_positions [K], kv) -> logits [B,K,vocab]`, writing the K/V of the T tokens into `kv` at
slots `cache_position` and projecting only the K positions asked for onto the vocabulary.

Each prompt row is a request of a private engine, all of them in one draft group (they pick
their drafter together, speculation.py); the engine prefills them in one forward, then runs
decode steps (schedule -> execute -> update) until every row is done, and finished rows leave
the batch. So `generate`, `rbcompile run` and `serve` decode with one loop.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from time import perf_counter
from typing import Callable, Iterator

import torch

from rbcompile.artifact.cache_pool import CachePool
from rbcompile.artifact.decoder import DecoderShape
from rbcompile.errors import UserError
from rbcompile.runtime.engine.core import BatchEngine
from rbcompile.runtime.engine.drafters import LightDrafter
from rbcompile.runtime.engine.kv_cache import power_of_two_at_least
from rbcompile.runtime.engine.requests import (
    DraftGroup,
    EngineConfig,
    EngineRequest,
    GenerationStats,
)
from rbcompile.runtime.engine.sampling import SamplingConfig
from rbcompile.runtime.engine.speculation import Speculation, check_mode
from rbcompile.runtime.engine.stopping import check_lengths, check_stop


@dataclass
class GenerationResult:
    """Per input row: the new tokens (EOS included, nothing past a stop string), the prompt's
    tokens followed by them, and the new text (cut at the stop string's end) when a `decode`
    was given."""
    tokens: list[list[int]]
    sequences: list[list[int]]
    texts: list[str] | None
    stats: GenerationStats


class GenerationRun:
    """One batch of rows on a private engine: iterate for (row, token) as tokens are accepted,
    then call `result()`. The cache goes back (to the pool, if any) when the loop ends, the
    iterator is closed, or the run is dropped unstarted."""

    def __init__(self, engine: BatchEngine, stats: GenerationStats, prompts: list[list[int]],
                 decode: Callable | None):
        self.engine, self.stats, self.prompts, self.decode = engine, stats, prompts, decode
        self.stats.prompt_tokens = sum(len(prompt) for prompt in prompts)
        self.requests: list[EngineRequest] = []
        self.events: deque[tuple[int, int]] = deque()
        self._release = weakref.finalize(self, _release_cache, engine)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        try:
            resumed = perf_counter()
            while self.engine.has_work:
                self.engine.step()
                while self.events:   # the consumer's time between events is not the engine's
                    self.stats.seconds += perf_counter() - resumed
                    yield self.events.popleft()
                    resumed = perf_counter()
            self.stats.seconds += perf_counter() - resumed
        finally:
            self._release()

    def result(self) -> GenerationResult:
        """The outputs and stats, once iteration is over."""
        if any(request.finish_reason is None for request in self.requests):
            raise RuntimeError("generation is not finished")
        tokens = [request.tokens for request in self.requests]
        self.stats.new_tokens = sum(map(len, tokens))
        texts = None if self.decode is None else \
            [self.decode(request.tokens)[:request.row.text_end] for request in self.requests]
        return GenerationResult(tokens, [p + t for p, t in zip(self.prompts, tokens)], texts,
                                self.stats)


def _release_cache(engine: BatchEngine) -> None:
    engine.cache.drop(engine.cache.tensors)


def stream(step: Callable, input_ids, attention_mask=None, *, shape: DecoderShape,
           max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
           eos_token_ids=(), stop: list[str] | None = None, decode: Callable | None = None,
           speculate: str = "off", draft_step: Callable | None = None, draft_tokens: int = 10,
           draft_threshold: float = 0.5, draft_cost: float = 1.0,
           quant: LightDrafter | None = None,
           cache_pool: CachePool | None = None, unpadded_prefill: bool = False) -> GenerationRun:
    """Generate from left-padded prompts `input_ids` [B, P] (or [P]); iterate the result for
    (row, token) as tokens are accepted, then call its `result()`. With a seed, row i samples
    with seed + i (its own generator, as a served request's choice i).

    `speculate`: 'off' (one token per step), 'ngram' (prompt lookup), 'self' (the light path
    `draft_step`, same interface as `step`, drafts on the same cache), 'quant' (the drafter
    `quant`: the decoder at a lower weight level, on the same cache), or 'auto' (per call,
    whichever of those measures fastest). `draft_tokens`: at most this many drafts per step
    (a row drafts as many as its acceptance earns);
    `draft_threshold`: the light path stops drafting below this top probability; `draft_cost`:
    what a light-path forward costs next to a full one, for 'auto' (0 for a light plan that
    calibration measured to pay: its first step may run at once). `stop` strings need
    `decode` (token ids -> text; given, the result has texts too). With a
    `cache_pool` (CUDA graphs) the K/V tensors come from it and go back to it, and the batch
    runs in power-of-two buckets. `unpadded_prefill`: `step` takes the mask as None for a
    prefill from the first slot without padding (`Decoder.unpadded_prefill`). Bad input raises
    a one-line `UserError` before anything runs."""
    prompt_ids, pads = check_prompts(input_ids, attention_mask)
    check_lengths(prompt_ids.shape[1], max_new_tokens, shape.max_positions)
    light = None if draft_step is None else LightDrafter(draft_step, draft_threshold, draft_cost)
    check_mode(speculate, light, quant)
    if draft_tokens < 1:
        raise UserError(f"draft_tokens must be >= 1, got {draft_tokens}")
    check_stop(stop, decode)
    prompts = [row[pad:] for row, pad in zip(prompt_ids.tolist(), pads.tolist())]
    rows, width = len(prompts), prompt_ids.shape[1]
    buckets = cache_pool is not None
    max_batch = power_of_two_at_least(rows) if buckets else rows
    config = EngineConfig(max_batch=max_batch, prefill_tokens=rows * width, prefill_chunk=None,
                          draft_tokens=draft_tokens, verify_tokens=max_batch * (1 + draft_tokens),
                          batch_buckets=buckets, unpadded_prefill=unpadded_prefill,
                          idle_cache_bytes=1 << 62)
    engine = BatchEngine(partial(_without_gates, step), shape, config,
                         gates_for_budget=lambda budget: None, eos_token_ids=eos_token_ids,
                         decode=decode, cache_pool=cache_pool, light=light, quant=quant)
    group = DraftGroup(Speculation(draft_tokens, light, quant).policy(speculate))
    run = GenerationRun(engine, group.stats, prompts, decode)
    for index, prompt in enumerate(prompts):
        seeded = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + index)
        run.requests.append(engine.submit(EngineRequest(
            prompt, max_new_tokens, seeded, list(stop or ()), speculate=speculate, drafting=group,
            on_token=partial(_deliver, run.events, index))))
    return run


def _without_gates(step: Callable, *inputs, gates=None) -> torch.Tensor:
    """`step` (its plan fixed by the caller) under the engine's calling convention."""
    return step(*inputs)


def _deliver(events: deque, index: int, token: int) -> None:
    events.append((index, token))


def generate(step: Callable, input_ids, attention_mask=None, **options) -> GenerationResult:
    """Generate to the end; the options are `stream`'s."""
    events = stream(step, input_ids, attention_mask, **options)
    for _ in events:
        pass
    return events.result()


def check_prompts(input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids [B, P], left-pad count per row); a one-line UserError for bad input."""
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
