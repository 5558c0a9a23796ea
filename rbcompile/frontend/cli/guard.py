"""The quality guard as the commands set it and say what it did."""
from __future__ import annotations

import sys

# Deferred on purpose: the commands import the rest of rbcompile (and torch) when they run,
# so the CLI starts, and handles Ctrl-C, before torch loads (see __init__._import_heavy).


def _quality_guard(args, model) -> None:
    """`model.guard` from --max-quality-loss and --allow-unmeasured-plans; the guard speaks
    through the command's own lines, not Python warnings. One warning line when unmeasured
    plans may run; `serve` also says which lossy budgets its guard leaves."""
    import warnings

    from rbcompile.artifact.compiled import QualityGuardWarning

    model.guard = _guard_from(args)
    warnings.filterwarnings("ignore", category=QualityGuardWarning)
    lossy, unmeasured = _lossy_plans(model), _unmeasured_plans(model)
    if args.allow_unmeasured_plans and (unmeasured or not lossy):
        what = f"{unmeasured} of its plans" if lossy else "every lossy budget (uncalibrated)"
        print(f"rbcompile: warning: --allow-unmeasured-plans: {what} may run with no measured "
              "quality cost", file=sys.stderr)


def _lossy_plans(model) -> list:
    return [plan for plan in model.plans or [] if plan.budget > 0]


def _unmeasured_plans(model) -> int:
    """How many of the stored lossy plans have no measured loss where the model serves."""
    from rbcompile.artifact.guard import DECODER, FORWARD

    path = model.loss_path(DECODER if model.decoder is not None else FORWARD)
    return sum(plan.loss(path) is None for plan in _lossy_plans(model))


def _use_executor(model, executor: str, weights: str, guard, prefill: str = "fp32") -> str:
    """Run `model`'s decode steps with `executor` at `weights` (--weights; "auto" resolved
    by executors.resolve_levels), prompts prefilled at `prefill` (--prefill-weights), which
    must be within `guard` together; one line on stderr for each that is not fp32 or was
    chosen."""
    from rbcompile.artifact.executors import (
        check_precision,
        onnxruntime_reason,
        resolve_levels,
        stored_precisions,
    )
    from rbcompile.artifact.ort_threads import share_threads

    asked, asked_prefill = weights, prefill
    onnxruntime = executor == "onnxruntime" or (executor == "auto"
                                                and onnxruntime_reason(model) is None)
    weights, prefill = resolve_levels(model.manifest, weights, prefill, guard, onnxruntime)
    if asked != weights and weights == "fp32":
        why = ("the torch executor runs fp32 only" if not onnxruntime else
               "no measured level is faster within the guard")
        print(f"rbcompile: --weights auto: fp32 ({why})", file=sys.stderr)
    check_precision(model.manifest, weights, guard, prefill)
    if model.decoder is None:
        return "torch"
    if executor != "torch":   # this process owns its sessions: one thread pool for them all
        share_threads()
    chosen = model.use_executor(executor, weights, prefill=prefill)
    if prefill != "fp32":
        _say_prefill(model.manifest, prefill, weights)
    elif asked_prefill == "auto":
        print("rbcompile: --prefill-weights auto: fp32 (no measured prefill level is faster "
              "within the guard)", file=sys.stderr)
    if weights != "fp32":
        measured = stored_precisions(model.manifest).get(weights)
        loss = "unmeasured" if measured is None else (
            f"quality loss {measured.decoder_quality_loss:.3f} measured")
        if measured is not None and measured.speedup is not None:
            loss += f", decode step {measured.speedup:.2f}x fp32 at batch 1"
            if measured.fp32_from_rows is not None:
                loss += f"; steps of {measured.fp32_from_rows}+ rows run fp32, no faster there"
        print(f"rbcompile: {'--weights auto: ' if asked != weights else ''}{weights} weights "
              f"({loss}) on {chosen}", file=sys.stderr)
    return chosen


def _say_prefill(manifest: dict, prefill: str, weights: str) -> None:
    from rbcompile.artifact.executors import stored_prefills

    measured = stored_prefills(manifest).get(prefill)
    loss = None if measured is None else measured.losses.get(weights)
    said = (f"unmeasured with {weights} decoding" if loss is None else
            f"quality loss {loss:.3f} measured with {weights} decoding")
    if measured is not None and measured.speedup is not None:
        said += f", {measured.speedup:.2f}x fp32 on a {measured.tokens}-token prompt"
    print(f"rbcompile: prompts prefilled at {prefill} ({said})", file=sys.stderr)


def _guard_from(args):
    """The QualityGuard of --max-quality-loss and --allow-unmeasured-plans."""
    from rbcompile.artifact.guard import QualityGuard
    from rbcompile.errors import UserError

    if not args.max_quality_loss >= 0:
        raise UserError(f"--max-quality-loss must be >= 0, got {args.max_quality_loss}")
    return QualityGuard(args.max_quality_loss, args.allow_unmeasured_plans)


def _guard_leaves(model) -> str:
    """What a serving guard leaves the controller: the budgets it allows that skip work."""
    lossy, unmeasured = _lossy_plans(model), _unmeasured_plans(model)
    allowed = _serving_budgets(model)
    if allowed and not lossy:
        return "any lossy budget (unmeasured)"
    if allowed:
        return f"lossy budgets {', '.join(f'{b:g}' for b in allowed)}"
    if not lossy:
        return "no lossy plan (uncalibrated: none is measured): the full path only"
    measured = len(lossy) - unmeasured
    return (f"no lossy plan ({measured} measured: over it or skipping nothing in the decoder, "
            f"{unmeasured} unmeasured): the full path only")


def _serving_budgets(model) -> list[float]:
    """The budgets > 0 the guard lets a controller set that skip some work where it runs (a
    decoder's plan that only narrows runs the whole KV-cached decoder)."""
    from rbcompile.artifact.guard import DECODER, FORWARD, lossy_budgets

    if model.decoder is None:
        return lossy_budgets(model.plans, model.guard, FORWARD)
    return [budget for budget in lossy_budgets(model.plans, model.guard, model.loss_path(DECODER))
            if not all(model.decoder_gates(min(budget, 1.0)) or [True])]


def _plan_line(model, budget, path: str) -> str:
    """What `budget` ran under the guard, with the flag that would change it."""
    from rbcompile.artifact.guard import UNMEASURED

    plan = model.guarded(budget, path)
    hint = ""
    if plan.withheld == UNMEASURED:
        hint = " (compile with --calib to measure plans, or --allow-unmeasured-plans)"
    elif plan.withheld is not None:
        hint = f" (--max-quality-loss {model.guard.max_quality_loss:g}; raise it to allow more)"
    return plan.describe() + hint
