"""Measure each node's FLOPs by running the graph once at a reference input shape.

Requires: canonical graph with real parameters. Ensures `meta:rb_flops` (matmul-class FLOPs
counted by torch.utils.flop_counter: linear, matmul, attention, ...) and, for tensor values,
`rb_shape` (the concrete shape at the reference input; batch 1, `REFERENCE_SEQ` tokens).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Interpreter
from torch.utils.flop_counter import FlopCounterMode

from rbcompile.passes.base import FLOPS, SHAPE, PassContext, PassReport, compute_nodes, graph_pass

REFERENCE_SEQ = 128


class _FlopInterpreter(Interpreter):
    def run_node(self, node):
        if node.op != "call_function":
            return super().run_node(node)
        with FlopCounterMode(display=False) as counter:
            result = super().run_node(node)
        node.meta[FLOPS] = int(counter.get_total_flops())
        if isinstance(result, torch.Tensor):
            node.meta[SHAPE] = tuple(result.shape)
        return result


@graph_pass(ensures=("meta:" + FLOPS,))
def annotate_flops(gm: GraphModule, ctx: PassContext) -> PassReport:
    inputs = [ctx.reference_inputs[name] for name in ctx.input_names]
    with torch.no_grad():
        _FlopInterpreter(gm).run(*inputs)
    total = sum(n.meta[FLOPS] for n in compute_nodes(gm))
    seq = next(x.shape[1] for x in inputs if isinstance(x, torch.Tensor) and x.dim() == 2)
    return PassReport(False, f"{total / 1e9:.3f} GFLOPs per forward at batch 1 x {seq} tokens",
                      {"total_flops": total, "reference_seq": seq})
