"""The prefix cache (runtime/engine/prefix_cache.py) in the continuous-batching engine: a prompt
sharing a cached prefix reuses its blocks and still gets the tokens of an uncached run; blocks
are keyed by the whole prefix and the plan, evicted least recently used, and a corrupted block
is refused by its checksum."""
import pytest
import torch

from rbcompile.runtime.engine.core import EngineRequest
from rbcompile.runtime.engine.prefix_cache import PrefixCache

SHARED = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]       # 13 tokens: 3 blocks of 4
QUESTIONS = [[40, 41, 42], [50, 51], [60, 61, 62, 63, 64, 65]]


def run(engine, prompts, new=8, **options):
    requests = [engine.submit(EngineRequest(prompt, new, **options)) for prompt in prompts]
    while engine.has_work:
        engine.step()
    return requests


def alone(compiled, prompt, new=8, **options):
    return compiled.generate(torch.tensor([prompt]), max_new_tokens=new, **options).tokens[0]


@pytest.fixture()
def engine(compiled_tiny):
    return compiled_tiny["llama"][0].batch_engine(max_batch=2, prefix_cache=PrefixCache(block_tokens=4))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_shared_prefix_is_reused_and_tokens_do_not_change(compiled_tiny, arch):
    compiled = compiled_tiny[arch][0]
    cache = PrefixCache(block_tokens=4)
    engine = compiled.batch_engine(max_batch=2, prefix_cache=cache)
    prompts = [SHARED + question for question in QUESTIONS]
    first = run(engine, prompts[:1])
    assert engine.stats.reused_prompt_tokens == 0 and len(cache.blocks) == 4   # 16 of 16 tokens
    later = run(engine, prompts[1:])           # 3 shared blocks each, prefilled together: the
    assert engine.stats.reused_prompt_tokens == 2 * 12 - 4    # window is the longer's 7 new tokens
    for request, prompt in zip(first + later, prompts):
        assert request.tokens == alone(compiled, prompt), prompt
    again = run(engine, prompts[:1])[0]                       # all 4 of its blocks, but one
    assert again.tokens == first[0].tokens                    # token is always prefilled
    assert engine.stats.reused_prompt_tokens == 2 * 12 - 4 + 12


def test_keys_name_the_whole_prefix_and_the_plan(engine, compiled_tiny):
    cache = engine.prefix_cache
    run(engine, [SHARED + QUESTIONS[0]])
    other_start = [99] + SHARED[1:] + QUESTIONS[0]             # same later blocks, other first
    assert cache.lookup(other_start, None) == []
    assert len(cache.lookup(SHARED + [7], None)) == 3
    light = compiled_tiny["llama"][0].decoder_gates(0.5)
    assert light is not None and cache.lookup(SHARED + [7], light) == []
    budget = run(engine, [SHARED + QUESTIONS[1]], budget=0.5)[0]
    assert budget.tokens == alone(compiled_tiny["llama"][0], SHARED + QUESTIONS[1], budget=0.5)


def test_least_recently_used_blocks_are_evicted(engine):
    cache = engine.prefix_cache
    run(engine, [SHARED + QUESTIONS[0]])
    block_bytes = next(iter(cache.blocks.values())).nbytes
    cache.capacity_bytes = 5 * block_bytes
    run(engine, [[70 + i for i in range(9)]])                 # 2 more blocks: 6 > 5
    assert len(cache.blocks) == 5 and cache.stats.evicted_blocks == 1
    assert len(cache.lookup(SHARED + [7], None)) == 0          # its first block went first
    cache.shrink(2 * block_bytes)
    assert len(cache.blocks) == 2 and cache.nbytes == 2 * block_bytes


def test_a_corrupted_block_is_refused_and_the_prompt_prefilled(engine, compiled_tiny):
    cache = engine.prefix_cache
    run(engine, [SHARED + QUESTIONS[0]])
    second = list(cache.blocks.values())[1]
    second.tensors[0][0, 0, 0] += 1.0                          # a flipped value in memory
    request = run(engine, [SHARED + QUESTIONS[2]])[0]
    assert cache.stats.corrupt_blocks == 1
    assert engine.stats.reused_prompt_tokens == 4              # the block before it only
    assert request.tokens == alone(compiled_tiny["llama"][0], SHARED + QUESTIONS[2])
