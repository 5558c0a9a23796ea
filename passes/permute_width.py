"""Reorder attention heads and MLP channels by descending importance (an exact rewrite).

Requires: `ctx:units`, `ctx:width_importance` (per unit: "heads" and/or "channels" scores).
Ensures: `ctx:permutations`. Every parameter that holds heads or channels is permuted in place
along the right axis (q/k/v rows and the output projection's columns; gate/up rows and the down
projection's columns; GPT-2's fused c_attn per q/k/v block). GQA-aware: key/value groups move
with their query heads. The function is unchanged (fp32 within 1e-5), and afterwards keeping the
top-k heads or channels is a contiguous slice.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

from ..errors import CompileError
from .base import PassContext, PassResult, graph_pass

# family -> unit part -> [(parameter name under the block, axis, index space, fused blocks)]
# index space: "q" (query heads), "kv" (key/value heads) or "channels".
PERMUTATION_SPECS = {
    "llama": {
        "heads": [("self_attn.q_proj.weight", 0, "q", 1), ("self_attn.q_proj.bias", 0, "q", 1),
                  ("self_attn.k_proj.weight", 0, "kv", 1), ("self_attn.k_proj.bias", 0, "kv", 1),
                  ("self_attn.v_proj.weight", 0, "kv", 1), ("self_attn.v_proj.bias", 0, "kv", 1),
                  ("self_attn.o_proj.weight", 1, "q", 1)],
        "channels": [("mlp.gate_proj.weight", 0, "channels", 1), ("mlp.up_proj.weight", 0, "channels", 1),
                     ("mlp.gate_proj.bias", 0, "channels", 1), ("mlp.up_proj.bias", 0, "channels", 1),
                     ("mlp.down_proj.weight", 1, "channels", 1)],
    },
    "gpt2": {  # Conv1D stores weights as [in, out]
        "heads": [("attn.c_attn.weight", 1, "q", 3), ("attn.c_attn.bias", 0, "q", 3),
                  ("attn.c_proj.weight", 0, "q", 1)],
        "channels": [("mlp.c_fc.weight", 1, "channels", 1), ("mlp.c_fc.bias", 0, "channels", 1),
                     ("mlp.c_proj.weight", 0, "channels", 1)],
    },
    "bert": {
        "heads": [(f"attention.self.{p}.{t}", 0, "q", 1) for p in ("query", "key", "value")
                  for t in ("weight", "bias")] + [("attention.output.dense.weight", 1, "q", 1)],
        "channels": [("intermediate.dense.weight", 0, "channels", 1),
                     ("intermediate.dense.bias", 0, "channels", 1),
                     ("output.dense.weight", 1, "channels", 1)],
    },
}
FAMILY_OF = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2", "bert": "bert"}


def head_orders(scores: list[float], kv_heads: int) -> tuple[list[int], list[int]]:
    """(query head order, key/value head order): KV groups by summed score, descending, each
    followed by its own query heads (also by score)."""
    heads = len(scores)
    group = heads // kv_heads
    group_score = [sum(scores[g * group:(g + 1) * group]) for g in range(kv_heads)]
    kv_order = sorted(range(kv_heads), key=lambda g: -group_score[g])
    q_order = [h for g in kv_order
               for h in sorted(range(g * group, (g + 1) * group), key=lambda h: -scores[h])]
    return q_order, kv_order


def _expand(order: list[int], unit_size: int, blocks: int) -> torch.Tensor:
    """Index of rows/columns for an order of units of `unit_size`, repeated per fused block."""
    per_block = torch.tensor([u * unit_size + i for u in order for i in range(unit_size)])
    stride = len(order) * unit_size
    return torch.cat([per_block + b * stride for b in range(blocks)])


@graph_pass(requires=("ctx:units", "ctx:width_importance"), ensures=("ctx:permutations",))
def permute_width(gm: GraphModule, ctx: PassContext) -> PassResult:
    spec = PERMUTATION_SPECS.get(FAMILY_OF.get(ctx.config.model_type))
    if spec is None:
        raise CompileError(f"no width permutation for model_type {ctx.config.model_type!r}")
    params = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    permutations, moved = {}, 0
    for unit in ctx.units:
        scores = ctx.width_importance.get(unit.name, {})
        block_path = ctx.blocks[unit.layer].module_path
        orders = {}
        if "heads" in scores:
            orders["q"], orders["kv"] = head_orders(scores["heads"], unit.width["kv_heads"])
        if "channels" in scores:
            orders["channels"] = sorted(range(len(scores["channels"])),
                                        key=lambda c: -scores["channels"][c])
        for part in ("heads", "channels"):
            if part not in scores:
                continue
            found = 0
            for suffix, axis, space, blocks in spec[part]:
                name = f"{block_path}.{suffix}"
                if name not in params:
                    continue
                unit_size = 1 if space == "channels" else unit.width["head_dim"]
                index = _expand(orders[space], unit_size, blocks)
                tensor = operator.attrgetter(name)(gm)
                with torch.no_grad():
                    tensor.copy_(tensor.index_select(axis, index))
                found += 1
            if found < 2:
                raise CompileError(f"{unit.name}: parameters for its {part} not found under "
                                   f"{block_path}")
            moved += found
        permutations[unit.name] = {k: v for k, v in orders.items()}
    ctx.permutations = permutations
    return PassResult(bool(permutations), f"reordered heads/channels of {len(permutations)} units "
                      f"by importance ({moved} parameters permuted in place)",
                      {"units": len(permutations), "parameters": moved})
