"""The ONNX graph of one KV-cached decoder step, built from an artifact's weights for the
Llama family (Llama, SmolLM, Qwen 2, Mistral without a window): what `StepExecutor` runs in
onnxruntime instead of the generated module's op-by-op eager step.

Inputs: input_ids [B, T], position_ids [B, T], logit_positions [K], the cache
(past_key_i / past_value_i [B, kv heads, S, head dim]), the fp32 weights (bound once) and the
attention's own inputs; outputs: logits [B, K, vocab] and the cache written. Two attention
forms (`StepVariant.fused_attention`):
- GroupQueryAttention: attention_bias [B, 1, T, start + T], seqlens_k, total_sequence_length;
  it writes the T new keys / values into the cache where it is (present_* bound to past_*);
- plain ops: attention_bias [B, 1, group * T, S + T]; scores against the cache and against the
  T new keys separately (the cache is never copied), new_key_i / new_value_i [B, kv heads, T,
  head dim] out for the caller to write.
Each fp32 linear is a FusedMatMul on the weight as stored ([out, in], transB), so the weights
are the artifact's own tensors; a lower precision is a MatMulNBits (`kernels/int_weights.py`),
or for prefills ("int8-token") a MatMulInteger on activations quantized per token
(`kernels/token_int8.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import TensorProto, helper

from rbcompile.kernels.int_weights import PackedWeight
from rbcompile.kernels.token_int8 import LIMIT, TINY, ChannelInt8

OPSET = 23
MS_DOMAIN = "com.microsoft"
# MatMulNBits' accuracy_level per weight level: int8 activations (4) are its fast AVX2 kernels;
# fp32 activations (0) have no fast int8 kernel on this CPU (3.7 tok/s against 41 on SmolLM2),
# but a fast int4 one, exact where the blocks are the source's own (docs/executor.md)
ACCURACY_LEVELS = {"int8": 4, "int4": 4, "int4-fp32": 0}
PACKED_AS = {"int4-fp32": "int4"}   # a level stored as another's blocks
TOKEN_INT8 = "int8-token"   # int8 per channel, activations int8 per token (prefill GEMMs)
ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED = ("llama", "qwen2", "mistral")   # transformers model types


@dataclass(frozen=True)
class StepShape:
    """The model dimensions the graph is built for (from a transformers config)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    max_positions: int

    @classmethod
    def from_config(cls, config: dict) -> "StepShape":
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(config["num_hidden_layers"], config["hidden_size"], heads,
                   config.get("num_key_value_heads") or heads, head_dim, config["vocab_size"],
                   float(config["rms_norm_eps"]), config["max_position_embeddings"])


@dataclass(frozen=True)
class StepVariant:
    """What one graph runs: `skipped_mlps` (layer indices whose MLP branch is off: a plan's
    gates), `precision` per linear weight name ("int8" / "int4"; absent: fp32), and the
    attention: `fused_attention` is onnxruntime's GroupQueryAttention writing the cache in
    place (its CPU kernel takes one row, or one token per row), else plain ops that read the
    cache and output the new keys / values."""
    skipped_mlps: frozenset[int] = frozenset()
    precision: tuple[tuple[str, str], ...] = ()
    fused_attention: bool = True

    def level(self, weight: str) -> str:
        return dict(self.precision).get(weight, "fp32")


def fused_name(keys: list[str]) -> str:
    """The name of the weight that stacks the rows of `keys` (a single key's own name)."""
    return keys[0] if len(keys) == 1 else "+".join(keys)


def unsupported_reason(config: dict) -> str | None:
    """Why the step graph cannot run this model (None: it can)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        return f"model type {model_type} is not one of {', '.join(SUPPORTED)}"
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and model_type != "llama":
        return "sliding-window attention"
    if config.get("hidden_act", "silu") != "silu":
        return f"activation {config.get('hidden_act')}"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:  # these scale the frequencies only (the tables take them)
        return f"rotary embedding type {kind}"
    return None


@dataclass
class _Builder:
    shape: StepShape
    variant: StepVariant
    source: Callable         # weight name -> np.ndarray (fp32) or PackedWeight ("NAME@int4")
    nodes: list = field(default_factory=list)
    initializers: dict = field(default_factory=dict)   # packed weights: name -> array
    weight_inputs: dict = field(default_factory=dict)  # fp32 weights: name -> array (inputs)
    constants: list = field(default_factory=list)      # small tensors stored in the graph
    prepack: bool = False    # fp32 weights are initializers too (onnxruntime prepacks them)
    counter: int = 0
    prescaled: set = field(default_factory=set)   # outputs already divided by the smoothing

    def name(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}_{self.counter}"

    def op(self, kind: str, inputs: list[str], domain: str = "", outputs: int = 1,
           out: str | list[str] | None = None, **attrs):
        """A node; its output name (names for `outputs` > 1), given by `out` or made up."""
        names = ([out] if isinstance(out, str) else out) if out else [
            self.name(kind.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, names, domain=domain or None, **attrs))
        return names[0] if len(names) == 1 else names

    def const(self, stem: str, value: np.ndarray) -> str:
        name = self.name(stem)
        self.constants.append(onnx.numpy_helper.from_array(value, name))
        return name

    def ints(self, *values: int) -> str:
        return self.const("shape", np.array(values, dtype=np.int64))

    def weight(self, key: str) -> str:
        """An fp32 weight: a graph input the executor binds to the stored tensor once (an
        initializer when `prepack`)."""
        if self.prepack:
            self.initializers.setdefault(key, self.source(key))
        elif key not in self.weight_inputs:
            self.weight_inputs[key] = self.source(key)
        return key

    def linear(self, x: str, keys: list[str], biases: list[str] | None = None,
               out: str | None = None) -> list[str]:
        """x [..., in] @ W^T (+ bias) for each weight [out, in] of `keys` (the linears that
        read `x`), each at the variant's precision: fp32 ones one matmul each on the stored
        weight (stacking them measured no faster, and would copy the weights), those of a
        lower precision one matmul of their rows stacked (`fused_name`), then split."""
        outputs = {}
        levels = [self.variant.level(key) for key in keys]
        groups = [[key] for key, level in zip(keys, levels) if level == "fp32"]
        groups += [[key for key, level in zip(keys, levels) if level == low]
                   for low in dict.fromkeys(levels) if low != "fp32"]
        for group in groups:
            level = self.variant.level(group[0])
            fused = fused_name(group)
            if level == "fp32":
                y = self.op("FusedMatMul", [x, self.weight(fused)], domain=MS_DOMAIN, transB=1,
                            out=out if len(keys) == 1 and not biases else None)
            elif level == TOKEN_INT8:
                y = self._token_int8_linear(x, f"{fused}@{level}",
                                            out=out if len(keys) == 1 and not biases else None)
            else:
                packed: PackedWeight = self.source(f"{fused}@{level}")
                y = self._int_linear(x, f"{fused}@{level}", packed, ACCURACY_LEVELS[level],
                                     out=out if len(keys) == 1
                                     and not biases else None)
            widths = [self.source(key).shape[0] for key in group]
            if biases:
                y = self.op("Add", [y, self.weight(fused_name(
                    [biases[keys.index(key)] for key in group]))], out=out)
            parts = (self.op("Split", [y, self.ints(*widths)], axis=-1, outputs=len(group))
                     if len(group) > 1 else [y])
            outputs.update(zip(group, parts))
        return [outputs[key] for key in keys]

    def _int_linear(self, x: str, name: str, packed: PackedWeight, accuracy_level: int,
                    out: str | None) -> str:
        """MatMulNBits (on the input divided by the smoothing, if any), plus for asymmetric
        blocks their offsets times the input's block sums."""
        x = self._smoothed(x, name, packed)
        names = [self._packed(name, part, value) for part, value in
                 (("q", packed.data), ("scales", packed.scales))]
        y = self.op("MatMulNBits", [x, *names], domain=MS_DOMAIN, K=packed.in_features,
                    N=packed.out_features, bits=packed.bits, block_size=packed.block_size,
                    accuracy_level=accuracy_level,
                    out=None if packed.offsets is not None else out)
        if packed.offsets is None:
            return y
        padding = packed.blocks * packed.block_size - packed.in_features
        if padding:
            x = self.op("Pad", [x, self.ints(0, 0, 0, 0, 0, padding)])
        sums = self.op("ReduceSum", [self.op("Reshape", [x, self.ints(0, 0, packed.blocks, -1)]),
                                     self.ints(-1)], keepdims=0)
        offsets = self.op("FusedMatMul", [sums, self._packed(name, "offsets", packed.offsets)],
                          domain=MS_DOMAIN, transB=1)
        return self.op("Add", [y, offsets], out=out)

    def _token_int8_linear(self, x: str, name: str, out: str | None) -> str:
        """x (smoothed) quantized per token (uint8, zero point 128), MatMulInteger on the int8
        weight, scaled back by the token's and the channel's scales
        (token_int8.reference_linear)."""
        packed: ChannelInt8 = self.source(name)
        x = self._smoothed(x, name, packed)
        peak = self.op("ReduceMax", [self.op("Abs", [x]), self.ints(-1)], keepdims=1)
        scale = self.op("Div", [self.op("Max", [peak, self.const("tiny", np.float32(TINY))]),
                                self.const("limit", np.float32(LIMIT))])
        zero = self.const("zero_point", np.uint8(128))
        quantized = self.op("QuantizeLinear", [self.op("Div", [x, scale]),
                                               self.const("one", np.float32(1)), zero])
        products = self.op("MatMulInteger", [quantized, self._packed(name, "q", packed.data),
                                             zero])
        y = self.op("Mul", [self.op("Cast", [products], to=TensorProto.FLOAT), scale])
        return self.op("Mul", [y, self._packed(name, "scales", packed.scales)], out=out)

    def _smoothed(self, x: str, name: str, packed) -> str:
        """x divided by `packed`'s smoothing (where it has one and a norm has not done it)."""
        if packed.inverse_smooth is None or x in self.prescaled:
            return x
        return self.op("Mul", [x, self._packed(name, "inverse_smooth", packed.inverse_smooth)])

    def smoothing(self, keys: list[str]) -> str | None:
        """The packed weight whose input scaling (smoothing) the linears of `keys` share: their
        group's, where they are all at one lower precision and it has one (None: their input
        goes as it is)."""
        levels = {self.variant.level(key) for key in keys}
        if len(levels) != 1 or "fp32" in levels:
            return None
        name = f"{fused_name(keys)}@{levels.pop()}"
        return name if getattr(self.source(name), "inverse_smooth", None) is not None else None

    def _packed(self, key: str, part: str, value: np.ndarray) -> str:
        name = f"{key}.{part}"
        self.initializers.setdefault(name, value)
        return name

    def heads_first(self, x: str, heads: int, out: str | None = None) -> str:
        """[B, T, heads * hd] -> [B, heads, T, hd]."""
        y = self.op("Reshape", [x, self.ints(0, 0, heads, self.shape.head_dim)])
        return self.op("Transpose", [y], perm=[0, 2, 1, 3], out=out)

    def add_norm(self, x: str, residual: str | None, key: str,
                 scaled_for: str | None = None) -> tuple[str, str]:
        """(rms_norm(residual + x), residual + x): one fused node; the norm's output divided by
        the smoothing of packed weight `scaled_for` (folded into the norm's weight)."""
        if residual is None:
            return self.rms_norm(x, key, scaled_for), x
        names = [self.name("norm"), "", "", self.name("residual")]
        self.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization",
                                           [x, residual, self._norm_weight(key, scaled_for)],
                                           names, domain=MS_DOMAIN, epsilon=self.shape.eps))
        if scaled_for is not None:
            self.prescaled.add(names[0])
        return names[0], names[3]

    def rms_norm(self, x: str, key: str, scaled_for: str | None = None) -> str:
        normed = self.op("RMSNormalization", [x, self._norm_weight(key, scaled_for)], axis=-1,
                         epsilon=self.shape.eps)
        if scaled_for is not None:
            self.prescaled.add(normed)
        return normed

    def _norm_weight(self, key: str, scaled_for: str | None) -> str:
        """A norm's weight, divided by `scaled_for`'s smoothing where given: a constant named
        after both (the same norm feeds other levels' weights in other graphs)."""
        if scaled_for is None:
            return self.weight(key)
        scale = self.source(scaled_for).inverse_smooth
        return self._packed(f"{key}/{scaled_for}", "smoothed",
                            (self.source(key) * scale).astype(np.float32))


def build_step_graph(shape: StepShape, variant: StepVariant, source: Callable,
                     qkv_bias: bool = False, prepack: bool = False
                     ) -> tuple[onnx.ModelProto, dict, dict]:
    """The step graph of `variant`, its initializers (name -> array, not stored in the proto:
    the packed weights, and with `prepack` the fp32 ones, which onnxruntime copies into its
    matmul kernels' layout) and its fp32 weights bound by pointer (graph inputs: no copy, but
    a GEMV on an unpacked weight is slower). `source(name)` gives a weight: a key of the
    checkpoint, keys joined by "+" (their rows stacked), either with "@int8" / "@int4"."""
    b = _Builder(shape, variant, source, prepack=prepack)
    x = b.op("Gather", [b.weight("model.embed_tokens.weight"), "input_ids"], axis=0)
    rotary = _rotary_tables(b, source("model.rotary_emb.inv_freq"))
    splits = (None if variant.fused_attention else
              b.op("Concat", [_dim(b, "past_key_0", 2), _dim(b, "input_ids", 1)], axis=0))
    residual = None   # x = residual + the pending branch output (folded into the next norm)
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        keys = [f"{p}self_attn.{kind}_proj" for kind in "qkv"]
        h, residual = b.add_norm(x, residual, p + "input_layernorm.weight",
                                 b.smoothing([key + ".weight" for key in keys]))
        q, k, v = b.linear(h, [key + ".weight" for key in keys],
                           [key + ".bias" for key in keys] if qkv_bias else None)
        q, k = (b.op("RotaryEmbedding", [y, "position_ids", *rotary], domain=MS_DOMAIN,
                     num_heads=heads, interleaved=0)
                for y, heads in ((q, shape.heads), (k, shape.kv_heads)))
        if variant.fused_attention:
            attended = b.op("GroupQueryAttention", [q, k, v, f"past_key_{layer}",
                                                    f"past_value_{layer}", "seqlens_k",
                                                    "total_sequence_length", "", "", "",
                                                    "attention_bias"],
                            domain=MS_DOMAIN, num_heads=shape.heads,
                            kv_num_heads=shape.kv_heads,
                            out=[b.name("attended"), f"present_key_{layer}",
                                 f"present_value_{layer}"])[0]
        else:
            k, v = (b.heads_first(y, shape.kv_heads, f"new_{kind}_{layer}")
                    for y, kind in ((k, "key"), (v, "value")))
            attended = _attention(b, b.heads_first(q, shape.heads), k, v, layer, splits)
        x = b.linear(attended, [p + "self_attn.o_proj.weight"])[0]
        if layer in variant.skipped_mlps:
            continue
        mlp_in = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        h, residual = b.add_norm(x, residual, p + "post_attention_layernorm.weight",
                                 b.smoothing(mlp_in))
        gate, up = b.linear(h, mlp_in)
        x = b.linear(b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up]),
                     [p + "mlp.down_proj.weight"])[0]
    x = b.op("Gather", [b.op("Add", [residual, x]), "logit_positions"], axis=1)
    b.linear(b.rms_norm(x, "model.norm.weight", b.smoothing(["lm_head.weight"])),
             ["lm_head.weight"], out="logits")
    return _model(b, shape, variant.fused_attention), b.initializers, b.weight_inputs


def _dim(b: _Builder, tensor: str, axis: int) -> str:
    return b.op("Gather", [b.op("Shape", [tensor]), b.ints(axis)], axis=0)


def _rotary_tables(b: _Builder, inv_freq: np.ndarray) -> tuple[str, str]:
    """RotaryEmbedding's cos / sin caches [positions, head dim / 2] (HF's default rotary)."""
    angles = np.outer(np.arange(b.shape.max_positions, dtype=np.float32),
                      inv_freq.astype(np.float32))
    return (b.const("cos_cache", np.cos(angles).astype(np.float32)),
            b.const("sin_cache", np.sin(angles).astype(np.float32)))


def _attention(b: _Builder, q: str, k: str, v: str, layer: int, splits: str) -> str:
    """softmax(q [past_k ; k]^T / sqrt(hd) + bias) [past_v ; v] with q [B, H, T, hd] grouped
    per K/V head; returns [B, T, H * hd]."""
    hd, heads = b.shape.head_dim, b.shape.heads
    grouped = b.op("Reshape", [q, b.ints(0, b.shape.kv_heads, -1, hd)])   # [B, kvh, g*T, hd]
    scale = 1.0 / float(np.sqrt(hd))
    past = b.op("FusedMatMul", [grouped, f"past_key_{layer}"], domain=MS_DOMAIN, transB=1,
                alpha=scale)
    new = b.op("FusedMatMul", [grouped, k], domain=MS_DOMAIN, transB=1, alpha=scale)
    scores = b.op("Add", [b.op("Concat", [past, new], axis=-1), "attention_bias"])
    past_probs, new_probs = b.op("Split", [b.op("Softmax", [scores], axis=-1), splits],
                                 axis=-1, outputs=2)
    out = b.op("Add", [b.op("MatMul", [past_probs, f"past_value_{layer}"]),
                       b.op("MatMul", [new_probs, v])])                      # [B, kvh, g*T, hd]
    out = b.op("Transpose", [b.op("Reshape", [out, b.ints(0, heads, -1, hd)])],
               perm=[0, 2, 1, 3])
    return b.op("Reshape", [out, b.ints(0, 0, heads * hd)])


def _model(b: _Builder, shape: StepShape, fused_attention: bool) -> onnx.ModelProto:
    float_, int32 = TensorProto.FLOAT, TensorProto.INT32
    cache_dims = ["B", shape.kv_heads, "S", shape.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "T"]),
              helper.make_tensor_value_info("logit_positions", TensorProto.INT64, ["K"])]
    outputs = [helper.make_tensor_value_info("logits", float_, ["B", "K", shape.vocab])]
    if fused_attention:
        inputs += [helper.make_tensor_value_info("attention_bias", float_, ["B", 1, "T", "L"]),
                   helper.make_tensor_value_info("seqlens_k", int32, ["B"]),
                   helper.make_tensor_value_info("total_sequence_length", int32, [])]
        written = "present"
    else:
        inputs.append(helper.make_tensor_value_info("attention_bias", float_,
                                                    ["B", 1, "GT", "ST"]))
        cache_dims[2], written = "T", "new"
    inputs += [helper.make_tensor_value_info(name, float_, list(value.shape))
               for name, value in b.weight_inputs.items()]
    for layer in range(shape.layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(
                f"past_{kind}_{layer}", float_, ["B", shape.kv_heads, "S", shape.head_dim]))
            outputs.append(helper.make_tensor_value_info(f"{written}_{kind}_{layer}", float_,
                                                         cache_dims))
    graph = helper.make_graph(b.nodes, "rbcompile_step", inputs, outputs,
                              b.constants + [_placeholder(name, value)
                                             for name, value in b.initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid(MS_DOMAIN, 1)])


def _placeholder(name: str, value: np.ndarray) -> TensorProto:
    """An initializer whose data the session gets from the caller (`add_external_initializers`):
    the proto holds only its name, type and shape."""
    tensor = TensorProto()
    tensor.name, tensor.data_type = name, helper.np_dtype_to_tensor_dtype(value.dtype)
    tensor.dims.extend(value.shape)
    tensor.data_location = TensorProto.EXTERNAL
    location = tensor.external_data.add()
    location.key, location.value = "location", "fed-by-rbcompile"
    return tensor
