"""Calibration of weight precisions: each level's quality against the full path on the
held-out batches, through the onnxruntime step executor (rbcompile/artifact/executors.py).

A level is measured as the decoder runs it: every linear (block projections and the
vocabulary head) at that precision, prefilled over each held-out batch; next-token loss,
perplexity and top-1 agreement with the full path go through quality.quality_loss, the
guard's unit. The fp32 full path of the same executor is measured too, as a check that the
executor itself costs nothing.
"""
from __future__ import annotations

from rbcompile.artifact import quality
from rbcompile.artifact.executors import WEIGHT_LEVELS, StoredPrecision, onnxruntime_reason
from rbcompile.errors import UserError
from rbcompile.progress import say

# Deferred on purpose: onnx and onnxruntime load when a precision is measured, not with the
# compiler (they add to every compile's start).

LOW_LEVELS = tuple(level for level in WEIGHT_LEVELS if level != "fp32")


def measure_precisions(compiled, batches, levels: tuple[str, ...]) -> list[StoredPrecision]:
    """Each of `levels` measured on `batches` ([(input_ids, mask)]) against the full path."""
    if not levels:
        return []
    reason = onnxruntime_reason(compiled)
    if reason is not None:
        raise UserError(f"cannot measure weight precisions: {reason} (compile with "
                        "--precisions none)")
    from rbcompile.artifact.step_executor import FULL_PRECISION_FROM, sequence_logits

    shape = compiled.decoder.shape
    dims = (shape.kv_heads, shape.head_dim, shape.layers)
    references = [quality.reference("decoder", compiled(ids, mask), mask) for ids, mask in batches]

    def summary(step) -> dict:
        parts = [quality.measure("decoder", {"logits": sequence_logits(step, ids, mask, *dims)},
                                 ids, mask, reference)
                 for (ids, mask), reference in zip(batches, references)]
        return quality.summarise("decoder", parts)

    full = summary(compiled.decoder)
    previous = compiled.decoder.executor, compiled.decoder.precision
    stored = []
    try:
        for level in ("fp32", *levels):
            compiled.use_executor("onnxruntime", level)
            compiled.decoder.executor.full_precision_from = None  # every position at `level`
            measured = summary(compiled.decoder)
            loss = quality.quality_loss(measured, full)
            say(f"  {level} weights: perplexity {measured['perplexity']:.2f} (full path "
                f"{full['perplexity']:.2f}), top-1 agreement {measured['top1_agreement']:.3f}, "
                f"quality loss {loss:.3f}")
            if level != "fp32":
                stored.append(StoredPrecision(level, loss, measured))
    finally:
        if compiled.decoder.step_executor is not None:
            compiled.decoder.step_executor.full_precision_from = FULL_PRECISION_FROM
        compiled.decoder.executor, compiled.decoder.precision = previous
    return stored
