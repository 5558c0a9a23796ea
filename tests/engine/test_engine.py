"""Continuous batching (runtime/engine/core.py) on tiny decoder artifacts: every request gets the
tokens it would get alone from `generate`, whatever joins or leaves the batch around it, the
batch's K/V cache keeps every row's keys through joins, leaves, shifts, compaction and growth,
and cancelled or bad requests leave the others alone."""
from dataclasses import replace

import pytest
import torch

from rbcompile.artifact.decoder import DecoderShape
from rbcompile.errors import UserError
from rbcompile.runtime.engine.core import EngineRequest
from rbcompile.runtime.engine.kv_cache import BatchKVCache, power_of_two_at_least
from rbcompile.runtime.engine.sampling import SamplingConfig

PROMPTS = [[21, 22, 23, 21, 22], [31, 32], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42]]


def alone(compiled, prompt, max_new_tokens, **options):
    return compiled.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, **options).tokens[0]


def record_forwards(engine) -> list[tuple[int, int, bool]]:
    """(rows, tokens, reads a mask) of each forward the engine runs from now on."""
    forwards, step = [], engine.step_fn
    engine.step_fn = lambda ids, mask, *args, **kwargs: \
        forwards.append((*ids.shape, mask is not None)) or step(ids, mask, *args, **kwargs)
    return forwards


def drain(engine, requests, submit_at: dict[int, list[EngineRequest]] | None = None, limit=500):
    """Step until every request finished; `submit_at[k]` are submitted before step k."""
    for k in range(limit):
        for request in (submit_at or {}).get(k, []):
            engine.submit(request)
        engine.step()
        if all(r.finish_reason for r in requests) and k >= max(submit_at or {0: 0}):
            return
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_requests_joining_and_leaving_get_their_tokens_alone(compiled_tiny, arch):
    """Four prompts of different lengths, two rows, a small block: requests wait, join at
    different steps (one prompt longer than the running rows, so the batch's slots shift right),
    leave at different steps (different max_new_tokens), the cache grows and compacts; each
    request's tokens equal `generate` on it alone."""
    compiled = compiled_tiny[arch][0]
    engine = compiled.batch_engine(max_batch=2)
    engine.cache.block = 4
    lengths = [12, 5, 9, 14]
    requests = [EngineRequest(prompt, new) for prompt, new in zip(PROMPTS, lengths)]
    drain(engine, requests, {0: requests[:2], 3: requests[2:]})
    for request, prompt, new in zip(requests, PROMPTS, lengths):
        assert request.tokens == alone(compiled, prompt, new), prompt
        assert request.finish_reason in ("stop", "length")
    assert engine.cache.active == 0 and not engine.running
    assert engine.stats.decode_rows > engine.stats.decode_steps   # rows really shared steps


def test_sampled_requests_with_seeds_match_alone_and_budgets_take_the_smallest(compiled_tiny):
    compiled = compiled_tiny["llama"][0]
    engine = compiled.batch_engine(max_batch=4)
    sampled = EngineRequest(PROMPTS[0], 10, SamplingConfig(do_sample=True, temperature=0.8, seed=3))
    greedy = EngineRequest(PROMPTS[1], 10, budget=0.5)
    drain(engine, [sampled, greedy], {0: [sampled, greedy]})
    assert sampled.tokens == alone(compiled, PROMPTS[0], 10, do_sample=True, temperature=0.8, seed=3)
    assert greedy.tokens == alone(compiled, PROMPTS[1], 10)   # batched with a full-path row
    gates = []
    engine.gates_for_budget = lambda budget: gates.append(budget) or compiled.decoder_gates(budget)
    light = [EngineRequest(PROMPTS[2], 4, budget=0.5), EngineRequest(PROMPTS[3], 4, budget=0.3)]
    drain(engine, light, {0: light[:1], 1: light[1:]})
    assert gates[:2] == [0.5, 0.5] and set(gates[2:]) == {0.3}   # alone, then with the smaller budget
    assert light[1].tokens == alone(compiled, PROMPTS[3], 4, budget=0.3)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_newcomers_are_prefilled_together_and_get_their_tokens_alone(compiled_tiny, arch):
    """Requests that arrive together (prompts of 2 to 11 tokens, one a group of two samples)
    join with one prefill forward, left-padded; later ones whose prompts the prefix cache holds
    in part join in one more, recomputing only the window the longest uncached part needs.
    Every request's tokens equal `generate` on it alone."""
    from rbcompile.runtime.engine.prefix_cache import PrefixCache

    compiled = compiled_tiny[arch][0]
    engine = compiled.batch_engine(max_batch=8, prefix_cache=PrefixCache(block_tokens=4))
    forwards = record_forwards(engine)
    first = [EngineRequest(prompt, 6) for prompt in PROMPTS]
    samples = [EngineRequest(PROMPTS[0], 6, SamplingConfig(do_sample=True, temperature=0.8, seed=seed))
               for seed in (5, 6)]
    engine.submit_samples(samples)
    for request in first:
        engine.submit(request)
    engine.step()
    assert forwards[0] == (5, 11, True)         # 5 prompts in one prefill: the longest is 11
    assert engine.stats.prefills == 5 and engine.stats.prefill_forwards == 1
    later = [EngineRequest(PROMPTS[2] + [50], 5), EngineRequest(PROMPTS[0] + [51, 52], 5)]
    drain(engine, first + samples + later, {0: later})
    # cached: 2 blocks of the first (12 tokens), 1 of the second (7); the window is the first's
    # 4 uncached tokens, so the second's last cached token is recomputed: 8 + 3 reused
    assert forwards.count((2, 4, True)) == 1
    assert engine.stats.prefill_forwards == 2 and engine.stats.reused_prompt_tokens == 8 + 3
    # prompts of one length on the idle engine: no padding, from the first slot, so no mask
    same = [EngineRequest([9, 8, 7, 6, 5, 4, 3], 4), EngineRequest([4, 5, 6, 7, 8, 9, 10], 4)]
    drain(engine, same, {0: same})
    assert forwards[-4] == (2, 7, False) and {masked for *_, masked in forwards[-3:]} == {True}
    for request in first + later + same:
        assert request.tokens == alone(compiled, request.prompt, request.max_new_tokens), request.prompt
    for request in samples:
        assert request.tokens == alone(compiled, PROMPTS[0], 6, do_sample=True, temperature=0.8,
                                       seed=request.sampling.seed)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_long_prompts_are_prefilled_in_chunks_between_decode_steps(compiled_tiny, arch):
    """With `prefill_chunk=4`, an 11-token prompt (and a group of two samples on a 14-token
    one) arriving while a request decodes is prefilled 4 tokens per step, each chunk followed
    by the running row's decode step; a later prompt sharing the first's cached blocks
    chunks only the rest. Every request's tokens equal `generate` on it alone."""
    from rbcompile.runtime.engine.prefix_cache import PrefixCache

    compiled = compiled_tiny[arch][0]
    engine = compiled.batch_engine(max_batch=4, prefill_chunk=4, prefix_cache=PrefixCache(block_tokens=4))
    forwards = record_forwards(engine)
    running = EngineRequest(PROMPTS[1], 12)
    long = EngineRequest(PROMPTS[2], 5)
    samples = [EngineRequest(PROMPTS[2] + [60, 61, 62], 4,
                             SamplingConfig(do_sample=True, temperature=0.8, seed=seed)) for seed in (1, 2)]
    engine.submit(running)
    engine.step()
    engine.submit(long)
    engine.submit_samples(samples)
    for _ in range(3):                  # three chunks (4 + 4 + 3), each before a decode step
        engine.step()
    # the prompt alone on the idle engine and the first chunk start at the first slot without
    # padding: no mask (passes/unpadded_attention.py); later chunks and decode steps read theirs
    assert forwards[:8] == [(1, 2, False), (1, 1, True), (1, 4, False), (1, 1, True), (1, 4, True),
                            (1, 1, True), (1, 3, True), (2, 1, True)]
    assert len(running.tokens) == 5 and len(long.tokens) == 2
    later = EngineRequest(PROMPTS[2] + [70, 71, 72, 73, 74], 3)
    drain(engine, [running, long, *samples, later], {3: [later]})
    # the samples' prompt (14 tokens) reused the first's 2 blocks, the later one (16) 2 of theirs
    assert engine.stats.prefill_chunks == 3 + 2 + 2
    assert engine.stats.reused_prompt_tokens == 8 + 8
    for request in (running, long, later):
        assert request.tokens == alone(compiled, request.prompt, request.max_new_tokens), request.prompt
    for request in samples:
        assert request.tokens == alone(compiled, request.prompt, 4, do_sample=True, temperature=0.8,
                                       seed=request.sampling.seed)
    assert engine.cache.active == 0 and engine.chunked is None


def test_cancelling_a_prompt_while_it_is_chunked_frees_it(compiled_tiny):
    compiled = compiled_tiny["llama"][0]
    engine = compiled.batch_engine(max_batch=2, prefill_chunk=4)
    gone, waiting = EngineRequest(PROMPTS[2], 5), EngineRequest(PROMPTS[2][:6], 3)
    engine.submit(gone)
    engine.submit(waiting)
    assert engine.step() and engine.chunked is not None and not engine.running
    engine.cancel(gone)
    drain(engine, [gone, waiting])
    assert gone.finish_reason == "cancelled" and gone.tokens == []
    assert waiting.tokens == alone(compiled, waiting.prompt, 3)
    assert engine.stats.prefill_chunks == 1 + 2 and not engine.has_work


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_speculating_rows_verify_ngram_drafts_in_the_batch_step(compiled_tiny, arch):
    """Requests with `speculate` (greedy, and sampled with a seed) share batch steps with one
    that does not; each step runs every row's pending token and drafts, and every request's
    tokens equal `generate` alone (speculate='ngram' for the speculating ones, off for the
    other); rejected drafts leave holes that later joins, leaves and growth keep masked."""
    compiled = compiled_tiny[arch][0]
    engine = compiled.batch_engine(max_batch=3)
    engine.cache.block = 4
    widths = []
    step = engine.step_fn
    engine.step_fn = lambda ids, *args, **kwargs: widths.append(ids.shape[1]) or step(ids, *args, **kwargs)
    sampling = SamplingConfig(do_sample=True, temperature=0.8, seed=4)
    greedy = EngineRequest(PROMPTS[0] * 2, 16, speculate="ngram")
    plain = EngineRequest(PROMPTS[1], 12)
    sampled = EngineRequest(PROMPTS[2], 14, sampling, speculate="ngram")
    later = EngineRequest(PROMPTS[3] * 3, 10, speculate="ngram")
    drain(engine, [greedy, plain, sampled, later], {0: [greedy, plain], 2: [sampled], 6: [later]})
    assert greedy.tokens == alone(compiled, greedy.prompt, 16, speculate="ngram")
    assert greedy.tokens == alone(compiled, greedy.prompt, 16)
    assert plain.tokens == alone(compiled, PROMPTS[1], 12)
    assert sampled.tokens == alone(compiled, PROMPTS[2], 14, speculate="ngram", do_sample=True,
                                   temperature=0.8, seed=4)
    assert later.tokens == alone(compiled, later.prompt, 10, speculate="ngram")
    stats = engine.stats
    assert stats.speculative_steps > 0 and 1 + engine.config.draft_tokens in widths   # earned
    assert stats.drafted == sum(r.drafted for r in (greedy, sampled, later)) > 0
    assert stats.accepted == sum(r.accepted for r in (greedy, sampled, later))
    assert plain.drafted == 0
    assert stats.decode_steps < stats.tokens - stats.prefills   # some steps gave a row several


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_drafter_runs_in_the_batch_steps(compiled_tiny, arch):
    """Requests with each drafter (off, n-gram, the light path, auto) join one engine at
    different steps; the light path drafts for its rows over the batch's own cache, and every
    greedy request's tokens equal `generate` on it alone without drafts. Each request's draft
    group counts its own steps."""
    compiled = compiled_tiny[arch][0]
    engine = compiled.batch_engine(max_batch=3)
    engine.speculation.light = replace(engine.speculation.light, threshold=0.0)  # flat tiny models
    light_calls = []
    step = engine.speculation.light.step
    engine.speculation.light = replace(engine.speculation.light, step=lambda ids, *rest:
                                       light_calls.append(ids.shape) or step(ids, *rest))
    modes = ["self", "off", "ngram", "auto", "self"]
    prompts = [PROMPTS[0] * 2, PROMPTS[1], PROMPTS[2] * 2, PROMPTS[3] * 3, PROMPTS[1]]
    requests = [EngineRequest(prompt, 12, speculate=mode) for prompt, mode in zip(prompts, modes)]
    drain(engine, requests, {0: requests[:2], 1: requests[2:4], 5: requests[4:]})
    for request in requests:
        assert request.tokens == alone(compiled, request.prompt, 12), request.speculate
    assert light_calls and all(shape[1] == 1 for shape in light_calls)
    assert requests[0].drafted > 0 and requests[4].drafted > 0 and requests[1].drafted == 0
    groups = [request.drafting for request in requests]
    assert len(set(map(id, groups))) == len(requests)
    assert groups[1].stats.steps_by_mode == {"off": groups[1].stats.decode_steps}
    assert set(groups[0].stats.steps_by_mode) == {"self"}
    assert engine.stats.steps_by_drafter.get("self", 0) > 0


def test_a_drafter_the_engine_lacks_is_refused_before_it_queues(compiled_tiny):
    engine = compiled_tiny["llama"][0].batch_engine(max_batch=2)
    engine.speculation.light = None
    for mode, message in (("self", "speculate='self' needs a draft_step"),
                          ("eagle", "unknown speculate='eagle'")):
        with pytest.raises(UserError, match=message):
            engine.submit(EngineRequest(PROMPTS[0], 4, speculate=mode))
    assert not engine.has_work


def test_cancelled_request_frees_its_row_and_others_go_on(compiled_tiny):
    compiled = compiled_tiny["llama"][0]
    engine = compiled.batch_engine(max_batch=2)
    seen = []
    gone = EngineRequest(PROMPTS[0], 20, on_token=seen.append)
    kept = EngineRequest(PROMPTS[1], 12)
    waiting = EngineRequest(PROMPTS[3], 6)
    for request in (gone, kept, waiting):
        engine.submit(request)
    engine.step()
    engine.step()
    engine.cancel(gone)
    drain(engine, [gone, kept, waiting])
    assert gone.finish_reason == "cancelled" and len(seen) == 3 == len(gone.tokens)  # prefill + 2 steps
    assert kept.tokens == alone(compiled, PROMPTS[1], 12)
    assert waiting.tokens == alone(compiled, PROMPTS[3], 6)


def test_stop_strings_and_finish_reasons(compiled_tiny):
    compiled = compiled_tiny["llama"][0]
    engine = compiled.batch_engine()
    full = alone(compiled, PROMPTS[2], 8)
    stop = compiled.tokenizer.decode(full[2:4])
    finished = []
    stopped = EngineRequest(PROMPTS[2], 8, stop=[stop], on_finish=finished.append)
    capped = EngineRequest(PROMPTS[2], 3, on_finish=finished.append)
    drain(engine, [stopped, capped], {0: [stopped, capped]})
    assert stopped.finish_reason == "stop" and stop in compiled.tokenizer.decode(stopped.tokens)
    assert len(stopped.tokens) <= 4 and stopped.tokens == full[:len(stopped.tokens)]
    assert capped.finish_reason == "length" and capped.tokens == full[:3]
    assert set(finished) == {stopped, capped}


@pytest.mark.parametrize("prompt,new,message", [
    ([], 4, "the prompt is empty"),
    ([3] * 64, 1, "the prompt has 64 tokens"),
    ([3] * 10, 60, "max_new_tokens must be between 1 and the 54 positions left"),
])
def test_bad_requests_are_refused_before_they_are_queued(compiled_tiny, prompt, new, message):
    engine = compiled_tiny["llama"][0].batch_engine()
    with pytest.raises(UserError, match=message):
        engine.submit(EngineRequest(prompt, new))
    assert not engine.queued


@pytest.mark.parametrize("power_of_two", [False, True], ids=["blocks", "power-of-two"])
def test_batch_cache_keeps_every_rows_keys_through_shifts_compaction_and_growth(power_of_two):
    """Each row's slots hold (row id, position) pairs, rejected drafts (99, 99); after every
    operation each active row's unmasked slots before `length` hold its own pairs, positions
    0, 1, 2, ... from its pad on, and `positions` gives its next one; the kept mask is 1 past
    `length` (the next step's slots) and on idle rows. With `power_of_two` (CUDA graphs) the
    capacity is always a power of two of blocks."""
    shape = DecoderShape(layers=1, kv_heads=1, head_dim=2, max_positions=512)
    cache = BatchKVCache(shape, rows=3, block=4, power_of_two=power_of_two)
    owners = []   # owner id per cache row
    capacities = {cache.capacity}

    def check():
        capacities.add(cache.capacity)
        mask = cache.attention_mask(slice(0, cache.active))
        assert mask[:, cache.length:].all() and cache.attention_mask(slice(cache.active, None)).all()
        for row, owner in enumerate(owners):
            visible = [slot for slot in range(cache.length) if mask[row, slot]]
            assert visible[0] == int(cache.pads[row])
            for tensor in cache.tensors:
                assert [tensor[row, 0, slot].tolist() for slot in visible] == \
                    [[owner, position] for position in range(len(visible))], row
            assert int(cache.positions(slice(row, row + 1))) == len(visible)

    def join(owner, prompt):
        row = cache.place(prompt)
        for tensor in cache.tensors:
            for i, slot in enumerate(range(cache.length - prompt, cache.length)):
                tensor[row, 0, slot] = torch.tensor([owner, i], dtype=tensor.dtype)
        cache.join()
        owners.append(owner)
        check()

    def speculate(kept, width):
        """A step of `width` slots per row; row i keeps its pending token and kept[i] drafts."""
        cache.reserve_step(width)
        positions = cache.positions(slice(0, cache.active)).tolist()
        for row, owner in enumerate(owners):
            for i in range(width):
                value = [owner, positions[row] + i] if i <= kept[row] else [99, 99]
                for tensor in cache.tensors:
                    tensor[row, 0, cache.length + i] = torch.tensor(value, dtype=tensor.dtype)
        cache.advance_rows(kept, width)
        check()

    def decode(steps):
        for _ in range(steps):
            speculate([0] * len(owners), 1)

    join(1, 3)
    decode(2)
    speculate([1], 4)     # two rejected drafts past the most kept: written again, no holes
    assert cache.length == 7 and not cache.skipped[0]
    join(2, 12)           # longer than the running row: slots (and holes) shift right
    assert int(cache.pads[0]) == 5
    speculate([3, 0], 4)  # row 1 rejects its 3 drafts: holes
    decode(2)
    cache.leave(0)        # row 1 moves into row 0, its holes with it
    owners[0:2] = [owners[1]]
    check()
    join(3, 2)
    capacity = cache.capacity
    decode(9)             # past the capacity: compacts (pads >= block) or grows
    assert cache.capacity >= capacity and int(cache.pads[:cache.active].min()) < cache.block
    speculate([2, 0], 3)
    # a prompt that shifts the rows right to a block boundary: the slot `place` reserves after
    # it must not compact them back (that left the newcomer a negative pad)
    join(4, (cache.length // cache.block + 2) * cache.block)
    blocks = sorted(capacity // cache.block for capacity in capacities)
    assert all(capacity % cache.block == 0 for capacity in capacities) and len(blocks) > 2
    assert all(power_of_two_at_least(n) == n for n in blocks) == power_of_two, blocks


def test_compaction_frees_the_slots_of_rejected_drafts_unmasked():
    """Compacting moves every row's slots left by the smallest pad; the slots it frees past the
    new length held the last step's rejected drafts (holes), and the next step writes there, so
    the kept mask must be 1 on them again."""
    shape = DecoderShape(layers=1, kv_heads=1, head_dim=2, max_positions=512)
    cache = BatchKVCache(shape, rows=2, block=4)
    for prompt in (9, 2):                    # the second row's pad: 7, past a block
        cache.place(prompt)
        cache.join()
    cache.reserve_step(4)
    cache.advance_rows([3, 0], 4)            # row 1 rejects its 3 drafts: holes at the end
    cache.leave(0)                           # the pad-0 row leaves: the smallest pad is 7
    length, capacity = cache.length, cache.capacity
    cache.reserve_step(capacity - length + 1)
    assert cache.length == length - 7 and int(cache.pads[0]) == 0     # compacted
    mask = cache.attention_mask(slice(0, 1))[0]
    assert mask[:cache.length].tolist() == [1] * 3 + [0] * 3           # prompt, token, holes
    assert mask[cache.length:].all()


def test_decode_steps_run_batch_buckets_under_cuda_graphs(compiled_tiny):
    """Under (fake, CPU) CUDA graphs a decode step runs the next power of two of rows, the rows
    past the running ones idle, so that its graphs are one per bucket; every request still gets
    the tokens it would get alone, and a speculative step stays within `verify_tokens` counting
    the idle rows."""
    from shared import FakeCapture

    compiled = compiled_tiny["llama"][0]
    prompts, lengths = [PROMPTS[0] * 2, PROMPTS[1], PROMPTS[2]], (9, 5, 7)
    expected = [alone(compiled, prompt, new) for prompt, new in zip(prompts, lengths)]
    compiled.use_cuda_graphs(capture=FakeCapture())
    try:
        engine = compiled.batch_engine(max_batch=4, verify_tokens=9)
        assert engine.config.batch_buckets
        graphs, steps = compiled.decoder.graphs, []
        run = graphs.run

        def recorded(ids, mask, position_ids, cache_position, logit_positions, *rest):
            if len(logit_positions) == ids.shape[1]:  # a decode step (a prefill asks for one)
                steps.append(tuple(ids.shape))
            return run(ids, mask, position_ids, cache_position, logit_positions, *rest)

        graphs.run = recorded
        requests = [EngineRequest(prompt, new, speculate="ngram")
                    for prompt, new in zip(prompts, lengths)]
        drain(engine, requests, {0: requests})
        assert [request.tokens for request in requests] == expected
        assert {rows for rows, _ in steps} == {4, 2, 1}          # 3 rows ran as 4
        assert max(width for _, width in steps) > 1              # drafts were verified
        assert all(rows * width <= 9 for rows, width in steps)
        assert graphs.stats.replays > 0
    finally:
        compiled.use_cuda_graphs(False)


def test_steady_decode_steps_replay_by_identity_under_cuda_graphs(compiled_tiny):
    """The batch's cache views are the same objects from step to step (until the rows or the
    tensors change), so under (fake) CUDA graphs every decode step after the one that captured
    is found as the last replay's repeat, without keying its 2 x layers cache tensors again."""
    from shared import FakeCapture

    compiled = compiled_tiny["llama"][0]
    expected = alone(compiled, PROMPTS[2], 12)
    compiled.use_cuda_graphs(capture=FakeCapture())
    try:
        engine = compiled.batch_engine(max_batch=4)
        request = EngineRequest(PROMPTS[2], 12)
        drain(engine, [request], {0: [request]})
        stats = compiled.decoder.graphs.stats
        assert request.tokens == expected and engine.cache.capacity == 64   # one capacity
        steps = len(expected) - 1    # the prefill gave the first token
        assert steps >= 4
        # the prefill and the first step eager, the second step captured, the others repeats
        assert (stats.eager_calls, stats.captures, stats.replays, stats.repeats) == (
            2, 1, steps - 1, steps - 2)
    finally:
        compiled.use_cuda_graphs(False)


def test_a_grown_cache_takes_the_graphs_that_read_it_along(compiled_tiny):
    """Under (fake) CUDA graphs the engine's cache grows by doubling; the graphs of the steps
    before each growth read tensors the engine no longer uses, and go with them (so those
    leave memory); the tokens are each request's alone."""
    import gc
    import weakref

    from shared import FakeCapture

    compiled = compiled_tiny["llama"][0]
    prompts, lengths = [PROMPTS[0], PROMPTS[1]], (12, 9)
    expected = [alone(compiled, prompt, new) for prompt, new in zip(prompts, lengths)]
    capture = FakeCapture()
    compiled.use_cuda_graphs(capture=capture)
    try:
        engine = compiled.batch_engine(max_batch=2, block=4)
        first = weakref.ref(engine.cache.tensors[0])
        requests = [EngineRequest(prompt, new) for prompt, new in zip(prompts, lengths)]
        drain(engine, requests, {0: requests})
        assert [request.tokens for request in requests] == expected
        graphs = compiled.decoder.graphs
        assert engine.cache.capacity >= 16 and graphs.stats.captures > 0
        assert graphs.stats.released > 0
        capture.captured.clear()
        gc.collect()
        assert first() is None
    finally:
        compiled.use_cuda_graphs(False)


def test_auto_does_not_draft_in_a_crowded_batch(compiled_tiny):
    """With more rows than AUTO_DRAFT_ROWS running, 'auto' rows take plain steps (a draft widens
    the step for every row); rows that asked for a drafter still draft. Tokens stay their own."""
    from rbcompile.runtime.engine.speculation import AUTO_DRAFT_ROWS

    compiled = compiled_tiny["llama"][0]
    rows = AUTO_DRAFT_ROWS + 1
    for speculate, drafts in (("auto", False), ("ngram", True)):
        engine = compiled.batch_engine(max_batch=rows)
        requests = [EngineRequest(PROMPTS[0] * 2, 8, speculate=speculate) for _ in range(rows)]
        drain(engine, requests, {0: requests})
        assert (engine.stats.drafted > 0) == drafts, speculate
        assert all(r.tokens == alone(compiled, r.prompt, 8) for r in requests)
