"""`StepExecutor`: a decoder's KV-cached steps run as one onnxruntime graph each
(`step_graph.py`) instead of op by op through PyTorch eager, with the same calling convention
as `Decoder.__call__` (it writes the step's keys / values into the caller's cache).

Inputs and outputs are bound by pointer: the cache is the torch tensors themselves. The full
path's graph (lossless decoding's every step) gets the fp32 weights as initializers, which
onnxruntime prepacks into its GEMM layout (faster GEMVs, one more copy of the weights; the
mapped originals' pages are then released); other graphs bind the stored tensors by pointer.
Packed int8 / int4 weights are initializers, copied into the kernels' layout per session. One
session per `StepVariant` (a plan's skipped MLPs, its weight precisions, the attention form),
built on first use and kept (up to `max_sessions`), with an IO binding whose weights are
bound once.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from rbcompile.artifact.ort_threads import session_options
from rbcompile.artifact.packed_weights import linear_keys
from rbcompile.artifact.page_release import release_file_pages
from rbcompile.artifact.step_graph import (
    PACKED_AS,
    TOKEN_INT8,
    StepShape,
    StepVariant,
    build_step_graph,
    unsupported_reason,
)
from rbcompile.kernels.int_weights import LEVELS, PackedWeight, quantize
from rbcompile.kernels.token_int8 import ChannelInt8, quantize_channels, smoothing

# steps of at least this many tokens per row are prefills: they run the fp32 weights (int8 /
# int4 MatMulNBits is slower than fp32 on GEMMs), or `prefill_precision`; drafts verify in
# shorter steps, so lossless drafting never runs the prefill's precision
FULL_PRECISION_FROM = 32
SMOOTHED_LEVELS = ("int8",)
# smoothing's alpha for MatMulNBits int8, whose activations are quantized per block of 32:
# 0.5 and 0.6 measured best (docs/executor.md); the per-token prefill's is token_int8.ALPHA
BLOCK_ALPHA = 0.5
# steps of several rows and at least this many tokens (batched prefills) run row by row:
# GroupQueryAttention then takes each row from its first kept token, where the batched
# plain-ops attention scores every row over the whole cache (docs/executor.md, "Batched prefills")
ROW_STEPS_FROM = 80
EMBEDDING_KEYS = ("model.embed_tokens.weight", "lm_head.weight")


def _session_options(threads: int | None):
    import onnxruntime

    options = session_options(threads)
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


class StepExecutor:
    """Runs decoder steps in onnxruntime; `variant(gates, precision)` names the graph."""

    def __init__(self, weights: dict[str, torch.Tensor], config: dict, mlp_gates: dict[int, int],
                 *, threads: int | None = None, max_sessions: int = 8, prepack: bool = True,
                 activation_max: dict[str, torch.Tensor] | None = None):
        reason = unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"the onnxruntime step executor does not run this model: {reason}")
        self.shape = StepShape.from_config(config)
        self.mlp_gates = mlp_gates        # gate index -> layer whose MLP branch it turns off
        self.threads, self.max_sessions = threads, max_sessions
        # whether the full path's graph holds its own prepacked copy of the fp32 weights: its
        # GEMVs are faster than on the weights bound by pointer (docs/executor.md), for one more
        # copy of them in memory. Off where a lower level decodes and the full path only
        # prefills; a graph built either way is kept, so switching levels builds nothing again
        self.prepack = prepack
        # steps of at least this many tokens per row (prefills) run `prefill_precision`; None:
        # every step at the given precision (what calibration measures)
        self.full_precision_from: int | None = FULL_PRECISION_FROM
        # the prefills' precision per linear weight (None: fp32; packed_weights.prefill_precision)
        self.prefill_precision: dict[str, str] | None = None
        # each linear weight's input's channel maxima on calibration text: the int8-token
        # linears' smoothing (kernels/token_int8.py; None or a weight absent: unsmoothed)
        self.activation_max = activation_max or {}
        # steps of at least this many rows run the fp32 weights too: where the level measured
        # no faster than fp32 at compile (StoredPrecision.fp32_from_rows; None: every step)
        self.full_precision_rows: int | None = None
        self.row_steps_from: int | None = ROW_STEPS_FROM   # None: batched steps stay batched
        self.qkv_bias = "model.layers.0.self_attn.q_proj.bias" in weights
        embedding = next(key for key in EMBEDDING_KEYS if key in weights)
        self.tensors = {key: tensor.detach().contiguous() for key, tensor in weights.items()}
        self.tensors["model.embed_tokens.weight"] = self.tensors[embedding]
        self.tensors.setdefault("lm_head.weight", self.tensors[embedding])
        self.arrays: dict[str, np.ndarray | PackedWeight | ChannelInt8] = {
            key: tensor.numpy() for key, tensor in self.tensors.items()}
        # (variant, prepacked) -> (session, binding): the full path's graph is kept apart
        # with and without its prepacked weights, so switching levels rebuilds neither
        self.sessions: OrderedDict[tuple[StepVariant, bool], tuple] = OrderedDict()
        # initializer -> OrtValue, made once (each session copies it into its own layout)
        self._values: dict[str, object] = {}
        # binding -> where its cache inputs / outputs point (rebound when they move)
        self._cache_bound: dict[object, tuple] = {}
        self._pages_released = False   # the mapped fp32 weights, once prepacked

    # ---- variants -----------------------------------------------------------------------

    def variant(self, gates=None, precision: dict[str, str] | None = None,
                fused_attention: bool = True) -> StepVariant:
        """The graph of decoder `gates` (None: all on) with `precision` per linear weight."""
        skipped = frozenset(layer for gate, layer in self.mlp_gates.items()
                            if gates is not None and not gates[gate])
        return StepVariant(skipped, tuple(sorted((precision or {}).items())), fused_attention)

    def linear_weights(self) -> list[str]:
        """The names of the weights a precision can be given to (every linear, head included)."""
        return linear_keys(self.tensors)

    def array(self, name: str) -> np.ndarray | PackedWeight | ChannelInt8:
        """A weight the graph names (step_graph.build_step_graph's `source`), made on first
        use: stacked rows of "+"-joined keys, packed for an "@int8" / "@int4" suffix."""
        if name not in self.arrays:
            stem, _, level = name.partition("@")
            if level in PACKED_AS:   # the same blocks, computed another way: one copy
                self.arrays[name] = self.array(f"{stem}@{PACKED_AS[level]}")
                return self.arrays[name]
            keys = stem.split("+")
            rows = (self.tensors[keys[0]] if len(keys) == 1 else
                    torch.cat([self.tensors[key] for key in keys]))
            self.arrays[name] = (self._token_int8(keys[0], rows) if level == TOKEN_INT8 else
                                 self._blocks(keys[0], rows, level) if level else rows.numpy())
        return self.arrays[name]

    def _blocks(self, key: str, rows: torch.Tensor, level: str) -> PackedWeight:
        """`rows` as MatMulNBits blocks at `level`; int8 smoothed by the input's calibration
        maxima where known (int4 keeps its blocks: a GGUF source's come back exactly)."""
        smooth = self._smoothing(key, rows, BLOCK_ALPHA) if level in SMOOTHED_LEVELS else None
        return quantize(rows, LEVELS[level], smooth=smooth)

    def _token_int8(self, key: str, rows: torch.Tensor) -> ChannelInt8:
        """`rows` (the weights reading one input, stacked) as an int8-token linear, smoothed
        by the input's calibration maxima where known."""
        return quantize_channels(rows, self._smoothing(key, rows))

    def _smoothing(self, key: str, rows: torch.Tensor, alpha: float | None = None
                   ) -> torch.Tensor | None:
        """The smoothing factors of `rows`, whose input is `key`'s (None: no maxima known)."""
        maxima = self.activation_max.get(key)
        return None if maxima is None else smoothing(maxima, rows, alpha)

    def session(self, variant: StepVariant):
        """(onnxruntime session, its IO binding with the weights bound) of `variant`, built on
        first use."""
        import onnxruntime

        prepack = self.prepack and variant == StepVariant()
        key = (variant, prepack)
        if key in self.sessions:
            self.sessions.move_to_end(key)
            return self.sessions[key]
        model, initializers, weights = build_step_graph(self.shape, variant, self.array,
                                                        self.qkv_bias, prepack=prepack)
        options = _session_options(self.threads)
        for name, value in initializers.items():
            if name not in self._values:
                self._values[name] = onnxruntime.OrtValue.ortvalue_from_numpy(value)
        options.add_external_initializers(list(initializers),
                                          [self._values[name] for name in initializers])
        session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                               providers=["CPUExecutionProvider"])
        if prepack and not self._pages_released:  # the session has its own copy of them
            embedding = self.tensors["model.embed_tokens.weight"].data_ptr()  # Gather reads it
            release_file_pages([self.tensors[key] for key in self.linear_weights()
                                if self.tensors[key].data_ptr() != embedding])
            self._pages_released = True
        binding = session.io_binding()   # the weights bound once; each step binds the rest
        for name in weights:
            _bind(binding.bind_input, name, self.tensors[name])
        self.sessions[key] = session, binding
        while len(self.sessions) > self.max_sessions:
            self._cache_bound.pop(self.sessions.popitem(last=False)[1][1], None)
        return self.sessions[key]

    # ---- a step ---------------------------------------------------------------------------

    def prepare(self, precision: dict[str, str] | None = None, gates=None) -> None:
        """Build the sessions of steps at `precision` (fused and plain attention) now, so that
        the first such step (a controller lowering precision under load) does not wait."""
        for fused in (True, False):
            self.session(self.variant(gates, precision, fused))

    def __call__(self, input_ids, attention_mask, position_ids, cache_position, logit_positions,
                 cache, gates=None, precision: dict[str, str] | None = None) -> torch.Tensor:
        """A step at `precision`, in fp32 from `full_precision_rows` rows (the decoding level's)."""
        return self.run(input_ids, attention_mask, position_ids, cache_position, logit_positions,
                        cache, gates, precision, self.full_precision_rows)

    def run(self, input_ids, attention_mask, position_ids, cache_position, logit_positions,
            cache, gates=None, precision: dict[str, str] | None = None,
            fp32_from_rows: int | None = None) -> torch.Tensor:
        """A step at `precision`, in fp32 from `fp32_from_rows` rows (None: at every batch size)
        and from `full_precision_from` tokens per row."""
        batch, tokens = input_ids.shape
        start = int(cache_position[0])
        if attention_mask is None:  # an unpadded prefill: every slot is kept
            attention_mask = torch.ones(batch, start + tokens, dtype=torch.long)
        if (batch > 1 and self.row_steps_from is not None and tokens >= self.row_steps_from
                and all(tensor.is_contiguous() for tensor in cache)):
            return torch.cat([self.run(*row, gates, precision, fp32_from_rows) for row in _rows(
                input_ids, attention_mask, position_ids, cache_position, logit_positions, cache)])
        fused = batch == 1 or tokens == 1   # what GroupQueryAttention's CPU kernel takes
        if self.full_precision_from is not None and tokens >= self.full_precision_from:
            # a prompt's prefill reads one position's logits; a step scoring the prompt (echo,
            # prompt logprobs) runs fp32: what it returns was never measured at the prefill's
            precision = self.prefill_precision if len(logit_positions) == 1 else None
        elif fp32_from_rows is not None and batch >= fp32_from_rows:
            precision = None
        variant = self.variant(gates, precision, fused)
        session, binding = self.session(variant)
        shape = self.shape
        logits = torch.empty(batch, len(logit_positions), shape.vocab)
        feeds = {"input_ids": input_ids.contiguous(), "position_ids": position_ids.contiguous(),
                 "logit_positions": logit_positions.contiguous()}
        if fused:
            written = cache            # GroupQueryAttention writes the cache where it is
            feeds["attention_bias"] = causal_bias(attention_mask, start, tokens)
            feeds["seqlens_k"] = torch.full((batch,), start + tokens - 1, dtype=torch.int32)
            feeds["total_sequence_length"] = torch.tensor(start + tokens, dtype=torch.int32)
        else:
            written = [torch.empty(batch, shape.kv_heads, tokens, shape.head_dim) for _ in cache]
            feeds["attention_bias"] = split_bias(attention_mask, start, tokens,
                                                 cache[0].shape[2], shape.heads // shape.kv_heads)
        for name, tensor in feeds.items():
            _bind(binding.bind_input, name, tensor)
        _bind(binding.bind_output, "logits", logits)
        self._bind_cache(variant, binding, cache, written)
        session.run_with_iobinding(binding)
        if not fused:
            for tensor, values in zip(cache, written, strict=True):
                tensor.index_copy_(2, cache_position, values)
        return logits

    def _bind_cache(self, variant: StepVariant, binding, cache: list[torch.Tensor],
                    written: list[torch.Tensor]) -> None:
        """Binds the cache read and the cache written, unless they are where the previous step
        of this variant had them (a decode loop's cache stays put: four binds a layer spared
        per step)."""
        where = tuple((t.data_ptr(), *t.shape, *t.stride()) for t in (*cache, *written))
        if self._cache_bound.get(binding) == where:
            return
        if variant.fused_attention:   # GroupQueryAttention reads only the slots it is told
            cache = written = [_whole_buffer(tensor) for tensor in cache]
        stem = "present" if variant.fused_attention else "new"
        for layer in range(self.shape.layers):
            for index, kind in ((2 * layer, "key"), (2 * layer + 1, "value")):
                _bind(binding.bind_input, f"past_{kind}_{layer}", cache[index])
                _bind(binding.bind_output, f"{stem}_{kind}_{layer}", written[index])
        self._cache_bound[binding] = where


def _whole_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A cache tensor [B, kv heads, S, head dim] cut along its slots from a contiguous buffer of
    more slots (a chunked prefill's view of its prompt's K/V) as that whole buffer, which is
    contiguous; any other tensor as it is."""
    batch, heads, _, dim = tensor.shape
    strides = tensor.stride()
    if tensor.is_contiguous() or strides[3] != 1 or strides[2] != dim or strides[1] % dim \
            or strides[0] != heads * strides[1]:
        return tensor
    return tensor.as_strided((batch, heads, strides[1] // dim, dim), strides)


def _rows(input_ids, attention_mask, position_ids, cache_position, logit_positions, cache):
    """A batched step's arguments per row, each row from its first kept token where every
    logit position asked for is at or after it (left padding: the pads are not computed)."""
    start, tokens = int(cache_position[0]), input_ids.shape[1]
    for row in range(input_ids.shape[0]):
        kept = attention_mask[row, start:start + tokens].nonzero()
        first = int(kept[0]) if len(kept) else 0
        if first > int(logit_positions.min()):
            first = 0
        positions = position_ids[row:row + 1] if len(position_ids) > 1 else position_ids
        yield (input_ids[row:row + 1, first:], attention_mask[row:row + 1, :start + tokens],
               positions[:, first:], cache_position[first:],
               logit_positions - first, [tensor[row:row + 1] for tensor in cache])


def scratch_cache(rows: int, kv_heads: int, slots: int, head_dim: int,
                  layers: int) -> list[torch.Tensor]:
    """A zeroed K/V cache of `slots` slots per row (keys and values of each layer, in turn)."""
    return [torch.zeros(rows, kv_heads, slots, head_dim) for _ in range(2 * layers)]


def sequence_logits(step, input_ids: torch.Tensor, attention_mask: torch.Tensor, kv_heads: int,
                    head_dim: int, layers: int) -> torch.Tensor:
    """Logits at every position of left- or right-padded sequences [B, T], from one prefill
    step (`step`: a Decoder or StepExecutor call) into a scratch cache of T slots."""
    batch, tokens = input_ids.shape
    cache = scratch_cache(batch, kv_heads, tokens, head_dim, layers)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    slots = torch.arange(tokens)
    return step(input_ids, attention_mask, positions, slots, slots, cache)


def _bind(bind, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: the step executor binds contiguous tensors only")
    bind(name, "cpu", 0, _NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}


def _allowed(attention_mask: torch.Tensor, start: int, tokens: int) -> torch.Tensor:
    """[B, T, start + T] bool: query t (slot start + t) sees the slots up to its own that the
    mask keeps, and always itself (a pad query attends to itself, so no row is all -inf)."""
    total = start + tokens
    keep = attention_mask[:, :total].to(torch.bool)
    slots = torch.arange(total)
    causal = slots[None, :] <= (start + torch.arange(tokens))[:, None]         # [T, total]
    itself = slots[None, :] == (start + torch.arange(tokens))[:, None]
    return (keep[:, None, :] & causal) | itself


def _bias(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))


def causal_bias(attention_mask: torch.Tensor, start: int, tokens: int) -> torch.Tensor:
    """GroupQueryAttention's attention_bias [B, 1, T, start + T] for a step writing slots
    [start, start + T)."""
    return _bias(_allowed(attention_mask, start, tokens))[:, None].contiguous()


def split_bias(attention_mask: torch.Tensor, start: int, tokens: int, slots: int,
               group: int) -> torch.Tensor:
    """The plain-ops attention's bias [B, 1, group * T, slots + T]: the cache's slots before
    `start`, then the step's own T tokens, rows repeated per grouped query head."""
    allowed = _allowed(attention_mask, start, tokens)
    past = torch.zeros(allowed.shape[0], tokens, slots, dtype=torch.bool)
    past[..., :start] = allowed[..., :start]
    both = torch.cat([past, allowed[..., start:]], dim=-1)
    return _bias(both)[:, None].repeat(1, 1, group, 1).contiguous()
