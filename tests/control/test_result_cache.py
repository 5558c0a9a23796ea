"""Result cache: keys, checksum verification on every hit, LRU byte budget, shrink, threads."""
import threading

import pytest
import torch

from rbcompile.runtime.control.result_cache import ResultCache

IDS = torch.tensor([[1, 5, 9, 2]])


def _outputs(seed: int = 0, size: int = 16) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"logits": torch.randn(1, size, generator=generator),
            "top1": torch.tensor([seed], dtype=torch.int64)}


def _nbytes(outputs) -> int:
    return sum(t.numel() * t.element_size() for t in outputs.values())


def test_hit_returns_equal_tensors():
    cache = ResultCache()
    key = ResultCache.key("model-a", "budget=0.25", IDS)
    outputs = _outputs()
    assert cache.put(key, outputs)
    found = cache.get(key)
    assert found.keys() == outputs.keys()
    for name, tensor in outputs.items():
        assert torch.equal(found[name], tensor) and found[name].dtype == tensor.dtype
    assert cache.stats["hits"] == 1 and cache.stats["puts"] == 1
    assert len(cache) == 1 and cache.nbytes == _nbytes(outputs)


def test_key_depends_on_plan_fingerprint_ids_dtype_and_shape():
    base = ResultCache.key("model-a", "full", IDS)
    assert ResultCache.key("model-a", "full", IDS.clone()) == base
    others = [ResultCache.key("model-a", "budget=0.1", IDS),
              ResultCache.key("model-b", "full", IDS),
              ResultCache.key("model-a", "full", torch.tensor([[1, 5, 9, 3]])),
              ResultCache.key("model-a", "full", IDS.to(torch.int32)),
              ResultCache.key("model-a", "full", IDS.reshape(2, 2)),
              ResultCache.key("model-af", "ull", IDS)]  # field boundaries are part of the key
    assert len({base, *others}) == len(others) + 1
    cache = ResultCache()
    cache.put(base, _outputs())
    assert all(cache.get(key) is None for key in others)
    assert cache.stats["misses"] == len(others) and cache.stats["hits"] == 0


def test_corrupted_entry_is_dropped_and_never_served():
    cache = ResultCache()
    key = ResultCache.key("model-a", "full", IDS)
    cache.put(key, _outputs())
    cache._entries[key].outputs["logits"][0, 3] += 1.0  # bit rot in the stored copy
    assert cache.get(key) is None
    assert cache.stats["corrupt"] == 1 and cache.stats["hits"] == 0
    assert len(cache) == 0 and cache.nbytes == 0
    assert cache.get(key) is None and cache.stats["misses"] == 1
    fresh = _outputs(seed=1)
    cache.put(key, fresh)
    assert torch.equal(cache.get(key)["logits"], fresh["logits"])
    assert cache.stats["corrupt"] == 1


def test_put_stores_a_copy_and_hits_return_copies():
    cache = ResultCache()
    key = ResultCache.key("model-a", "full", IDS)
    outputs = _outputs()
    expected = outputs["logits"].clone()
    cache.put(key, outputs)
    outputs["logits"].zero_()  # the caller reuses its buffer
    found = cache.get(key)
    found["logits"].fill_(7.0)  # the caller mutates what it got back
    again = cache.get(key)
    assert torch.equal(again["logits"], expected)
    assert cache.stats["corrupt"] == 0 and cache.stats["hits"] == 2


def test_stored_copies_are_detached_contiguous_cpu():
    cache = ResultCache()
    key = ResultCache.key("model-a", "full", IDS)
    logits = torch.randn(4, 6, requires_grad=True)
    cache.put(key, {"logits": logits.t()})  # non-contiguous view of a graph leaf
    stored = cache._entries[key].outputs["logits"]
    assert stored.is_contiguous() and stored.device.type == "cpu" and not stored.requires_grad
    assert torch.equal(cache.get(key)["logits"], logits.detach().t())


def test_lru_eviction_under_byte_budget():
    entry_bytes = _nbytes(_outputs())
    cache = ResultCache(max_bytes=3 * entry_bytes)
    keys = [ResultCache.key("model-a", "full", torch.tensor([i])) for i in range(4)]
    for i, key in enumerate(keys[:3]):
        cache.put(key, _outputs(seed=i))
    assert cache.get(keys[0]) is not None  # keys[1] is now the least recently used
    cache.put(keys[3], _outputs(seed=3))
    assert cache.get(keys[1]) is None
    assert all(cache.get(keys[i]) is not None for i in (0, 2, 3))
    assert len(cache) == 3 and cache.nbytes == 3 * entry_bytes
    assert cache.stats["evictions"] == 1


def test_entry_larger_than_budget_is_not_stored():
    cache = ResultCache(max_bytes=100)
    key = ResultCache.key("model-a", "full", IDS)
    assert not cache.put(key, _outputs(size=64))
    assert cache.get(key) is None and len(cache) == 0 and cache.nbytes == 0


def test_replacing_a_key_keeps_the_byte_count_exact():
    cache = ResultCache()
    key = ResultCache.key("model-a", "full", IDS)
    cache.put(key, _outputs(size=16))
    cache.put(key, _outputs(size=32))
    assert len(cache) == 1 and cache.nbytes == _nbytes(_outputs(size=32))


def test_shrink_evicts_lru_and_lowers_the_budget_until_restore():
    entry_bytes = _nbytes(_outputs())
    cache = ResultCache(max_bytes=10 * entry_bytes)
    keys = [ResultCache.key("model-a", "full", torch.tensor([i])) for i in range(10)]
    for i, key in enumerate(keys):
        cache.put(key, _outputs(seed=i))
    assert cache.shrink(0.4) == 6
    assert len(cache) == 4 and cache.nbytes == 4 * entry_bytes
    assert cache.budget == 4 * entry_bytes
    assert all(cache.get(key) is None for key in keys[:6])
    assert all(cache.get(key) is not None for key in keys[6:])
    extra = ResultCache.key("model-a", "full", torch.tensor([99]))
    cache.put(extra, _outputs())  # still under the lowered budget: evicts another
    assert len(cache) == 4
    cache.restore()
    assert cache.budget == cache.max_bytes
    cache.put(keys[0], _outputs())
    assert len(cache) == 5
    with pytest.raises(ValueError):
        cache.shrink(1.5)


def test_clear_drops_everything():
    cache = ResultCache()
    cache.put(ResultCache.key("model-a", "full", IDS), _outputs())
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_concurrent_put_and_get_from_eight_threads():
    cache = ResultCache()  # 256 MiB: nothing is evicted
    per_thread, errors = 50, []
    barrier = threading.Barrier(8)

    def worker(thread: int):
        try:
            barrier.wait()
            for i in range(per_thread):
                key = ResultCache.key("model-a", f"t{thread}", torch.tensor([i]))
                cache.put(key, _outputs(seed=thread * 1000 + i, size=64))
                found = cache.get(key)
                assert torch.equal(found["top1"], torch.tensor([thread * 1000 + i]))
                cache.get(ResultCache.key("model-a", f"t{(thread + 1) % 8}", torch.tensor([i])))
        except BaseException as error:  # collected: an assertion in a thread would be lost
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    stats = cache.stats
    assert len(cache) == 8 * per_thread and stats["puts"] == 8 * per_thread
    assert stats["hits"] + stats["misses"] == 2 * 8 * per_thread
    assert stats["hits"] >= 8 * per_thread and stats["corrupt"] == 0 == stats["evictions"]
    assert cache.nbytes == 8 * per_thread * _nbytes(_outputs(size=64))
