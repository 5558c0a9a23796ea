"""`CompiledModel`: the generated module plus what it needs at run time; save and load."""
from __future__ import annotations

import datetime
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from rbcompile import __version__
from rbcompile.artifact import manifest as manifests
from rbcompile.artifact.atomic import write_folder
from rbcompile.artifact.cuda_graphs import GraphCache, plan_key
from rbcompile.artifact.decoder import DECODER_GRAPH, DECODER_SOURCE, Decoder
from rbcompile.artifact.executors import use_executor
from rbcompile.artifact.guard import (
    DECODER,
    FORWARD,
    GuardedPlan,
    QualityGuard,
    decoder_path,
    guard_budget,
)
from rbcompile.artifact.input_complexity import LengthRarityComplexity
from rbcompile.artifact.manifest import (
    ACTIVATION_FILE,
    CONFIG,
    GRAPH,
    MANIFEST,
    PACKED_SCHEMA_VERSION,
    SCHEMA_VERSION,
    SOURCE,
    WEIGHTS,
)
from rbcompile.artifact.models import copy_tokenizer_files, load_tokenizer
from rbcompile.artifact.module import attach_weights, compile_regions, stored_weights
from rbcompile.artifact.offramps import RAMP_FILE, OffRamps
from rbcompile.artifact.packed_weights import pack, unmeasure
from rbcompile.artifact.placement import check_same_dtype, parse_device, parse_dtype
from rbcompile.artifact.plan_graphs import PlanGraphs, compile_plans
from rbcompile.artifact.plans import (
    StoredPlan,
    check_budget,
    plan_for_budget,
    skipped_share,
    stored_plans,
    width_shares,
)
from rbcompile.artifact.regions import Plan
from rbcompile.errors import UserError

SELF_DRAFT_BUDGET = 0.5  # the light plan `speculate="self"` drafts with


class QualityGuardWarning(UserWarning):
    """A budget asked for a plan the quality guard withheld."""


class CompiledOutput(dict):
    """Output tensors by name, plus how they were computed."""

    def __init__(self, tensors: dict, *, path: str, gates: list[bool], widths: list[float] | None,
                 skipped_flops: float, complexity: list[float] | None,
                 plan: GuardedPlan | None = None):
        super().__init__(tensors)
        self.path = path                    # "full" | "light" | "gates"
        self.gates = gates
        self.widths = widths                # per gate width requested (None: all full width)
        self.skipped_flops = skipped_flops  # fraction of prunable FLOPs skipped
        self.complexity = complexity
        self.plan = plan                    # what a budget ran under the quality guard


@dataclass(frozen=True)
class GateChoice:
    """The gates and widths a call runs, how they were chosen ("full", "light", "gates"), the
    inputs' complexity scores (with a complexity threshold) and the guarded plan (a budget)."""
    gates: list[bool]
    widths: list[float] | None
    path: str
    complexity: list[float] | None = None
    plan: GuardedPlan | None = None

    def output(self, tensors: dict, skipped_flops: float) -> CompiledOutput:
        return CompiledOutput(tensors, path=self.path, gates=self.gates, widths=self.widths,
                              skipped_flops=skipped_flops, complexity=self.complexity,
                              plan=self.plan)


class CompiledModel:
    """A compiled model. Call it like the original (`input_ids`, `attention_mask`) with
    `budget` (fraction of prunable FLOPs to skip) or explicit `gates`.

    With a budget, inputs whose complexity score (see runtime/control/complexity.py) is below
    `complexity_threshold` take the light path of that budget and the rest the full path;
    with `complexity_threshold=None` the budget applies to every input. Every budget runs
    under `guard` (rbcompile/artifact/guard.py): a plan whose measured quality loss is over
    `guard.max_quality_loss`, or that was never measured, is withheld (a warning says so).
    """

    def __init__(self, module: torch.nn.Module, ir: dict, source: str, manifest: dict, *,
                 tokenizer_dir: Path | None, hf_config: dict, decoder: Decoder | None = None):
        self.module = module
        self.decoder = decoder  # decoders: the KV-cached module generate() runs
        self.plan_graphs: PlanGraphs | None = None  # compile_plans
        # calls without padding drop the masks the module can (False: every call reads them)
        self.unpadded_attention = True
        self.ir = ir
        self.source = source
        self.manifest = manifest
        self.tokenizer_dir = tokenizer_dir
        self.hf_config = hf_config
        self.regions = ir["regions"]
        self.output_names = [name for name, _ in ir["outputs"]]
        # outputs with a sequence axis (cut back after padding); artifacts before it: rank 3
        self.sequence_outputs: list[str] | None = ir.get("sequence_outputs")
        arch = manifest["architecture"]
        self.family = arch["family"]
        self.task_head = arch.get("head")  # heads.py; None: an encoder's hidden states
        self.labels: list[str] | None = arch.get("labels")  # classifiers: names by class index
        self.vocab_size = arch["vocab_size"]
        self.max_positions = arch["max_positions"]
        self.num_gates = module.NUM_GATES
        self.complexity = LengthRarityComplexity(self.vocab_size)
        self.complexity_threshold: float | None = None
        self.plans: list[StoredPlan] | None = stored_plans(manifest)
        self.guard = QualityGuard()
        self.width_shares = width_shares(ir.get("variants", []))
        self.offramps: OffRamps | None = None  # encoders calibrated with a task head
        self.dtype = getattr(torch, arch.get("dtype", "float32"))  # the precision it was traced in
        self.cuda_graphs = None  # a GraphCache after use_cuda_graphs()
        packed = manifest.get("packed_weights")  # how save() stores the linears (packed_weights.py)
        self.weights_level = packed["level"] if packed else "fp32"
        self.loaded_packing: dict = {}   # key -> PackedWeight, as loaded (loading.py)
        self._tokenizer = None

    # ---- placement ----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.module.device

    def to(self, device=None, dtype=None) -> "CompiledModel":
        """Move the weights to `device` (views for width levels stay views). `dtype` may only
        name the dtype the model was compiled in (see rbcompile/artifact/placement.py)."""
        device = parse_device(device)
        check_same_dtype(self.dtype, parse_dtype(dtype))
        if device is not None and device != self.device:
            modules = [self.module] + ([self.decoder.module] if self.decoder else [])
            # each tensor moved once (the modules share weights), the stacks made again there
            attach_weights(modules, {key: tensor.to(device)
                                     for key, tensor in stored_weights(modules).items()})
            for module in modules:
                module.region_cache.clear()
            if self.offramps is not None:
                self.offramps = self.offramps.to(device)
            if self.cuda_graphs is not None:
                self.cuda_graphs.clear()
            if self.decoder is not None:
                self.decoder.clear_graphs()
                # it runs on the CPU copy of the weights
                self.decoder.executor = self.decoder.step_executor = None
        return self

    def use_executor(self, executor: str = "auto", weights: str = "fp32",
                     threads: int | None = None, prefill: str = "fp32") -> str:
        """Run the decoder's steps with `executor` ("auto", "torch", "onnxruntime") at
        `weights` (executors.WEIGHT_LEVELS: "fp32", "int8", "int4", "int4-fp32"), prompts
        prefilled at `prefill` ("fp32", "int8"); returns the executor chosen."""
        return use_executor(self, executor, weights, threads, prefill)

    def use_cuda_graphs(self, enabled: bool = True, *, max_graphs: int = 16,
                        batch_buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), seq_multiple: int = 64,
                        capture_after: int = 1, min_free_fraction: float = 0.05,
                        borrow_outputs: bool = False, capture=None) -> "CompiledModel":
        """Run through CUDA graphs, one per (gates, widths, batch bucket, sequence bucket).

        Inputs are padded up to the next batch bucket (rows of mask 1) and the next multiple of
        `seq_multiple` tokens (mask 0 on the right), outputs cut back and copied out of the
        graph. `borrow_outputs=True` skips that copy (a 4 x 1024 prefill's bf16 logits over a
        128k vocabulary: 1 GB): a call's outputs are then the graph's own buffers, which the
        next call overwrites (any plan or shape: the graphs share their memory), as inductor's
        `reduce-overhead` does; for callers done with an output before they call again. The
        shape-keyed region cache is off while graphs are on (the graph computes those values
        itself). `capture` replaces the CUDA capture (tests: a fake one on CPU; see
        rbcompile/artifact/cuda_graphs.py)."""
        if self.device.type != "cuda" and capture is None and enabled:
            raise UserError(f"CUDA graphs need the model on a CUDA device (it is on {self.device})")
        if self.decoder is not None:  # its decode steps: one graph per plan and shape
            self.decoder.use_cuda_graphs(enabled, max_graphs=max_graphs, capture=capture)
        if not enabled:
            self.cuda_graphs = None
            self.module.region_cache.enabled = True
            return self

        self.module.region_cache.enabled = False
        self._buckets = (tuple(sorted(batch_buckets)), seq_multiple)
        self.cuda_graphs = GraphCache(self.module, max_graphs=max_graphs,
                                      capture_after=capture_after,
                                      min_free_fraction=min_free_fraction,
                                      in_place=lambda tensor: False, capture=capture,
                                      borrow_outputs=borrow_outputs)
        return self

    def _run_graphs(self, input_ids, attention_mask, gates, widths, unpadded: bool):
        """The module's outputs through the CUDA graph of this plan and bucket. `unpadded`
        (see `_check_inputs`): the graph takes no mask when its attention is causal or the
        sequence needs no padding to its bucket. Inputs that fill their bucket go to the graph
        as they are (it copies them into its buffers); of its outputs, the rows and positions
        of the call are copied out."""
        batch_buckets, seq_multiple = self._buckets
        batch, seq = input_ids.shape
        padded_batch = next((b for b in batch_buckets if b >= batch), batch)
        padded_seq = min(-(-seq // seq_multiple) * seq_multiple, self.max_positions)
        fills = (padded_batch, padded_seq) == (batch, seq)
        ids = input_ids if fills else _padded(input_ids, padded_batch, padded_seq)
        mask = None
        if not unpadded or (not fills and not self.module.UNPADDED.causal):
            # filler rows attend to something: no all-masked softmax
            mask = attention_mask if fills else _padded(attention_mask, padded_batch, padded_seq,
                                                        filler=1)

        def cut(outputs):  # the call's rows, and positions of the per-token outputs
            per_token = (self.sequence_outputs if self.sequence_outputs is not None else
                         [name for name, out in zip(self.output_names, outputs) if out.dim() >= 3])
            return [out[:batch, :seq] if name in per_token else out[:batch]
                    for name, out in zip(self.output_names, outputs)]

        return self.cuda_graphs(plan_key(gates, widths), ids, mask, gates, widths,
                                select=None if fills else cut)

    # ---- running --------------------------------------------------------------------------

    def _check_inputs(self, input_ids, attention_mask):
        """Validated `(input_ids, attention_mask, unpadded)`, the tensors as int64 on the
        model's device. `unpadded`: whether the call may run without its attention masks
        (passes/unpadded_attention.py): the module has such masks and no row of the caller's
        mask is padded, checked on the caller's device as transformers does in eager mode.
        The token range and the mask are read in one device-to-host transfer."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise UserError("input_ids must be a 2-D tensor [batch, sequence]")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise UserError(f"input_ids must be integer, got {input_ids.dtype}")
        batch, seq = input_ids.shape
        if batch == 0 or seq == 0:
            raise UserError(f"empty input: input_ids has shape {tuple(input_ids.shape)}")
        if seq > self.max_positions:
            raise UserError(f"sequence of {seq} tokens exceeds the model's "
                            f"{self.max_positions} positions")
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                           or attention_mask.shape != input_ids.shape):
            raise UserError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}")
        droppable = self.unpadded_attention and getattr(self.module, "UNPADDED", None) is not None
        low, high, whole = _read_inputs(input_ids, attention_mask if droppable else None)
        if low < 0 or high >= self.vocab_size:
            raise UserError(f"token ids must be in [0, {self.vocab_size})")
        unpadded = droppable and whole
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.long)
        device = self.device
        return input_ids.to(device, torch.long), attention_mask.to(device, torch.long), unpadded

    def choose_gates(self, input_ids, attention_mask, budget=None, gates=None,
                     widths=None) -> GateChoice:
        """What a batch runs: explicit `gates` / `widths`, or the guarded plan of `budget`."""
        if widths is not None:
            widths = [float(w) for w in (widths.tolist() if isinstance(widths, torch.Tensor) else widths)]
            if len(widths) != self.num_gates or not all(0 < w <= 1 for w in widths):
                raise UserError(f"widths must be {self.num_gates} values in (0, 1]")
        if gates is not None:
            gates = [bool(g) for g in (gates.tolist() if isinstance(gates, torch.Tensor) else gates)]
            if len(gates) != self.num_gates:
                raise UserError(f"expected {self.num_gates} gates, got {len(gates)}")
            return GateChoice(gates, widths, "gates")
        full = [True] * self.num_gates
        if budget is None:
            return GateChoice(full, widths, "full" if widths is None else "gates")
        budget = check_budget(budget)
        scores = None
        if self.complexity_threshold is not None:
            scores = self.complexity(input_ids, attention_mask).tolist()
            if max(scores) >= self.complexity_threshold:
                return GateChoice(full, None, "full", scores)
        plan = self.guarded(budget)
        gates, widths = self.plan_for_budget(plan.budget)
        return GateChoice(gates, widths, "light" if plan.lossy else "full", scores, plan)

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask=None, *, budget=None, gates=None,
                 widths=None) -> CompiledOutput:
        input_ids, attention_mask, unpadded = self._check_inputs(input_ids, attention_mask)
        chosen = self.choose_gates(input_ids, attention_mask, budget, gates, widths)
        gates, widths = chosen.gates, chosen.widths
        if self.cuda_graphs is not None:
            outputs = self._run_graphs(input_ids, attention_mask, gates, widths, unpadded)
        else:
            outputs = self.module(input_ids, None if unpadded else attention_mask, gates, widths)
        return chosen.output(dict(zip(self.output_names, outputs)), self.skipped_share(gates, widths))

    def compile_regions(self) -> "CompiledModel":
        """Compile the generated regions with inductor (first calls per shape are slow)."""
        compile_regions(self.module)
        return self

    def compile_plans(self, max_plans: int = 8) -> "CompiledModel":
        """Run the model, and the KV-cached decoder's steps, through one inductor graph per
        plan (rbcompile/artifact/plan_graphs.py): a plan's first call compiles the whole model (tens of
        seconds on CPU); at most `max_plans` graphs each are kept."""
        self.plan_graphs = compile_plans(self.module, self.ir, max_plans=max_plans)
        if self.decoder is not None:
            self.decoder.plan_graphs = compile_plans(self.decoder.module, self.decoder.ir,
                                                     max_plans=max_plans)
        return self

    def plan_for_budget(self, budget: float) -> Plan:
        return plan_for_budget(self.regions, budget, self.plans)

    def guarded(self, budget: float | None, path: str = FORWARD) -> GuardedPlan:
        """The plan `budget` runs under `guard` on the whole-sequence graph (FORWARD) or the
        KV-cached decoder (DECODER, at the weight level its steps run); a withheld plan is
        warned about."""
        plan = guard_budget(self.plans, budget, self.guard, self.loss_path(path))
        if plan.withheld is not None:
            warnings.warn(f"rbcompile: {plan.describe()} (quality guard: max_quality_loss "
                          f"{self.guard.max_quality_loss:g})", QualityGuardWarning, stacklevel=3)
        return plan

    def loss_path(self, path: str = FORWARD) -> str:
        """The StoredPlan.loss path that bounds `path` as it runs now: DECODER becomes the
        decoder's weight level's and prefill level's (guard.decoder_path)."""
        if path == DECODER and self.decoder is not None:
            return decoder_path(self.decoder.weights, self.decoder.prefill)
        return path

    def guarded_decoder_gates(self, budget: float | None) -> list[bool] | None:
        """`decoder_gates` of the plan `budget` runs under `guard`."""
        return self.decoder_gates(self.guarded(budget, DECODER).budget)

    def gates_for_budget(self, budget: float) -> list[bool]:
        return self.plan_for_budget(budget)[0]

    def decoder_gates(self, budget: float | None) -> list[bool] | None:
        """The KV-cached decoder's gates for `budget` (None for the full path: no budget or 0)."""
        budget = None if budget is None else check_budget(budget)
        return self.decoder.gates_from(self.regions, self.gates_for_budget(budget)) if budget else None

    def skipped_share(self, gates, widths=None) -> float:
        """Fraction of prunable FLOPs not computed under these gates and widths."""
        return skipped_share(self.regions, gates, widths, self.width_shares)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.tokenizer_dir is None:
                raise UserError("this compiled model has no tokenizer (compiled from a module)")
            self._tokenizer = load_tokenizer(self.tokenizer_dir)
        return self._tokenizer

    # ---- artifact ---------------------------------------------------------------------------

    def save(self, out_dir, weights: str | None = None) -> Path:
        """Write the artifact folder atomically (temporary folder, then rename). `weights`:
        "int8" / "int4" stores the linears packed (artifact/packed_weights.py), "fp32" as
        they are; default: as this model was loaded."""
        level = weights or self.weights_level

        def write(tmp: Path) -> tuple[dict, list[str]]:
            (tmp / GRAPH).write_text(json.dumps(self.ir, indent=1))
            (tmp / SOURCE).write_text(self.source)
            modules = [self.module]
            if self.decoder is not None:
                (tmp / DECODER_GRAPH).write_text(json.dumps(self.decoder.ir, indent=1))
                (tmp / DECODER_SOURCE).write_text(self.decoder.source)
                modules.append(self.decoder.module)
            tensors = {key: tensor.detach().contiguous().cpu()
                       for key, tensor in stored_weights(modules).items()}
            packed = None
            if level != "fp32":
                tensors, parts, metadata, packed = pack(tensors, level, self.loaded_packing)
                save_file(parts, str(tmp / packed.file), metadata=metadata)
            save_file(tensors, str(tmp / WEIGHTS))
            (tmp / CONFIG).write_text(json.dumps(self.hf_config, indent=1, default=str))
            tokenizer_files = (copy_tokenizer_files(self.tokenizer_dir, tmp)
                               if self.tokenizer_dir else [])
            if self.offramps is not None:
                save_file(self.offramps.tensors(), str(tmp / RAMP_FILE))
            maxima = self.decoder and self.decoder.activation_max
            if maxima:
                save_file({key: value.contiguous() for key, value in maxima.items()},
                          str(tmp / ACTIVATION_FILE))
            manifest = {
                "schema_version": PACKED_SCHEMA_VERSION if packed else SCHEMA_VERSION,
                "rbcompile_version": __version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                **{k: v for k, v in self.manifest.items() if k not in ("schema_version", "files",
                                                                       "regions", "created",
                                                                       "rbcompile_version",
                                                                       "offramps", "decoder",
                                                                       "packed_weights")},
                **({"packed_weights": packed.to_json()} if packed else {}),
                **({"offramps": {"file": RAMP_FILE, "layers": self.offramps.layers,
                                 "threshold": self.offramps.threshold}}
                   if self.offramps is not None else {}),
                **({"decoder": {"graph": DECODER_GRAPH, "source": DECODER_SOURCE,
                                "gates": self.decoder.num_gates,
                                "shape": self.decoder.sizes.sizes(),
                                **({"activation_max": ACTIVATION_FILE} if maxima else {}),
                                **({"draft": self.decoder.draft} if self.decoder.draft else {})}}
                   if self.decoder is not None else {}),
                "regions": [{**{k: r[k] for k in r if k not in ("inputs", "outputs", "skip")},
                             **({"width_shares": {str(w): v for w, v in
                                                  self.width_shares[r["id"]].items()}}
                                if r["id"] in self.width_shares else {})}
                            for r in self.regions],
                "files": {"graph": GRAPH, "source": SOURCE, "weights": WEIGHTS,
                          "config": CONFIG, "tokenizer": tokenizer_files},
            }
            if packed and packed.max_abs_error > 0:
                unmeasure(manifest)
            manifest["files"]["sha256"] = manifests.digests(tmp)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            return manifest, tokenizer_files

        out_dir = Path(out_dir)
        manifest, tokenizer_files = write_folder(out_dir, write, manifests.owned_files,
                                                 manifests.KIND)
        self.manifest, self.weights_level = manifest, level
        self.tokenizer_dir = out_dir if tokenizer_files else None
        return out_dir


def _padded(tensor: torch.Tensor, batch: int, seq: int, filler: int = 0) -> torch.Tensor:
    """`tensor` [b, s] in the corner of a [batch, seq] tensor of zeros, its rows past b filled
    with `filler`."""
    padded = tensor.new_zeros(batch, seq)
    padded[:tensor.shape[0], :tensor.shape[1]] = tensor
    if filler and batch > tensor.shape[0]:
        padded[tensor.shape[0]:] = filler
    return padded


def _read_inputs(input_ids: torch.Tensor, attention_mask) -> tuple[int, int, bool]:
    """(smallest token id, largest, whether `attention_mask` is None or pads no row) with one
    device-to-host transfer where the two tensors share a device."""
    values = list(torch.aminmax(input_ids))
    together = attention_mask is not None and attention_mask.device == input_ids.device
    if together:
        values.append(attention_mask.all())
    read = torch.stack(values).tolist()
    whole = bool(read[2]) if together else attention_mask is None or bool(attention_mask.all())
    return read[0], read[1], whole
