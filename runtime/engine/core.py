"""The decoding engine: continuous batching for an artifact's decoder (as vLLM v1 and TGI).
`generate`, `rbcompile run`, `serve` and self-consistency's samples all decode here.

One loop, `BatchEngine.step()`: schedule (waiting requests join by priority, then the client
holding the fewest rows, then arrival, waiting.py; newcomers prefill together, left-padded,
after the `PrefixCache` blocks of their prompts are copied into their rows; a prompt longer
than `prefill_chunk` prefills one chunk per step instead; every row's drafter proposes,
speculation.py) -> execute (one forward of the decoder over every running row's pending token
and drafts, under the plan of the smallest budget among the rows) -> update (verify and sample
per row, emit, finish; finished or cancelled rows leave). A group of requests on one prompt
(`submit_samples`: n choices, a vote's samples) prefills one row, forked per request.

Any thread may `submit` / `cancel`; one thread calls `step` while `has_work`. A row's tokens
are those it would get alone (rows share only the step, never each other's keys; drafts are
verified losslessly; weight levels: weight_levels.py). docs/generation.md has the details.
"""
from __future__ import annotations

import threading
from collections import Counter
from time import perf_counter
from typing import Callable

import torch

from rbcompile.artifact.cache_pool import CachePool, zeros
from rbcompile.artifact.decoder import DecoderShape
from rbcompile.errors import UserError
from rbcompile.runtime.engine.drafters import LightDrafter, Proposal
from rbcompile.runtime.engine.kv_cache import BatchKVCache, copy_blocks, release_freed_memory
from rbcompile.runtime.engine.logprobs import record as record_logprobs
from rbcompile.runtime.engine.prefix_cache import PrefixCache
from rbcompile.runtime.engine.requests import (
    ChunkedPrefill,
    EngineConfig,
    EngineRequest,
    EngineStats,
)
from rbcompile.runtime.engine.sampling import verify_rows
from rbcompile.runtime.engine.speculation import Speculation
from rbcompile.runtime.engine.stopping import StopCriteria, check_lengths, check_stop
from rbcompile.runtime.engine.waiting import WaitingQueue, fair_victims
from rbcompile.runtime.engine.weight_levels import WeightLevel, WeightLevels


class BatchEngine:
    """`step(input_ids, attention_mask, position_ids, cache_position, logit_positions, cache,
    gates=None)` is the artifact's decoder (see decoder.Decoder); `gates_for_budget(budget)`
    its gates for a budget (None: the full path); `config` how it batches (`EngineConfig`).
    `release_cache(tensors)` hears of K/V tensors the engine no longer uses (the cache grew, or
    started over): the decoder's `forget_cache`; with a `cache_pool` they come from the pool
    and go back to it. `light` / `quant`: what 'self' / 'quant' draft with; `levels`: the
    weight levels requests may ask (`EngineRequest.weights`; default: the step's own)."""

    def __init__(self, step: Callable, shape: DecoderShape, config: EngineConfig = EngineConfig(),
                 *, gates_for_budget: Callable, eos_token_ids=(), decode: Callable | None = None,
                 wake: threading.Condition | None = None, prefix_cache: PrefixCache | None = None,
                 release_cache: Callable | None = None, cache_pool: CachePool | None = None,
                 light: LightDrafter | None = None, quant: LightDrafter | None = None,
                 levels: WeightLevels | None = None):
        self.config, self.max_batch = config, config.max_batch
        self.step_fn, self.shape, self.gates_for_budget = step, shape, gates_for_budget
        self.eos = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        self.decode, self.prefix_cache = decode, prefix_cache
        self.cache = BatchKVCache(shape, config.max_batch, config.block,
                                  power_of_two=config.batch_buckets, on_drop=release_cache,
                                  pool=cache_pool)
        self.waiting = WaitingQueue()
        self.running: list[EngineRequest] = []        # running[i] decodes in cache row i
        self.chunked: ChunkedPrefill | None = None    # a long prompt being prefilled
        self.criteria: dict[EngineRequest, StopCriteria] = {}
        self.generators: dict[EngineRequest, torch.Generator | None] = {}
        self.speculation = Speculation(config.draft_tokens, light, quant)
        self.levels = levels or WeightLevels(WeightLevel("full", None, 0.0))
        self.stats = EngineStats()
        self.budget: float | None = None   # for requests without their own (a controller's)
        self.weights: str | None = None    # likewise, the weight level (weight_levels.py)
        self.controller = None             # runtime.decode_control.DecodeController, if any
        self._check_s = 0.0                # this step's seconds in a quality check's full path
        self.wake = wake or threading.Condition()   # notified on submit and cancel

    # ---- any thread ----------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> EngineRequest:
        """Queue `request`; bad input raises a one-line UserError here, before it is queued."""
        self._queue([request])
        return request

    def submit_samples(self, requests: list[EngineRequest]) -> list[EngineRequest]:
        """Queue requests on one prompt as one group: they join together when there are rows
        for all of them (at the most urgent priority among them), with one prefill whose row
        is forked into one row per request; each draws its first token from that prefill's
        logits with its own generator, so each gets the tokens it would get alone."""
        if not 1 <= len(requests) <= self.max_batch:
            raise UserError(f"a group of {len(requests)} samples needs as many rows: between 1 "
                            f"and max_batch ({self.max_batch})")
        if any(request.prompt != requests[0].prompt for request in requests):
            raise UserError("the samples of one group must share one prompt")
        self._queue(requests)
        return requests

    def _queue(self, group: list[EngineRequest]) -> None:
        for request in group:
            if not request.prompt:
                raise UserError("the prompt is empty (0 tokens)")
            check_lengths(len(request.prompt), request.max_new_tokens, self.shape.max_positions)
            check_stop(request.stop, self.decode)
            self.speculation.check(request)
            self.levels.check(request.weights)
        for request in group:
            self.criteria[request] = StopCriteria(request.max_new_tokens, self.eos,
                                                  list(request.stop), self.decode)
            self.generators[request] = request.sampling.generator(self.shape.device)
            self.speculation.start(request)
        priority = min(request.priority for request in group)
        with self.wake:
            self.waiting.push(priority, tuple(group))
            self.wake.notify()
        if self.controller is not None:
            self.controller.arrived()

    def cancel(self, request: EngineRequest) -> None:
        """Stop `request` at the next step (a client gone); its row is freed."""
        with self.wake:
            request.cancelled = True
            self.wake.notify()

    @property
    def queued(self) -> int:   # requests waiting for a row
        return self.waiting.requests

    def queued_by_priority(self) -> dict[int, int]:
        with self.wake:
            return self.waiting.by_priority()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # ---- the engine's thread ---------------------------------------------------------------

    def step(self) -> bool:
        """Admit waiting requests (and prefill the next chunk of a long prompt), then one
        decode step for every running row. False when there was nothing to do."""
        try:
            if self.controller is not None:
                self.controller.before_step()
            self._drop_cancelled()
            chunked, decoding = self._admit(), bool(self.running)
            if decoding:
                self._decode()
            idle = not (self.running or self.chunked)
            if idle and self.cache.nbytes > self.config.idle_cache_bytes:
                self.cache = self.cache.emptied()   # idle: a long request's K/V go back
                release_freed_memory()
            return chunked or decoding
        except Exception as exc:
            self._fail_all(exc)
            raise

    def _admit(self) -> bool:
        """Waiting groups join in queue order while the next one has rows for all its requests
        and the padded prefill stays within `prefill_tokens`; they are prefilled together. A
        group with a prompt longer than `prefill_chunk` starts a chunked prefill instead, if
        none is running (else admission stops there). True when a chunk was prefilled."""
        groups, longest = [], 0
        rows = len(self.running) + (len(self.chunked.group) if self.chunked else 0)
        held = Counter(request.client for request in self.running)
        while True:
            with self.wake:
                waiting = self.waiting.next(held)
                if waiting is not None and rows + len(waiting.requests) > self.max_batch:
                    rows -= self._preempt_for(waiting, held, self.max_batch - rows)
                if waiting is None or rows + len(waiting.requests) > self.max_batch:
                    break
                group = waiting.requests
                chunk = self.config.prefill_chunk
                long = chunk is not None and len(group[0].context) > chunk
                width = max(longest, len(group[0].context))
                if long and self.chunked is not None or \
                        not long and groups and (len(groups) + 1) * width > self.config.prefill_tokens:
                    break
                self.waiting.remove(waiting)
            joining = self._live(group)
            if not joining:
                continue
            rows += len(joining)
            held[group[0].client] += len(joining)
            if long:
                self.chunked = self._start_chunked(joining)
            else:
                groups.append(joining)
                longest = width
        if groups:
            # cache rows: each group's first request, then the others (forks) group by group;
            # in `running` before the prefill, so a failing prefill fails them too
            self.running.extend(group[0] for group in groups)
            self.running.extend(request for group in groups for request in group[1:])
            self._prefill(groups)
        chunked = self.chunked is not None
        if chunked:
            self._prefill_chunk()
        self._leave_finished()
        return chunked

    def _preempt_for(self, waiting, held: Counter, free: int) -> int:
        """Send rows of clients over their fair share back to the queue so `waiting` fits
        (waiting.py); they rejoin by prefilling their prompt and tokens (recompute, as vLLM
        preempts). The rows freed."""
        if all(request.client == waiting.client for request in self.running):
            return 0   # one client (the usual case): nothing to share, nor to count per step
        victims = fair_victims(self.running, waiting, held, self.max_batch, free,
                               self.waiting.clients(self.running))
        for index in sorted(victims, reverse=True):
            request = self._remove_row(index)
            held[request.client] -= 1
            self.waiting.push(request.priority, (request,))
            self.stats.preempted += 1
        return len(victims)

    def _live(self, group: list[EngineRequest]) -> list[EngineRequest]:
        """The requests of `group` not cancelled; the cancelled ones finish."""
        for request in group:
            if request.cancelled:
                self._finish(request, "cancelled")
        return [request for request in group if not request.cancelled]

    def _start_chunked(self, group: list[EngineRequest]) -> ChunkedPrefill:
        """K/V of the group's whole prompt, the prefix cache's blocks copied in, under the
        gates of the group's budget now."""
        prompt, gates, shape = group[0].context, self._gates(group), self.shape
        kv = zeros(2 * shape.layers, (1, shape.kv_heads, len(prompt), shape.head_dim),
                   shape.dtype, shape.device)
        blocks = self.prefix_cache.lookup(prompt, self._cache_key(group, gates)) \
            if self.prefix_cache else []
        done = copy_blocks(kv, 0, 0, [block.tensors for block in blocks])
        self.stats.reused_prompt_tokens += done
        return ChunkedPrefill(group, kv, gates, done)

    def _prefill_chunk(self) -> None:
        """The next chunk of the long prompt; after the last one, its group joins the batch."""
        job, device = self.chunked, self.shape.device
        start = job.done
        end = min(len(job.prompt), start + self.config.prefill_chunk)
        slots = torch.arange(start, end, device=device)
        mask = None if self.config.unpadded_prefill and start == 0 else \
            torch.ones(1, end, dtype=torch.long, device=device)
        step = self._step_of(job.group)
        logits = step(torch.tensor([job.prompt[start:end]], device=device), mask, slots[None],
                      slots, torch.tensor([end - start - 1], device=device),
                      [tensor[:, :, :end] for tensor in job.kv], gates=job.gates)[0, -1]
        job.done = end
        self.stats.prefill_forwards += 1
        self.speculation.prefilled(job.group[:1])
        self.stats.prefill_chunks += 1
        if end < len(job.prompt):
            return
        self.chunked = None
        kv = [tensor[0] for tensor in job.kv]
        if self.prefix_cache is not None:
            self.prefix_cache.insert(job.prompt, self._cache_key(job.group, job.gates), kv)
        live = self._live(job.group)
        if not live:
            return
        row = self.cache.place(len(job.prompt))
        self.cache.write_prompt(row, [kv])
        self.cache.join()
        self.running.append(live[0])
        for request in live[1:]:
            self.cache.fork(row)
            self.running.append(request)
        self.stats.prefills += 1
        self._first_tokens(live, logits)

    def _prefill(self, groups: list[list[EngineRequest]]) -> None:
        """Write each group's prompt K/V into a new row (cached prefix blocks copied, the rest
        run in one forward for every group, left-padded), fork that row for each other request
        of its group, and emit each one's first token."""
        cache, device, gates = self.cache, self.shape.device, self._gates(self.running)
        prompts = [group[0].context for group in groups]
        key = self._cache_key([request for group in groups for request in group], gates)
        hits = [self.prefix_cache.lookup(prompt, key) if self.prefix_cache else []
                for prompt in prompts]
        reused = [len(blocks) * (self.prefix_cache.block_tokens if blocks else 0) for blocks in hits]
        first = cache.active
        for prompt in prompts:
            cache.place(len(prompt))
            cache.join()
        for row, blocks in enumerate(hits, first):
            cache.write_prompt(row, [block.tensors for block in blocks])
        # slots [end - width, end) of every row: the prompt parts not in the cache (a shorter
        # one left-padded, a longer one's cached tokens past the window recomputed)
        end, width = cache.length, max(len(p) - r for p, r in zip(prompts, reused))
        ids = [[0] * (width - len(prompt)) + prompt[-width:] for prompt in prompts]
        rows = slice(first, first + len(prompts))
        slots = torch.arange(end - width, end, device=device)
        unpadded = self.config.unpadded_prefill and width == end and \
            all(len(p) == end for p in prompts)
        step = self._step_of([request for group in groups for request in group])
        logits = step(torch.tensor(ids, device=device),
                      None if unpadded else cache.attention_mask(rows),
                      (slots[None] - cache.pads[rows, None]).clamp_min(0), slots,
                      torch.tensor([width - 1], device=device), cache.views(rows),
                      gates=gates)[:, -1]
        for row, group in enumerate(groups, first):
            for _ in group[1:]:
                cache.fork(row)
        if self.prefix_cache is not None:
            for row, prompt in enumerate(prompts, first):
                self.prefix_cache.insert(prompt, key, cache.prompt_kv(row, len(prompt)))
        self.stats.prefills += len(prompts)
        self.stats.prefill_forwards += 1
        self.speculation.prefilled([group[0] for group in groups])
        self.stats.reused_prompt_tokens += sum(max(0, len(prompt) - width) for prompt in prompts)
        for group, row_logits in zip(groups, logits):
            self._first_tokens(group, row_logits)

    def _first_tokens(self, group: list[EngineRequest], logits: torch.Tensor) -> None:
        """Each request of a group draws its first token from its prompt's logits [vocab] (a
        resumed one has its tokens: its last is the next step's input)."""
        for request in group:
            if request.tokens:
                continue
            if request.keep_first_logits:
                request.first_logits = logits
            token = int(request.sampling.choose(request.scores(logits[None]),
                                                self.generators[request]))
            record_logprobs(request, logits[None], [token])
            self._emit(request, token)

    def _decode(self) -> None:
        """One step over every running row: its pending token and its drafts, if any."""
        cache, started = self.cache, perf_counter()
        self._check_s = 0.0
        config = self.config
        limit = min(config.draft_tokens,
                    config.verify_tokens // cache.step_rows(config.batch_buckets) - 1)
        reach = max((min(limit, r.draft_length) for r in self.running if r.speculate != "off"),
                    default=0)
        cache.reserve_step(1 + max(reach, 0))   # the light path drafts in the step's slots
        proposals = self.speculation.propose(self.running, limit, self._light_forward,
                                             [self.generators[r] for r in self.running])
        drafts = [proposal.tokens for proposal in proposals]
        width = 1 + max(map(len, drafts))
        ids = [[request.tokens[-1], *draft] + [request.tokens[-1]] * (width - 1 - len(draft))
               for request, draft in zip(self.running, drafts)]
        logits = self._checked_step(self._step_inputs(ids, 0), self._budget(self.running))
        emitted = self._verify(logits, proposals)
        for request, row_logits, tokens in zip(self.running, logits, emitted):
            record_logprobs(request, row_logits, tokens)
        cache.advance_rows([len(tokens) - 1 for tokens in emitted], width)
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(self.running)
        self.stats.speculative_steps += width > 1
        self.speculation.record(self.running, proposals, emitted, perf_counter() - started)
        for mode in {r.drafting.mode for r, draft in zip(self.running, drafts) if draft} or {"off"}:
            self.stats.steps_by_drafter[mode] = self.stats.steps_by_drafter.get(mode, 0) + 1
        if self.controller is not None:
            top = logits[:, 0].float().softmax(-1).max(-1).values.tolist()
            self.controller.step_done(perf_counter() - started - self._check_s, top)
        for request, tokens in zip(self.running, emitted):
            for token in tokens:
                self._emit(request, token)
                if request.finish_reason is not None:
                    break
        self._leave_finished()

    def _step_inputs(self, ids: list[list[int]], offset: int) -> tuple:
        """A decode step's inputs (`BatchKVCache.step_inputs`)."""
        return self.cache.step_inputs(ids, offset, self.config.batch_buckets, self.shape.device)

    def _light_forward(self, step: Callable, tokens: list[int], offset: int) -> torch.Tensor:
        """A drafter's `step` logits [rows, vocab], one token per row `offset` slots on."""
        inputs = self._step_inputs([[token] for token in tokens], offset)
        return step(*inputs)[:self.cache.active, 0]

    def _verify(self, logits: torch.Tensor, proposals: list[Proposal]) -> list[list[int]]:
        """Each row's tokens from the step's logits [rows, width, vocab] (`sampling.verify_rows`)."""
        drafts = [proposal.tokens for proposal in proposals]
        emitted = verify_rows(logits, [request.sampling for request in self.running], drafts,
                              [self.generators[request] for request in self.running],
                              [proposal.probs for proposal in proposals],
                              [request.scores if request.adjusts else None
                               for request in self.running])
        for request, draft, tokens in zip(self.running, drafts, emitted):
            kept = len(tokens) - 1 if draft else 0
            request.drafted += len(draft)
            request.accepted += kept
            self.stats.drafted += len(draft)
            self.stats.accepted += kept
        return emitted

    def _gates(self, requests: list[EngineRequest]):
        """The gates of the smallest budget among `requests` (the running rows, or a group), one
        without a budget of its own taking the engine's (None, the full path, beats any), for a
        prefill: an unmeasured plan the controller's checks have not yet passed prefills on
        the full path (its decode steps are checked; a prefill is not)."""
        budget = self._budget(requests)
        if budget and self.controller is not None:
            budget = self.controller.prefill_budget(budget)
        return self.gates_for_budget(budget)

    def _budget(self, requests: list[EngineRequest]) -> float | None:
        """The smallest budget among `requests` (see `_gates`), bounded by the controller's
        quality loop; each notes it in `budget_run`."""
        budgets = [self.budget if request.budget is None else request.budget for request in requests]
        budget = None if None in budgets else min(budgets)
        if budget and self.controller is not None:
            budget = self.controller.bound(budget)
        for request in requests:
            request.budget_run = max(request.budget_run, budget or 0.0)
        return budget

    def _checked_step(self, inputs: tuple, budget: float | None) -> torch.Tensor:
        """The decode step's logits under the plan of `budget`. When the controller asks for a
        quality check of a light step, the light step runs, then the full path on the same
        step, and the controller hears how many rows' top-1 tokens agree; the step's tokens
        and its K/V (the full forward writes the same slots last) are then the full path's, so
        a checked step loses nothing."""
        active, gates = len(self.running), self.gates_for_budget(budget)
        step = self._step_of(self.running)
        if gates is None or all(gates) or self.controller is None or \
                not self.controller.check_due(budget):
            return step(*inputs, gates=gates)[:active]
        light = step(*inputs, gates=gates)[:active, 0].argmax(-1).tolist()
        started = perf_counter()
        logits = step(*inputs, gates=None)[:active]
        self._check_s = perf_counter() - started   # not the step's: the controller times light
        full = logits[:, 0].argmax(-1).tolist()
        self.controller.checked(budget, sum(a == b for a, b in zip(light, full)), active)
        return logits

    def _cache_key(self, requests: list[EngineRequest], gates):
        """What the prefix cache keys a prefill's K/V by (`WeightLevels.cache_key`)."""
        return self.levels.cache_key([r.weights or self.weights for r in requests], gates)

    def _step_of(self, requests: list[EngineRequest]) -> Callable:
        """The step of a forward over `requests`, at their weight level (`level_for`)."""
        return self.levels.step_for(requests, self.step_fn, self.weights)

    def _emit(self, request: EngineRequest, token: int) -> None:
        request.row.tokens.append(token)
        if request.grammar is not None and request.grammar.advance(token):
            request.finish_reason = "stop"   # the grammar ended: nothing may follow
        self.speculation.extend(request, token)
        if request.first_token_at is None:
            request.first_token_at = perf_counter()
        self.stats.tokens += 1
        if request.on_token is not None:
            request.on_token(token)
        criteria = self.criteria[request]
        if criteria.finished(request.row):
            request.finish_reason = criteria.reason(request.row)

    def _drop_cancelled(self) -> None:
        if self.chunked is not None and all(request.cancelled for request in self.chunked.group):
            group, self.chunked = self.chunked.group, None
            self._live(group)
        for request in self.running:
            if request.cancelled and request.finish_reason is None:
                request.finish_reason = "cancelled"
        self._leave_finished()

    def _leave_finished(self) -> None:
        """Finished rows leave the batch (the last row moves into each freed one)."""
        for index in reversed(range(len(self.running))):
            if self.running[index].finish_reason is not None:
                request = self._remove_row(index)
                self._finish(request, request.finish_reason)

    def _remove_row(self, index: int) -> EngineRequest:
        """Row `index` leaves the batch (the last row moves into its place): its request."""
        self.cache.leave(index)
        request, self.running[index] = self.running[index], self.running[-1]
        self.running.pop()
        return request

    def _finish(self, request: EngineRequest, reason: str, error: BaseException | None = None) -> None:
        request.finish_reason, request.error = reason, error
        self.criteria.pop(request, None)
        self.generators.pop(request, None)
        self.speculation.drop(request)
        self.stats.finished += 1
        if request.on_finish is not None:
            request.on_finish(request)

    def _fail_all(self, exc: BaseException) -> None:
        """A step failed: every running request ends with the error; the cache starts over."""
        failed, self.running = self.running, []
        if self.chunked is not None:
            failed, self.chunked = failed + self.chunked.group, None
        self.cache = self.cache.emptied()
        for request in failed:
            self._finish(request, "error", exc)
