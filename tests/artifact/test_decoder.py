"""The artifact's KV-cached decoder: its graph (cache writes in the skeleton, MLPs prunable),
CompiledModel.generate equal to HF generate in every speculation mode after save / load
(calibrated and permuted weights included), budgets mapped onto the decoder's MLP gates."""
from pathlib import Path

import pytest
import torch

import rbcompile
from rbcompile.artifact.cache_pool import zeros
from rbcompile.errors import UserError
from rbcompile.runtime.engine.kv_cache import step_inputs

from shared import DECODER_PROMPTS, hf_new_tokens


@pytest.fixture(scope="module")
def saved(compiled_tiny, tmp_path_factory):
    """arch -> (the decoder artifact saved and loaded back, eager model)."""
    folder = tmp_path_factory.mktemp("decoders")
    return {arch: (rbcompile.load(compiled.save(folder / arch)), eager)
            for arch, (compiled, eager) in compiled_tiny.items() if arch != "bert"}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_graph_writes_the_cache_in_the_skeleton_and_gates_the_mlps(saved, arch):
    decoder = saved[arch][0].decoder
    regions = decoder.ir["regions"]
    prunable = [r for r in regions if r["kind"] == "prunable"]
    assert [r["unit_kind"] for r in prunable] == ["mlp"] * decoder.shape.layers
    if arch == "llama":   # 4 query heads on 2 K/V heads: read in place, the form per call
        assert decoder.source.count("grouped_attention(") == decoder.shape.layers
        assert "enable_gqa" not in decoder.source and "repeat" not in decoder.source
    writes = [(node[0], node[4]) for node in decoder.ir["nodes"] if node[1].endswith("index_copy_.default")]
    assert len(writes) == 2 * decoder.shape.layers
    assert {regions[region]["kind"] for _, region in writes} == {"skeleton"}
    assert decoder.ir["inputs"][:5] == ["input_ids", "attention_mask", "position_ids",
                                        "cache_position", "logit_positions"]


def _stacks(compiled) -> dict:
    """stacked key -> (the stack, its parts) of each module, as buffers."""
    from rbcompile.artifact.module import stacks

    found = {}
    for module in (compiled.module, compiled.decoder.module):
        by_key = {key: name for name, key in module.PARAMETERS.items()}
        for key, parts in stacks(module).items():
            found.setdefault(key, []).append(
                (module.get_buffer(by_key[key]), [module.get_buffer(by_key[p]) for p in parts]))
    return found


def test_projections_are_stacked_over_one_copy_of_the_weights(
        tiny_checkpoints, calib_file, calibrated_tiny, monkeypatch, tmp_path):
    """Compiled as on CUDA (`--kernels --stack-projections`), q / k / v and gate / up are one
    matmul each (4 per layer, not 7) in the decoder and in the main graph, calibrated (permuted
    weights, width levels): the main module's outputs at full and narrower widths are the
    unstacked artifact's, and the decoder still generates HF's tokens. The stacks are made at
    load from the parts the artifact stores; both modules hold the same stacks, and every part
    is a view of its stack (the weights are held once), also after `to(device)`."""
    from safetensors import safe_open

    from rbcompile.artifact.models import load_hf_model
    from rbcompile.frontend.cli import main

    path, folder = tiny_checkpoints["llama"], tmp_path / "artifact"
    assert main(["compile", str(path), "--calib", str(calib_file), "--calib-samples", "8",
                 "--calib-seq", "32", "--kernels", "--stack-projections", "-o", str(folder)]) == 0
    compiled = rbcompile.load(folder)
    ops = {node[1] for node in compiled.decoder.ir["nodes"]}
    assert "rbcompile.rotary_write_kv.default" in ops
    layers = compiled.decoder.shape.layers
    for ir, head in ((compiled.decoder.ir, 1), (compiled.ir, 1)):  # + the LM head
        assert sum(node[1] == "aten.linear.default" for node in ir["nodes"]) == 4 * layers + head
    stacks = _stacks(compiled)
    assert [key.rsplit(".", 1)[1] for key in stacks] == \
        ["q_proj_k_proj_v_proj_weight", "gate_proj_up_proj_weight"] * layers
    for held in stacks.values():
        (stack, _), _ = held
        assert len(held) == 2 and all(s is stack for s, _ in held)   # one stack for both modules
        for _, parts in held:
            assert all(part._base is stack for part in parts)
            assert torch.equal(torch.cat(parts), stack)
    with safe_open(str(folder / "weights.safetensors"), "pt") as stored:
        keys = set(stored.keys())
    held_keys = {*compiled.module.PARAMETERS.values(), *compiled.decoder.module.PARAMETERS.values()}
    assert keys == held_keys - set(stacks)
    unstacked = calibrated_tiny["llama"]
    ids = DECODER_PROMPTS.clamp_min(3)
    mask = (DECODER_PROMPTS != 0).long()
    gates = [gate % 2 == 0 for gate in range(compiled.num_gates)]
    for options in ({}, {"widths": [0.5] * compiled.num_gates}, {"gates": gates},
                    {"widths": [0.75] * compiled.num_gates}):
        want = unstacked(ids, mask, **options)["logits"]
        assert (compiled(ids, mask, **options)["logits"] - want).abs().max() <= 1e-5, options
    for speculate in ("off", "self"):
        assert compiled.generate(DECODER_PROMPTS, mask, max_new_tokens=10, speculate=speculate).tokens \
            == hf_new_tokens(load_hf_model(path), DECODER_PROMPTS, mask, 10)
    monkeypatch.setattr("rbcompile.artifact.compiled.parse_device", torch.device)  # "meta" as a device
    compiled.to("meta")
    for held in _stacks(compiled).values():
        for stack, parts in held:
            assert stack.device.type == "meta" and all(part._base is stack for part in parts)


def test_a_trace_that_writes_no_cache_is_refused(compiled_tiny, monkeypatch):
    """A transformers whose forward takes the cache by a name rbcompile does not pass would make
    a cache of its own and leave the given tensors unwritten: compile says so."""
    from rbcompile.artifact.architectures import lookup
    from rbcompile.compiler import trace
    from rbcompile.errors import CompileError

    eager = compiled_tiny["llama"][1]
    monkeypatch.setattr(trace, "cache_keyword", lambda model: "a_cache_nobody_reads")
    with pytest.raises(CompileError, match="writes 0 cache tensors in place, not 8"):
        trace.trace_cached(eager, lookup(eager.config), 32)


def _prefill(decoder, positions=torch.arange(7), gates=None):
    """The decoder's prefill of DECODER_PROMPTS on a fresh cache: (logits at `positions`, the cache)."""
    shape, mask = decoder.shape, (DECODER_PROMPTS != 0).long()
    cache = zeros(2 * shape.layers, (len(DECODER_PROMPTS), shape.kv_heads, 12, shape.head_dim),
                  shape.dtype, shape.device)
    return decoder(DECODER_PROMPTS, *step_inputs(7 - mask.sum(1), 0, 7, 12), positions, cache,
                   gates=gates), cache


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_projects_only_the_logit_positions_asked_for(saved, arch):
    """A prefill asks for its last position's logits only; they equal that row of the full
    logits, and the cache gets the same keys / values either way."""
    decoder = saved[arch][0].decoder
    outputs = {name: _prefill(decoder, positions)
               for name, positions in {"all": torch.arange(7), "last": torch.tensor([6]),
                                       "some": torch.tensor([4, 1])}.items()}
    full, full_cache = outputs["all"]
    assert outputs["last"][0].shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(outputs["last"][0], full[:, 6:], atol=1e-5, rtol=0)
    torch.testing.assert_close(outputs["some"][0], full[:, [4, 1]], atol=1e-5, rtol=0)
    for tensors in (outputs["last"][1], outputs["some"][1]):
        for written, reference in zip(tensors, full_cache, strict=True):
            torch.testing.assert_close(written[:, :, :7], reference[:, :, :7], atol=1e-6, rtol=0)


def test_a_decoder_with_another_step_convention_is_refused_at_load(saved, tmp_path):
    """An artifact whose decoder step takes other inputs (one built before logit_positions)
    is refused with a one-line error that says to compile it again."""
    import json

    from rbcompile.artifact.codegen import generate_source
    from rbcompile.artifact.manifest import MANIFEST, digests

    folder = Path(saved["llama"][0].save(tmp_path / "old"))
    graph = (folder / "decoder_graph.json").read_text().replace('"logit_positions"', '"kept_rows"')
    (folder / "decoder_graph.json").write_text(graph)
    (folder / "decoder.py").write_text(generate_source(json.loads(graph)))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["sha256"] = digests(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="decoder was built by an older rbcompile .* compile it again"):
        rbcompile.load(folder)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("speculate", ["off", "ngram", "self", "auto"])
def test_generate_equals_hf_generate_after_save_and_load(saved, arch, speculate):
    compiled, eager = saved[arch]
    mask = (DECODER_PROMPTS != 0).long()
    result = compiled.generate(DECODER_PROMPTS, mask, max_new_tokens=10, speculate=speculate)
    assert result.tokens == hf_new_tokens(eager, DECODER_PROMPTS, mask, 10)
    if speculate in ("ngram", "self"):
        assert set(result.stats.steps_by_mode) == {speculate}


def test_calibrated_decoder_uses_the_permuted_weights(calibrated_tiny, compiled_tiny):
    """Calibration permutes heads and channels; the decoder runs on those weights and still
    generates the unpermuted model's tokens."""
    compiled, eager = calibrated_tiny["llama"], compiled_tiny["llama"][1]
    mask = (DECODER_PROMPTS != 0).long()
    assert compiled.generate(DECODER_PROMPTS, mask, max_new_tokens=8).tokens == \
        hf_new_tokens(eager, DECODER_PROMPTS, mask, 8)


def test_budget_skips_the_plans_mlps_in_the_decoder(calibrated_tiny, tiny_checkpoints):
    """The decoder under a budget's gates is the model without that plan's MLPs: its logits
    equal eager transformers' with those MLPs returning zeros, and differ from the full path's;
    `generate(budget=)` gives that model's greedy tokens."""
    from rbcompile.artifact.models import load_hf_model

    compiled = calibrated_tiny["llama"]
    gates = compiled.gates_for_budget(0.5)
    decoder_gates = compiled.decoder.gates_from(compiled.regions, gates)
    skipped_mlps = {r["name"] for r in compiled.regions
                    if r["kind"] == "prunable" and r["unit_kind"] == "mlp" and not gates[r["gate"]]}
    assert skipped_mlps, "the 0.5 plan skips some MLP"
    assert {name for name, gate in compiled.decoder.unit_gates.items()
            if not decoder_gates[gate]} == skipped_mlps
    eager = load_hf_model(tiny_checkpoints["llama"])
    for name in skipped_mlps:
        eager.get_submodule(name).register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    mask = (DECODER_PROMPTS != 0).long()
    with torch.no_grad():
        reference = eager(input_ids=DECODER_PROMPTS, attention_mask=mask).logits
    light = _prefill(compiled.decoder, gates=decoder_gates)[0]
    valid = mask.bool()  # padded positions' logits are not defined alike
    torch.testing.assert_close(light[valid], reference[valid], atol=1e-5, rtol=0)
    assert (light - _prefill(compiled.decoder)[0]).abs().max() > 1e-3
    tokens = compiled.generate(DECODER_PROMPTS, max_new_tokens=6, budget=0.5).tokens
    assert tokens == hf_new_tokens(eager, DECODER_PROMPTS, mask, 6)


def test_encoders_have_no_decoder(compiled_tiny):
    compiled = compiled_tiny["bert"][0]
    assert compiled.decoder is None
    with pytest.raises(UserError, match="generate needs a decoder artifact"):
        compiled.generate(DECODER_PROMPTS, max_new_tokens=2)


def test_decode_steps_replay_one_graph_per_plan(compiled_tiny):
    """With (fake, CPU) CUDA graphs the decoder captures a decode step once per plan and
    replays it; the prefill, seen once, runs eagerly; the tokens do not change. Later
    generations take the same cache tensors from the pool, so they replay those graphs
    (the prefill too, from its second sight) instead of capturing their own."""
    from shared import FakeCapture

    compiled = compiled_tiny["llama"][0]
    expected = compiled.generate(DECODER_PROMPTS, max_new_tokens=8).tokens
    shorter = compiled.generate(DECODER_PROMPTS, max_new_tokens=5).tokens
    compiled.use_cuda_graphs(capture=FakeCapture())
    try:
        assert compiled.generate(DECODER_PROMPTS, max_new_tokens=8).tokens == expected
        stats = compiled.decoder.graphs.stats
        assert stats.captures == 1 and stats.replays == 6  # steps 2..8 of T = 1: one capture
        assert stats.eager_calls == 2                      # the prefill and the first step
        assert stats.repeats == 5        # the steps after the capture: known by identity
        assert compiled.generate(DECODER_PROMPTS, max_new_tokens=8).tokens == expected
        assert stats.captures == 2 and stats.replays == 6 + 8 and stats.eager_calls == 2
        assert stats.repeats == 5 + 6    # not the prefill, nor the first step after it
        assert compiled.generate(DECODER_PROMPTS, max_new_tokens=5).tokens == shorter  # same slots
        assert stats.captures == 2 and stats.replays == 14 + 5
        pool = compiled.decoder.cache_pool
        assert pool.taken == 3 and pool.reused == 2
    finally:
        compiled.use_cuda_graphs(False)
    assert compiled.decoder.graphs is None and compiled.decoder.cache_pool is None


def test_finished_rows_move_the_batch_to_smaller_buckets_under_cuda_graphs(compiled_tiny):
    """With (fake) CUDA graphs a batch decodes in power-of-two buckets: 3 prompts as 4 rows,
    and as rows finish the steps run the bucket of the rows left (the first rows of the same
    tensors, which come from the pool). So a generation that repeats the last one replays
    every step's graph; tokens are eager's, with and without drafts."""
    from shared import FakeCapture

    compiled = compiled_tiny["llama"][0]
    prompts = torch.cat([DECODER_PROMPTS, DECODER_PROMPTS[1:].flip(1)])
    own_eos, compiled.hf_config["eos_token_id"] = compiled.hf_config["eos_token_id"], None
    try:
        free = compiled.generate(prompts, max_new_tokens=10).tokens
        eos = next([a, b] for a in free[0][1:6] for b in free[1][1:6]   # rows end at 3 lengths
                   if len({_ended(row, [a, b]) for row in free}) == 3)
        compiled.hf_config["eos_token_id"] = eos
        expected = compiled.generate(prompts, max_new_tokens=10).tokens
        compiled.use_cuda_graphs(capture=FakeCapture())
        graphs, batches = compiled.decoder.graphs, []
        run = graphs.run

        def recorded(ids, *rest):
            batches.append(ids.shape[0])
            return run(ids, *rest)

        graphs.run = recorded
        for speculate in ("off", "off", "ngram", "off"):
            before = (graphs.stats.captures, graphs.stats.eager_calls)
            assert compiled.generate(prompts, max_new_tokens=10, speculate=speculate).tokens == expected
        assert (graphs.stats.captures, graphs.stats.eager_calls) == before   # all replayed
        assert set(batches) == {3, 4, 2, 1}     # the prefill: its 3 rows; decode steps: buckets
        assert compiled.decoder.cache_pool.reused >= 3   # the batch's set, generations 2-4
    finally:
        compiled.use_cuda_graphs(False)
        compiled.hf_config["eos_token_id"] = own_eos


def test_a_set_the_pool_drops_takes_its_graphs_along(compiled_tiny):
    """Under (fake) CUDA graphs, when the pool drops a K/V set (past its bound) the step graphs
    that read it are dropped too, so the set leaves memory; the tokens stay eager's."""
    import gc
    import weakref

    from shared import FakeCapture

    compiled = compiled_tiny["llama"][0]
    one, two = DECODER_PROMPTS[:1], DECODER_PROMPTS[:2]
    expected = compiled.generate(one, max_new_tokens=6).tokens
    capture = FakeCapture()
    compiled.use_cuda_graphs(capture=capture)
    try:
        pool, graphs = compiled.decoder.cache_pool, compiled.decoder.graphs
        pool.max_share = 1.0                 # one set waits at a time
        assert compiled.generate(one, max_new_tokens=6).tokens == expected
        first = [t for t in capture.captured[0] if isinstance(t, torch.Tensor) and t.dim() == 4]
        assert first and graphs.stats.captures >= 1
        held = weakref.ref(first[0])
        compiled.generate(two, max_new_tokens=6)   # its set goes back: the first set is dropped
        assert graphs.stats.released >= 1
        del first
        capture.captured.clear()
        gc.collect()
        assert held() is None
        assert compiled.generate(one, max_new_tokens=6).tokens == expected
    finally:
        compiled.use_cuda_graphs(False)


def test_a_stream_dropped_before_its_first_token_gives_its_cache_back(compiled_tiny):
    """The server makes a stream in one job and iterates it in later ones: a client gone
    before its first token drops a stream never started, and its pooled K/V set goes back."""
    from shared import FakeCapture

    compiled = compiled_tiny["llama"][0]
    compiled.use_cuda_graphs(capture=FakeCapture())
    try:
        pool = compiled.decoder.cache_pool
        compiled.generate(DECODER_PROMPTS, max_new_tokens=2)
        events = compiled.generate(DECODER_PROMPTS, max_new_tokens=2, stream=True)  # takes that set
        del events
        compiled.generate(DECODER_PROMPTS, max_new_tokens=2)
        assert pool.taken == 3 and pool.reused == 2
    finally:
        compiled.use_cuda_graphs(False)


def _ended(tokens: list[int], eos: list[int]) -> int:
    """How many tokens a row keeps when it ends at the first of `eos`."""
    return next((i + 1 for i, token in enumerate(tokens) if token in eos), len(tokens))


def test_cache_pool_hands_out_zeroed_sets_and_keeps_a_bounded_share():
    from rbcompile.artifact.cache_pool import CachePool

    dropped = []
    pool = CachePool(max_share=1.5, on_drop=dropped.append)
    four = pool.take(2, (4, 1, 8, 2), torch.float32, "cpu")
    for tensor in four:
        tensor.fill_(7.0)
    pool.give_back(four)
    again, other = pool.take(2, (4, 1, 8, 2), torch.float32, "cpu"), \
        pool.take(2, (4, 1, 8, 2), torch.float32, "cpu")   # the waiting set, zeroed; a new one
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in four]
    assert all((t == 0).all() for t in again)
    assert other[0].data_ptr() not in {t.data_ptr() for t in four}
    one = pool.take(2, (1, 1, 8, 2), torch.float32, "cpu")   # another shape: its own set
    assert pool.taken == 4 and pool.reused == 1
    pool.give_back(one)
    pool.give_back(other)
    pool.give_back(again)   # 1 + 4 + 4 rows' bytes: over 1.5 times a 4-row set's, the oldest go
    assert [id(tensors) for tensors in dropped] == [id(one), id(other)]
    assert pool.take(2, (4, 1, 8, 2), torch.float32, "cpu")[0].data_ptr() == four[0].data_ptr()


def test_calibration_chooses_the_draft_plan_by_acceptance_and_cost(calibrated_tiny, tmp_path):
    compiled = calibrated_tiny["llama"]
    draft = compiled.decoder.draft
    budgets = {plan.budget for plan in compiled.plans if plan.budget > 0}
    assert draft["candidates"] and {c["budget"] for c in draft["candidates"]} <= budgets
    for candidate in draft["candidates"]:
        assert 0 <= candidate["acceptance"] <= 1 and candidate["tokens_per_step"] >= 1
    best = max(draft["candidates"], key=lambda c: c["modelled_speedup"])
    if draft["budget"] is None:
        assert best["modelled_speedup"] <= 1
    else:
        assert draft["budget"] == best["budget"] and best["modelled_speedup"] > 1
    assert rbcompile.load(compiled.save(tmp_path / "calibrated")).decoder.draft == draft
