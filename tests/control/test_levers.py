"""The controller's lever order (runtime/control/levers.py): lower weight precision within the
guard before skipping. The ladder keeps only levels that pay for their loss; PID walks down
it before its budget grows; the engine's decode steps run the decided level and each request
reports the level it ran."""
import pytest
from fastapi.testclient import TestClient
from shared import DECODER_PROMPTS, int4_measured

from rbcompile.artifact.executors import StoredPrecision
from rbcompile.artifact.guard import QualityGuard
from rbcompile.runtime.control.decode_control import DecodeController
from rbcompile.runtime.control.levers import precision_ladder, served_ladder
from rbcompile.runtime.control.pid import PIDConfig
from rbcompile.runtime.control.policy import BasePolicy, Decision, PIDPolicy
from rbcompile.runtime.engine.requests import EngineRequest


def _manifest(int4_loaded: float) -> dict:
    def level(name, loss, one, loaded):
        return StoredPrecision(name, loss, {}, ((1, one), (8, loaded))).to_json()
    return {"precisions": [level("int4-fp32", 0.0, 1.4, 0.82), level("int8", 0.05, 2.4, 1.4),
                           level("int4", 0.058, 2.39, int4_loaded)]}


def test_the_ladder_keeps_levels_the_guard_allows_that_pay_for_their_loss():
    # int4-fp32 is no faster with full batches; int4 costs more than int8 and is slower
    assert precision_ladder(_manifest(1.31), QualityGuard(0.06), "fp32") == ("int8",)
    assert precision_ladder(_manifest(1.6), QualityGuard(0.06), "fp32") == ("int8", "int4")
    assert precision_ladder(_manifest(1.6), QualityGuard(0.055), "fp32") == ("int8",)
    assert precision_ladder(_manifest(1.6), QualityGuard(0.03), "fp32") == ()
    assert precision_ladder(_manifest(1.6), QualityGuard(0.06), "int8") == ("int4",)
    assert precision_ladder({}, QualityGuard(1.0), "fp32") == ()


def test_a_lossless_level_is_the_ladders_first_rung_where_it_pays():
    manifest = _manifest(1.6)
    manifest["precisions"][0]["speedups"]["8"] = 1.2   # int4-fp32 faster with full batches
    assert precision_ladder(manifest, QualityGuard(0.06), "fp32") == ("int4-fp32", "int8",
                                                                      "int4")


@pytest.mark.parametrize("output, weights, budget", [
    (0.0, None, 0.0), (0.4, None, 0.0), (0.6, "int8", 0.0), (1.6, "int4", 0.0),
    (2.3, "int4", 0.3), (2.5, "int4", 0.5)])
def test_pid_lowers_precision_before_its_budget_grows(output, weights, budget):
    policy = PIDPolicy(PIDConfig(setpoint=0.1), max_budget=0.5, levels=("int8", "int4"))
    assert policy.controller.config.output_max == 2.5
    policy.controller.output = output
    decision = policy.decide(None)
    assert (decision.weights, decision.budget) == (weights, pytest.approx(budget))


class _Fixed(BasePolicy):
    def __init__(self, decision: Decision):
        self.decision = decision

    def decide(self, state):
        return self.decision


@pytest.fixture(scope="module")
def measured(tiny_checkpoints):
    return int4_measured(tiny_checkpoints["llama"])


def test_the_controllers_level_runs_the_steps_of_requests_without_their_own(measured):
    model = measured
    try:
        model.use_executor("onnxruntime", "int4")
        prompt = DECODER_PROMPTS[1].tolist()
        alone = model.batch_engine(max_batch=2)
        expected = alone.submit(EngineRequest(prompt, 6))
        while alone.has_work:
            alone.step()
        model.use_executor("onnxruntime")
        assert served_ladder(model) == ()    # int4 is no faster at 2 rows: no rung
        engine = model.batch_engine(max_batch=2)
        DecodeController(engine, _Fixed(Decision(weights="int4")), 0.1, lambda: 0.0)
        ran = []
        for asked in (None, "fp32"):   # full precision asked: the controller's level is lower
            ran.append(engine.submit(EngineRequest(prompt, 6, weights=asked)))
            while engine.has_work:
                engine.step()
        assert ran[0].tokens == expected.tokens
        assert [request.weights_run for request in ran] == ["int4", "fp32"]
    finally:
        model.use_executor("torch")


def test_serve_reports_the_weights_a_completion_ran(measured):
    from rbcompile.runtime.serving.http import create_app

    model = measured
    try:
        model.use_executor("onnxruntime")
        client = TestClient(create_app(model, policy=_Fixed(Decision(weights="int4"))))
        body = {"prompt": "the time", "max_tokens": 4, "temperature": 0}
        plan = client.post("/v1/completions", json=body).json()["rbcompile"]["plan"]
        loss = model.manifest["precisions"][0]["decoder_quality_loss"]
        assert plan["weights"] == "int4" and plan["weights_quality_loss"] == pytest.approx(loss)
        gauge = next(line for line in client.get("/metrics").text.splitlines()
                     if line.startswith("rbcompile_decode_weights_quality_loss "))
        assert float(gauge.split()[1]) == pytest.approx(loss)
    finally:
        model.use_executor("torch")
