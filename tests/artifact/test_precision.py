"""Artifacts in bf16 / fp16: traced in that dtype, parity with eager in the same dtype, kept
through save / load; the dtype rule and device plumbing; torch.compile graphs in half precision
and with dynamo's unspecialised floats (`dynamic=True`) are compiled, not fallen back."""
import pytest
import torch

import rbcompile
from rbcompile import UserError
from rbcompile.artifact.placement import TOLERANCE, parse_device, parse_dtype, within_tolerance
from rbcompile.frontend import backend

from conftest import make_tiny_model, random_batch

HALF = [torch.bfloat16, torch.float16]


def _inputs(batch=2, seq=11):
    return random_batch(batch, seq, seed=3)


def _first(output):
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_half_artifact_matches_eager_in_its_dtype(arch, dtype, tmp_path):
    eager = make_tiny_model(arch).to(dtype)
    compiled = rbcompile.compile(make_tiny_model(arch), dtype=dtype)
    assert compiled.dtype == dtype and compiled.manifest["architecture"]["dtype"] == str(dtype)[6:]
    ids, mask = _inputs()
    expected = _first(eager(input_ids=ids, attention_mask=mask))
    got = compiled(ids, mask)[compiled.output_names[0]]
    assert got.dtype == dtype
    ok, diff = within_tolerance(got, expected)
    assert ok and diff <= 1e-2, diff
    compiled.save(tmp_path / "art")
    loaded = rbcompile.load(tmp_path / "art", device="cpu", dtype=dtype)
    assert torch.equal(loaded(ids, mask)[compiled.output_names[0]], got)


def test_an_encoder_calibrates_with_a_task_head_in_bf16(tiny_checkpoints, tmp_path):
    """A task head read in fp32 scores a bf16 encoder's pooled stream in fp32: calibration
    chooses plans and trains off-ramps (it stopped at a bf16 x fp32 matmul), and the loaded
    artifact classifies with early exit."""
    from safetensors.torch import save_file

    from rbcompile.runtime.control.early_exit import run_with_exits

    from conftest import labelled_words

    save_file({"weight": torch.randn(2, 32), "bias": torch.zeros(2)}, str(tmp_path / "head.st"))
    labelled_words(tmp_path / "labelled.jsonl")
    compiled = rbcompile.compile(tiny_checkpoints["bert"], calib=tmp_path / "labelled.jsonl",
                                 calib_samples=40, calib_seq=16, calib_head=tmp_path / "head.st",
                                 dtype="bf16")
    assert compiled.dtype == torch.bfloat16 and compiled.plans and compiled.offramps is not None
    loaded = rbcompile.load(compiled.save(tmp_path / "art"))
    result = run_with_exits(loaded, loaded.offramps, *_inputs())
    assert result.logits.dtype == torch.float32 and torch.isfinite(result.logits).all()


def test_devices_that_do_not_exist_here_are_refused():
    for device in ("cpu:1", "gpu0", "meta"):
        with pytest.raises(UserError, match="device"):
            parse_device(device)
    assert parse_device("cpu:0") == torch.device("cpu:0")


def test_dtype_rule_and_names(tmp_path):
    compiled = rbcompile.compile(make_tiny_model("llama"))
    assert compiled.dtype == torch.float32
    with pytest.raises(UserError, match="compiled in float32; to run in float16 compile it with "
                                        "--dtype fp16"):
        compiled.to(dtype="fp16")
    compiled.save(tmp_path / "art")
    with pytest.raises(UserError, match="compile it with --dtype bf16"):
        rbcompile.load(tmp_path / "art", dtype=torch.bfloat16)
    assert compiled.to("cpu", "fp32") is compiled
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float16") is torch.float16
    with pytest.raises(UserError, match="unknown dtype 'int4'"):
        parse_dtype("int4")
    with pytest.raises(UserError, match="unknown device"):
        parse_device("gpu0")
    assert TOLERANCE[torch.float32] == (0.0, 1e-5)  # the project's fp32 parity rule


def test_to_keeps_width_views_as_views():
    from conftest import make_tiny_model as make
    compiled = rbcompile.compile(make("llama"))
    module = compiled.module
    compiled.to("cpu")  # same device: nothing moves
    for name, (key, axis, length) in module.PARAMETER_VIEWS.items():
        assert getattr(module, name).untyped_storage().data_ptr() == \
            module.get_buffer(next(n for n, k in module.PARAMETERS.items() if k == key)) \
            .untyped_storage().data_ptr()


def test_inputs_follow_the_model_device():
    compiled = rbcompile.compile(make_tiny_model("bert"))
    ids, mask = _inputs()
    out = compiled(ids.int(), mask.to(torch.int32))  # int32 inputs are converted too
    assert out["last_hidden_state"].device == compiled.device


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    backend.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("arch, dtype, dynamic", [
    *[("llama", dtype, dynamic) for dtype in (torch.bfloat16, torch.float32)
      for dynamic in (None, True)],
    *[("gpt2", dtype, True) for dtype in (torch.bfloat16, torch.float32)],  # its fallback's case
], ids=lambda v: "dynamic" if v is True else "static" if v is None else str(v))
def test_backend_kv_cache_graphs_in_half_and_dynamic_are_compiled(fresh_dynamo, arch, dtype,
                                                                   dynamic):
    """Dynamo passes an RMSNorm's eps and the rotary scaling (Llama), and `math.pi` in the
    tanh GELU (GPT-2: a constant chain shared by every layer's MLP) as 0-dim inputs under
    dynamic=True; aot_autograd's decompositions of them carry no module path. All are handled:
    the graphs go to rbcompile (strict: no fallback) and generate() gives eager's tokens."""
    model = make_tiny_model(arch).to(dtype)
    ids, mask = _inputs(2, 7)
    settings = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True)
    expected = model.generate(ids, **settings)
    model.forward = torch.compile(model.forward, backend="rbcompile", dynamic=dynamic,
                                  options={"strict": True, "regions": "eager"})
    got = model.generate(ids, **settings)
    assert torch.equal(expected, got)
    graphs = backend.compiled_graphs()
    assert graphs and all(g.handled_by == "rbcompile" and g.num_gates > 0 for g in graphs)
    summaries = [h["summary"] for g in graphs for h in g.passes if h["pass"] == "canonicalize"]
    if dynamic and arch == "llama":
        assert any("module paths inherited" in s for s in summaries)
