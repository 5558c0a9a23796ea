"""Which executor runs a decoder's steps, and at which weight precision.

- "torch": the generated module, op by op (the reference: the full path equals the source
  model to fp32 rounding);
- "onnxruntime": `StepExecutor`, one onnxruntime graph per plan, with the weights at `fp32`,
  `int8` or `int4` (MatMulNBits);
- "auto": onnxruntime where it runs the model (a Llama-family fp32 decoder on the CPU), torch
  elsewhere.

Lower precisions change the output: `check_precision` lets one run only where calibration
measured its quality loss within the guard (the manifest's `precisions`, compiler/precision.py),
or where the guard allows unmeasured plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from rbcompile.artifact.guard import QualityGuard
from rbcompile.artifact.manifest import PRECISION_LEVELS
from rbcompile.artifact.packed_weights import level_precision
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


def stored_precisions(manifest: dict) -> dict[str, StoredPrecision]:
    return {entry["level"]: StoredPrecision.from_json(entry)
            for entry in manifest.get("precisions", [])}


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


def resolve_weights(manifest: dict, weights: str, guard: QualityGuard) -> str:
    """`weights`, or for "auto" the `fastest_level` at batch 1."""
    return fastest_level(manifest, guard) if weights == AUTO else weights


def fastest_level(manifest: dict, guard: QualityGuard, rows: int = 1) -> str:
    """The measured level with the largest decode speedup at `rows` rows whose loss `guard`
    allows (fp32 where none is faster)."""
    speedups = {level.level: level.speedup_at(rows) or 0.0
                for level in stored_precisions(manifest).values()
                if guard.allows(level.decoder_quality_loss)}
    faster = {level: speedup for level, speedup in speedups.items() if speedup > 1}
    return max(faster, key=faster.get) if faster else "fp32"


def _check_level(weights: str) -> None:
    if weights not in WEIGHT_LEVELS:
        raise UserError(f"weights must be one of {', '.join(WEIGHT_LEVELS)}, got {weights!r}")


def check_precision(manifest: dict, weights: str, guard: QualityGuard) -> None:
    """Refuse (UserError) `weights` where its measured loss is over `guard`, or where it was
    never measured and `guard` runs measured plans only."""
    _check_level(weights)
    if weights == "fp32":
        return
    measured = stored_precisions(manifest).get(weights)
    loss = None if measured is None else measured.decoder_quality_loss
    if not guard.allows(loss):
        why = ("were never measured on this artifact (compile it with --precisions "
               f"{weights}, or pass --allow-unmeasured-plans)" if loss is None else
               f"cost quality loss {loss:.3f} on held-out text, over the guard's "
               f"{guard.max_quality_loss:g} (raise --max-quality-loss to run them)")
        raise UserError(f"{weights} weights {why}")


def use_executor(compiled, executor: str = "auto", weights: str = "fp32",
                 threads: int | None = None) -> str:
    """Run `compiled`'s decoder steps with `executor` at `weights`; returns the executor
    chosen ("auto" resolved). Precision other than fp32 needs onnxruntime."""
    if executor not in EXECUTORS:
        raise UserError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    _check_level(weights)
    reason = onnxruntime_reason(compiled)
    if executor == "auto":
        executor = "onnxruntime" if reason is None else "torch"
    if executor == "torch":
        if weights != "fp32":
            raise UserError(f"{weights} weights need the onnxruntime executor "
                            f"({reason or 'pass --executor onnxruntime'})")
        if compiled.decoder is not None:
            compiled.decoder.executor, compiled.decoder.precision = None, None
            compiled.decoder.weights = "fp32"
        return executor
    if reason is not None:
        raise UserError(f"the onnxruntime executor cannot run this model: {reason}")
    from rbcompile.artifact.module import weights as module_weights
    from rbcompile.artifact.step_executor import StepExecutor

    decoder = compiled.decoder
    if decoder.step_executor is None or decoder.step_executor.threads != threads:
        decoder.step_executor = StepExecutor(module_weights(decoder.module), compiled.hf_config,
                                             decoder.mlp_layers(), threads=threads)
    decoder.executor = decoder.step_executor
    decoder.precision = level_precision(weights, decoder.executor.linear_weights())
    decoder.weights = weights
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
