"""Per-token int8 GEMMs (kernels/token_int8.py): onnxruntime's MatMulInteger, as the step graph
builds it (`_Builder._token_int8_linear`), against the PyTorch reference over odd shapes (one
row and several, inputs and outputs that are not multiples of anything), rows of zeros, and
rows whose scales differ by orders of magnitude."""
import pytest
import torch
from shared import run_linear_graph

from rbcompile.kernels.token_int8 import (
    LIMIT,
    dequantize,
    quantize_channels,
    quantize_tokens,
    reference_linear,
    smoothing,
)

# the graph and the reference do the same integer arithmetic; only the final fp32 products'
# rounding may differ
TOLERANCE = {torch.float32: 1e-6}


def _graph_linear(packed, x: torch.Tensor) -> torch.Tensor:
    """One per-token int8 linear as the step graph builds it, run in onnxruntime."""
    return run_linear_graph(lambda builder: builder._token_int8_linear(
        "x", "w@int8-token", out="y"), packed, x)


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("out_features,in_features", [(7, 17), (96, 100), (33, 576), (5, 1536)])
@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 37), (3, 5)])
def test_matmul_integer_matches_the_reference(dtype, out_features, in_features, batch, rows):
    generator = torch.Generator().manual_seed(out_features * in_features + rows)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(batch, rows, in_features, generator=generator, dtype=dtype)
    x[..., 0] *= 1 + torch.arange(rows)   # rows of different scales
    packed = quantize_channels(weight)
    expected = reference_linear(x, packed)
    got = _graph_linear(packed, x)
    assert got.shape == expected.shape == (batch, rows, out_features)
    assert (got - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max()
    exact = torch.nn.functional.linear(x, weight)   # and it is close to the fp32 linear
    assert (got - exact).abs().max() <= 0.1 * exact.abs().max()


def test_tokens_keep_their_own_scales():
    """A row of zeros stays zeros (no NaN), a tiny row keeps its precision next to a huge one."""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    x = torch.zeros(1, 3, 64)
    x[0, 1] = torch.linspace(-1e-3, 1e-3, 64)
    x[0, 2] = torch.linspace(-1e3, 1e3, 64)
    got = _graph_linear(quantize_channels(weight), x)
    assert torch.equal(got[0, 0], torch.zeros(16))
    exact = torch.nn.functional.linear(x, weight)
    for row in (1, 2):
        assert (got[0, row] - exact[0, row]).abs().max() <= 0.03 * exact[0, row].abs().max()


def test_quantization_error_is_at_most_half_a_step():
    weight = torch.randn(40, 100) * 0.1
    packed = quantize_channels(weight)
    steps = torch.from_numpy(packed.scales)[:, None]
    assert ((dequantize(packed) - weight).abs() <= steps / 2 + 1e-7).all()
    assert packed.data.shape == (100, 40) and packed.data.dtype.name == "int8"
    assert abs(packed.data).max() == LIMIT
    values, scale = quantize_tokens(torch.randn(2, 7, 100))
    assert values.abs().max() == LIMIT and scale.shape == (2, 7, 1)


@pytest.mark.parametrize("out_features,in_features", [(7, 17), (33, 576)])
def test_smoothed_linears_match_the_reference_and_flatten_outlier_channels(out_features,
                                                                             in_features):
    """With the input's channel maxima, the smoothed graph equals its reference, and an outlier
    channel costs the other channels less than unsmoothed."""
    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(2, 9, in_features, generator=generator)
    x[..., 3] *= 200   # a channel that always runs large, as in real decoders
    smooth = smoothing(x.abs().flatten(0, 1).amax(0), weight)
    assert smooth.shape == (in_features,) and (smooth > 0).all()
    smoothed, plain = quantize_channels(weight, smooth), quantize_channels(weight)
    got = _graph_linear(smoothed, x)
    expected = reference_linear(x, smoothed)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    steps = torch.from_numpy(smoothed.scales)[:, None]   # half a step of the smoothed weight
    assert (((dequantize(smoothed) - weight) * smooth).abs() <= steps / 2 + 1e-6).all()
    exact = torch.nn.functional.linear(x, weight)
    error = {name: (_graph_linear(packed, x) - exact).abs().mean()
             for name, packed in (("smoothed", smoothed), ("plain", plain))}
    assert error["smoothed"] < error["plain"]
    unused = smoothing(torch.zeros(in_features), weight)   # channels that never moved keep 1
    assert torch.equal(unused, torch.ones(in_features))
