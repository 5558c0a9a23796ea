"""Which executor runs a decoder's steps, and at which weight precision.

- "torch": the generated module, op by op (the reference: the full path equals the source
  model to fp32 rounding);
- "onnxruntime": `StepExecutor`, one onnxruntime graph per plan, with the weights at `fp32`,
  `int8` or `int4` (MatMulNBits);
- "auto": onnxruntime where it runs the model (a Llama-family fp32 decoder on the CPU), torch
  elsewhere.

Prompts may be prefilled at a precision of their own (`prefill`: "fp32", or "int8": activations
quantized per token, kernels/token_int8.py), whatever level decodes. Lower precisions change the
output: `check_precision` lets one run only where calibration measured its quality loss within
the guard (the manifest's `precisions` and `prefill_precisions`, compiler/precision.py), or
where the guard allows unmeasured plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from rbcompile.artifact.guard import QualityGuard
from rbcompile.artifact.manifest import PRECISION_LEVELS, PREFILL_LEVELS
from rbcompile.artifact.packed_weights import level_precision, prefill_precision
from rbcompile.errors import UserError

EXECUTORS = ("auto", "torch", "onnxruntime")
WEIGHT_LEVELS = ("fp32", *PRECISION_LEVELS)


@dataclass(frozen=True)
class StoredPrecision:
    """A weight precision as calibration measured it on held-out text (the manifest's
    `precisions`): its quality loss against the full path (quality.quality_loss), the
    measures behind it, and its decode step's speedup over the fp32 full path per batch rows,
    on the machine that compiled it ((rows, speedup) pairs, ascending; empty: not timed)."""
    level: str
    decoder_quality_loss: float
    heldout: dict
    speedups: tuple[tuple[int, float], ...] = ()

    @property
    def speedup(self) -> float | None:
        """The batch-1 decode step's speedup (None: not timed)."""
        return dict(self.speedups).get(1)

    def speedup_at(self, rows: int) -> float | None:
        """The decode step's speedup at `rows` rows: the one timed at the smallest batch size
        of at least as many (speedups fall as batches grow; None: above every one timed)."""
        return next((speedup for timed, speedup in self.speedups if timed >= rows), None)

    @property
    def fp32_from_rows(self) -> int | None:
        """Steps of at least this many rows run fp32: the first timed batch size at which this
        level was no faster (None: faster at every one timed, or not timed)."""
        return next((rows for rows, speedup in self.speedups if speedup <= 1), None)

    def to_json(self) -> dict:
        stored = {"level": self.level, "decoder_quality_loss": self.decoder_quality_loss,
                  "heldout": self.heldout}
        if self.speedups:
            stored["speedups"] = {str(rows): speedup for rows, speedup in self.speedups}
        return stored

    @classmethod
    def from_json(cls, entry: dict) -> "StoredPrecision":
        return cls(entry["level"], float(entry["decoder_quality_loss"]), dict(entry["heldout"]),
                   tuple(sorted((int(rows), speedup)
                                for rows, speedup in entry.get("speedups", {}).items())))


@dataclass(frozen=True)
class StoredPrefill:
    """A prefill precision as calibration measured it (the manifest's `prefill_precisions`):
    per decode level, the quality loss of decoding at it after prompts prefilled at `level`
    (the held-out windows' first halves prefilled, their second halves scored), the measures
    behind the fp32 decode's, and its prefill's speedup over fp32 on a `tokens`-token prompt
    (None: not timed)."""
    level: str
    losses: dict[str, float]
    heldout: dict
    speedup: float | None = None
    tokens: int = 0

    def to_json(self) -> dict:
        return {"level": self.level, "losses": dict(self.losses), "heldout": self.heldout,
                "speedup": self.speedup, "tokens": self.tokens}

    @classmethod
    def from_json(cls, entry: dict) -> "StoredPrefill":
        return cls(entry["level"], {key: float(loss) for key, loss in entry["losses"].items()},
                   dict(entry["heldout"]), entry.get("speedup"), int(entry.get("tokens", 0)))


def stored_precisions(manifest: dict) -> dict[str, StoredPrecision]:
    return {entry["level"]: StoredPrecision.from_json(entry)
            for entry in manifest.get("precisions", [])}


def stored_prefills(manifest: dict) -> dict[str, StoredPrefill]:
    return {entry["level"]: StoredPrefill.from_json(entry)
            for entry in manifest.get("prefill_precisions", [])}


def level_loss(manifest: dict, level: str, prefill: str = "fp32") -> float | None:
    """The measured quality loss of decoding at weight `level` after prompts prefilled at
    `prefill` (0 for fp32 both; None: never measured)."""
    if prefill != "fp32":
        measured = stored_prefills(manifest).get(prefill)
        return None if measured is None else measured.losses.get(level)
    if level == "fp32":
        return 0.0
    measured = stored_precisions(manifest).get(level)
    return None if measured is None else measured.decoder_quality_loss


def onnxruntime_reason(compiled) -> str | None:
    """Why the onnxruntime executor cannot run `compiled`'s decoder (None: it can)."""
    from rbcompile.artifact.step_graph import unsupported_reason

    decoder = compiled.decoder
    if decoder is None:
        return "the artifact has no KV-cached decoder"
    reason = unsupported_reason(compiled.hf_config)
    if reason is not None:
        return reason
    if decoder.device.type != "cpu":
        return f"the model is on {decoder.device} (the executor runs on the CPU)"
    if decoder.dtype != torch.float32:
        return f"the weights are {decoder.dtype} (the executor takes fp32)"
    if decoder.mlp_layers() is None:
        return "its decoder gates are not all MLP branches"
    return None


AUTO = "auto"


def resolve_weights(manifest: dict, weights: str, guard: QualityGuard,
                    prefill: str = "fp32") -> str:
    """`weights`, or for "auto" the `fastest_level` at batch 1."""
    return fastest_level(manifest, guard, prefill=prefill) if weights == AUTO else weights


class Levels(NamedTuple):
    """The weight level decode steps run at and the level prompts are prefilled at."""
    weights: str
    prefill: str


def resolve_levels(manifest: dict, weights: str, prefill: str, guard: QualityGuard,
                   onnxruntime: bool) -> Levels:
    """`weights` and `prefill` with "auto" resolved: fp32 where the onnxruntime executor will not
    run the steps (`onnxruntime` False: only it runs other levels); else the weights' fastest
    level whose loss with the prefill the guard allows (both "auto": the weights' first, with an
    fp32 prefill), then the prefill's for those weights (`resolve_prefill`)."""
    if not onnxruntime:
        return Levels("fp32" if weights == AUTO else weights,
                      "fp32" if prefill == AUTO else prefill)
    weights = resolve_weights(manifest, weights, guard, "fp32" if prefill == AUTO else prefill)
    return Levels(weights, resolve_prefill(manifest, prefill, weights, guard))


def resolve_prefill(manifest: dict, prefill: str, weights: str, guard: QualityGuard) -> str:
    """`prefill`, or for "auto" the measured prefill level that timed faster than fp32 and
    whose loss with decoding at `weights` `guard` allows (fp32 where none)."""
    if prefill != AUTO:
        return prefill
    faster = [level for level, measured in stored_prefills(manifest).items()
              if (measured.speedup or 0) > 1 and guard.allows(measured.losses.get(weights))]
    return faster[0] if faster else "fp32"


def fastest_level(manifest: dict, guard: QualityGuard, rows: int = 1,
                  prefill: str = "fp32") -> str:
    """The measured level with the largest decode speedup at `rows` rows whose loss (after
    prompts prefilled at `prefill`) `guard` allows (fp32 where none is faster)."""
    speedups = {level.level: level.speedup_at(rows) or 0.0
                for level in stored_precisions(manifest).values()
                if guard.allows(level_loss(manifest, level.level, prefill))}
    faster = {level: speedup for level, speedup in speedups.items() if speedup > 1}
    return max(faster, key=faster.get) if faster else "fp32"


def _check_level(weights: str, prefill: str = "fp32") -> None:
    if weights not in WEIGHT_LEVELS:
        raise UserError(f"weights must be one of {', '.join(WEIGHT_LEVELS)}, got {weights!r}")
    if prefill not in PREFILL_LEVELS:
        raise UserError(f"prefill weights must be one of {', '.join(PREFILL_LEVELS)}, "
                        f"got {prefill!r}")


def check_precision(manifest: dict, weights: str, guard: QualityGuard,
                    prefill: str = "fp32") -> None:
    """Refuse (UserError) decoding at `weights` after prompts prefilled at `prefill` where
    their measured loss is over `guard`, or where it was never measured and `guard` runs
    measured plans only."""
    _check_level(weights, prefill)
    loss = level_loss(manifest, weights, prefill)
    if guard.allows(loss):   # the full path's loss is 0
        return
    what = f"{weights} weights" + (f" after an {prefill} prefill" if prefill != "fp32" else "")
    remedy = "--precisions " + ("auto" if prefill != "fp32" else weights)
    why = (f"were never measured on this artifact (compile it with {remedy}, or pass "
           "--allow-unmeasured-plans)" if loss is None else
           f"cost quality loss {loss:.3f} on held-out text, over the guard's "
           f"{guard.max_quality_loss:g} (raise --max-quality-loss to run them)")
    raise UserError(f"{what} {why}")


def use_executor(compiled, executor: str = "auto", weights: str = "fp32",
                 threads: int | None = None, prefill: str = "fp32") -> str:
    """Run `compiled`'s decoder steps with `executor` at `weights`, prompts prefilled at
    `prefill`; returns the executor chosen ("auto" resolved). Precision other than fp32 needs
    onnxruntime."""
    if executor not in EXECUTORS:
        raise UserError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    _check_level(weights, prefill)
    reason = onnxruntime_reason(compiled)
    if executor == "auto":
        executor = "onnxruntime" if reason is None else "torch"
    if executor == "torch":
        if weights != "fp32" or prefill != "fp32":
            what = f"{weights} weights need" if weights != "fp32" else f"an {prefill} prefill needs"
            raise UserError(f"{what} the onnxruntime executor "
                            f"({reason or 'pass --executor onnxruntime'})")
        if compiled.decoder is not None:
            compiled.decoder.executor, compiled.decoder.precision = None, None
            compiled.decoder.weights = compiled.decoder.prefill = "fp32"
        return executor
    if reason is not None:
        raise UserError(f"the onnxruntime executor cannot run this model: {reason}")
    from rbcompile.artifact.module import weights as module_weights
    from rbcompile.artifact.step_executor import StepExecutor

    decoder = compiled.decoder
    if decoder.step_executor is None or decoder.step_executor.threads != threads:
        decoder.step_executor = StepExecutor(module_weights(decoder.module), compiled.hf_config,
                                             decoder.mlp_layers(), threads=threads,
                                             activation_max=decoder.activation_max)
    decoder.executor = decoder.step_executor
    decoder.precision = level_precision(weights, decoder.executor.linear_weights())
    decoder.weights, decoder.prefill = weights, prefill
    decoder.executor.prefill_precision = prefill_precision(prefill,
                                                           decoder.executor.linear_weights())
    measured = stored_precisions(compiled.manifest).get(weights)
    decoder.executor.full_precision_rows = measured and measured.fp32_from_rows
    # the full path decodes too where it runs the level's larger steps: prepacked then
    decoder.executor.prepack = (weights == "fp32"
                                or decoder.executor.full_precision_rows is not None)
    return executor


def prepare_level(compiled, level: str) -> None:
    """Build the onnxruntime sessions of `level`'s decode steps now (`StepExecutor.prepare`)."""
    executor = compiled.decoder.executor
    executor.prepare(level_precision(level, executor.linear_weights()))


def level_step(compiled, level: str):
    """The decoder's step at weight `level` whatever level it decodes at (what
    `speculate="quant"` drafts with, and rows asking a level of their own run): the onnxruntime
    executor's, in fp32 from the batch size where `level` measured no faster. Needs the
    executor in use and `level` measured (or fp32)."""
    decoder = compiled.decoder
    measured = stored_precisions(compiled.manifest).get(level)
    if decoder is None or decoder.executor is None or (measured is None and level != "fp32"):
        raise UserError(f"a step at {level} needs the onnxruntime executor and {level} weights "
                        f"measured at compile (--precisions)")
    return partial(decoder.executor.run,
                   precision=level_precision(level, decoder.executor.linear_weights()),
                   fp32_from_rows=measured and measured.fp32_from_rows)
