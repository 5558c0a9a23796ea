"""The serving runtime: priority order, watermarks, cache checksums, concurrency, bad requests."""
import threading

import pytest
import torch

from rbcompile.runtime.control.policy import BasePolicy, Decision, StaticPolicy
from rbcompile.runtime.control.server import (
    PRESETS,
    AdaptiveServer,
    Preset,
    RequestError,
    ServerConfig,
)

TEXT = "the time of his new house was well"


class BlockingPolicy(BasePolicy):
    """Holds the worker on its first decision until released (contention on demand)."""

    def __init__(self, budget=0.0):
        self.release = threading.Event()
        self.entered = threading.Event()
        self.budget = budget

    def decide(self, state):
        self.entered.set()
        self.release.wait(10)
        return Decision(self.budget)


@pytest.fixture
def bert(compiled_tiny):
    return compiled_tiny["bert"][0]


def test_priority_order_under_contention(bert):
    policy = BlockingPolicy()
    done = []
    with AdaptiveServer(bert, policy, ServerConfig(max_batch=1)) as server:
        first = server.submit(TEXT)
        assert policy.entered.wait(10)
        futures = [server.submit(TEXT + f" {word}", qos=qos)
                   for word, qos in (("a", "batch"), ("the", "standard"), ("of", "interactive"),
                                     ("in", "batch"), ("is", "interactive"))]
        for f, qos in zip(futures, ("batch", "standard", "interactive", "batch", "interactive")):
            f.add_done_callback(lambda _, q=qos: done.append(q))
        policy.release.set()
        first.result(10)
        for f in futures:
            f.result(10)
    assert done == ["interactive", "interactive", "standard", "batch", "batch"]


def test_watermarks_shrink_raise_budget_refuse_lowest_class_and_shed(bert):
    memory = {"now": 0.5}
    server = AdaptiveServer(bert, StaticPolicy(0.0), ServerConfig(max_batch=4),
                            memory_override=lambda: memory["now"])
    with server:
        assert server.submit(TEXT, qos="batch").result(10).budget == 0.0
        memory["now"] = 0.65  # shrink caches
        server.submit(TEXT + " a").result(10)
        assert server.counters["shrinks"] == 1
        assert server.result_cache.budget < server.result_cache.max_bytes
        memory["now"] = 0.85  # protect: raise the budget, refuse the lowest class
        refused = server.submit(TEXT, qos="batch")
        assert isinstance(refused.exception(), RequestError)
        assert "not admitting QoS class 'batch'" in str(refused.exception())
        raised = server.submit(TEXT + " of", qos="standard").result(10)
        assert raised.budget >= server.config.watermarks.pressure_budget
        memory["now"] = 0.5
    # shed at 95%, but requests admitted before are all served
    policy = BlockingPolicy()
    server = AdaptiveServer(bert, policy, ServerConfig(max_batch=2),
                            memory_override=lambda: memory["now"])
    with server:
        admitted = [server.submit(TEXT + f" {w}") for w in ("a", "the", "of", "in", "is")]
        assert policy.entered.wait(10)
        memory["now"] = 0.96
        shed = server.submit(TEXT, qos="interactive")
        assert "overloaded" in str(shed.exception()) and "95%" in str(shed.exception())
        policy.release.set()
        assert all(f.result(10).outputs["embedding"].shape == (32,) for f in admitted)
    assert server.counters["shed"] == 1 and server.counters["completed"] == 5


def test_repeat_is_served_from_cache_and_a_corrupt_entry_is_recomputed(bert):
    with AdaptiveServer(bert, StaticPolicy(0.0)) as server:
        first = server.submit(TEXT).result(10)
        second = server.submit(TEXT).result(10)
        assert not first.from_cache and second.from_cache
        torch.testing.assert_close(second.outputs["embedding"], first.outputs["embedding"])
        for entry in server.result_cache._entries.values():  # bit rot in the stored copy
            next(iter(entry.outputs.values())).add_(1.0)
        third = server.submit(TEXT).result(10)
    assert not third.from_cache and server.result_cache.stats["corrupt"] == 1
    torch.testing.assert_close(third.outputs["embedding"], first.outputs["embedding"])


def test_concurrent_submissions_lose_nothing(bert):
    futures, lock = [], threading.Lock()

    def client(seed):
        for i in range(25):
            future = (server.submit(input_ids=torch.randint(4, 96, (5 + (seed + i) % 7,)))
                      if i % 2 else server.submit(TEXT + f" {i} {seed}"))
            with lock:
                futures.append(future)

    with AdaptiveServer(bert, StaticPolicy(0.1), ServerConfig(max_batch=8)) as server:
        threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        responses = [f.result(30) for f in futures]
    assert len(responses) == 200
    assert server.counters["admitted"] == server.counters["completed"] == 200


def test_bad_requests_fail_alone_and_serving_goes_on(bert):
    with AdaptiveServer(bert, StaticPolicy(0.0), ServerConfig(max_tokens=20)) as server:
        bad = {"empty text": server.submit("   "),
               "exceeds the limit of 20": server.submit(" ".join(["the"] * 40)),
               "unknown QoS class 'gold'": server.submit(TEXT, qos="gold"),
               "budget must be in [0, 1]": server.submit(TEXT, budget=float("nan")),
               "token ids must be in": server.submit(input_ids=[1, 500])}
        good = server.submit(TEXT)
        for message, future in bad.items():
            assert isinstance(future.exception(5), RequestError) and message in str(future.exception())
        assert good.result(10).outputs["embedding"].shape == (32,)


def test_unconfident_light_answers_escalate_at_most_max_steps(task_bert):
    preset = Preset(confidence_threshold=1.01, max_fallback_steps=1, cache_keep=0.4)
    config = ServerConfig(preset=preset)
    config.tiers.light_below = config.tiers.full_from = 1.0  # everything starts light
    with AdaptiveServer(task_bert, StaticPolicy(0.3), config) as server:
        response = server.submit(TEXT).result(10)
    assert response.fallback_steps == 1 and response.tier == 1
    overloaded = StaticPolicy(0.3, tier_shift=0.5)  # past the largest budget: no retries
    with AdaptiveServer(task_bert, overloaded, config) as server:
        response = server.submit(TEXT).result(10)
    assert response.fallback_steps == 0 and response.tier == 0
    assert set(PRESETS) == {"realtime-chat", "document-summary", "code-generation"}
    assert PRESETS["document-summary"] == Preset(0.78, 3, 0.6)
