"""Rows at a weight level of their own (runtime/engine/weight_levels.py): a forward runs the
level its rows ask, the most precise one when they differ; votes decode at their tier's level
(`VoteOptions.tier_weights`), with the tokens of the decoder at that level, within the guard."""
import pytest
from shared import DECODER_PROMPTS, int4_measured

from rbcompile.artifact.guard import QualityGuard
from rbcompile.errors import UserError
from rbcompile.runtime.engine.consistency import VoteOptions
from rbcompile.runtime.engine.requests import EngineRequest
from rbcompile.runtime.engine.vote_sampling import tier_levels
from rbcompile.runtime.engine.weight_levels import WeightLevel, WeightLevels


def test_a_forward_runs_the_level_its_rows_ask_or_the_most_precise_one():
    own, int8, int4 = object(), object(), object()
    found = {"int8": WeightLevel("int8", int8, 0.01), "int4": WeightLevel("int4", int4, 0.04)}

    def find(name):
        if name not in found:
            raise UserError(f"{name} weights were never measured")
        return found[name]
    levels = WeightLevels(WeightLevel("fp32", None, 0.0), find)
    for name in ("int4", "int8", None, "fp32"):
        levels.check(name)
    rows = [EngineRequest([1], 4, weights="int4"), EngineRequest([1], 4, weights="int4")]
    assert levels.step_for(rows, own) is int4
    rows[1].weights = "int8"
    assert levels.step_for(rows, own) is int8
    rows[1].weights = None                                # None: the engine's own level
    assert levels.step_for(rows, own) is own
    assert levels.step_for(rows, own, fallback="int8") is int8   # a controller's level
    assert [row.weights_run for row in rows] == ["int4", "int4"]  # the least precise run
    assert levels.level_for(["int8", "fp32"]).name == "fp32"
    with pytest.raises(UserError, match="int3 weights were never measured"):
        levels.check("int3")
    with pytest.raises(UserError, match="int4 weights per request need the onnxruntime"):
        WeightLevels(WeightLevel("fp32", None, 0.0)).check("int4")


@pytest.fixture(scope="module")
def measured(tiny_checkpoints):
    return int4_measured(tiny_checkpoints["llama"])


def _spy(model) -> list:
    """The precision of each step the executor runs from now on (None: fp32)."""
    executor, ran = model.decoder.executor, []
    run = type(executor).run.__get__(executor)

    def spied(*args, **kwargs):
        ran.append(bool(kwargs.get("precision", args[7] if len(args) > 7 else None)))
        return run(*args, **kwargs)
    executor.run = spied
    return ran


def _greedy(model, **generate):
    ids = DECODER_PROMPTS[:1, 1:]
    return model.generate(ids, max_new_tokens=6, consistency=1, **generate)


def test_a_vote_decodes_at_its_tiers_level_with_that_levels_tokens(measured):
    model = measured
    try:
        model.use_executor("onnxruntime", "int4")
        at_int4 = _greedy(model).samples[0].tokens
        model.use_executor("onnxruntime")
        at_fp32 = _greedy(model).samples[0].tokens
        ran = _spy(model)
        result = _greedy(model, vote=VoteOptions(tier_weights={1: "int4", 3: "fp32"}))
        assert result.samples[0].tokens == at_int4 and result.stats.weights == "int4"
        assert ran[1:] and all(ran[1:])    # the prefill before the decode steps
        if at_int4 != at_fp32:             # a test that can tell the levels apart
            assert result.samples[0].tokens != at_fp32
        engine = model.batch_engine(max_batch=4)
        assert tier_levels(model, engine, "auto") == {1: "int4"}   # 3, 7 rows: not faster
        model.guard = QualityGuard(0.0)
        with pytest.raises(UserError, match="int4 weights cost quality loss"):
            _greedy(model, vote=VoteOptions(tier_weights={1: "int4"}))
        assert tier_levels(model, model.batch_engine(max_batch=4), "auto") == {}
    finally:
        model.guard = QualityGuard(10.0)
        model.use_executor("torch")
    with pytest.raises(UserError, match="int4 weights need the onnxruntime executor"):
        _greedy(model, vote=VoteOptions(tier_weights={1: "int4"}))


def test_rows_asking_different_levels_run_the_most_precise_until_it_leaves(measured):
    """An int4 row beside a row at the decoder's fp32 runs fp32 steps; once that row has
    finished, its steps run int4."""
    model = measured
    try:
        model.use_executor("onnxruntime")
        engine = model.batch_engine(max_batch=4)
        prompt = DECODER_PROMPTS[1].tolist()
        ran = _spy(model)
        rows = engine.submit_samples([EngineRequest(prompt, 8, weights="int4"),
                                      EngineRequest(prompt, 3)])
        while engine.has_work:
            engine.step()
        decode = ran[1:]
        assert [len(row.tokens) for row in rows] == [8, 3], [r.finish_reason for r in rows]
        assert decode == [False] * 2 + [True] * 5
    finally:
        model.use_executor("torch")


def test_tier_weights_are_checked_when_given():
    with pytest.raises(UserError, match="tier_weights must be 'auto' or map samples"):
        VoteOptions(tier_weights={2: "int4"})
    with pytest.raises(UserError, match="tier_weights must be 'auto' or map samples"):
        VoteOptions(tier_weights="int4")
    assert VoteOptions(tier_weights={1: "int4"}).tier_weights == {1: "int4"}


def test_cached_prompt_kv_of_one_level_is_not_another_levels(measured):
    """The prefix cache keys K/V by the level that wrote them: a prompt prefilled in int4 is
    reused by an int4 request, never by one at the decoder's fp32."""
    from rbcompile.runtime.engine.prefix_cache import PrefixCache

    model = measured
    try:
        model.use_executor("onnxruntime")
        engine = model.batch_engine(max_batch=2, prefix_cache=PrefixCache())
        prompt = list(range(5, 40))
        reused = []
        for weights in ("int4", None, "int4"):
            before = engine.stats.reused_prompt_tokens
            engine.submit(EngineRequest(prompt, 2, weights=weights))
            while engine.has_work:
                engine.step()
            reused.append(engine.stats.reused_prompt_tokens - before)
        assert reused[0] == 0 and reused[1] == 0 and reused[2] > 0
    finally:
        model.use_executor("torch")
