"""Attention without its mask when no row is padded (an exact rewrite, chosen per call).

A traced model builds its attention mask in the graph from the `attention_mask` input: the
conjunction of causality (`kv <= q`, decoders) and padding (`attention_mask[b, kv]`), read by
every layer's `scaled_dot_product_attention`. With no padding the padding term is all True,
so the mask says nothing but causality: SDPA's `is_causal=True` without a mask (decoders) or no
mask at all (encoders) computes the same values, with the kernels that take no mask (on CUDA
flash attention where queries and keys are as many, as in a forward; a prefill into a longer
KV cache runs memory-efficient attention without a mask, flash aligning its causal mask
otherwise; on CPU the causal kernel skips the masked blocks: benchmarks/bench_unpadded.py).
transformers makes the same choice in eager mode (`padding_mask.all()`); a trace cannot, since
that is a property of the values.

This pass finds such masks and lets the generated module choose per call: a forward given the
mask input as None (rbcompile/artifact/regions.py `Unpadded`: the artifact passes None when its
`attention_mask` is all ones) fills that input with ones, so every other reader sees what it
did, and drops the mask after the region that makes it; each attention reading it after that
region then runs with `is_causal = (mask is None)` (a decoder's) or no mask (an encoder's). A
mask recognised needs every conjunct to be one of: all True (`new_ones`, `kv >= 0`), causality
`kv <= q` with keys 0.. along dim 3 and queries 0.. along dim 2 (SDPA's `is_causal`, whatever
the two lengths), or an index into the one mask input (through casts and views). The KV-cached
decoder's queries start at `cache_position[0]`: its masks are recorded with that `start`, and
only a prefill from the first slot (`Decoder.unpadded_prefill`, `generate`) drops them.
Anything else (a sliding window, a mask made inside a layer) leaves its attentions as they
were. Causal masks are dropped only
where every attention of the graph is causal (a sliding window's is): a call without padding
then needs no mask either for the tokens the runtime pads the sequence with (they come last).

Only for a traced checkpoint (its inputs are the artifact's); a torch.compile graph is left as
it is: its caller always passes the mask it has. Requires: `ctx:regions` (the mask must reach
its attentions as a region input). Ensures: the graph computes the same values;
`ctx.unpadded` is None or names the mask input, an input of its shape, the masks dropped and
whether they are causal.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from rbcompile.passes.base import FLOPS, REGION, PassContext, PassReport, graph_pass, tensor_val

aten = torch.ops.aten
_ATTENTION = aten.scaled_dot_product_attention.default
_AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
_SAME_VALUES = {aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default,
                aten.view.default, aten.reshape.default, aten.clone.default}


def _index(node) -> tuple | None:
    """(offset, dim, rank) of `arange(length) + offset` (an int or a node) unsqueezed so that
    its values lie along `dim` of a `rank`-D tensor; else None."""
    dims = []
    while isinstance(node, Node) and node.target is aten.unsqueeze.default:
        dims.append(node.args[1])
        node = node.args[0]
    offset = 0
    if isinstance(node, Node) and node.target is aten.add.Tensor and not node.kwargs:
        node, offset = node.args
    if not (isinstance(node, Node) and node.target is aten.arange.default and len(node.args) == 1):
        return None
    dim, rank = 0, 1
    for unsqueezed in reversed(dims):  # innermost first
        unsqueezed = unsqueezed if unsqueezed >= 0 else unsqueezed + rank + 1
        dim += unsqueezed <= dim
        rank += 1
    return offset, dim, rank


def _source_input(node) -> Node | None:
    """The graph input `node` holds the values of (through casts and views), or None."""
    while isinstance(node, Node) and node.target in _SAME_VALUES:
        node = node.args[0]
    return node if isinstance(node, Node) and node.op == "placeholder" else None


def _first_of(node) -> Node | None:
    """The graph input whose first value `node` is (`input[0]`), or None."""
    if (isinstance(node, Node) and node.target is aten.select.int and tuple(node.args[1:]) == (0, 0)
            and isinstance(node.args[0], Node) and node.args[0].op == "placeholder"):
        return node.args[0]
    return None


def _term(node) -> tuple[str, object] | None:
    """What one conjunct of a mask is without padding: ("true", None), ("padding", the input
    it indexes), or ("causal", start): `kv <= q` over keys 0.. and queries 0.. (what SDPA's
    `is_causal` masks, whatever the two lengths), start None; or queries from `start[0]` on, an
    input (the KV-cached decoder's cache positions): causal that way when it is 0, a prefill
    from the first slot. None for anything else."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target is aten.new_ones.default and node.kwargs.get("dtype") is torch.bool:
        return "true", None
    if node.target is aten.ge.Scalar and node.args[1] == 0:
        index = _index(node.args[0])
        return ("true", None) if index is not None and index[0] == 0 else None
    if node.target is aten.le.Tensor:
        kv, q = (_index(arg) for arg in node.args)
        if not (kv and q and kv[0] == 0 and (kv[1:], q[1:]) == ((3, 4), (2, 4))):
            return None
        start = None if q[0] == 0 else _first_of(q[0])
        return ("causal", start) if q[0] == 0 or start is not None else None
    if node.target is aten.index.Tensor:
        source = _source_input(node.args[0])
        return ("padding", source) if source is not None else None
    return None


def _conjuncts(node) -> list:
    """The terms of `node` read as a conjunction (through broadcasts); a term `_term` does not
    know is ("other", node)."""
    if isinstance(node, Node) and node.target is aten.expand.default:
        return _conjuncts(node.args[0])
    if isinstance(node, Node) and node.target in _AND:
        return [term for arg in node.args for term in _conjuncts(arg)]
    return [_term(node) or ("other", node)]


def _bool_mask(mask) -> Node | None:
    """The bool mask behind an attention's mask: itself, or what an additive conversion
    (`where(mask, 0, -inf)`, passes/share_attention_masks.py) converts."""
    if not isinstance(mask, Node):
        return None
    if mask.target is aten.where.self:
        zero, minus_inf = (arg.args[0] if isinstance(arg, Node)
                           and arg.target is aten.scalar_tensor.default else None
                           for arg in mask.args[1:])
        return mask.args[0] if (zero, minus_inf) == (0.0, float("-inf")) else None
    value = tensor_val(mask)
    return mask if value is not None and value.dtype == torch.bool else None


def _unpadded_form(mask) -> tuple[Node, bool, Node | None] | None:
    """(the mask input, causal, the input whose first value must be 0) when `mask` without
    padding is causality or nothing."""
    terms = _conjuncts(_bool_mask(mask))
    inputs = {source for kind, source in terms if kind == "padding"}
    starts = {start for kind, start in terms if kind == "causal"}
    if len(inputs) != 1 or len(starts) > 1 or any(kind == "other" for kind, _ in terms):
        return None
    return inputs.pop(), bool(starts), next(iter(starts), None)


def _causal(attention: Node) -> bool:
    """Whether `attention` is causal whatever else its mask says: a key after the query's
    position is never read (`is_causal`, or causality among its mask's conjuncts)."""
    flag = attention.args[5] if len(attention.args) > 5 else attention.kwargs.get("is_causal")
    if flag is True:
        return True
    mask = attention.args[3] if len(attention.args) > 3 else attention.kwargs.get("attn_mask")
    return any(kind == "causal" for kind, _ in _conjuncts(_bool_mask(mask)))


def _later(mask: Node) -> list[Node]:
    """The readers of `mask` in regions after its own."""
    return [user for user in mask.users if user.meta[REGION] != mask.meta[REGION]]


def _fill_shape(gm: GraphModule, mask_input: Node) -> list[list] | None:
    """[input, dim] per dimension of the mask input: another graph input as long there (the
    token ids' rows and columns; the decoder's slots: a cache's), or None."""
    def sizes(node):
        value = tensor_val(node)
        return [] if value is None else [str(size) for size in value.shape]

    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n is not mask_input]
    found = [next(([n.name, sizes(n).index(size)] for n in inputs if size in sizes(n)), None)
             for size in sizes(mask_input)]
    return None if not found or None in found else found


@graph_pass(requires=("ctx:regions",))
def unpadded_attention(gm: GraphModule, ctx: PassContext) -> PassReport:
    ctx.unpadded = None
    if ctx.architecture is None:
        return PassReport(False, "a torch.compile graph: its caller passes the mask it has")
    every_attention = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _ATTENTION]
    attentions = [n for n in every_attention if 3 < len(n.args) < 6 and "is_causal" not in n.kwargs]
    forms = {}  # mask -> (input, causal)
    for attention in attentions:
        mask = attention.args[3]
        if mask not in forms:
            forms[mask] = _unpadded_form(mask)
    # read after the region that makes it only by attentions, as their mask (readers in that
    # region see the mask: in the KV-cached decoder, layer 0's attention)
    forms = {mask: form for mask, form in forms.items() if form is not None and _later(mask)
             and all(user in attentions and user.args[3] is mask for user in _later(mask))}
    kinds = set(forms.values())
    if len(kinds) != 1:
        return PassReport(False, "no attention mask without padding is causality or nothing"
                          if not kinds else "masks of different inputs or kinds: left alone")
    (mask_input, causal, start), = kinds
    if mask_input.name != ctx.architecture.mask_input:
        return PassReport(False, f"masks made from {mask_input.name}, not the mask input: left alone")
    if causal and not all(map(_causal, every_attention)):
        # a call without padding then takes no mask even where the runtime pads the sequence
        return PassReport(False, "causal masks beside an attention that is not causal: left alone")
    like = _fill_shape(gm, mask_input)
    if like is None:
        return PassReport(False, f"no inputs of {mask_input.name}'s sizes to fill it from")
    if causal:
        for mask in forms:
            for attention in _later(mask):
                with gm.graph.inserting_before(attention):
                    absent = gm.graph.call_function(operator.is_, (mask, None))
                absent.meta.update({k: v for k, v in attention.meta.items() if k != "val"},
                                   val=False, **{FLOPS: 0})
                attention.kwargs = {**attention.kwargs, "is_causal": absent}
    gm.recompile()
    ctx.unpadded = {"input": mask_input.name, "like": like, "masks": [mask.name for mask in forms],
                    "causal": causal, "start": start and start.name}
    readers = sum(len(_later(mask)) for mask in forms)
    return PassReport(True, f"{readers} attentions run unmasked ({'causal' if causal else 'no mask'})"
                      f" when {mask_input.name} has no padding", {"attentions": readers,
                                                                   "masks": len(forms)})
