"""`rbcompile serve --ray` (runtime/serving/ray_serving.py): the cluster controller's aggregation and the
replicas' non-blocking link to it (no Ray needed), the one-line error without the 'ray' extra,
and, with ray installed (`make test-ray`), two replicas behind Ray Serve's proxy."""
import concurrent.futures
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import text_streamed_through_sigterm, unguarded
from fastapi.testclient import TestClient

import rbcompile
from rbcompile.artifact.guard import QualityGuard
from rbcompile.frontend.cli import main
from rbcompile.runtime.control.decode_control import DecodeController
from rbcompile.runtime.control.policy import BasePolicy, Decision, PolicyState, StaticPolicy
from rbcompile.runtime.serving.http import create_app
from rbcompile.runtime.serving.ray_serving import (
    CLUSTER_PATH,
    RAY_MISSING,
    REPLICA_HEADER,
    ClusterBudget,
    ClusterPolicy,
    aggregate,
)
from rbcompile.runtime.serving.serve_config import ServeConfig
from rbcompile.runtime.serving.serve_policy import PolicyOptions

# serve's --max-quality-loss and --allow-unmeasured-plans, as the cluster controller gets them
GUARD = {"max_quality_loss": 0.03, "allow_unmeasured": True}
PROMPTS = ["the a of and to in", "he she", "it was the", "of the a he", "she was in", "to be or"]


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---- without Ray -------------------------------------------------------------------------------

def test_serve_ray_without_the_extra_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)          # `import ray` raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve", str(tmp_path), "--ray", "--replicas", "2"]) == 2
    assert capsys.readouterr().err == f"rbcompile: error: {RAY_MISSING}\n"
    assert RAY_MISSING == "rbcompile serve --ray needs the 'ray' extra: pip install 'rbcompile[ray]'"


def test_ray_flags_need_ray(capsys, tmp_path):
    assert main(["serve", str(tmp_path), "--replicas", "2"]) == 2
    assert "go with --ray" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--ray", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_aggregate_adds_queues_and_takes_the_worst_latency():
    a = PolicyState(memory=0.3, queue_depth=2, arrival_rate=1.5, latency_p50=0.01, latency_p99=0.02,
                    last_latency=0.01, confidence_mean=0.8, confidence_p10=0.5, cpu_utilisation=0.2,
                    input_length=10, slo_s=0.05)
    b = PolicyState(memory=0.6, queue_depth=3, arrival_rate=2.5, latency_p50=0.03, latency_p99=0.09,
                    last_latency=0.04, confidence_mean=0.6, confidence_p10=0.4, cpu_utilisation=0.9,
                    input_length=30, slo_s=0.05)
    cluster = aggregate([a, b], previous_budget=0.25)
    assert (cluster.queue_depth, cluster.arrival_rate) == (5, 4.0)
    assert (cluster.latency_p50, cluster.latency_p99, cluster.last_latency) == (0.03, 0.09, 0.04)
    assert (cluster.memory, cluster.cpu_utilisation) == (0.6, 0.9)
    assert cluster.confidence_mean == pytest.approx(0.7) and cluster.confidence_p10 == 0.4
    assert cluster.input_length == 20 and cluster.previous_budget == 0.25 and cluster.slo_s == 0.05
    assert aggregate([]).queue_depth == 0


class Recording(BasePolicy):
    """Budget 0.1 per unit of the queue it sees; raises when told to."""
    name = "recording"

    def __init__(self):
        self.seen, self.fail = [], False

    def decide(self, state):
        if self.fail:
            raise RuntimeError("broken policy")
        self.seen.append(state)
        return Decision(budget=min(1.0, 0.1 * state.queue_depth))


def test_cluster_budget_decides_on_the_aggregate_once_per_period():
    now = [0.0]
    policy = Recording()
    cluster = ClusterBudget(policy, period_s=0.25, stale_s=5.0, clock=lambda: now[0])
    assert cluster.report("r1", PolicyState(queue_depth=2)).budget == pytest.approx(0.2)
    now[0] = 0.1   # within the period: stored, not decided
    assert cluster.report("r2", PolicyState(queue_depth=3)).budget == pytest.approx(0.2)
    now[0] = 0.3
    assert cluster.report("r1", PolicyState(queue_depth=1)).budget == pytest.approx(0.4)   # 1 + 3
    assert [s.queue_depth for s in policy.seen] == [2, 4]
    now[0] = 6.0   # r2 has not reported for 5.9 s: out of the aggregate
    assert cluster.report("r1", PolicyState(queue_depth=1)).budget == pytest.approx(0.1)
    policy.fail, now[0] = True, 7.0
    assert cluster.report("r1", PolicyState(queue_depth=9)).budget == pytest.approx(0.1)   # kept
    summary = cluster.summary()
    assert summary["reports"] == {"r1": 4, "r2": 1} and summary["live_replicas"] == ["r1"]
    assert summary["errors"] == 1 and "broken policy" in summary["last_error"]


def test_cluster_budget_builds_the_policy_as_serve_does(tmp_path):
    def config(policy, budget=0.0, slo_ms=100.0):
        return ServeConfig(policy=PolicyOptions(policy, budget, slo_ms), guard=QualityGuard(**GUARD))

    cluster = ClusterBudget()
    assert cluster.start(config("static", 0.5), str(tmp_path)) is None
    assert cluster.report("r", PolicyState()).budget == 0.5
    assert "--policy-file goes with --policy ppo" in ClusterBudget().start(config("ppo"), str(tmp_path))
    assert "--slo-ms must be > 0" in ClusterBudget().start(config("static", slo_ms=0), str(tmp_path))
    assert "missing manifest.json" in ClusterBudget().start(   # pid reads the artifact's plans
        config("pid"), str(tmp_path))


def test_cluster_policy_never_waits_on_a_slow_controller_and_keeps_the_last_decision():
    release, calls = threading.Event(), []

    def report(state):
        calls.append(state.queue_depth)
        if state.queue_depth == 1:
            return Decision(budget=0.5)
        if state.queue_depth == 2:
            release.wait(10)            # a slow controller
            return Decision(budget=0.75)
        raise ConnectionError("controller gone")

    policy = ClusterPolicy(report)
    try:
        assert policy.decide(PolicyState()).budget == 0.0           # nothing received yet
        policy.observe(PolicyState(queue_depth=1))
        assert wait_for(lambda: policy.received == 1)
        assert policy.decide(PolicyState()).budget == 0.5
        started = time.perf_counter()
        policy.observe(PolicyState(queue_depth=2))
        assert wait_for(lambda: calls[-1:] == [2])
        for depth in (3, 4, 5):                                     # while the report hangs
            policy.observe(PolicyState(queue_depth=depth))
            assert policy.decide(PolicyState()).budget == 0.5
        assert time.perf_counter() - started < 0.5
        release.set()
        # the newest state waiting (5) goes next; the ones it replaced are never sent
        assert wait_for(lambda: policy.failures == 1)
        assert calls == [1, 2, 5] and policy.decide(PolicyState()).budget == 0.75   # kept
        assert "controller gone" in policy.status()["last_error"]
    finally:
        policy.close()


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return unguarded(rbcompile.compile(tiny_checkpoints["llama"]))


def test_one_controller_sets_the_budget_of_two_apps(llama):
    """Two in-process apps (no Ray), each with a ClusterPolicy reporting to one ClusterBudget:
    the cluster's decision (a static 0.5) becomes both engines' budget."""
    cluster, lock = ClusterBudget(StaticPolicy(0.5), period_s=0.0), threading.Lock()

    def link(name):
        def report(state):
            with lock:
                return cluster.report(name, state)
        return ClusterPolicy(report)

    policies = [link("a"), link("b")]
    clients = [TestClient(create_app(llama, policy=p)) for p in policies]
    for client in clients:
        controller = client.app.state.engine.controller
        assert isinstance(controller, DecodeController)
        controller.period_s = 0.0
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert wait_for(lambda: controller.policy.received >= 1)
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.app.state.engine.budget == 0.5
        assert "rbcompile_decode_budget 0.5" in client.get("/metrics").text
    assert set(cluster.summary()["reports"]) == {"a", "b"}
    for policy in policies:
        policy.close()


# ---- two replicas under Ray Serve (make test-ray) ----------------------------------------------

def greedy_text(compiled, prompt, max_tokens, budget):
    ids = compiled.tokenizer([prompt], return_tensors="pt")["input_ids"]
    tokens = compiled.generate(ids, max_new_tokens=max_tokens, budget=budget).tokens[0]
    return compiled.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.ray
def test_two_ray_serve_replicas_one_controller(llama, tmp_path, monkeypatch):
    """`rbcompile serve --ray --replicas 2 --policy static --budget 0.5` (with an API key) on a
    local Ray: both replicas serve (the replica header), the controller's 0.5 reaches both engines (their
    /v1/rbcompile/cluster and its summary), greedy completions without a budget of their own
    equal `generate` at 0.5, and SIGTERM drains and exits 0."""
    pytest.importorskip("ray.serve", reason="needs the 'ray' extra (make test-ray)")
    import httpx

    compiled = llama
    artifact = compiled.save(tmp_path / "llama")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("RBC_TEST_KEY", "k3y")
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "rbcompile.frontend.cli", "serve", str(artifact), "--ray",
                                "--replicas", "2", "--replica-cpus", "0.5", "--port", str(port),
                                "--policy", "static", "--budget", "0.5", "--api-key-env", "RBC_TEST_KEY",
                                "--allow-unmeasured-plans"],
                               stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=base, timeout=60, headers={"Authorization": "Bearer k3y"})
    try:
        while True:   # serve.run returns once both replicas are up: then the line is printed
            line = process.stderr.readline()
            assert line or process.poll() is None, "serve --ray ended before serving"
            if line.startswith("serving "):
                break
            assert time.monotonic() - started < 150, "serve --ray did not come up in 150 s"
        up = time.monotonic() - started
        assert httpx.get(f"{base}/v1/models").status_code == 401      # the key holds on replicas
        assert httpx.get(f"{base}/health").status_code == 200

        def complete(prompt):
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                            "temperature": 0})
            assert response.status_code == 200, response.text
            return response.headers[REPLICA_HEADER], response.json()["choices"][0]["text"]

        # Warm-up until the controller's decision has reached both replicas' engines.
        seen: dict[str, dict] = {}
        deadline = time.monotonic() + 60
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            while not (len(seen) == 2 and all(v["engine_budget"] == 0.5 for v in seen.values())):
                assert time.monotonic() < deadline, seen
                list(pool.map(complete, PROMPTS * 2))
                for _ in range(6):
                    status = client.get(CLUSTER_PATH)
                    assert status.headers[REPLICA_HEADER] == status.json()["replica"]
                    seen[status.json()["replica"]] = status.json()
            # Greedy identity at the cluster's budget, spread over both replicas.
            served = list(pool.map(complete, PROMPTS * 3))
        replicas = {replica for replica, _ in served}
        assert len(replicas) == 2, replicas
        for (replica, text), prompt in zip(served, PROMPTS * 3):
            assert text == greedy_text(compiled, prompt, 24, 0.5), (replica, prompt)
        assert any(greedy_text(compiled, p, 24, 0.5) != greedy_text(compiled, p, 24, 0.0)
                   for p in PROMPTS)   # the budget changes the tokens: 0.5 was really applied

        controller = seen[next(iter(seen))]["controller"]
        assert controller["policy"] == "static" and controller["budget"] == 0.5
        assert set(controller["reports"]) == set(seen) == replicas
        assert all(v["link"]["received"] >= 1 and v["link"]["failures"] == 0 for v in seen.values())
        metrics = client.get("/metrics").text
        assert "rbcompile_decode_budget 0.5" in metrics

        # SIGTERM with a stream open: it finishes ([DONE]), then the command exits 0.
        body = {"prompt": PROMPTS[1], "max_tokens": 40, "stream": True, "temperature": 0}
        with client.stream("POST", "/v1/completions", json=body) as response:
            text = text_streamed_through_sigterm(response, process)
        assert text == greedy_text(compiled, PROMPTS[1], 40, 0.5)
        assert process.wait(90) == 0, process.stderr.read()
        print(json.dumps({"up_s": round(up, 1), "total_s": round(time.monotonic() - started, 1),
                          "by_replica": {r: sum(1 for s, _ in served if s == r) for r in replicas}}))
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
            process.wait(30)
