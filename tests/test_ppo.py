"""PPO serving policy: it learns in the simulator, runs INT8, saves as safetensors + JSON only, and
`rbcompile train-policy` measures a real artifact and trains on it."""
import json
import random
import statistics
import time

import pytest
from conftest import WORDS
from safetensors.torch import load_file

import rbcompile
from rbcompile.cli import main
from rbcompile.errors import UserError
from rbcompile.runtime.policy import PolicyState, StaticPolicy
from rbcompile.runtime.ppo import PPOPolicy, train_ppo
from rbcompile.runtime.simulator import (ServiceTable, ServingSimulator, Setting, SimConfig,
                                         WorkloadItem, batch_reward)

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
    from rbcompile import train_policy
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
