"""Integer weights (kernels/int_weights.py): the packing against its PyTorch reference, and
onnxruntime's MatMulNBits, as the step graph calls it, against `reference_linear` over odd
shapes (inputs that are not whole blocks, one row and several)."""
import numpy as np
import pytest
import torch
from shared import run_linear_graph

from rbcompile.artifact.step_graph import ACCURACY_LEVELS
from rbcompile.kernels.int_weights import LEVELS, dequantize, quantize, reference_linear

# |graph - reference| <= TOLERANCE * max |reference|: int8 and int4 round their inputs to int8
# per block (accuracy level 4, the fast kernels), which costs about 1% of the output's scale;
# int4-fp32 keeps them fp32 (level 0), so only the order of fp32 sums differs
TOLERANCE = {"int8": 0.03, "int4": 0.03, "int4-fp32": 1e-5}
BITS = {**LEVELS, "int4-fp32": 4}


def _graph_linear(packed, x: torch.Tensor, level: str) -> torch.Tensor:
    """One int linear as the step graph builds it (`_Builder._int_linear`), run in onnxruntime."""
    return run_linear_graph(lambda builder: builder._int_linear(
        "x", "w", packed, ACCURACY_LEVELS[level], out="y"), packed, x)


@pytest.mark.parametrize("level", ["int8", "int4", "int4-fp32"])
@pytest.mark.parametrize("out_features,in_features", [(7, 32), (96, 100), (33, 576), (64, 48)])
@pytest.mark.parametrize("rows", [1, 5])
def test_matmul_nbits_matches_the_reference(level, out_features, in_features, rows):
    generator = torch.Generator().manual_seed(out_features * in_features + BITS[level])
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(1, rows, in_features, generator=generator)
    packed = quantize(weight, BITS[level])
    expected = reference_linear(x, packed)
    got = _graph_linear(packed, x, level)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= TOLERANCE[level] * expected.abs().max()


@pytest.mark.parametrize("out_features,in_features", [(7, 32), (33, 100)])
def test_smoothed_int8_blocks_match_the_reference_and_flatten_outlier_channels(out_features,
                                                                              in_features):
    """Smoothing moves an outlier input channel's range into the weight: the graph (input
    divided by the factors, then MatMulNBits) still matches `reference_linear`, and its output
    is closer to the fp32 linear's than without."""
    from rbcompile.kernels.token_int8 import smoothing

    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(1, 6, in_features, generator=generator)
    x[..., 5] *= 100
    smooth = smoothing(x.abs().flatten(0, 1).amax(0), weight, 0.5)
    smoothed = quantize(weight, 8, smooth=smooth)
    assert smoothed.inverse_smooth is not None and smoothed.inverse_smooth.shape == (in_features,)
    expected = reference_linear(x, smoothed)
    got = _graph_linear(smoothed, x, "int8")
    assert (got - expected).abs().max() <= TOLERANCE["int8"] * expected.abs().max()
    exact = torch.nn.functional.linear(x, weight)
    plain = _graph_linear(quantize(weight, 8), x, "int8")
    assert (got - exact).abs().mean() < (plain - exact).abs().mean()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_error_is_at_most_half_a_step(bits):
    weight = torch.randn(40, 100) * 0.1
    packed = quantize(weight, bits, block_size=32)
    error = (dequantize(packed) - weight).abs()
    steps = torch.from_numpy(packed.scales).view(40, -1).repeat_interleave(32, dim=1)[:, :100]
    assert (error <= steps / 2 + 1e-7).all()
    assert packed.data.shape == (40, 4, 32 * bits // 8)
    assert (packed.offsets is None) == (bits == 8)


def test_gguf_blocks_come_back_exactly():
    """A Q4_1 block (d * q + m, q in 0..15) is an int4 block exactly; a Q8_0 block (d * q, q in
    -127..127 with its extreme reached) is an int8 block exactly."""
    generator = torch.Generator().manual_seed(1)
    d = torch.rand(16, 3, 1, generator=generator) * 0.01 + 1e-3
    m = -torch.rand(16, 3, 1, generator=generator) * 0.05
    q = torch.randint(0, 16, (16, 3, 32), generator=generator).float()
    q[..., 0], q[..., 1] = 0, 15
    q4_1 = (d * q + m).view(16, 96)
    assert torch.allclose(dequantize(quantize(q4_1, 4)), q4_1, rtol=0, atol=1e-6)
    q8 = torch.randint(-127, 128, (16, 3, 32), generator=generator).float()
    q8[..., 0] = 127
    q8_0 = (d * q8).view(16, 96)
    assert torch.allclose(dequantize(quantize(q8_0, 8)), q8_0, rtol=0, atol=1e-6)


def test_bad_levels_are_refused():
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(torch.zeros(4, 32), 3)
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.zeros(4, 32), 4, block_size=24)
    assert np.array_equal(dequantize(quantize(torch.zeros(4, 32), 4)).numpy(), np.zeros((4, 32)))
