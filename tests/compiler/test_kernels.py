"""The fused kernels: each Triton launcher against its PyTorch reference (odd shapes, fp32 /
bf16 / fp16), the ops under torch.export and torch.compile, their fake implementations, gated
residual rows, head-sliced attention without copies.

Without a GPU the launchers run on CPU tensors in Triton's interpreter (conftest sets
TRITON_INTERPRET=1 before triton is imported); with `TRITON_INTERPRET=0` and CUDA present
(benchmarks/gpu_check.sh) the same tests run the compiled kernels on the GPU, and the ops'
CUDA dispatch is checked to be the Triton launcher.
"""
import os
import subprocess
import sys

import pytest
import torch

from rbcompile.kernels import (
    OPS,
    REFERENCES,
    _triton,
    configs,
    gated_residual,
    gelu,
    layer_norm,
    rms_norm,
    rotary,
    rotary_write_kv,
    swiglu,
    write_kv,
)

needs_triton = pytest.mark.skipif(not _triton.AVAILABLE, reason="triton not installed")
if _triton.AVAILABLE and not _triton.interpreting() and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() and not _triton.interpreting() else "cpu"
SHAPES = [(5, 123), (3, 37, 576), (1, 1, 64), (7, 4096)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def rand(shape, dtype, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(device=DEVICE, dtype=dtype)


def close(actual, expected, dtype):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        actual.shape, actual.dtype, expected.shape, expected.dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def cases(shape, dtype):
    """(label, op name, triton launcher, reference, args) for every kernel at `shape` / `dtype`."""
    n = shape[-1]
    x, other = rand(shape, dtype, 0, 2.0), rand(shape, dtype, 1)
    weight, bias = rand(n, dtype, 2), rand(n, dtype, 3)
    row_gate = (torch.arange(shape[0], device=DEVICE) % 2).to(dtype)
    scalar_gate = torch.tensor(0.7, device=DEVICE)
    return [
        ("rms_norm", "rms_norm", rms_norm.rms_norm_triton, rms_norm.rms_norm_reference,
         (x, weight, 1e-6)),
        ("add_rms_norm", "add_rms_norm", rms_norm.add_rms_norm_triton,
         rms_norm.add_rms_norm_reference, (x, other, weight, 1e-6)),
        ("layer_norm", "layer_norm", layer_norm.layer_norm_triton, layer_norm.layer_norm_reference,
         (x, weight, bias, 1e-5)),
        ("add_layer_norm", "add_layer_norm", layer_norm.add_layer_norm_triton,
         layer_norm.add_layer_norm_reference, (x, other, weight, bias, 1e-5)),
        ("swiglu", "swiglu", swiglu.swiglu_triton, swiglu.swiglu_reference, (x, other)),
        ("gelu_erf_bias", "gelu_bias", gelu.gelu_bias_triton, gelu.gelu_bias_reference,
         (x, bias, "none")),
        ("gelu_tanh_bias", "gelu_bias", gelu.gelu_bias_triton, gelu.gelu_bias_reference,
         (x, bias, "tanh")),
        ("gelu_tanh", "gelu_bias", gelu.gelu_bias_triton, gelu.gelu_bias_reference,
         (x, None, "tanh")),
        ("gated_residual_scalar", "gated_residual", gated_residual.gated_residual_triton,
         gated_residual.gated_residual_reference, (x, other, scalar_gate)),
        ("gated_residual_rows", "gated_residual", gated_residual.gated_residual_triton,
         gated_residual.gated_residual_reference, (x, other, row_gate)),
    ]


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_reference(shape, dtype):
    for name, _, launcher, reference, args in cases(shape, dtype):
        for actual, expected in zip(as_tuple(launcher(*args)), as_tuple(reference(*args)),
                                    strict=True):
            try:
                close(actual, expected, dtype)
            except AssertionError as error:
                raise AssertionError(f"{name}: {error}") from None


ROTARY_SHAPES = [(1, 9, 1, 64), (2, 3, 37, 64), (3, 4, 5, 6), (1, 2, 7, 128)]  # [B, H, T, D]


def _matches_with_layout(got, want, dtype, label: str) -> None:
    """`got` close to the reference's `want`, in its layout (what inductor asserts of a custom
    op's output) on the dimensions where strides mean something; failures name `label`."""
    try:
        close(got, want, dtype)
        assert [st for n, st in zip(got.shape, got.stride()) if n > 1] == [
            st for n, st in zip(want.shape, want.stride()) if n > 1], (got.stride(), want.stride())
    except AssertionError as error:
        raise AssertionError(f"{label}: {error}") from None


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rotary_matches_reference(shape, dtype):
    """q / k as attention makes them (the projection's [B, T, H, D] transposed), cos / sin per
    batch row or shared; a contiguous input; a partial rotary's slice of a wider head."""
    batch, heads, tokens, width = shape
    transposed = rand((batch, tokens, heads, width), dtype, 0).transpose(1, 2)
    partial = rand((batch, tokens, heads, width + 6), dtype, 3).transpose(1, 2)[..., :width]
    for label, x, angle_rows in (("transposed", transposed, batch),
                                 ("contiguous", transposed.contiguous(), 1),
                                 ("partial", partial, batch)):
        cos = rand((angle_rows, 1, tokens, width), dtype, 1)
        sin = rand((angle_rows, 1, tokens, width), dtype, 2)
        _matches_with_layout(rotary.rotary_triton(x, cos, sin),
                             rotary.rotary_reference(x, cos, sin), dtype, label)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rotary_pair_matches_reference(shape, dtype):
    """q and k in one launch, as attention makes them (transposed projections): k with fewer
    heads (GQA) and with more; each output as the reference's, in its layout."""
    batch, heads, tokens, width = shape
    q = rand((batch, tokens, heads, width), dtype, 0).transpose(1, 2)
    cos = rand((batch, 1, tokens, width), dtype, 1)
    sin = rand((1, 1, tokens, width), dtype, 2)
    for k_heads in (max(1, heads // 3), heads + 2):
        k = rand((batch, tokens, k_heads, width), dtype, 3).transpose(1, 2)
        got = rotary.rotary_pair_triton(q, k, cos, sin)
        for label, g, w in zip("qk", got, rotary.rotary_pair_reference(q, k, cos, sin)):
            _matches_with_layout(g, w, dtype, f"{label} with {k_heads} k heads")


@needs_triton
def test_rotary_pair_takes_the_reference_where_the_kernel_does_not_apply():
    q, k, cos, sin = (rand((2, 3, 4, 8), torch.float32, seed) for seed in range(4))
    for args in ((q, k, cos, sin),                                # cos / sin per head
                 (q, k[..., :6], cos[:, :1, :, :1], sin[:, :1, :, :1]),  # another head dim
                 (q, k[:1], cos[:, :1], sin[:, :1]),              # another batch
                 (q[0], k[0], cos[0, :1], sin[0, :1])):           # 3-D
        for got, want in zip(rotary.rotary_pair_triton(*args),
                             rotary.rotary_pair_reference(*args), strict=True):
            assert torch.equal(got, want)


@needs_triton
def test_rotary_takes_the_reference_where_the_kernel_does_not_apply():
    x4, cos, sin = (rand((2, 3, 4, 8), torch.float32, seed) for seed in range(3))
    for args in ((x4[..., :7], cos[..., :7], sin[..., :7]),   # odd head dimension
                 (x4[0], cos[0], sin[0]),                      # 3-D
                 (x4[:, :1], cos, sin),                        # cos / sin widen x
                 (x4.bfloat16(), cos[0, 0, 0, 0], sin[0, 0, 0, 0]),  # 0-dim angles: bf16 out
                 (x4.double(), cos.double(), sin.double())):   # a dtype the kernel lacks
        assert torch.equal(rotary.rotary_triton(*args), rotary.rotary_reference(*args))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_write_kv_matches_reference(shape, dtype):
    """k / v as attention makes them (transposed projections; k a rotary's contiguous output)
    into caches of more slots, at slots in any order: the caches equal the reference's."""
    batch, heads, tokens, width = shape
    slots = tokens + 5
    k = rand((batch, heads, tokens, width), dtype, 0)
    v = rand((batch, tokens, heads, width), dtype, 1).transpose(1, 2)
    positions = torch.randperm(slots, generator=torch.Generator().manual_seed(2))[:tokens]
    caches = [rand((batch, heads, slots, width), dtype, seed) for seed in (3, 4)]
    want = [cache.clone() for cache in caches]
    write_kv.write_kv_triton(*caches, positions.to(DEVICE), k, v)
    write_kv.write_kv_reference(*want, positions.to(DEVICE), k, v)
    for got, expected in zip(caches, want, strict=True):
        assert torch.equal(got, expected)


@needs_triton
def test_write_kv_takes_the_reference_where_the_kernel_does_not_apply():
    k, v = (rand((2, 3, 4, 8), torch.float32, seed) for seed in range(2))
    positions = torch.tensor([5, 1, 2, 0], device=DEVICE)
    for args in ((k, v[..., :6], positions),           # k and v of other shapes
                 (k[0], v[0], positions),              # 3-D
                 (k, v, positions.double())):          # positions not integers
        caches = [rand((2, 3, 6, 8), torch.float32, seed) for seed in (3, 4)]
        want = [cache.clone() for cache in caches]
        try:
            write_kv.write_kv_reference(*want, args[2], *args[:2])
        except (RuntimeError, IndexError) as error:  # the reference refuses it: so must it
            with pytest.raises(type(error)):
                write_kv.write_kv_triton(*caches, args[2], *args[:2])
            continue
        write_kv.write_kv_triton(*caches, args[2], *args[:2])
        assert all(torch.equal(got, expected) for got, expected in zip(caches, want))


def _step_tensors(shape, dtype, k_heads):
    """A layer's step as attention makes it: q / k / v transposed projections ([B, H, T, D]
    views), cos per batch row, sin shared, two caches of more slots, slots in any order."""
    batch, heads, tokens, width = shape
    q = rand((batch, tokens, heads, width), dtype, 0).transpose(1, 2)
    k, v = (rand((batch, tokens, k_heads, width), dtype, seed).transpose(1, 2) for seed in (1, 2))
    cos, sin = rand((batch, 1, tokens, width), dtype, 3), rand((1, 1, tokens, width), dtype, 4)
    slots = tokens + 5
    positions = torch.randperm(slots, generator=torch.Generator().manual_seed(5))[:tokens]
    caches = [rand((batch, k_heads, slots, width), dtype, seed) for seed in (6, 7)]
    return caches, positions.to(DEVICE), q, k, v, cos, sin


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rotary_write_kv_matches_reference(shape, dtype):
    """q rotated, k rotated into its cache slots and v copied into its own, in one launch: the
    rotated q in the reference's layout, the key cache close to the reference's (the rotation
    rounds once), the value cache equal, for k / v with fewer heads than q (GQA) and more."""
    for k_heads in (max(1, shape[1] // 3), shape[1] + 2):
        caches, positions, *rest = _step_tensors(shape, dtype, k_heads)
        want = [cache.clone() for cache in caches]
        got_q = rotary_write_kv.rotary_write_kv_triton(*caches, positions, *rest)
        want_q = rotary_write_kv.rotary_write_kv_reference(*want, positions, *rest)
        label = f"{k_heads} k heads"
        _matches_with_layout(got_q, want_q, dtype, f"q with {label}")
        close(caches[0], want[0], dtype)
        assert torch.equal(caches[1], want[1]), label


@needs_triton
def test_rotary_write_kv_takes_the_references_where_the_kernel_does_not_apply():
    """Where `rotary_pair` or `write_kv` would not launch, or the rotated k's dtype is not the
    key cache's, both references run (and refuse what they refuse)."""
    caches, positions, q, k, v, cos, sin = _step_tensors((2, 3, 4, 8), torch.float32, 3)
    for args in ((positions, q, k, v, cos.expand(-1, 3, -1, -1), sin),  # cos per head
                 (positions, q, k, v[..., :6], cos, sin),                 # v of another shape
                 (positions.double(), q, k, v, cos, sin),                 # positions not integers
                 (positions, q, k, v, cos.double(), sin.double())):      # a float64 rotated k
        got, want = [c.clone() for c in caches], [c.clone() for c in caches]
        try:
            expected = rotary_write_kv.rotary_write_kv_reference(*want, *args)
        except (RuntimeError, IndexError) as error:  # the reference refuses it: so must it
            with pytest.raises(type(error)):
                rotary_write_kv.rotary_write_kv_triton(*got, *args)
            continue
        assert torch.equal(rotary_write_kv.rotary_write_kv_triton(*got, *args), expected)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


TABLE_WIDTHS = [384, 576, 768, 2048, 4096, 1000]  # the table's, and one the heuristic serves


@needs_triton
@pytest.mark.parametrize("width", TABLE_WIDTHS)
def test_gpu_configs_match_reference(width, monkeypatch):
    """Every kernel with the launch config the GPU takes at `width` (table or heuristic), run
    here in the interpreter: column tiles that divide the width, rows per program. 9 rows:
    several programs, a partial last one; MIN_PROGRAMS=1 keeps the configured rows."""
    monkeypatch.setattr(configs, "MIN_PROGRAMS", 1)
    for label, name, launcher, reference, args in cases((9, width), torch.bfloat16):
        with configs.override(configs.config(name, width)):
            actual = launcher(*args)
        for got, want in zip(as_tuple(actual), as_tuple(reference(*args)), strict=True):
            try:
                close(got, want, torch.bfloat16)
            except AssertionError as error:
                raise AssertionError(f"{label} {configs.config(name, width)}: {error}") from None


def is_pow2(n):
    return n >= 1 and n & (n - 1) == 0


def test_config_lookup(monkeypatch):
    """The table covers every kernel at the tuned widths; the GPU lookups give power-of-two
    blocks that cover odd widths and row counts, column tiles that divide the tuned widths."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # lookups only: the GPU's configs
    for kernel in configs.NORMS + configs.ELEMENTWISE:
        assert set(configs.TABLE[kernel]) >= {"384", "576", "768", "2048", "4096"}, kernel
        for config in configs.TABLE[kernel].values():
            keys = {"rows", "warps"} if kernel in configs.NORMS else {"block", "warps"}
            assert set(config) == keys and all(map(is_pow2, config.values())), (kernel, config)
    for width in (1, 3, 37, 123, 576, 1000, 4095, 5000, 65536):
        for n_rows in (1, 7, 8, 4096, 100_003):
            for kernel in configs.NORMS:
                block_rows, block_n, warps, grid = configs.blocks(kernel, n_rows, width)
                assert all(map(is_pow2, (block_rows, block_n, warps))), (kernel, width, n_rows)
                assert block_n >= width and grid[0] * block_rows >= n_rows and warps <= 32
            for kernel in configs.ELEMENTWISE:
                block_rows, block_n, warps, grid = configs.tiles(kernel, n_rows, width)
                assert all(map(is_pow2, (block_rows, block_n, warps))), (kernel, width, n_rows)
                assert block_n <= configs.MAX_TILE_N and warps <= 32
                assert grid[0] == -(-n_rows // block_rows) * -(-width // block_n)
    assert configs.tiles("swiglu", 4096, 576)[1] == 64  # no padded lanes at the bundled widths
    assert configs.tiles("swiglu", 4096, 384)[1] == 128
    assert configs.blocks("rms_norm", 8, 576)[0] == 1  # decode: one row per program
    with pytest.raises(ValueError):
        configs.blocks("rms_norm", 1, configs.MAX_HIDDEN + 1)


@needs_triton
def test_non_contiguous_and_mixed_dtypes():
    base = rand((6, 96, 4), torch.float32, 0)
    x = base.transpose(1, 2)  # [6, 4, 96], last dimension strided
    other = rand((6, 4, 96), torch.float32, 1)[:, :, ::1]
    weight = rand(96, torch.float32, 2)
    assert not x.is_contiguous()
    close(rms_norm.rms_norm_triton(x, weight, 1e-6), rms_norm.rms_norm_reference(x, weight, 1e-6),
          torch.float32)
    close(swiglu.swiglu_triton(x, other), swiglu.swiglu_reference(x, other), torch.float32)
    rows = rand((8, 200), torch.float32, 3)[:, 50:146]  # row stride 200 > hidden 96
    close(layer_norm.layer_norm_triton(rows, weight, weight, 1e-5),
          layer_norm.layer_norm_reference(rows, weight, weight, 1e-5), torch.float32)
    # bf16 activations with an fp32 weight: the reference promotes to fp32, so must the kernel
    xb = x.to(torch.bfloat16)
    close(rms_norm.rms_norm_triton(xb, weight, 1e-6), rms_norm.rms_norm_reference(xb, weight, 1e-6),
          torch.bfloat16)


@needs_triton
def test_cuda_dispatch_registered_and_used():
    for name in sorted(ALL_OP_NAMES):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rbcompile::{name}", "CUDA"), name
    if DEVICE != "cuda":
        return
    for label, name, launcher, _, args in cases((3, 37, 576), torch.bfloat16):
        op = getattr(OPS, name)
        for actual, expected in zip(as_tuple(op(*args)), as_tuple(launcher(*args)), strict=True):
            assert torch.equal(actual, expected), label


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import torch; import rbcompile.kernels as k;"
            "from rbcompile.kernels import _triton;"
            "assert not _triton.AVAILABLE;"
            "assert not torch._C._dispatch_has_kernel_for_dispatch_key('rbcompile::rms_norm', 'CUDA');"
            "x = torch.randn(2, 8); print(k.OPS.rms_norm(x, torch.ones(8), 1e-6).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([2, 8])" in out.stdout


class AllOps(torch.nn.Module):
    """Every op once, chained the way a block would use them."""

    def __init__(self, hidden=32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(hidden))
        self.b = torch.nn.Parameter(torch.randn(hidden))
        angles = torch.arange(hidden) / hidden
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x, residual, gate):
        return self.run(OPS, x, residual, gate)

    def reference(self, x, residual, gate):
        return self.run(REFERENCES, x, residual, gate)

    def run(self, ops, x, residual, gate):
        h = ops.rms_norm.default(x, self.w, 1e-6)
        h, residual = ops.add_rms_norm.default(h, residual, self.w, 1e-6)
        h = ops.layer_norm.default(h, self.w, self.b, 1e-5)
        h, residual = ops.add_layer_norm.default(h, residual, self.w, self.b, 1e-5)
        h = ops.swiglu.default(h, residual)
        h = ops.gelu_bias.default(h, self.b, "tanh")
        h = ops.rotary.default(h, self.cos, self.sin)
        h, residual = ops.rotary_pair.default(h, residual, self.cos, self.sin)
        return ops.gated_residual.default(residual, h, gate), residual


ALL_OP_NAMES = {"rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "swiglu", "gelu_bias",
                "rotary", "rotary_pair", "gated_residual"}


def all_ops_inputs():
    torch.manual_seed(0)
    return torch.randn(3, 5, 32), torch.randn(3, 5, 32), torch.tensor([1.0, 0.0, 1.0])


def test_ops_in_torch_export():
    model = AllOps().eval()
    inputs = all_ops_inputs()
    program = torch.export.export(model, inputs)
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    for name in ALL_OP_NAMES:
        assert getattr(OPS, name).default in targets, name
    for got, want in zip(program.module()(*inputs), model.reference(*inputs), strict=True):
        torch.testing.assert_close(got, want)


def test_ops_in_torch_compile_fullgraph():
    model = AllOps().eval()
    inputs = all_ops_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for got, want in zip(compiled(*inputs), model.reference(*inputs), strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fake_impl_shapes_and_dtypes(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    eager = [(label, name, reference, tuple(a.cpu() if isinstance(a, torch.Tensor) else a
                                            for a in args))
             for label, name, _, reference, args in cases((3, 37, 96), dtype)]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for label, name, reference, args in eager:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                              for a in args)
            fake = as_tuple(getattr(OPS, name)(*fake_args))
            assert all(isinstance(t, torch._subclasses.FakeTensor) for t in fake), label
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                real = as_tuple(reference(*args))
            assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real], label


@needs_triton
def test_gated_residual_rows_take_or_skip():
    h, f = rand((4, 7, 96), torch.float32, 0), rand((4, 7, 96), torch.float32, 1)
    gate = torch.tensor([1.0, 0.0, 0.0, 1.0], device=DEVICE)
    for fn in (gated_residual.gated_residual_triton, OPS.gated_residual):
        out = fn(h, f, gate)
        assert torch.equal(out[1:3], h[1:3])  # skipped rows: exactly h
        torch.testing.assert_close(out[[0, 3]], h[[0, 3]] + f[[0, 3]], atol=0, rtol=0)
    # a per-row gate of a 2-D input ([batch, hidden]) and the scalar gate at 0 and 1
    h2, f2 = h[:, 0], f[:, 0]
    torch.testing.assert_close(gated_residual.gated_residual_triton(h2, f2, gate),
                               torch.where(gate[:, None] > 0, h2 + f2, h2), atol=0, rtol=0)
    for value in (0.0, 1.0):
        out = gated_residual.gated_residual_triton(h, f, torch.tensor(value))
        assert torch.equal(out, h + f if value else h)


SM90_COMPILE = r'''
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rbcompile.kernels import (gated_residual, gelu, layer_norm, rms_norm, rotary, rotary_write_kv,
                               swiglu, write_kv)

def source(fn, types, consts):
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types[n] for n in names}
    return ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()})

for dt in ("bf16", "fp32"):
    P, I, F = "*" + dt, "i32", "fp32"
    tile = dict(BLOCK_ROWS=4, BLOCK_N=1024, RTNE=False)
    norm = dict(x_ptr=P, r_ptr=P, w_ptr=P, b_ptr=P, out_ptr=P, total_ptr=P, n_rows=I, n_cols=I,
                x_stride=I, r_stride=I, eps=F)
    jobs = [(rms_norm._rms_norm_kernel, norm, dict(HAS_RESIDUAL=True, **tile)),
            (layer_norm._layer_norm_kernel, norm, dict(HAS_RESIDUAL=True, **tile)),
            (swiglu._swiglu_kernel, dict(gate_ptr=P, up_ptr=P, out_ptr=P, n_rows=I, n_cols=I,
                                         gate_stride=I, up_stride=I), tile),
            (gated_residual._gated_residual_kernel,
             dict(h_ptr=P, f_ptr=P, gate_ptr=P, out_ptr=P, n_rows=I, n_cols=I, h_stride=I,
                  f_stride=I, rows_per_gate=I), tile)]
    jobs.append((rotary._rotary_kernel,
                 dict(x_ptr=P, cos_ptr=P, sin_ptr=P, out_ptr=P, n_rows=I, half=I, heads=I,
                      tokens=I, **{f"{t}_{d}": I for t in "xcso" for d in "bhtd"}), tile))
    jobs.append((rotary._rotary_pair_kernel,
                 dict(q_ptr=P, k_ptr=P, cos_ptr=P, sin_ptr=P, qo_ptr=P, ko_ptr=P, q_rows=I,
                      k_rows=I, half=I, q_heads=I, k_heads=I, tokens=I,
                      **{f"{t}_{d}": I for t in ("q", "k", "c", "s", "qo", "ko") for d in "bhtd"}),
                 tile))
    jobs.append((write_kv._write_kv_kernel,
                 dict(k_ptr=P, v_ptr=P, kc_ptr=P, vc_ptr=P, pos_ptr="*i64", n_rows=I, width=I,
                      heads=I, tokens=I, **{f"{t}_{d}": I for t in ("k", "v") for d in "bhtd"},
                      **{f"{t}_{d}": I for t in ("kc", "vc") for d in "bhsd"}),
                 dict(BLOCK_ROWS=4, BLOCK_N=64)))
    jobs.append((rotary_write_kv._rotary_write_kv_kernel,
                 dict(q_ptr=P, k_ptr=P, v_ptr=P, cos_ptr=P, sin_ptr=P, qo_ptr=P, kc_ptr=P,
                      vc_ptr=P, pos_ptr="*i64", q_rows=I, kv_rows=I, half=I, q_heads=I,
                      kv_heads=I, tokens=I,
                      **{f"{t}_{d}": I for t in ("q", "k", "v", "c", "s", "qo") for d in "bhtd"},
                      **{f"{t}_{d}": I for t in ("kc", "vc") for d in "bhsd"}), tile))
    for tanh in (False, True):
        jobs.append((gelu._gelu_bias_kernel, dict(x_ptr=P, b_ptr=P, out_ptr=P, n_rows=I, n_cols=I,
                                                  x_stride=I), dict(HAS_BIAS=True, TANH=tanh, **tile)))
    for fn, types, consts in jobs:
        try:
            src = source(fn, types, consts)
        except TypeError as error:  # another Triton version's ASTSource
            print("API", error); sys.exit(0)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert kernel.asm["cubin"], fn
        print("compiled", fn.__name__, dt)
'''


@needs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles the kernels itself")
def test_kernels_compile_for_sm90(tmp_path):
    """Without a GPU: the kernels as the GPU compiles them (no interpreter) build to sm_90 cubin."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", SM90_COMPILE], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("API"):
        pytest.skip(f"Triton's ASTSource API differs: {out.stdout}")
    assert out.stdout.count("compiled") == 20, out.stdout
