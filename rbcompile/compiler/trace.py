"""Capture a transformers model as an ATen-level torch.fx graph with torch.export."""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass

import torch
from transformers import StaticCache

from rbcompile.artifact.architectures import DECODER, Architecture
from rbcompile.artifact.cache_pool import zeros
from rbcompile.artifact.decoder import STEP_INPUTS
from rbcompile.artifact.heads import CLASSIFIERS, ClassifierOutputs, module_head
from rbcompile.errors import CompileError, first_line

logger = logging.getLogger("rbcompile.compiler.trace")


@dataclass
class TracedModel:
    graph_module: torch.fx.GraphModule  # parameters as get_attr nodes, nn_module_stack in meta
    input_names: tuple[str, ...]
    output_names: list[str]
    max_positions: int


def example_inputs(architecture: Architecture, vocab_size: int, batch: int = 2, seq: int = 8,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Inputs used for tracing (the token ids, then the attention mask, under the
    architecture's input names): the sizes are irrelevant, batch and sequence stay dynamic."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[-1, : seq // 4] = 0  # one padded row so the mask path is traced generally
    ids_name, = (name for name in architecture.inputs if name != architecture.mask_input)
    return {ids_name: input_ids.to(device), architecture.mask_input: attention_mask.to(device)}


def model_placement(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """(device, float dtype) of a model's parameters."""
    floats = [p for p in model.parameters() if p.is_floating_point()]
    first = floats[0] if floats else next(model.parameters())
    return first.device, first.dtype


def _export(model, kwargs, dims: dict, family: str):
    dynamic = {name: dict(dims) for name in kwargs}
    if family == DECODER:
        kwargs = {**kwargs, "use_cache": False}
        dynamic["use_cache"] = None
    with torch.no_grad():
        return torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=dynamic, strict=False)


@contextlib.contextmanager
def tracing_grouped_heads():
    """While tracing, transformers' SDPA attention reads grouped K/V heads in place
    (`enable_gqa=True`) instead of through `repeat_kv` copies: the graph the `gqa_attention`
    pass makes of the copies, traced without them (their expand + reshape over dynamic shapes
    was a third of a KV-cached decoder's trace time; the generated module chooses the form per
    call, rbcompile/artifact/attention.py). transformers' own switch, `use_gqa_in_sdpa`, is patched for
    the duration. Without the switch nothing changes and the pass rewrites the copies."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:   # transformers without it: nothing to switch
        sdpa_attention = None
    original = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if original is None:
        yield
        return
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: True
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = original


def export_or_retry(export, what: str):
    """`export(dims)` (under `tracing_grouped_heads`) with named dimensions first; where an older
    torch finds a narrower valid range than that (torch 2.11 on some decoders: "Constraints
    violated (seq)"), `Dim.DYNAMIC` lets export refine the range instead of failing, and the
    runtime's own input checks stay in force. Any other failure is a one-line CompileError."""
    with tracing_grouped_heads():
        return _export_or_retry(export, what)


def _export_or_retry(export, what: str):
    try:
        try:
            return export(None)
        except Exception as exc:
            if "Constraints violated" not in str(exc):
                raise
            logger.info("torch.export: %s; retrying with Dim.DYNAMIC",
                        " ".join(str(exc).split())[:300])
            exported = export(torch.export.Dim.DYNAMIC)
            logger.debug("torch.export ranges: %s", exported.range_constraints)
            return exported
    except Exception as exc:
        raise CompileError(f"torch.export failed for {what}: {first_line(exc)}") from None


def _output_names(exported) -> list[str]:
    out_spec = exported.call_spec.out_spec
    names = list(out_spec.context) if isinstance(out_spec.context, list) else []
    return names or [f"output_{i}" for i in range(out_spec.num_leaves)]


def _trace(model: torch.nn.Module, architecture: Architecture, config=None) -> TracedModel:
    dims = architecture.dimensions(config or model.config)
    limit, family = dims.max_positions, architecture.family
    kwargs = example_inputs(architecture, dims.vocab, seq=min(8, limit),
                            device=model_placement(model)[0])
    kwargs = {name: kwargs[name] for name in architecture.inputs}

    def export(dynamic):
        named = {0: dynamic or torch.export.Dim("batch", min=1, max=4096),
                 1: dynamic or torch.export.Dim("seq", min=1, max=limit)}
        return _export(model, kwargs, named, family)

    exported = export_or_retry(export, type(model).__name__)
    return TracedModel(exported.module(), architecture.inputs, _output_names(exported), limit)


def trace(model: torch.nn.Module, architecture: Architecture) -> TracedModel:
    """torch.export the model with dynamic batch and sequence (1..4096 rows, 1..max positions),
    `use_cache=False`. A classifier (heads.py) is traced for its `logits` and the encoder's
    `last_hidden_state`, with the parameter and module paths of the classifier itself."""

    if module_head(model, architecture.family) not in CLASSIFIERS:
        return _trace(model, architecture)
    traced = _trace(ClassifierOutputs(model), architecture, model.config)
    traced.graph_module = _strip_prefix(traced.graph_module, "model")
    return traced


def _strip_prefix(gm: torch.fx.GraphModule, prefix: str) -> torch.fx.GraphModule:
    """The graph of a wrapper's submodule `prefix` as a graph over that submodule: parameter
    targets and module paths without `prefix.`, the wrapper's own stack entry dropped."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and not node.users:  # export's `_guards_fn` check
            gm.graph.erase_node(node)
        elif node.op == "get_attr":
            node.target = node.target[len(prefix) + 1:]
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {
                key: ("" if path == prefix else path[len(prefix) + 1:], kind)
                for key, (path, kind) in stack.items()
                if path == prefix or path.startswith(prefix + ".")}
    return torch.fx.GraphModule(gm.get_submodule(prefix), gm.graph)


# ---- decoders with a static KV cache -----------------------------------------------------------



def cache_names(layers: int) -> tuple[str, ...]:
    """Graph input names of the cache tensors: key_cache_0, value_cache_0, key_cache_1, ..."""
    return tuple(f"{kind}_cache_{i}" for i in range(layers) for kind in ("key", "value"))


class CachedDecoder(torch.nn.Module):
    """A causal LM called with its static K/V cache as tensors (gpt-fast style), the calling
    convention of an artifact's decoder:

    `(input_ids [B, T], attention_mask [B, max_len], position_ids [B, T], cache_position [T],
    logit_positions [K], key_cache_0, value_cache_0, ...) -> logits [B, K, vocab]`: the logits
    of the K positions (indices into T) asked for (a prefill needs only its last; verifying
    drafts needs all T), the vocabulary projection being the largest matmul of a small
    model's prefill. Each cache tensor is [B, KV heads, max_len, head dim] and gets the T new
    keys / values at slots `cache_position`, in place.
    `attention_mask` is 0 only on left-pad slots (later slots are masked by causality), so a
    cache rolls back by writing over it. transformers' StaticCache holds the given tensors
    (it allocates nothing); its layers write at `cache_position` and report `cache_position[0]`
    as the length before this call (the causal mask's offset)."""

    def __init__(self, model: torch.nn.Module, max_len: int):
        super().__init__()
        self.model, self.max_len = model, max_len

    def forward(self, input_ids, attention_mask, position_ids, cache_position, logit_positions,
                *cache):

        static = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        for layer, keys, values in zip(static.layers, cache[0::2], cache[1::2], strict=True):
            layer.keys, layer.values, layer.device = keys, values, keys.device
            layer.batch_size, layer.num_heads = keys.shape[:2]
            layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
            layer.max_cache_len = keys.shape[2]  # the cache's length is the caller's choice
            layer.cumulative_length = cache_position[0]  # the causal mask's query offset
            layer.cumulative_length_int = cache_position[0]  # (a sliding-window layer's)
            layer.update = _writer(keys, values, cache_position)
            # every slot holds its own token (no rolling window buffer): a sliding-window
            # layer's mask is the full length from slot 0, its window applied by position
            layer.get_mask_sizes = _full_mask_sizes(keys)
            layer.is_initialized = True
        config = self.model.config
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            attention_mask = _layer_masks(config, attention_mask, position_ids, cache_position,
                                          self.model.dtype)
        elif getattr(config, "layer_types", None) is None and window and window < self.max_len:
            # every layer sliding (Mistral): one 4-D mask, which transformers takes as it is
            attention_mask = _layer_masks(config, attention_mask, position_ids, cache_position,
                                          self.model.dtype)["sliding_attention"]
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=True,
                          logits_to_keep=logit_positions, **{cache_keyword(self.model): static}).logits


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a transformers model takes its Cache object by: `cache` in recent transformers,
    `past_key_values` in older ones (5.17, the GPU machine's). Both forwards take `**kwargs`, so
    the wrong name would be dropped silently and the model would make a cache of its own."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _layer_masks(config, attention_mask, position_ids, cache_position, dtype) -> dict:
    """The 4-D masks of full and sliding-window layers (Gemma 2 / 3, Mistral), by layer type.
    transformers measures a sliding window in cache slots; here a row's slots are not its
    positions once speculation masks its rejected slots, so the window is measured between the
    query's position and each slot's (its unmasked slots before it)."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in ("eager", "sdpa"):
        raise CompileError(f"sliding-window layers with attention {implementation!r}: the KV-cached "
                           "decoder builds their masks for 'eager' and 'sdpa' only")
    slots = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    full = ((attention_mask[:, None, None, :] == 1)
            & (slots[None, None, None, :] <= cache_position[None, None, :, None]))
    key_positions = attention_mask.cumsum(-1) - 1
    near = (position_ids[:, None, :, None] - key_positions[:, None, None, :]) < config.sliding_window
    masks = {"full_attention": full, "sliding_attention": full & near}
    if implementation == "sdpa":  # a pad query attending nothing would give NaN: let it attend
        masks = {kind: mask | ~mask.any(-1, keepdim=True) for kind, mask in masks.items()}
    else:
        low = torch.finfo(dtype).min
        masks = {kind: torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), low)
                 for kind, mask in masks.items()}
    return masks


def _full_mask_sizes(keys: torch.Tensor):
    """`get_mask_sizes` of a layer whose cache slots are absolute positions: (length, offset 0)."""
    def get_mask_sizes(*args, **kwargs):
        return keys.shape[2], 0
    return get_mask_sizes


def _writer(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
    """StaticLayer.update without its length counter: the new K/V go to `slots`, in place."""
    def update(key_states, value_states, *args, **kwargs):
        keys.index_copy_(2, slots, key_states)
        values.index_copy_(2, slots, value_states)
        return keys, values
    return update


def cached_example_inputs(dims, max_len: int, batch: int, seq: int, dtype, device) -> dict:
    """Inputs of a prefill of `seq` tokens into an empty cache (for tracing and FLOP counts)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, dims.vocab, (batch, seq), generator=generator),
              "attention_mask": torch.ones(batch, max_len, dtype=torch.long),
              "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
              "cache_position": torch.arange(seq), "logit_positions": torch.arange(seq)}
    inputs = {name: value.to(device) for name, value in inputs.items()}
    cache = zeros(2 * dims.layers, (batch, dims.kv_heads, max_len, dims.head_dim), dtype, device)
    return {**inputs, **dict(zip(cache_names(dims.layers), cache))}


def _unwrap(gm: torch.fx.GraphModule, names: tuple[str, ...]) -> torch.fx.GraphModule:
    """The exported CachedDecoder as a graph over the model itself: parameter targets and module
    paths without the wrapper's `model.` prefix (the same names as the uncached graph's), and
    the placeholders named `names`."""
    prefix = "model."
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and not node.users:  # export's `_guards_fn` check
            gm.graph.erase_node(node)
        elif node.op == "get_attr":
            node.target = node.target[len(prefix):]
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {
                key: (path[len(prefix):], kind) for key, (path, kind) in stack.items()
                if path.startswith(prefix)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names, strict=True):
        node.target = name
        node._rename(name)
    gm.graph._codegen = torch.fx.graph.CodeGen()  # plain positional inputs, no pytree specs
    return torch.fx.GraphModule(gm.get_submodule("model"), gm.graph)


def trace_cached(model: torch.nn.Module, architecture: Architecture, max_len: int) -> TracedModel:
    """torch.export `CachedDecoder(model)`: one graph for prefill (T tokens) and decode (T = 1),
    dynamic batch (1..4096), T (1..max_len) and cache length (2..max_len: each generation
    allocates what it needs); the cache writes are in-place `index_copy_` nodes on the cache
    inputs."""
    if architecture.family != DECODER:
        raise CompileError(f"a KV cache is for decoders; {architecture.model_type} is an encoder")
    dims = architecture.dimensions(model.config)
    device, dtype = model_placement(model)
    names = STEP_INPUTS + cache_names(dims.layers)
    # batch, T and K of 2 or more (export specialises sizes 0 and 1) and unequal (it would
    # take equal sizes for the same size), a short cache
    example = cached_example_inputs(dims, min(max_len, 32), batch=2, seq=4, dtype=dtype,
                                    device=device)
    example["logit_positions"] = example["logit_positions"][1:]
    wrapper = CachedDecoder(model, max_len).eval()

    def export(dynamic):
        batch = dynamic or torch.export.Dim("batch", min=1, max=4096)
        seq = dynamic or torch.export.Dim("seq", min=1, max=max_len)
        length = dynamic or torch.export.Dim("cache_len", min=2, max=max_len)
        kept = dynamic or torch.export.Dim("kept", min=1, max=max_len)
        shapes = ({0: batch, 1: seq}, {0: batch, 1: length}, {0: batch, 1: seq}, {0: seq}, {0: kept},
                  tuple({0: batch, 2: length} for _ in range(2 * dims.layers)))
        with torch.no_grad():
            return torch.export.export(wrapper, tuple(example[n] for n in names),
                                       dynamic_shapes=shapes, strict=False)

    exported = export_or_retry(export, f"{type(model).__name__} with a KV cache")
    graph_module = _unwrap(exported.module(), names)
    writes = sum(node.target is torch.ops.aten.index_copy_.default for node in graph_module.graph.nodes)
    if writes != 2 * dims.layers:
        raise CompileError(f"the KV-cached trace of {type(model).__name__} writes {writes} cache "
                           f"tensors in place, not {2 * dims.layers} (a transformers version whose "
                           "cache interface rbcompile does not know?)")
    return TracedModel(graph_module, names, ["logits"], max_len)
