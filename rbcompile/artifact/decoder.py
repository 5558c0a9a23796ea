"""An artifact's KV-cached decoder: the generated module of the `trace.CachedDecoder` graph.

A decoder artifact holds two generated modules over the same weights: `model.py` (the whole
sequence at once, the graph the budget plans are calibrated on) and `decoder.py` (prefill and
decode steps with a static K/V cache, see trace.CachedDecoder for the calling convention). In
the decoder graph the attention branches write the cache, so they are skeleton; the MLP
branches are its prunable regions, gated by unit name from the main graph's plans.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from rbcompile.artifact.architectures import lookup
from rbcompile.artifact.cache_pool import CachePool
from rbcompile.artifact.cuda_graphs import GraphCache, plan_key
from rbcompile.artifact.plan_graphs import PlanGraphs

DECODER_GRAPH, DECODER_SOURCE = "decoder_graph.json", "decoder.py"
# the step's inputs before the cache tensors (trace.CachedDecoder's calling convention)
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids", "cache_position", "logit_positions")


@dataclass(frozen=True)
class DecoderShape:
    """What a generation loop needs to know about a decoder: the KV cache's shape, its dtype
    and device, and the position limit."""
    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"

    @classmethod
    def from_config(cls, config, dtype=torch.float32, device="cpu") -> "DecoderShape":
        """From a transformers config, through the architecture registry."""
        dims = lookup(config).dimensions(config)
        return cls(dims.layers, dims.kv_heads, dims.head_dim, dims.max_positions, dtype, device)

    def sizes(self) -> dict:
        """The integer fields (what a manifest stores)."""
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "max_positions": self.max_positions}


class Decoder:
    """`step(input_ids, attention_mask, position_ids, cache_position, logit_positions, cache,
    gates=None)` -> logits [B, K, vocab] at the K `logit_positions`, writing the T new keys / values into `cache` (a list of tensors
    in trace.cache_names order) at slots `cache_position`."""

    def __init__(self, module: torch.nn.Module, ir: dict, source: str, sizes: DecoderShape,
                 draft: dict | None = None):
        self.module, self.ir, self.source, self.sizes = module, ir, source, sizes
        self.draft = draft  # the light plan `speculate="self"` drafts with (calibration)
        self.num_gates = module.NUM_GATES
        self.unit_gates = {region["name"]: region["gate"] for region in ir["regions"]
                           if region["kind"] == "prunable"}
        self.graphs: GraphCache | None = None
        self.cache_pool: CachePool | None = None  # with graphs: K/V tensors kept for reuse
        self.plan_graphs: PlanGraphs | None = None  # CompiledModel.compile_plans
        self.executor = None  # a StepExecutor: steps run as onnxruntime graphs (use_executor)
        self.step_executor = None  # the one built, kept while steps run in torch
        self.precision: dict[str, str] | None = None  # the executor's weight precision per linear
        self.weights = "fp32"  # the level `precision` gives the linears (executors.WEIGHT_LEVELS)
        self.prefill = "fp32"  # the level prompts are prefilled at (executors.PREFILL_LEVELS)
        # weight name -> its input's channel maxima on calibration text (the int8 prefill's
        # smoothing, compiler/activations.py; stored as manifest.ACTIVATION_FILE)
        self.activation_max: dict[str, torch.Tensor] | None = None

    def use_cuda_graphs(self, enabled: bool = True, *, max_graphs: int = 16,
                        capture=None) -> "Decoder":
        """Run steps through CUDA graphs, one per (gates, input shapes, cache tensors): a
        decode step is then one replay. The cache tensors (the 4-D inputs) are read and written
        where they are, so a generation's steps share its graph, and generations take their
        cache from `cache_pool`, so later ones of the same batch bucket and rounded length
        replay the graphs of earlier ones (the prefill too, from its second sight of a prompt
        length); the graphs that read a set the pool drops (or a cache's own, grown set) are
        dropped with it. A key seen once runs eagerly. `capture` replaces the CUDA capture
        (tests: a fake one)."""
        self.graphs, self.cache_pool = None, None
        if enabled:
            self.module.region_cache.enabled = False  # the graph computes those values itself
            self.graphs = GraphCache(self.module, max_graphs=max_graphs, capture_after=2,
                                     in_place=lambda tensor: tensor.dim() == 4, capture=capture)
            self.cache_pool = CachePool(on_drop=self.forget_cache)
        else:
            self.module.region_cache.enabled = True
        return self

    def clear_graphs(self) -> None:
        """Forget the captured graphs and the pooled cache (the weights moved)."""
        if self.graphs is not None:
            self.graphs.clear()
            self.cache_pool.clear()

    def forget_cache(self, tensors: list[torch.Tensor]) -> None:
        """K/V `tensors` will not be used again: the graphs that read them go (they would keep
        the tensors in memory until evicted)."""
        if self.graphs is not None:
            self.graphs.forget(tensors)

    @property
    def unpadded_prefill(self) -> bool:
        """Whether a step takes `attention_mask=None` for a prefill from the first slot without
        padding, attending causally without the mask (passes/unpadded_attention.py); artifacts
        before it take a mask always."""
        spec = getattr(self.module, "UNPADDED", None)
        return spec is not None and spec.start == STEP_INPUTS[3]  # cache_position

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the largest buffer's: a bf16 Llama keeps its rotary
        frequencies in fp32)."""
        return max(self.module.buffers(), key=torch.Tensor.numel).dtype

    @property
    def shape(self) -> DecoderShape:
        """The cache shape, in the dtype and on the device the module is now."""
        return dataclasses.replace(self.sizes, dtype=self.dtype, device=self.device)

    def __call__(self, input_ids, attention_mask, position_ids, cache_position, logit_positions,
                 cache, gates=None) -> torch.Tensor:
        if self.executor is not None:
            return self.executor(input_ids, attention_mask, position_ids, cache_position,
                                 logit_positions, cache, gates, self.precision)
        gates = [True] * self.num_gates if gates is None else gates
        inputs = (input_ids, attention_mask, position_ids, cache_position, logit_positions,
                  *cache, gates)
        with torch.no_grad():
            if self.graphs is not None:
                return self.graphs(plan_key(gates, None), *inputs)[0]
            return self.module(*inputs)[0]

    def mlp_layers(self) -> dict[int, int] | None:
        """gate -> the layer whose MLP branch it turns off (None: a gate that is not one)."""
        layers = {}
        for name, gate in self.unit_gates.items():
            found = re.fullmatch(r".*layers\.(\d+)\.mlp", name)
            if found is None:
                return None
            layers[gate] = int(found.group(1))
        return layers

    def cost(self, gates) -> float:
        """FLOP share of a step that runs under `gates` (1.0: the full path)."""
        return 1.0 - sum(region["flops_share"] for region in self.ir["regions"]
                         if region["kind"] == "prunable" and not gates[region["gate"]])

    def gates_from(self, regions: list[dict], gates) -> list[bool]:
        """The decoder's gates for a plan of the main graph (`regions`, `gates`): each MLP runs
        when the main graph's region of the same unit runs; skipped attention branches of the
        plan still run here (they write the cache)."""
        chosen = [True] * self.num_gates
        for region in regions:
            if region["kind"] == "prunable" and region["name"] in self.unit_gates:
                chosen[self.unit_gates[region["name"]]] = bool(gates[region["gate"]])
        return chosen
