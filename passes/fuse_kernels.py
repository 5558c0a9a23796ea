"""Replace norm and activation patterns with the fused kernels of `rbcompile.kernels`.

Requires: `ctx:regions` (a pattern is fused only when all its nodes lie in one region, so
guarded branches keep their boundaries; mark_seams then fuses across them). Runs only with
`ctx.kernels` set (on by default for CUDA; on CPU the kernels run their PyTorch references,
which inductor cannot fuse through). Ensures: the graph computes the same values; fused nodes
keep the region, kind and unit of the node they replace.

Patterns, on ATen graphs from torch.export and from the torch.compile backend (aot_autograd):
- HF RMSNorm: `w * (x * rsqrt(mean(x^2, -1) + eps))` (with fp32 casts) -> `rms_norm`;
- `layer_norm(x, ...)` -> `layer_norm`;
- a residual add feeding either norm in the same region -> `add_rms_norm` / `add_layer_norm`
  (the new residual comes back as the op's second output);
- `silu(gate) * up` (either order) -> `swiglu`;
- `gelu(linear(x, W, b))` (erf or tanh) and the tanh formula of GPT-2's NewGELU, with its
  bias when the producing matmul has one -> `linear(x, W)` + `gelu_bias`;
- rotary embedding `x * cos + cat(-x2, x1) * sin` (transformers' `apply_rotary_pos_emb`, per
  q / k, partial rotary included) -> `rotary`; two of them with one `cos` / `sin` in one region
  (q's and k's) -> `rotary_pair` (one launch);
- a static cache's K and V writes (`index_copy_` at one position into two graph inputs, one
  region: the KV-cached decoder) -> `write_kv`; what read the writes' results reads the caches;
- a `rotary_pair` whose rotated k only a `write_kv` in its region reads -> `rotary_write_kv`
  (k rotated straight into its cache slots; one launch where two were).
Norms and activations left as they were (a form no pattern matches: Gemma's `(1 + w)` RMSNorm)
are counted in the pass log ("left unfused: ...").
"""
from __future__ import annotations

import math
import operator
from collections import Counter

import torch
from torch.fx import GraphModule, Node

from rbcompile.kernels import OPS as ops
from rbcompile.passes.base import REGION, PassContext, PassReport, graph_pass, tensor_val

aten = torch.ops.aten
_CASTS = {aten.to.dtype, aten._to_copy.default}


def _call(node, target, n_args: int | None = None) -> bool:
    return (isinstance(node, Node) and node.op == "call_function" and node.target == target
            and (n_args is None or len(node.args) == n_args))


def _uncast(node: Node) -> Node:
    return node.args[0] if _call(node, aten.to.dtype) or _call(node, aten._to_copy.default) else node


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _scalar_arg(node: Node, value: float) -> Node | None:
    """The tensor operand of `node` when its other operand is the number `value`."""
    a, b = node.args[:2]
    if isinstance(b, (int, float)) and math.isclose(b, value, rel_tol=1e-6):
        return a
    if isinstance(a, (int, float)) and math.isclose(a, value, rel_tol=1e-6):
        return b
    return None


def _match_rms_norm(rsqrt: Node):
    """(x, weight, eps, nodes, output) of an HF RMSNorm around `rsqrt`, or None."""
    add = rsqrt.args[0]
    if not _call(add, aten.add.Tensor) or not isinstance(add.args[1], float):
        return None
    mean = add.args[0]
    if not (_call(mean, aten.mean.dim) and list(mean.args[1]) == [-1]
            and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim"))):
        return None
    power = mean.args[0]
    if not (_call(power, aten.pow.Tensor_Scalar) and power.args[1] == 2):
        return None
    x = power.args[0]
    scaled = _only_user(rsqrt)
    if not _call(scaled, aten.mul.Tensor) or set(scaled.args) != {x, rsqrt}:
        return None
    cast = _only_user(scaled)
    nodes = [power, mean, add, rsqrt, scaled]
    if cast is not None and cast.target in _CASTS:
        nodes.append(cast)
        scaled = cast
    out = _only_user(scaled)
    if not _call(out, aten.mul.Tensor):
        return None
    weight = out.args[0] if out.args[1] is scaled else out.args[1]
    if not isinstance(weight, Node) or weight.op != "get_attr":
        return None
    if any(len(n.users) != 1 for n in nodes):
        return None
    return _uncast(x), weight, add.args[1], nodes + [out], out


def _match_new_gelu(out: Node):
    """x of `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` ending at `out`, or None."""
    if not _call(out, aten.mul.Tensor):
        return None
    half, one_plus = out.args[:2]
    if not (_call(half, aten.mul.Tensor) and _call(one_plus, aten.add.Tensor)):
        return None
    x = _scalar_arg(half, 0.5)
    tanh = _scalar_arg(one_plus, 1.0)
    if x is None or not _call(tanh, aten.tanh.default):
        return None
    inner = _scalar_arg(tanh.args[0], math.sqrt(2 / math.pi)) if _call(tanh.args[0], aten.mul.Tensor) else None
    if not _call(inner, aten.add.Tensor) or x not in inner.args:
        return None
    cubic = inner.args[1] if inner.args[0] is x else inner.args[0]
    cube = _scalar_arg(cubic, 0.044715) if _call(cubic, aten.mul.Tensor) else None
    if not (_call(cube, aten.pow.Tensor_Scalar) and cube.args[0] is x and cube.args[1] == 3):
        return None
    nodes = [half, cube, cubic, inner, tanh.args[0], tanh, one_plus, out]
    if any(user not in nodes for n in nodes[:-1] for user in n.users):
        return None
    return x, nodes


def _half_of(node, low: bool) -> Node | None:
    """x when `node` is `x[..., :D // 2]` (`low`) or `x[..., D // 2:]` (D: x's last dimension,
    a fixed size), as `aten.slice.Tensor`; else None."""
    if not _call(node, aten.slice.Tensor) or len(node.args) != 4:
        return None
    x, dim, start, end = node.args
    val = tensor_val(x)
    if not (_on_last_dim(x, dim) and all(isinstance(v, int) for v in (val.shape[-1], start, end))):
        return None
    width = val.shape[-1]
    halves = start == 0 and end == width // 2 if low else start == width // 2 and end >= width
    return x if halves else None


def _on_last_dim(node, dim) -> bool:
    """`dim` (an int, maybe negative) is the last dimension of the tensor `node` computes."""
    val = tensor_val(node)
    return val is not None and isinstance(dim, int) and dim % val.dim() == val.dim() - 1


def _match_rotary(add: Node):
    """(x, cos, sin, nodes) of `x * cos + cat(-x2, x1) * sin` ending at `add` (transformers'
    `apply_rotary_pos_emb` for one of q / k; x1, x2 the halves of x's last dimension), or None."""
    if not _call(add, aten.add.Tensor, 2) or add.kwargs:  # no alpha
        return None
    for straight, turned in (add.args, add.args[::-1]):
        if not (_call(straight, aten.mul.Tensor, 2) and _call(turned, aten.mul.Tensor, 2)):
            continue
        for cat, sin in (turned.args, turned.args[::-1]):
            if not (_call(cat, aten.cat.default) and len(cat.args[0]) == 2
                    and _on_last_dim(cat, cat.args[1] if len(cat.args) > 1 else 0)):
                continue
            neg, low = cat.args[0]
            if not _call(neg, aten.neg.default):
                continue
            x = _half_of(low, low=True)
            if x is None or _half_of(neg.args[0], low=False) is not x or x not in straight.args:
                continue
            cos = straight.args[1] if straight.args[0] is x else straight.args[0]
            nodes = [low, neg.args[0], neg, cat, turned, straight]
            if all(isinstance(n, Node) for n in (cos, sin)) and all(len(n.users) == 1 for n in nodes):
                return x, cos, sin, nodes + [add]
    return None


class _Fuser:
    def __init__(self, gm: GraphModule):
        self.gm, self.counts = gm, Counter()
        self.renamed: dict[str, str] = {}
        self.erased: set[Node] = set()

    def same_region(self, nodes) -> bool:
        return len({n.meta.get(REGION) for n in nodes if n.op == "call_function"}) == 1

    def replace(self, kind: str, anchor: Node, target, args, outputs: list[Node | None],
                removed: list[Node]) -> None:
        """Insert `target(*args)` at `anchor`; output i replaces `outputs[i]` (None: unused)."""
        graph = self.gm.graph
        meta = {k: v for k, v in anchor.meta.items() if k != "val"}
        with graph.inserting_before(anchor):
            fused = graph.call_function(target, tuple(args))
            fused.meta.update(meta)
            if len(outputs) == 1:
                results = [fused]
            else:
                results = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(outputs))]
                for result in results:
                    result.meta.update(meta)
        for old, new in zip(outputs, results):
            if old is not None:
                new.meta["val"] = old.meta.get("val")
                old.replace_all_uses_with(new)
                self.renamed[old.name] = new.name
        for node in reversed(removed):
            if not node.users:
                graph.erase_node(node)
                self.erased.add(node)
        self.counts[kind] += 1

    def _residual(self, x: Node, anchor: Node, pattern: list[Node]) -> Node | None:
        """`x` when it is a residual add in the pattern's region whose other users all come after
        `anchor` (they read the fused op's second output instead)."""
        if not _call(x, aten.add.Tensor) or not all(isinstance(a, Node) for a in x.args[:2]):
            return None
        if len(x.args) > 2 or x.kwargs.get("alpha", 1) != 1 or not self.same_region([x, *pattern]):
            return None
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        if any(order[user] < order[anchor] for user in x.users if user not in pattern):
            return None
        vals = [a.meta.get("val") for a in x.args[:2]]
        same = all(isinstance(v, torch.Tensor) for v in vals) and vals[0].shape == vals[1].shape
        return x if same else None

    def norm(self, kind, anchor, x, params, pattern, plain, with_add) -> None:
        add = self._residual(x, anchor, pattern)
        if add is None:
            self.replace(kind, anchor, plain, (x, *params), [anchor], pattern)
        else:
            residual, branch = add.args[:2]
            self.replace("add+" + kind, anchor, with_add, (branch, residual, *params),
                         [anchor, add], pattern + [add])

    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            if node in self.erased or node.op != "call_function":
                continue
            if node.target is aten.rsqrt.default:
                match = _match_rms_norm(node)
                if match and self.same_region(match[3]):
                    x, weight, eps, nodes, out = match
                    self.norm("rms_norm", out, x, (weight, eps), nodes, ops.rms_norm.default,
                              ops.add_rms_norm.default)
            elif node.target is aten.layer_norm.default and len(node.args) >= 4:
                x, shape, weight, bias = node.args[:4]
                eps = node.args[4] if len(node.args) > 4 else 1e-5
                if (isinstance(weight, Node) and isinstance(bias, Node) and len(shape) == 1):
                    self.norm("layer_norm", node, x, (weight, bias, eps), [node],
                              ops.layer_norm.default, ops.add_layer_norm.default)
        for node in list(self.gm.graph.nodes):
            if node in self.erased or node.op != "call_function":
                continue
            if _call(node, aten.mul.Tensor) and any(_call(a, aten.silu.default)
                                                    for a in node.args[:2]):
                # silu(gate) * up, or up * silu(gate) (Phi-3)
                side = 0 if _call(node.args[0], aten.silu.default) else 1
                silu, up = node.args[side], node.args[1 - side]
                if (len(silu.users) == 1 and isinstance(up, Node)
                        and self.same_region([silu, node])):
                    self.replace("swiglu", node, ops.swiglu.default, (silu.args[0], up),
                                 [node], [node, silu])
            elif _call(node, aten.add.Tensor, 2) and (match := _match_rotary(node)):
                x, cos, sin, nodes = match
                if self.same_region(nodes):
                    self.replace("rotary", node, ops.rotary.default, (x, cos, sin), [node], nodes)
            elif _call(node, aten.gelu.default):
                approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
                self.gelu(node, node.args[0], approximate, [node])
            else:
                match = _match_new_gelu(node)
                if match:
                    self.gelu(node, match[0], "tanh", match[1])

    def _pairs(self, candidate, key_of, place):
        """(first, second, anchor) for candidate nodes of one key, in graph order: `place(first,
        second, order)` says where their fused op goes (an anchor), or None: the second waits
        for a partner of its own."""
        order = {node: i for i, node in enumerate(self.gm.graph.nodes)}
        waiting: dict[tuple, Node] = {}
        for node in list(self.gm.graph.nodes):
            if node in self.erased or node.op != "call_function" or not candidate(node):
                continue
            key = key_of(node)
            first = waiting.pop(key, None)
            anchor = place(first, node, order) if first is not None else None
            if anchor is None:
                waiting[key] = node
            else:
                yield first, node, anchor

    def pair_rotaries(self) -> None:
        """Each layer's two rotaries of one `cos` / `sin` in one region (q's, then k's) -> one
        `rotary_pair`: where the second is, when nothing reads the first before it, else where
        the first is, when the second's input is there already (a partial rotary's slice)."""
        def place(first, second, order):
            if all(order.get(user, -1) > order[second] for user in first.users):
                return second
            return first if order.get(second.args[0], len(order)) < order[first] else None

        for first, second, anchor in self._pairs(
                lambda node: node.target is ops.rotary.default,
                lambda node: (*node.args[1:3], node.meta.get(REGION)), place):
            self.replace("rotary_pair", anchor, ops.rotary_pair.default,
                         (first.args[0], second.args[0], *second.args[1:3]), [first, second],
                         [first, second])

    def pair_cache_writes(self) -> None:
        """Each layer's K and V cache writes (`index_copy_` of one `cache_position` into two
        graph inputs, in one region) -> one `write_kv` where the second is, when nothing reads
        the first's result before it; readers of the results then read the caches, after it."""
        def place(first, second, order):
            if first.args[0] is second.args[0] or any(
                    order.get(user, -1) < order[second] for user in first.users):
                return None
            return second

        graph = self.gm.graph
        for first, second, anchor in self._pairs(
                lambda node: (_call(node, aten.index_copy_.default, 4) and node.args[1] == 2
                              and node.args[0].op == "placeholder"),
                lambda node: (node.args[2], node.meta.get(REGION)), place):
            with graph.inserting_before(anchor):
                fused = graph.call_function(ops.write_kv.default, (
                    first.args[0], second.args[0], second.args[2], first.args[3], second.args[3]))
            fused.meta.update({k: v for k, v in anchor.meta.items() if k != "val"})
            for write in (first, second):
                write.replace_all_uses_with(write.args[0])
                self.renamed[write.name] = write.args[0].name
                graph.erase_node(write)
                self.erased.add(write)
            self.counts["write_kv"] += 1

    def rotate_into_cache_writes(self) -> None:
        """A layer's `rotary_pair` whose rotated k only its cache write reads (in one region),
        with nothing reading the rotated q before that write -> one `rotary_write_kv` where
        the write is."""
        order = {node: i for i, node in enumerate(self.gm.graph.nodes)}
        for write in [node for node in self.gm.graph.nodes if _call(node, ops.write_kv.default)]:
            key_cache, value_cache, position, k_rotated, v = write.args
            pair = k_rotated.args[0] if _call(k_rotated, operator.getitem) else None
            if not (_call(pair, ops.rotary_pair.default) and k_rotated.args[1] == 1
                    and len(k_rotated.users) == 1 and self.same_region([pair, write])):
                continue
            q_rotated = [user for user in pair.users if user.args[1] == 0]
            if any(order[reader] < order[write] for user in q_rotated for reader in user.users):
                continue
            q, k, cos, sin = pair.args
            self.replace("rotary_write_kv", write, ops.rotary_write_kv.default,
                         (key_cache, value_cache, position, q, k, v, cos, sin),
                         [q_rotated[0] if q_rotated else None], [pair, k_rotated, *q_rotated, write])

    def gelu(self, anchor: Node, x: Node, approximate: str, pattern: list[Node]) -> None:
        if not self.same_region(pattern):
            return
        if (_call(x, aten.linear.default, 3) and isinstance(x.args[2], Node) and len(x.users) == 1
                and self.same_region([x, *pattern])):
            graph = self.gm.graph
            bias = x.args[2]
            with graph.inserting_before(x):
                matmul = graph.call_function(aten.linear.default, x.args[:2])
            matmul.meta.update(x.meta)
            self.replace("linear+gelu_bias", anchor, ops.gelu_bias.default,
                         (matmul, bias, approximate), [anchor], pattern + [x])
        else:
            self.replace("gelu", anchor, ops.gelu_bias.default, (x, None, approximate), [anchor],
                         pattern)


def _unfused(gm: GraphModule) -> str:
    """What is left of the norm and activation forms the patterns did not match: each `rsqrt`
    is a norm left as it was (Gemma's `(1 + w)` RMSNorm, computed in fp32 before its cast: the
    fused op casts first), each silu an activation."""
    left = Counter()
    for node in gm.graph.nodes:
        if _call(node, aten.rsqrt.default):
            left["norms (rsqrt)"] += 1
        elif _call(node, aten.silu.default):
            left["silu"] += 1
    return ", ".join(f"{v} {k}" for k, v in sorted(left.items()))


def _rename_region_values(regions: list[dict], renamed: dict[str, str]) -> None:
    def follow(name):
        while name in renamed:
            name = renamed[name]
        return name
    for region in regions:
        region["inputs"] = [follow(n) for n in region["inputs"]]
        region["outputs"] = [follow(n) for n in region["outputs"]]
        if "skip" in region:
            region["skip"] = {follow(k): follow(v) for k, v in region["skip"].items()}


@graph_pass(requires=("ctx:regions",))
def fuse_kernels(gm: GraphModule, ctx: PassContext) -> PassReport:
    if not ctx.kernels:
        return PassReport(False, "off (fused kernels not requested)")
    fuser = _Fuser(gm)
    fuser.run()
    fuser.pair_rotaries()
    fuser.pair_cache_writes()
    fuser.rotate_into_cache_writes()
    gm.graph.eliminate_dead_code()  # casts the fused ops now do themselves
    gm.graph.lint()
    gm.recompile()
    _rename_region_values(ctx.regions, fuser.renamed)
    total = sum(fuser.counts.values())
    detail = ", ".join(f"{v} {k}" for k, v in sorted(fuser.counts.items()))
    left = _unfused(gm)
    return PassReport(total > 0, f"fused {total} patterns ({detail or 'none found'})"
                      + (f"; left unfused: {left}" if left else ""),
                      {**fuser.counts, **({"unfused": left} if left else {})})
