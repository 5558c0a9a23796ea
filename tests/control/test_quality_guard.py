"""The quality guard (rbcompile/artifact/guard.py) and the quality loop of `rbcompile serve`
(runtime/control/quality_loop.py): no budget, flag, request or controller decision runs a plan whose
measured quality loss is over the guard, and unmeasured plans run only when allowed."""
import asyncio
import math
import warnings

import httpx
import pytest
import torch

import rbcompile
from rbcompile.artifact.compiled import QualityGuardWarning
from rbcompile.artifact.guard import (
    DECODER,
    OVER_GUARD,
    UNGUARDED,
    UNMEASURED,
    QualityGuard,
    decoder_path,
    guard_budget,
    lossy_budgets,
)
from rbcompile.artifact.plans import StoredPlan
from rbcompile.artifact.quality import quality_loss
from rbcompile.frontend.cli import main
from rbcompile.runtime.control.decode_control import DecodeController
from rbcompile.runtime.control.pid import PIDConfig
from rbcompile.runtime.control.policy import PIDPolicy, StaticPolicy
from rbcompile.runtime.control.quality_loop import (
    OBSERVED,
    QualityLoop,
    QualityLoopConfig,
    changed_lower_bound,
)
from rbcompile.runtime.engine.core import EngineRequest
from rbcompile.runtime.serving.http import create_app
from rbcompile.runtime.serving.serve_config import ServeConfig
from rbcompile.runtime.serving.serve_policy import PolicyOptions

from conftest import served_by_cli

PROMPTS = ["the a of and to in", "he she and", "in the in the", "of and to in he", "she was",
           "a the of and"]


def plans(*losses):
    """Stored plans of budgets 0, 0.1, 0.2, ... with these measured losses (None: unmeasured)."""
    return [StoredPlan(0.0, quality_loss=0.0)] + [
        StoredPlan(round(0.1 * (i + 1), 1), (i,), quality_loss=loss) for i, loss in enumerate(losses)]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    """The tiny llama, uncalibrated: every lossy plan is unmeasured (the default guard)."""
    return rbcompile.compile(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def calibrated(tiny_checkpoints, calib_file):
    """The tiny llama calibrated: every plan carries its measured losses."""
    return rbcompile.compile(tiny_checkpoints["llama"], calib=calib_file, calib_samples=8,
                             calib_seq=32, calib_budgets=(0.1, 0.3, 0.5))


def test_guard_takes_the_largest_allowed_plan_under_the_budget():
    guard = QualityGuard(0.05)
    stored = plans(0.01, 0.2, 0.04, None)
    assert guard_budget(stored, 0.25, guard).as_json() == {
        "requested_budget": 0.25, "budget": 0.1, "quality_loss": 0.01, "withheld": OVER_GUARD}
    assert guard_budget(stored, 0.35, guard).budget == 0.3   # losses need not grow with budget
    assert guard_budget(stored, 0.4, guard).withheld == UNMEASURED
    assert guard_budget(stored, 0.4, QualityGuard(0.05, allow_unmeasured=True)).budget == 0.4
    assert guard_budget(stored, 0.1, guard).withheld is None
    assert guard_budget(stored, None, guard).budget == 0.0 == guard_budget(stored, 0, guard).budget
    assert lossy_budgets(stored, guard) == [0.1, 0.3]
    assert guard_budget(plans(0.01), 0.1, QualityGuard(0.0)).budget == 0.0


def test_an_uncalibrated_budget_is_the_full_path_unless_unmeasured_plans_are_allowed():
    assert guard_budget(None, 0.3, QualityGuard()).as_json() == {
        "requested_budget": 0.3, "budget": 0.0, "quality_loss": 0.0, "withheld": UNMEASURED}
    assert guard_budget(None, 0.3, UNGUARDED).budget == 0.3
    assert guard_budget(None, 0.3, UNGUARDED).quality_loss is None
    assert lossy_budgets(None, QualityGuard()) == []
    with pytest.raises(ValueError, match="max_quality_loss"):
        QualityGuard(-0.1)
    with pytest.raises(ValueError, match="max_quality_loss"):
        QualityGuard(math.nan)


def test_quality_loss_takes_the_worse_of_agreement_and_perplexity():
    full = {"perplexity": 40.0, "top1_agreement": 1.0}
    assert quality_loss({"perplexity": 41.0, "top1_agreement": 0.9}, full) == pytest.approx(0.1)
    assert quality_loss({"perplexity": 60.0, "top1_agreement": 0.9}, full) == pytest.approx(0.5)
    assert quality_loss({"perplexity": 30.0, "top1_agreement": 1.0}, full) == 0.0
    assert quality_loss({"accuracy": 0.7}, {"accuracy": 0.8}) == pytest.approx(0.1)
    assert quality_loss({"cosine": 0.96}, {"cosine": 1.0}) == pytest.approx(0.04)


def test_calibration_stores_each_plans_measured_loss_on_both_paths(calibrated, tmp_path):
    """Every plan carries its loss on held-out text: the whole-sequence graph's, and the
    decoder's (its MLP skips: attention runs to write the cache); both survive save / load."""
    from rbcompile.compiler.calibrate import decoder_setting

    full = calibrated.plans[0].heldout
    for plan in calibrated.plans:
        assert plan.quality_loss == pytest.approx(quality_loss(plan.heldout, full))
        assert plan.decoder_quality_loss == pytest.approx(quality_loss(plan.decoder_heldout, full))
        gates = [gate not in plan.skip_gates for gate in range(calibrated.num_gates)]
        kept = decoder_setting(calibrated, gates)
        attention = [r["gate"] for r in calibrated.regions
                     if r["kind"] == "prunable" and r["name"] not in calibrated.decoder.unit_gates]
        assert all(kept[gate] for gate in attention)
    assert calibrated.plans[0].quality_loss == 0.0
    loaded = rbcompile.load(calibrated.save(tmp_path / "artifact"))
    assert [p.decoder_quality_loss for p in loaded.plans] == \
        [p.decoder_quality_loss for p in calibrated.plans]


def test_a_forward_with_an_unmeasured_budget_runs_the_full_path_and_warns(llama):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    full = llama(ids)
    with pytest.warns(QualityGuardWarning, match="budget 0.5 withheld"):
        out = llama(ids, budget=0.5)
    assert out.path == "full" and out.skipped_flops == 0 and out.plan.withheld == UNMEASURED
    assert torch.equal(out["logits"], full["logits"])
    llama.guard = QualityGuard(allow_unmeasured=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            light = llama(ids, budget=0.5)
    finally:
        llama.guard = QualityGuard()
    assert light.path == "light" and light.skipped_flops > 0 and light.plan.quality_loss is None


def test_generate_never_runs_a_plan_over_the_guard(calibrated):
    """Under a guard below every decoder plan that changes a token, generate at any budget is
    the full path's text; with the loss of the lossiest plan allowed, the largest budget runs
    it. (A plan that only narrows runs the whole decoder: its decoder loss is 0.)"""
    ids = torch.tensor([[5, 6, 7, 8]])
    full = calibrated.generate(ids, max_new_tokens=12).tokens[0]
    losses = [p.decoder_quality_loss for p in calibrated.plans if p.budget > 0]
    calibrated.guard = QualityGuard(min(loss for loss in losses if loss > 0) / 2)
    try:
        with pytest.warns(QualityGuardWarning):
            assert calibrated.generate(ids, max_new_tokens=12, budget=0.5).tokens[0] == full
        plan = calibrated.guarded(0.5, DECODER)
        assert plan.quality_loss == 0.0 and plan.withheld == OVER_GUARD
        assert all(calibrated.guarded_decoder_gates(0.5) or [True])
        calibrated.guard = QualityGuard(max(losses))
        plan = calibrated.guarded(0.5, DECODER)
        assert plan.withheld is None and plan.budget == 0.5 and plan.quality_loss == losses[-1]
    finally:
        calibrated.guard = QualityGuard()


def test_a_plan_at_a_lower_weight_precision_is_guarded_by_that_pairs_own_loss():
    """A plan's loss at fp32 does not bound it at int4: the pair's measured loss does, and a
    pair never measured is unmeasured."""
    stored = [StoredPlan(0.0), StoredPlan(0.1, (0,), decoder_quality_loss=0.01,
                                          precision_losses=(("int4", 0.08),)),
              StoredPlan(0.2, (0, 1), decoder_quality_loss=0.02)]
    guard = QualityGuard(0.05)
    assert guard_budget(stored, 0.1, guard, DECODER).budget == 0.1
    at_int4 = guard_budget(stored, 0.1, guard, decoder_path("int4"))
    assert at_int4.budget == 0.0 and at_int4.withheld == OVER_GUARD
    assert guard_budget(stored, 0.2, QualityGuard(0.1), decoder_path("int4")).as_json() == {
        "requested_budget": 0.2, "budget": 0.1, "quality_loss": 0.08, "withheld": UNMEASURED}
    assert decoder_path("fp32") == DECODER
    assert StoredPlan.from_json(stored[1].to_json()) == stored[1]


def test_calibration_measures_each_plan_at_each_weight_level(calibrated, tmp_path):
    """Compile measures every lossy plan with its weights at int8 and int4 (a plan whose decoder
    skips nothing costs its level's loss); the losses survive save / load, and generate at int4
    weights runs a budget only where the int4 pair is within the guard."""
    levels = {p["level"]: p["decoder_quality_loss"] for p in calibrated.manifest["precisions"]}
    lossy = [plan for plan in calibrated.plans if plan.budget > 0]
    for plan in lossy:
        assert set(dict(plan.precision_losses)) == {"int8", "int4", "int4-fp32"}
        if all(calibrated.decoder_gates(plan.budget)):
            assert dict(plan.precision_losses) == levels
    loaded = rbcompile.load(calibrated.save(tmp_path / "artifact"))
    assert [p.precision_losses for p in loaded.plans] == [p.precision_losses for p in calibrated.plans]
    top = max(lossy, key=lambda plan: abs(dict(plan.precision_losses)["int4"]
                                          - plan.decoder_quality_loss))
    losses = {"fp32": top.decoder_quality_loss, "int4": dict(top.precision_losses)["int4"]}
    assert losses["fp32"] != losses["int4"]
    previous = calibrated.decoder.executor
    calibrated.guard = QualityGuard(min(losses.values()))
    try:
        for level, loss in losses.items():
            calibrated.use_executor("onnxruntime", level)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", QualityGuardWarning)
                plan = calibrated.guarded(top.budget, DECODER)
            assert (plan.budget == top.budget) == (loss == min(losses.values())), level
    finally:
        calibrated.guard = QualityGuard()
        calibrated.use_executor("torch" if previous is None else "onnxruntime")


async def _post_all(app, bodies, path="/v1/completions"):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        responses = await asyncio.gather(*(client.post(path, json=body) for body in bodies))
        return responses, (await client.get("/metrics")).text


def _greedy(compiled, prompt, tokens):
    ids = compiled.tokenizer([prompt], return_tensors="pt")["input_ids"]
    return compiled.tokenizer.decode(compiled.generate(ids, max_new_tokens=tokens).tokens[0],
                                     skip_special_tokens=True)


def test_pid_under_an_slo_it_cannot_hold_keeps_an_uncalibrated_model_lossless(llama):
    """`serve --policy pid` on an uncalibrated artifact under a load that breaks the SLO: the
    controller asks for the largest budget, the guard withholds every (unmeasured) lossy plan,
    each greedy completion is the full path's, and /metrics counts the withheld decisions."""
    policy = PIDPolicy(PIDConfig(setpoint=1e-6, period_s=0.0), max_budget=1.0)
    app = create_app(llama, ServeConfig(max_batch=4, policy=PolicyOptions(slo_ms=1e-3)), policy=policy)
    app.state.engine.controller.period_s = 0.0
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PROMPTS]
    responses, metrics = asyncio.run(_post_all(app, bodies))
    assert policy.decide(None).budget == 1.0   # the resource loop asked for everything
    assert [r.json()["choices"][0]["text"] for r in responses] == \
        [_greedy(llama, p, 16) for p in PROMPTS]
    assert all(r.json()["rbcompile"]["plan"]["budget"] == 0.0 for r in responses)
    withheld = app.state.engine.controller.quality_loop.withheld[UNMEASURED]
    assert withheld > 0 and app.state.engine.budget is None
    assert f'rbcompile_lossy_plans_withheld_total{{reason="unmeasured"}} {float(withheld)}' in metrics
    assert "rbcompile_quality_guard_max_loss 0.03" in metrics


def test_a_request_budget_over_the_guard_gets_the_guarded_plan_and_says_so(llama):
    app = create_app(llama, policy=StaticPolicy(0.0))
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "rbcompile": {"budget": 0.5}}
    (response,), _ = asyncio.run(_post_all(app, [body]))
    assert response.json()["rbcompile"]["plan"] == {
        "requested_budget": 0.5, "budget": 0.0, "quality_loss": 0.0, "withheld": UNMEASURED,
        "weights": "fp32", "prefill_weights": "fp32", "weights_quality_loss": 0.0,
        "max_quality_loss": 0.03}
    assert response.json()["choices"][0]["text"] == _greedy(llama, PROMPTS[0], 8)
    (streamed,), _ = asyncio.run(_post_all(app, [{**body, "stream": True}]))
    assert streamed.headers["x-rbcompile-budget"] == "0"
    assert streamed.headers["x-rbcompile-withheld"] == UNMEASURED


def test_a_controller_driven_to_its_maximum_runs_no_plan_over_the_guard(calibrated):
    """A calibrated artifact whose guard allows some plans and not others: PID at its largest
    budget runs only allowed plans, and every response reports a plan within the guard."""
    decoder_losses = {p.budget: p.decoder_quality_loss for p in calibrated.plans}
    limit = sorted(decoder_losses.values())[len(decoder_losses) // 2]
    calibrated.guard = QualityGuard(limit)
    try:
        allowed = lossy_budgets(calibrated.plans, calibrated.guard, DECODER)
        assert any(loss > limit for loss in decoder_losses.values())
        policy = PIDPolicy(PIDConfig(setpoint=1e-6, period_s=0.0), max_budget=1.0)
        app = create_app(calibrated, ServeConfig(max_batch=4, policy=PolicyOptions(slo_ms=1e-3)),
                         policy=policy)
        engine = app.state.engine
        engine.controller.period_s = 0.0
        ran, guarded = [], engine.gates_for_budget
        engine.gates_for_budget = lambda budget: ran.append(budget) or guarded(budget)
        bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in PROMPTS]
        responses, _ = asyncio.run(_post_all(app, bodies))
    finally:
        calibrated.guard = QualityGuard()
    assert {b for b in ran if b} <= set(allowed) and max(filter(None, ran), default=0) == max(allowed, default=0)
    for response in responses:
        plan = response.json()["rbcompile"]["plan"]
        assert plan["quality_loss"] <= limit and plan["budget"] in [0.0, *allowed]


def _corrupted_light_steps(compiled):
    """The decoder, its light steps made to pick another top-1 token than the full path."""
    decoder = compiled.decoder

    def step(*inputs, gates=None):
        logits = decoder(*inputs, gates=gates)
        if gates is not None and not all(gates):
            logits = logits.roll(1, dims=-1)
        return logits
    return step


def test_sampled_agreement_checks_withhold_a_plan_that_disagrees(llama):
    """The quality loop runs the full path beside sampled light steps; a plan made to disagree
    (injected) is withheld once its checks show it, and the engine goes back to the full path
    whatever the policy says."""
    llama.guard = QualityGuard(allow_unmeasured=True)
    try:
        engine = llama.batch_engine(max_batch=4)
        engine.step_fn = _corrupted_light_steps(llama)
        loop = QualityLoop(llama, QualityLoopConfig(check_every=2, window=16, min_checks=8))
        controller = DecodeController(engine, StaticPolicy(0.5), 0.1, memory=lambda: 0.5,
                                      period_s=0.0, quality_loop=loop)
        for prompt in ([5, 6, 7], [8, 9, 10, 11], [12, 13]):
            engine.submit(EngineRequest(prompt, 24))
        budgets, gates, guarded = [], [], engine.gates_for_budget
        engine.gates_for_budget = lambda budget: gates.append(guarded(budget)) or gates[-1]
        while engine.has_work:
            engine.step()
            budgets.append(engine.budget)
    finally:
        llama.guard = QualityGuard()
    assert budgets[0] == 0.5 and controller.decision.budget == 0.5
    assert gates[0] is None                                # an unverified plan prefills full
    assert any(g is not None and not all(g) for g in gates)   # its decode steps ran light
    assert gates[-1] is None or all(gates[-1])   # the decoder's full path again
    assert loop.checked_rows >= 8 and loop.agreed_rows == 0 and loop.agreement() == 0.0
    assert loop.ceiling < 0.5 and loop.withheld[OBSERVED] > 0


def test_an_unmeasured_plan_runs_the_full_path_until_its_checks_pass(llama):
    """A new unmeasured plan prefills on the full path, and each checked decode step's tokens
    and K/V are the full path's: with every step checked, the run is the full path's, token
    for token (its verdict, all the while, comes from the light forwards)."""
    llama.guard = QualityGuard(max_quality_loss=math.inf, allow_unmeasured=True)
    try:
        engine = llama.batch_engine(max_batch=2)
        loop = QualityLoop(llama, QualityLoopConfig(check_every=1, window=64, min_checks=64))
        DecodeController(engine, StaticPolicy(0.5), 0.1, memory=lambda: 0.5, period_s=0.0,
                         quality_loop=loop)
        request = engine.submit(EngineRequest([5, 6, 7, 8], 16))
        while engine.has_work:
            engine.step()
        assert loop.checked_rows == 15 and loop.ceiling == 1.0 and request.budget_run == 0.5
        assert loop.prefill_budget(0.5) is None    # 15 rows: not yet verified
        loop.checked(0.5, 64, 64)
        assert loop.prefill_budget(0.5) == 0.5
    finally:
        llama.guard = QualityGuard()
    assert request.tokens == llama.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=16).tokens[0]


def test_cli_run_says_when_the_guard_withholds_a_budget(llama, tmp_path, capsys):
    artifact = llama.save(tmp_path / "artifact")
    args = ["run", str(artifact), "--text", "the a of", "--max-new-tokens", "4", "--budget", "0.5"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "budget 0.5 withheld (its plan was never measured): ran the full path" in out.out
    assert "--allow-unmeasured-plans" in out.out and out.err == ""
    assert main(args + ["--allow-unmeasured-plans"]) == 0
    out = capsys.readouterr()
    assert "ran budget 0.5 (unmeasured)" in out.out
    assert out.err.count("warning: --allow-unmeasured-plans") == 1
    assert main(args + ["--max-quality-loss", "-1"]) == 2
    assert "--max-quality-loss must be >= 0" in capsys.readouterr().err
    assert main(["inspect", str(artifact), "--budget", "0.5"]) == 0
    assert "unmeasured: run and serve withhold it" in capsys.readouterr().out


def test_inspect_lists_each_plans_measured_losses(calibrated, tmp_path, capsys):
    assert main(["inspect", str(calibrated.save(tmp_path / "artifact"))]) == 0
    out = capsys.readouterr().out
    for plan in calibrated.plans[1:]:
        assert (f"plan {plan.budget:g}: skips {plan.skipped_share:.1%} of prunable FLOPs, "
                f"quality loss {plan.quality_loss:.3f}, decoder "
                f"{plan.decoder_quality_loss:.3f}") in out


def test_cli_serve_says_at_start_what_its_guard_allows(llama, tmp_path, monkeypatch, capsys):
    served = served_by_cli(monkeypatch)
    artifact = llama.save(tmp_path / "artifact")
    assert main(["serve", str(artifact), "--policy", "pid"]) == 0
    err = capsys.readouterr().err
    assert "quality guard: max quality loss 0.03; no lossy plan (uncalibrated" in err
    assert served["app"].state.engine.controller.policy.max_budget == 0.0
    assert main(["serve", str(artifact), "--quality-check-every", "-1"]) == 2
    assert main(["serve", str(artifact), "--allow-unmeasured-plans"]) == 0
    assert "any lossy budget (unmeasured)" in capsys.readouterr().err


def test_backend_withholds_an_unmeasured_budget_unless_allowed():
    from rbcompile.frontend import backend

    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    ids = torch.randint(3, 90, (1, 8))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
    for allow in (False, True):
        torch._dynamo.reset()
        backend.reset()
        compiled = torch.compile(model, backend="rbcompile", options={
            "budget": 0.5, "regions": "eager", "allow_unmeasured_plans": allow})
        with torch.no_grad():
            logits = compiled(ids, use_cache=False).logits
        skipped = max(graph.last_skipped for graph in backend.compiled_graphs())
        assert (skipped > 0) == allow
        assert torch.allclose(logits, reference, atol=1e-5) != allow
    assert backend.BackendOptions.parse({"allow_unmeasured_plans": True}).guard.allow_unmeasured
    with pytest.raises(ValueError, match="unknown rbcompile option"):
        backend.BackendOptions.parse({"max_quality_loss": 0.1})   # its plans are never measured


def test_a_plan_is_withheld_only_when_its_checks_are_confidently_over_the_guard():
    """The Wilson lower bound: 2 changed rows of 64 (3.1%) is noise around a 0.03 guard, 10 of
    64 is not."""
    assert changed_lower_bound(2, 64) < 0.03 < changed_lower_bound(10, 64)
    assert changed_lower_bound(0, 64) == 0.0 and changed_lower_bound(0, 0) == 0.0
    assert changed_lower_bound(64, 64) > 0.9


def test_a_plan_failed_live_is_withheld_from_requests_too(calibrated):
    """Once the live checks withhold a decoder plan, a request asking for it runs a lower plan
    with other gates and says why; the controller's decisions are clamped alike."""
    calibrated.guard = QualityGuard(0.5)   # over every plan's measured loss: all allowed
    try:
        app = create_app(calibrated, policy=StaticPolicy(0.0))
        loop = app.state.engine.controller.quality_loop
        top = max(p.budget for p in calibrated.plans)
        assert loop.plan(top).withheld is None
        loop.checked(top, 0, 64)                       # every checked row changed
        plan = loop.plan(top)
        assert plan.withheld == OBSERVED and plan.budget < top
        assert tuple(calibrated.decoder_gates(plan.budget) or ()) != \
            tuple(calibrated.decoder_gates(top))
        assert loop.clamp(top) == (plan.budget or None) and loop.withheld[OBSERVED] == 1
        body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
                "rbcompile": {"budget": top}}
        (response,), metrics = asyncio.run(_post_all(app, [body]))
    finally:
        calibrated.guard = QualityGuard()
    reported = response.json()["rbcompile"]["plan"]
    assert reported["withheld"] == OBSERVED and reported["budget"] == plan.budget
    assert f"rbcompile_quality_ceiling_budget {float(plan.budget)}" in metrics


def test_the_controller_times_light_steps_without_their_checks(llama):
    """A checked step's full-path forward is the check's cost, not the light plan's: the
    decode-step latency the policy sees leaves it out."""
    import time

    llama.guard = QualityGuard(math.inf, allow_unmeasured=True)
    try:
        engine = llama.batch_engine(max_batch=2)
        decoder = llama.decoder

        def slow_full_path(*inputs, gates=None):
            if gates is None and engine.running:
                time.sleep(0.2)
            return decoder(*inputs, gates=gates)
        engine.step_fn = slow_full_path
        loop = QualityLoop(llama, QualityLoopConfig(check_every=1, window=8, min_checks=8))
        controller = DecodeController(engine, StaticPolicy(0.5), 0.1, memory=lambda: 0.5,
                                      period_s=0.0, quality_loop=loop)
        engine.submit(EngineRequest([5, 6, 7, 8], 6))
        steps = []
        controller.steps.record = lambda seconds, **_: steps.append(seconds)
        while engine.has_work:
            engine.step()
    finally:
        llama.guard = QualityGuard()
    assert loop.checked_rows == 5 and len(steps) == 5 and max(steps) < 0.2


def test_a_new_plan_is_checked_every_step_until_it_has_its_rows(llama):
    llama.guard = QualityGuard(math.inf, allow_unmeasured=True)
    try:
        loop = QualityLoop(llama, QualityLoopConfig(check_every=3, window=8, min_checks=4))
        due = []
        for _ in range(8):
            due.append(loop.check_due(0.5))
            if due[-1]:
                loop.checked(0.5, 2, 2)
        assert due == [True, True, False, False, True, False, False, True]
        assert loop.check_due(0.2)          # another plan (other gates): a verdict of its own
    finally:
        llama.guard = QualityGuard()
