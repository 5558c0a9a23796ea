"""PPO serving policy: it learns in the simulator, runs INT8, saves as safetensors + JSON only, and
`rbcompile train-policy` measures a real artifact and trains on it."""
import json
import random
import statistics
import time

import pytest
import torch
from safetensors.torch import load_file

import rbcompile
from rbcompile.errors import UserError
from rbcompile.frontend.cli import main
from rbcompile.runtime.control.policy import Decision, PolicyState, StaticPolicy
from rbcompile.runtime.control.ppo import PPOPolicy, train_ppo
from rbcompile.runtime.control.simulator import (
    ServiceTable,
    ServingSimulator,
    Setting,
    SimConfig,
    WorkloadItem,
    batch_reward,
)

from conftest import WORDS, served_by_cli

FULL_FIXED_S, FULL_PER_TOKEN_S = 0.002, 0.04 / (16 * 32)  # 40 ms for 16 x 32 tokens


def synthetic_table() -> ServiceTable:
    """Budget 0.25 runs 1.7x faster for 2 points, 0.5 2.5x for 5; width 0.5 adds 1.3x for 2 more
    points (hard inputs lose 1.5x as much, easy ones half). The full path falls behind at midday
    and every lighter setting pays the accuracy penalty: the best policy has to adapt."""
    settings = []
    for budget, speedup, drop in ((0.0, 1.0, 0.0), (0.25, 1.7, 0.02), (0.5, 2.5, 0.05)):
        for width, width_speedup, width_drop in ((1.0, 1.0, 0.0), (0.5, 1.3, 0.02)):
            total = drop + width_drop
            settings.append(Setting(budget, width, 0.5 * total, 1.5 * total, total, FULL_FIXED_S,
                                    FULL_PER_TOKEN_S / (speedup * width_speedup)))
    return ServiceTable(settings, metric="synthetic")


@pytest.fixture(scope="module")
def simulator():
    rng = random.Random(0)
    workload = []
    for _ in range(200):
        complexity = rng.random()
        workload.append(WorkloadItem(rng.randint(8, 32), complexity, complexity > 0.5))
    return ServingSimulator(synthetic_table(), workload, SimConfig())


@pytest.fixture(scope="module")
def trained(simulator):
    network, log = train_ppo(simulator, 4000, seed=0)
    return network, log


def _mean_reward(simulator, policy) -> float:
    return statistics.mean(simulator.run(policy, seed=1000 + day).summary(0.1)["mean_reward"]
                           for day in range(3))


def _random_states(count: int, seed: int) -> list[PolicyState]:
    rng = random.Random(seed)
    return [PolicyState(memory=rng.random(), input_length=rng.uniform(8, 32),
                        complexity=rng.random(), queue_depth=rng.randint(0, 300),
                        arrival_rate=rng.uniform(0, 600), last_latency=rng.uniform(0, 0.4),
                        latency_p50=rng.uniform(0, 0.3), latency_p99=rng.uniform(0, 0.5),
                        confidence_mean=rng.uniform(0.9, 1), confidence_p10=rng.uniform(0.8, 1),
                        cpu_utilisation=rng.random(), previous_budget=rng.choice((0, 0.25, 0.5)))
            for _ in range(count)]


def test_reward_formula_and_table_round_trip(simulator):
    # 2 requests at 0 and 2x the SLO, 3 points lost, one component switched
    assert batch_reward([0.0, 0.2], [0.03, 0.03], 1, 0.1) == pytest.approx(0 - 0.2 - 0.05)
    table = synthetic_table()
    assert ServiceTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    assert table.lookup(0.3, 0.6) == table.lookup(0.25, 1.0)  # largest budget <=, cap >=
    assert table.within_one_point().budget == 0.0
    costly = ServiceTable([Setting(0.0, 1.0, 0.02, 0.02, 0.02, 0.01, 0.0),
                           Setting(0.3, 1.0, 0.05, 0.05, 0.05, 0.005, 0.0)])
    assert costly.within_one_point().budget == 0.0  # nothing within a point: the least drop
    days = [simulator.run(StaticPolicy(0.25, 1.0, use_cache), seed=7) for use_cache in (0, 1)]
    assert days[0].requests == days[1].requests == len(simulator.trace)
    assert min(days[1].latencies) < 1e-3 < min(days[0].latencies)  # cache hits cost ~0


def test_ppo_beats_static_full_and_most_aggressive(simulator, trained):
    network, log = trained
    assert log[-1]["steps"] == 4000 and log[-1]["mean_reward"] > log[0]["mean_reward"]
    learned = _mean_reward(simulator, PPOPolicy(network, simulator.levels))
    full = _mean_reward(simulator, StaticPolicy(0.0, 1.0, True))
    aggressive = _mean_reward(simulator, StaticPolicy(0.5, 0.5, True))
    assert learned > full + 0.1 and learned > aggressive + 0.1, (learned, full, aggressive)


def test_int8_policy_agrees_with_fp32_and_is_fast(simulator, trained):
    int8 = PPOPolicy(trained[0], simulator.levels)
    fp32 = PPOPolicy(trained[0], simulator.levels, quantized=False)
    states = _random_states(500, seed=1)
    decisions = [int8.decide(s) for s in states]
    assert sum(d == fp32.decide(s) for d, s in zip(decisions, states)) >= 0.95 * len(states)
    assert len(set(decisions)) > 1  # the decision depends on the state
    timings = []
    for state in states:
        start = time.perf_counter()
        int8.decide(state)
        timings.append(time.perf_counter() - start)
    assert statistics.median(timings) < 0.005


def test_save_load_round_trip_and_corrupt_files(simulator, trained, tmp_path):
    policy = PPOPolicy(trained[0], simulator.levels, info={"training": {"log": trained[1]}})
    folder = policy.save(tmp_path / "policy")
    assert sorted(p.name for p in folder.iterdir()) == ["policy.json", "policy.safetensors"]
    assert load_file(str(folder / "policy.safetensors"))  # plain safetensors, no pickle
    meta = json.loads((folder / "policy.json").read_text())
    assert meta["actions"]["budget"] == [0.0, 0.25, 0.5] and len(meta["features"]) == 12
    loaded = PPOPolicy.load(folder)
    states = _random_states(200, seed=2)
    assert [loaded.decide(s) for s in states] == [policy.decide(s) for s in states]
    assert loaded.info["training"]["log"] == trained[1]

    weights = folder / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UserError, match="corrupt safetensors file"):
        PPOPolicy.load(folder)
    weights.unlink()
    with pytest.raises(UserError, match="missing policy.safetensors"):
        PPOPolicy.load(folder)
    (folder / "policy.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt JSON"):
        PPOPolicy.load(folder)
    with pytest.raises(UserError, match="no such policy folder"):
        PPOPolicy.load(tmp_path / "missing")


def _workload(path, lines: int) -> None:
    rng = random.Random(0)
    path.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in
                                                          range(rng.randint(3, 40)))})
                              for _ in range(lines)))


@pytest.fixture(scope="module")
def bert_artifact(tiny_checkpoints, calib_file, tmp_path_factory):
    """The tiny bert calibrated as in conftest's `calibrated_tiny` (bert alone: that fixture
    calibrates all three architectures, which would triple this file's run time)."""
    compiled = rbcompile.compile(tiny_checkpoints["bert"], calib=calib_file, calib_samples=8,
                                 calib_seq=32)
    return compiled.save(tmp_path_factory.mktemp("ppo") / "bert")


def test_cli_train_policy(bert_artifact, tmp_path, capsys, monkeypatch):
    from rbcompile.runtime.control import train_policy
    monkeypatch.setattr(train_policy, "LATENCY_ROUNDS", 1)    # fewer repeats of the same work
    monkeypatch.setattr(train_policy, "EVALUATION_DAYS", 1)
    artifact = bert_artifact
    workload = tmp_path / "workload.jsonl"
    _workload(workload, 200)
    out = tmp_path / "policy"
    assert main(["train-policy", str(artifact), "--workload", str(workload), "-o", str(out),
                 "--steps", "300", "--max-batch", "8"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["policy.json", "policy.safetensors",
                                                     "table.json"]
    table = ServiceTable.from_json(json.loads((out / "table.json").read_text()))
    assert table.widths == (1.0, 0.75, 0.5) and len(table.budgets) == 11
    assert all(s.per_token_s > 0 or s.fixed_s > 0 for s in table.settings)
    full = next(s for s in table.settings if (s.budget, s.width) == (0.0, 1.0))
    assert full.drop < 1e-6 and full.skipped_share == 0  # the executor's full path is exact
    assert max(s.drop for s in table.settings) > 0 and max(s.skipped_share for s in table.settings) > 0
    printed = capsys.readouterr().out
    assert "ppo (int8)" in printed and "static full" in printed and "(<= 1 pt)" in printed
    assert PPOPolicy.load(out).info["training"]["steps"] == 300

    _workload(workload, 150)
    assert main(["train-policy", str(artifact), "--workload", str(workload), "-o",
                 str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "150 inputs; train-policy needs at least 200" in err[0]
    assert not (tmp_path / "other").exists()


# ---- decoders: the decode-step simulator and train-policy on a decoder -----------------------

def synthetic_decode_table() -> ServiceTable:
    """Decode steps of 30 ms + 5 ms per row (+ a little per context token); budget 0.3 runs
    1.6x faster for 4 points of top-1 agreement."""
    settings = []
    for budget, speedup, drop in ((0.0, 1.0, 0.0), (0.3, 1.6, 0.04)):
        settings.append(Setting(budget, 1.0, drop, drop, drop, 0.03 / speedup, 1e-6 / speedup,
                                budget, 0.005 / speedup, 0.01, 2e-4 / speedup,
                                (0.5, 0.7, 0.9) if budget else (0.6, 0.8, 0.95)))
    return ServiceTable(settings, metric="synthetic")


@pytest.fixture(scope="module")
def decode_simulator():
    from rbcompile.runtime.control.decode_simulator import DecodeSimConfig, DecodeSimulator
    rng = random.Random(0)
    workload = [WorkloadItem(rng.randint(8, 64), c, c > 0.5)
                for c in (rng.random() for _ in range(100))]
    return DecodeSimulator(synthetic_decode_table(), workload,
                           DecodeSimConfig(slo_s=0.08, max_batch=8, new_tokens=16, day_s=30.0))


def test_decode_simulator_batches_continuously_with_the_controllers_state(decode_simulator):
    from rbcompile.runtime.control.decode_control import DecodeController
    from rbcompile.runtime.control.policy import FEATURES

    sim = decode_simulator
    table = sim.table
    assert ServiceTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    assert table.full.seconds(4, 100) == pytest.approx(0.03 + 0.005 * 4 + 1e-6 * 400)
    assert table.full.prefill_seconds(2, 50) == pytest.approx(0.01 + 2e-4 * 100)
    state = sim.reset(seed=3)
    assert isinstance(sim.controller, DecodeController) and sim.levels.sizes == (2, 1, 1)
    states, rows = [], []
    while state is not None:
        states.append(state)
        rows.append(len(sim.engine.running))
        _, state, served = sim.step(Decision(0.0))
        assert len(served["latencies"]) == len(served["drops"])
    assert max(rows) <= 8 and max(rows) > 1      # rows join a running batch, never beyond 8
    busy = [s for s in states if s.latency_p99 > 0]
    assert busy and all(s.slo_s == 0.08 and s.max_length == 8192 for s in states)
    # per-step latencies, as DecodeController sees them: one step of 1 to 8 rows
    low, high = table.full.seconds(1, 8), table.full.seconds(8, 64 + 16)
    assert all(low - 1e-9 <= s.latency_p50 <= s.latency_p99 <= high + 1e-9 for s in busy)
    assert all(0.6 <= s.confidence_p10 <= s.confidence_mean <= 0.95 for s in busy)
    assert max(s.queue_depth for s in states) > 0 and max(s.arrival_rate for s in states) > 0
    assert all(8 <= s.input_length <= 64 + 16 for s, n in zip(states, rows) if n)
    assert any(n == 0 and s.input_length == 0 for s, n in zip(states, rows))
    assert len(states[0].vector()) == len(FEATURES)
    full = sim.run(StaticPolicy(0.0), seed=3)
    light = sim.run(StaticPolicy(0.3), seed=3)
    assert full.requests == light.requests == len(sim.trace)   # every request finishes
    assert full.summary(0.08)["request_p99_ms"] > light.summary(0.08)["request_p99_ms"]
    assert set(light.drops) == {0.04} and set(full.drops) == {0.0}


def test_decode_training_is_deterministic_with_a_seed(decode_simulator):
    runs = [train_ppo(decode_simulator, 300, seed=5) for _ in range(2)]
    assert runs[0][1] == runs[1][1]
    for a, b in zip(runs[0][0].state_dict().values(), runs[1][0].state_dict().values()):
        assert torch.equal(a, b)
    other = train_ppo(decode_simulator, 300, seed=6)[0]
    assert not all(torch.equal(a, b) for a, b in zip(runs[0][0].state_dict().values(),
                                                     other.state_dict().values()))


@pytest.fixture(scope="module")
def llama_artifact(tiny_checkpoints, tmp_path_factory):
    return rbcompile.compile(tiny_checkpoints["llama"]).save(
        tmp_path_factory.mktemp("ppo") / "llama")


def test_cli_train_policy_on_a_decoder_and_serve_it(llama_artifact, tmp_path, capsys,
                                                    monkeypatch):
    from fastapi.testclient import TestClient

    from rbcompile.runtime.control import train_policy
    from rbcompile.runtime.control.policy import GuardedPolicy
    monkeypatch.setattr(train_policy, "DECODER_LATENCY_ROUNDS", 1)
    monkeypatch.setattr(train_policy, "EVALUATION_DAYS", 1)
    monkeypatch.setattr(train_policy, "DECODER_BUDGETS", (0.2, 0.5))
    monkeypatch.setattr(train_policy, "DECODER_QUALITY_INPUTS", 64)
    monkeypatch.setattr(train_policy, "DECODE_STEPS", 2)
    workload = tmp_path / "workload.jsonl"
    _workload(workload, 200)
    out = tmp_path / "policy"
    assert main(["train-policy", str(llama_artifact), "--workload", str(workload), "-o",
                 str(out), "--steps", "200", "--max-batch", "2", "--slo-ms", "20",
                 "--new-tokens", "8"]) == 0
    table = ServiceTable.from_json(json.loads((out / "table.json").read_text()))
    assert table.budgets == (0.0, 0.2, 0.5) and table.widths == (1.0,)
    for s in table.settings:    # a decode-step row and a prefill row for every plan
        assert s.fixed_s + s.per_row_s + s.per_token_s > 0
        assert s.seconds(4, 40) < 1.0 and s.prefill_fixed_s + s.prefill_per_token_s > 0
        assert len(s.confidences) == train_policy.CONFIDENCE_QUANTILES
        assert all(0 <= c <= 1 for c in s.confidences)
    assert table.full.drop == 0 and max(s.drop for s in table.settings) > 0
    meta = json.loads((out / "policy.json").read_text())
    assert meta["simulator"] == "decode-step" and meta["state"]["slo_s"] == 0.02
    assert meta["actions"]["budget"] == [0.0, 0.2, 0.5] and meta["simulation"]["new_tokens"] == 8
    printed = capsys.readouterr().out
    assert "ppo (int8)" in printed and "req p99 ms" in printed

    served = served_by_cli(monkeypatch)
    assert main(["serve", str(llama_artifact), "--policy", "ppo", "--policy-file", str(out),
                 "--slo-ms", "20"]) == 0
    controller = served["app"].state.engine.controller
    assert isinstance(controller.policy, GuardedPolicy) and controller.slo_s == 0.02
    assert isinstance(controller.policy.policy, PPOPolicy)
    with TestClient(served["app"]) as client:   # the model thread steps, the policy decides
        answer = client.post("/v1/completions", json={"prompt": "the a of", "max_tokens": 6,
                                                      "temperature": 0}).json()
    assert answer["usage"]["completion_tokens"] == 6
    assert controller.policy.decisions >= 1 and controller.decision.budget in (0.0, 0.2, 0.5)

    meta["simulator"] = "requests"    # a policy trained for AdaptiveServer's whole requests
    (out / "policy.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["serve", str(llama_artifact), "--policy", "ppo", "--policy-file", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a policy from train-policy --simulator decode-step" in err[0]
