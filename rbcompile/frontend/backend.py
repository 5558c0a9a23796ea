"""The `rbcompile` torch.compile backend (entry point `torch_dynamo_backends`).

    model = torch.compile(hf_model, backend="rbcompile", options={"budget": 0.25})
    with rbcompile.frontend.backend.decision(budget=0.1):   # per call, from the runtime: no recompile
        out = model(input_ids, attention_mask=mask)

Dynamo hands the backend a torch-level graph with parameters as placeholders. aot_autograd lowers
it to ATen (keeping `nn_module_stack`); `to_pipeline_graph` turns the weights into constants and
names the inputs; then the graph runs the same passes and codegen as `rbcompile compile`. The
generated module's regions are compiled with inductor (`regions="eager"` keeps them eager;
`regions="plan"` compiles one inductor graph per plan instead, see plan_graphs.py); gates are
chosen in Python at every call, so a new decision never recompiles (with "plan", a plan's first
call compiles it).

A graph without transformer layers (a fragment between graph breaks) has nothing to adapt and
goes to inductor. A graph rbcompile cannot handle is logged and falls back to inductor;
`options={"strict": True}` raises instead.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import keyword
import logging
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import GraphModule

from rbcompile.artifact.cuda_graphs import GraphCache, plan_key
from rbcompile.artifact.guard import QualityGuard, guard_budget
from rbcompile.artifact.ir import RESERVED_NAMES
from rbcompile.artifact.module import compile_regions
from rbcompile.artifact.plan_graphs import compile_plans
from rbcompile.artifact.plans import check_budget, plan_for_budget, skipped_share
from rbcompile.compiler.driver import generate_module
from rbcompile.errors import CompileError, first_line
from rbcompile.passes import PassContext, run_pipeline
from rbcompile.passes.base import module_stack

# Deferred on purpose: inductor and dynamo's internals load when a graph is compiled, not when
# torch finds the backend's entry point.

logger = logging.getLogger("rbcompile.frontend.backend")

REGION_COMPILERS = ("inductor", "eager", "plan")


@dataclass(frozen=True)
class BackendOptions:
    """`torch.compile(..., options={...})` of the rbcompile backend."""
    budget: float | None = None  # default budget when no `decision` is active (None: full path)
    regions: str = "inductor"    # how the regions run: "inductor" (each compiled), "eager",
    #                              or "plan" (one inductor graph per plan, plan_graphs.py)
    strict: bool = False         # raise on a graph rbcompile cannot compile (no fallback)
    kernels: bool | None = None  # fuse norms / activations into rbcompile's kernels (None: on CUDA)
    dump_pass: str | None = None  # write the graph before/after this pass (see passes/)
    cuda_graphs: bool = False    # CUDA inputs: one CUDA graph per (plan, shapes); see cuda_graphs.py
    max_graphs: int = 16         # bound on the CUDA graphs (and plan graphs) of one graph
    capture: Callable | None = None  # replaces the CUDA capture (tests: a fake one, CPU inputs too)
    # the quality guard (rbcompile/artifact/guard.py): a graph compiled here has no measured plans, so
    # a lossy budget runs only with allow_unmeasured_plans; otherwise the full path, logged once
    allow_unmeasured_plans: bool = False

    @property
    def guard(self) -> QualityGuard:
        return QualityGuard(allow_unmeasured=self.allow_unmeasured_plans)

    @classmethod
    def parse(cls, options: dict | None) -> "BackendOptions":
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown rbcompile option(s) {unknown}; known: {sorted(known)}")
        parsed = cls(**options)
        if parsed.budget is not None:
            check_budget(parsed.budget)
        if parsed.regions not in REGION_COMPILERS:
            raise ValueError(f"option regions must be one of {REGION_COMPILERS}, "
                             f"got {parsed.regions!r}")
        return parsed


@dataclass(frozen=True)
class GateDecision:
    """What the runtime chose for the calls inside a `decision(...)` block."""
    budget: float | None = None
    gates: tuple[bool, ...] | None = None
    widths: tuple[float, ...] | None = None


_current: contextvars.ContextVar[GateDecision | None] = contextvars.ContextVar(
    "rbcompile_decision", default=None)


@contextlib.contextmanager
def decision(budget: float | None = None, gates=None, widths=None):
    """Run the compiled graphs inside this block at `budget` (or explicit `gates` / `widths`)."""
    if budget is not None:
        budget = check_budget(budget)
    chosen = GateDecision(budget, None if gates is None else tuple(bool(g) for g in gates),
                      None if widths is None else tuple(float(w) for w in widths))
    token = _current.set(chosen)
    try:
        yield chosen
    finally:
        _current.reset(token)


@dataclass
class CompiledGraph:
    """One graph dynamo handed to the backend, and what became of it."""
    index: int
    handled_by: str                     # "rbcompile" | "inductor"
    reason: str = ""                    # why inductor took it
    regions: list[dict] = field(default_factory=list)
    num_gates: int = 0
    passes: list[dict] = field(default_factory=list)  # what each pass did (ctx.history)
    calls: int = 0
    last_gates: list[bool] | None = None
    last_skipped: float = 0.0           # fraction of prunable FLOPs the last call skipped
    writes: InputWrites | None = None   # how it writes its inputs (a static cache's K/V)


_graphs: list[CompiledGraph] = []


def compiled_graphs() -> list[CompiledGraph]:
    """Every graph compiled by this backend in this process (newest last)."""
    return list(_graphs)


def reset() -> None:
    _graphs.clear()


# ---- dynamo graph -> pipeline graph ------------------------------------------------------------

_TAKEN = RESERVED_NAMES | {"widths"}  # the generated forward's own names
_WEIGHT = re.compile(r"_(parameters|buffers)_")
# a module attribute, or a float of an imported module (`math.pi` in GPT-2's tanh GELU), that
# dynamo passes as an input
_ATTRIBUTE = re.compile(r"_modules_|^l_self_|^g_import_", re.IGNORECASE)
_PREFIX = re.compile(r"^l_(self_|args_0_|kwargs_)?")


def _weight_key(placeholder: str) -> str:
    """`l_self_modules_layers_modules_0_modules_mlp_parameters_weight_` -> `layers.0.mlp.weight`."""
    name = _PREFIX.sub("", placeholder).rstrip("_")
    return re.sub(r"(^|_)(modules|parameters|buffers)_", lambda m: "." if m[1] else "", name).strip(".")


def _input_name(placeholder: str) -> str:
    """`l_kwargs_attention_mask_` -> `attention_mask`; `l_args_1_` -> `args_1`; names the
    generated forward uses itself get an `input_` prefix."""
    name = re.sub(r"\W", "_", re.sub(r"^l_(kwargs_)?", "", placeholder).rstrip("_")).strip("_")
    if not name or name[0].isdigit() or keyword.iskeyword(name) or name in _TAKEN:
        return f"input_{name}"
    return name


def _set_buffer(root: torch.nn.Module, key: str, tensor: torch.Tensor) -> None:
    *path, leaf = key.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_buffer(leaf, tensor, persistent=False)


def _hint(value):
    """A concrete value for a symbolic example input (its size hint)."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    return value


def _is_constant(name: str, value) -> bool:
    """Weights (dynamo names with `_parameters_` / `_buffers_`), and the float attributes of
    modules (an RMSNorm's eps, rotary scaling) or of imported modules (`math.pi`) that dynamo
    passes as 0-dim tensors under `dynamic=True`: fixed for a model, so the graph holds them as
    constants like the weights."""
    if not isinstance(value, torch.Tensor):
        return False
    return bool(_WEIGHT.search(name)) or (value.dim() == 0 and bool(_ATTRIBUTE.search(name)))


def to_pipeline_graph(aten_gm: GraphModule, names: list[str], values: list):
    """Constants (see `_is_constant`) become get_attr nodes, the other placeholders named
    inputs. Returns (graph, input names, input positions, references)."""
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        raise CompileError(f"ATen graph has {len(placeholders)} inputs for {len(names)} "
                           "dynamo inputs")
    input_names, positions, references = [], [], {}
    keys: dict[int, str] = {}  # tensor id -> key: a tied weight is one constant
    for position, (node, name, value) in enumerate(zip(placeholders, names, values)):
        if _is_constant(name, value):
            if id(value) not in keys:
                keys[id(value)] = _weight_key(name)
                _set_buffer(aten_gm, keys[id(value)], value.detach())
            key = keys[id(value)]
            with aten_gm.graph.inserting_before(node):
                constant = aten_gm.graph.get_attr(key)
            constant.meta = dict(node.meta)
            node.replace_all_uses_with(constant)
            aten_gm.graph.erase_node(node)
        else:
            input_name = _input_name(name)
            node.target = node.name = input_name
            input_names.append(input_name)
            positions.append(position)
            references[input_name] = _hint(value)
    aten_gm.recompile()
    return aten_gm, tuple(input_names), positions, references


@dataclass(frozen=True)
class InputWrites:
    """How a compiled graph writes its inputs (see `take_input_writes`): `copied` (input
    position, output index) pairs, values the runner copies into inputs after the graph;
    `in_place` the positions of every input written (in place or by a copy); `outputs` the
    number of outputs the caller gets (the extra outputs of `copied` values come after)."""
    copied: tuple[tuple[int, int], ...]
    in_place: frozenset[int]
    outputs: int


def _readers(node):
    """The nodes that read `node`'s data: its users, and the users of its views."""
    for user in node.users:
        if getattr(user.target, "is_view", False):
            yield from _readers(user)
        else:
            yield user


def take_input_writes(gm: GraphModule) -> InputWrites:
    """aot_autograd (`keep_inference_input_mutations`) ends the graph with one `copy_(input,
    value)` per input the model writes (a static KV cache's tensors, transformers' StaticCache
    length counter); the passes see values, not writes, so these copies leave the graph. A
    write of `index_copy(input, ...)` whose input nothing reads after it becomes that op in
    place, `index_copy_` (an artifact decoder's cache writes, which the passes place and fuse),
    with no copy at all; any other value becomes an extra graph output, which the runner copies
    into its input after the graph (inside the CUDA graph, when there is one). Without this,
    aot_autograd returned every written tensor (each K/V in full) and copied it back into its
    input outside the graph: two ops per written tensor per call, on the host's critical path
    of a decode step."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    output = nodes[-1]
    placeholders = [node for node in nodes if node.op == "placeholder"]
    copied, in_place = [], set()
    for node in nodes:
        if node.target is not torch.ops.aten.copy_.default:
            continue
        target, value = node.args[:2]
        readers = set(_readers(target)) - {node, output}
        if target.op != "placeholder" or any(order[reader] > order[node] for reader in readers):
            raise CompileError(f"{node.name} writes {target}, which is not an input written "
                               "after its last read")
        position = placeholders.index(target)
        in_place.add(position)
        if (value.target is torch.ops.aten.index_copy.default and value.args[0] is target
                and all(order[reader] < order[value] for reader in readers - {value})):
            with graph.inserting_before(value):
                written = graph.call_function(torch.ops.aten.index_copy_.default, value.args,
                                              value.kwargs)
            written.meta, order[written] = dict(value.meta), order[value]
            value.replace_all_uses_with(written)
            graph.erase_node(value)
            node.replace_all_uses_with(written)  # an output that is the input: aot returns the input
        else:
            node.replace_all_uses_with(value)
            copied.append((position, value))
        graph.erase_node(node)
    results = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    count = len(results)
    for _, value in copied:
        if value not in results:
            results.append(value)
    output.args = (tuple(results),)
    gm.recompile()
    return InputWrites(tuple((position, results.index(value)) for position, value in copied),
                       frozenset(in_place), count)


# ---- the backend -------------------------------------------------------------------------------

def _modules(gm: GraphModule) -> set[tuple[str, str]]:
    """(path, type name) of every module of the model that the graph's nodes came from."""
    return {entry for n in gm.graph.nodes for entry in module_stack(n)}


def _family(gm: GraphModule) -> str:
    """decoder when the model is a causal LM (its graph has an LM head), else encoder."""
    return "decoder" if any("ForCausalLM" in type_name or "LMHead" in type_name
                            for _, type_name in _modules(gm)) else "encoder"


def _has_layers(gm: GraphModule) -> bool:
    return any(re.search(r"\.\d+$", path) for path, _ in _modules(gm))


class _Runner:
    """The callable aot_autograd runs: picks gates for each call, runs the generated module and
    writes the inputs it writes (`InputWrites`; with `cuda_graphs`, both through the CUDA graph
    of that plan and those input shapes, which reads the written inputs in place)."""

    def __init__(self, module, positions, record: CompiledGraph, options: BackendOptions,
                 writes: InputWrites):
        self.module, self.positions, self.record = module, positions, record
        self.options, self.writes = options, writes
        self.warned = False   # a withheld budget is logged once per graph
        self.graphs = None
        if options.cuda_graphs:
            module.region_cache.enabled = False
            # from a key's second call: an int input that changes at every call never captures
            self.graphs = GraphCache(self._forward, max_graphs=options.max_graphs, capture_after=2,
                                     in_place_at=writes.in_place, capture=options.capture)

    def _forward(self, *inputs):
        """The module's outputs for `inputs` (the graph's, then gates and widths), after
        copying the values it computes for written inputs into them."""
        outputs = self.module(*inputs)
        for position, index in self.writes.copied:
            inputs[position].copy_(outputs[index])
        return list(outputs[:self.writes.outputs])

    def _choose(self):
        chosen = _current.get() or GateDecision(self.options.budget)
        regions, count = self.record.regions, self.record.num_gates
        if chosen.gates is not None:
            if len(chosen.gates) != count:
                raise ValueError(f"graph {self.record.index} has {count} gates, got "
                                 f"{len(chosen.gates)}")
            return list(chosen.gates), (list(chosen.widths) if chosen.widths else None)
        if chosen.budget is None:
            return [True] * count, None
        plan = guard_budget(None, chosen.budget, self.options.guard)   # no measured plans
        if plan.withheld is not None and not self.warned:
            self.warned = True
            logger.warning("rbcompile backend: %s (option allow_unmeasured_plans runs it)",
                           plan.describe())
        return plan_for_budget(regions, plan.budget)

    def __call__(self, *args):
        gates, widths = self._choose()
        self.record.calls += 1
        self.record.last_gates = gates
        self.record.last_skipped = skipped_share(self.record.regions, gates, widths, {})
        inputs = [args[i] for i in self.positions]
        with torch.no_grad():
            if self.graphs is not None and (self.options.capture is not None or any(
                    isinstance(v, torch.Tensor) and v.is_cuda for v in inputs)):
                return self.graphs(plan_key(gates, widths), *inputs, gates, widths)
            return self._forward(*inputs, gates, widths)


def _compile_aten(aten_gm: GraphModule, names, values, options: BackendOptions,
                  record: CompiledGraph):
    gm, input_names, positions, references = to_pipeline_graph(aten_gm, names, values)
    writes = record.writes = take_input_writes(gm)
    on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)
    ctx = PassContext(family=_family(gm), reference_inputs=references,
                      input_names=input_names, dump_pass=options.dump_pass,
                      kernels=on_cuda if options.kernels is None else options.kernels)
    run_pipeline(gm, ctx)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    ir, _, module = generate_module(gm, ctx.regions, input_names,
                                   [f"output_{i}" for i in range(len(outputs))],
                                   f"torch.compile graph {record.index}")
    if options.regions == "inductor":
        compile_regions(module)
    elif options.regions == "plan":
        compile_plans(module, ir, max_plans=options.max_graphs)
    record.handled_by, record.regions, record.num_gates = "rbcompile", ctx.regions, module.NUM_GATES
    record.passes = ctx.history
    logger.info("graph %d: %d regions, %d gates; %s", record.index, len(ctx.regions),
                module.NUM_GATES, "; ".join(f"{h['pass']}: {h['summary']}" for h in ctx.history
                                             if h["pass"] in ("form_regions", "fuse_kernels")))
    return _Runner(module, positions, record, options, writes)


def _inductor(gm, example_inputs, record: CompiledGraph, reason: str):
    from torch._inductor.compile_fx import compile_fx

    record.handled_by, record.reason = "inductor", reason
    return compile_fx(gm, example_inputs)


def rbcompile_backend(gm: GraphModule, example_inputs, options: dict | None = None, **_):
    """Dynamo backend: compile `gm` with rbcompile's passes and codegen (see module docstring)."""
    parsed = BackendOptions.parse(options)
    record = CompiledGraph(len(_graphs), "pending")
    _graphs.append(record)
    if not _has_layers(gm):
        logger.info("graph %d has no transformer layers: inductor", record.index)
        return _inductor(gm, example_inputs, record, "no transformer layers")
    if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad
                                       for v in example_inputs):
        return _fail(gm, example_inputs, record, parsed,
                     "rbcompile compiles inference graphs: call the model under torch.no_grad()")
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def compile_inference(aten_gm, _fake_inputs):
        try:
            with unset_fake_temporarily():  # aot_autograd compiles under fake mode
                return _compile_aten(aten_gm, names, list(example_inputs), parsed, record)
        except Exception as exc:  # any failure: this graph is not one rbcompile can compile
            raise _Unsupported(f"{type(exc).__name__}: {first_line(exc)}") from exc

    try:
        return aot_autograd(fw_compiler=compile_inference,
                            keep_inference_input_mutations=True)(gm, example_inputs)
    except _Unsupported as exc:
        return _fail(gm, example_inputs, record, parsed, str(exc))
    except BaseException:  # dynamo restarting its analysis (e.g. to specialise a float): no graph
        _graphs.remove(record)
        raise


class _Unsupported(Exception):
    """rbcompile's passes or codegen cannot handle this graph (the reason is the message)."""


def _fail(gm, example_inputs, record, options: BackendOptions, reason: str):
    if options.strict:
        raise CompileError(f"graph {record.index}: {reason}")
    logger.warning("graph %d: %s; falling back to inductor", record.index, reason)
    return _inductor(gm, example_inputs, record, reason)
