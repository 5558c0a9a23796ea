"""The quality-latency curve: every calibrated plan and a static Block-Influence layer-drop
baseline, measured on held-out real data in one run (quality and latency side by side).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rbcompile.artifact import quality
from rbcompile.artifact.plans import within_budget
from rbcompile.calibration_data import DATA, decoder_windows, load_labelled, load_texts, paragraphs
from rbcompile.errors import UserError
from rbcompile.progress import say

# Deferred on purpose: matplotlib (optional) loads only to draw a plot.

DEFAULT_EVAL = DATA / "eval-tempest.txt"


@dataclass
class EvalData:
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    labels: list[torch.Tensor] | None  # per batch, when the data has labels


def load_eval_data(compiled, source, *, samples: int, seq: int, batch: int) -> EvalData:
    """Decoders: `samples` windows of `seq` tokens. Encoders: texts (JSONL may carry "label")."""
    path = Path(source) if source else DEFAULT_EVAL
    tokenizer = compiled.tokenizer
    seq = min(seq, compiled.max_positions)
    if compiled.family == "decoder":
        ids = decoder_windows(tokenizer, load_texts(path), seq, samples)
        return EvalData([(ids[i:i + batch], torch.ones_like(ids[i:i + batch]))
                         for i in range(0, len(ids), batch)], None)
    texts, labels = _texts_and_labels(path)
    texts, labels = texts[:samples], labels[:samples] if labels else None
    batches, label_batches = [], []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], return_tensors="pt", padding=True, truncation=True,
                        max_length=seq)
        batches.append((enc["input_ids"], enc["attention_mask"]))
        if labels:
            label_batches.append(torch.tensor(labels[i:i + batch]))
    return EvalData(batches, label_batches or None)


def _texts_and_labels(path: Path) -> tuple[list[str], list[int] | None]:
    """JSONL: one text (and label) per line; plain text: one text per paragraph."""
    texts, labels = load_labelled(path)
    if path.suffix == ".jsonl":
        return texts, labels
    return paragraphs(texts[0]), None


def static_bi_gates(compiled, budget: float) -> list[bool]:
    """ShortGPT baseline: drop whole layers with the lowest Block Influence within the budget."""
    layers = compiled.manifest["calibration"]["layers"]
    by_layer: dict[int, list[dict]] = {}
    for region in compiled.regions:
        if region["kind"] == "prunable":
            by_layer.setdefault(region["layer"], []).append(region)
    gates, skipped = [True] * compiled.num_gates, 0.0
    for layer in sorted(by_layer, key=lambda i: layers[str(i)]["block_influence"]):
        share = sum(r["prunable_share"] for r in by_layer[layer])
        if within_budget(skipped + share, budget):
            for region in by_layer[layer]:
                gates[region["gate"]] = False
            skipped += share
    return gates


def references(compiled, data: EvalData) -> list[torch.Tensor]:
    """The full path's reference of each batch (see quality.reference)."""
    return [quality.reference(compiled.family, compiled(ids, mask), mask)
            for ids, mask in data.batches]


def measure_quality(compiled, data: EvalData, gates, widths, references,
                    classifier=None) -> dict:
    """Quality of one setting (gates, widths) over every batch of `data` (quality.summarise;
    with labels and a classifier, also accuracy)."""
    parts, correct, total = [], 0, 0
    for index, ((ids, mask), ref) in enumerate(zip(data.batches, references)):
        out = compiled(ids, mask, gates=gates, widths=widths)
        parts.append(quality.measure(compiled.family, out, ids, mask, ref))
        own = compiled.task_head == "sequence-classification"  # heads.SEQUENCE
        if (classifier is not None or own) and data.labels is not None:
            logits = (out["logits"] if classifier is None else
                      quality.head_logits(classifier, out["last_hidden_state"], mask))
            correct += int((logits.argmax(-1) == data.labels[index]).sum())
            total += len(ids)
    result = quality.summarise(compiled.family, parts)
    if total:
        result["accuracy"] = correct / total
    return result


def _time(compiled, data: EvalData, gates, widths) -> float:
    start = time.perf_counter()
    for ids, mask in data.batches:
        compiled(ids, mask, gates=gates, widths=widths)
    return time.perf_counter() - start


def knee(points: list[dict], key: str, higher_is_better: bool) -> dict:
    """Kneedle: the interior point farthest on the good side of the chord from the full path to
    the fastest point (where extra speed starts to cost the most quality)."""
    ordered = sorted(points, key=lambda p: p["speedup"])
    (x0, y0), (x1, y1) = ((ordered[0]["speedup"], ordered[0][key]),
                          (ordered[-1]["speedup"], ordered[-1][key]))
    sign = 1 if higher_is_better else -1

    def above_chord(p):
        if x1 == x0:
            return 0.0
        chord = y0 + (y1 - y0) * (p["speedup"] - x0) / (x1 - x0)
        scale = abs(y1 - y0) or 1.0
        return sign * (p[key] - chord) / scale
    interior = ordered[1:-1] or ordered
    return max(interior, key=above_chord)


def sweep(compiled, data: EvalData, *, classifier=None, rounds: int = 3) -> dict:
    """Measure every plan and the BI baseline; quality once, latency as a median of rounds."""
    if not compiled.plans:
        raise UserError("this artifact has no calibrated plans: compile it with --calib")
    settings = [("full", 0.0, [True] * compiled.num_gates, None)]
    for plan in compiled.plans[1:]:
        settings.append(("plan", plan.budget, *compiled.plan_for_budget(plan.budget)))
        settings.append(("static-BI", plan.budget, static_bi_gates(compiled, plan.budget), None))
    key = lambda gates, widths: (tuple(gates), tuple(widths) if widths else None)  # noqa: E731
    unique = {key(g, w): (g, w) for _, _, g, w in settings}
    full = references(compiled, data)
    measured = {}
    for index, (k, (gates, widths)) in enumerate(unique.items(), 1):
        measured[k] = measure_quality(compiled, data, gates, widths, full, classifier)
        say(f"  quality {index}/{len(unique)}: skipped {compiled.skipped_share(gates, widths):.1%}")
    times: dict[tuple, list[float]] = {k: [] for k in unique}
    for round_index in range(rounds):  # interleaved: each setting once per round
        for k, (gates, widths) in unique.items():
            times[k].append(_time(compiled, data, gates, widths))
        say(f"  latency round {round_index + 1}/{rounds}")
    full_time = statistics.median(times[key(settings[0][2], None)])
    rows = []
    for kind, budget, gates, widths in settings:
        k = key(gates, widths)
        seconds = statistics.median(times[k])
        rows.append({"kind": kind, "budget": budget,
                     "skipped_share": compiled.skipped_share(gates, widths),
                     "skipped_gates": [i for i, g in enumerate(gates) if not g],
                     "narrowed": {str(i): w for i, w in enumerate(widths or []) if w < 1},
                     "median_s": seconds, "speedup": full_time / seconds, **measured[k]})
    metric, higher = main_metric(compiled.family, rows)
    plan_points = [r for r in rows if r["kind"] in ("full", "plan")]
    return {"metric": metric, "higher_is_better": higher, "rows": rows,
            "knee": knee(plan_points, metric, higher)}


def main_metric(family: str, rows) -> tuple[str, bool]:
    if "accuracy" in rows[0]:
        return "accuracy", True
    if family == "decoder":
        return "perplexity", False
    return ("top1_agreement", True) if "top1_agreement" in rows[0] else ("cosine", True)


def plot(result: dict, title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = result["metric"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    full = next(r for r in result["rows"] if r["kind"] == "full")
    for kind, style in (("plan", "o-"), ("static-BI", "s--")):
        pts = sorted([full] + [r for r in result["rows"] if r["kind"] == kind],
                     key=lambda r: r["skipped_share"])
        label = "rbcompile plans (measured importance)" if kind == "plan" else \
            "static layer drop (Block Influence order)"
        ax.plot([p["speedup"] for p in pts], [p[metric] for p in pts], style, label=label)
    k = result["knee"]
    ax.scatter([k["speedup"]], [k[metric]], s=160, facecolors="none", edgecolors="red",
               label=f"knee: budget {k['budget']:.2f}")
    if metric == "perplexity":
        ax.set_yscale("log")
    save_plot(fig, ax, title, ("measured speedup over the full path (x)", metric), path)


def save_plot(fig, ax, title: str, labels: tuple[str, str], path: Path) -> None:
    """Axis labels (x, y), title, grid and legend on `ax`, then `fig` written to `path`."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict) -> str:
    metric = result["metric"]
    lines = [f"{'kind':<10} {'budget':>6} {'skipped':>8} {'speedup':>8} {metric:>11} "
             f"{'agreement' if 'top1_agreement' in result['rows'][0] else '':>9}"]
    for r in result["rows"]:
        extra = f"{r['top1_agreement']:9.4f}" if "top1_agreement" in r else ""
        lines.append(f"{r['kind']:<10} {r['budget']:6.2f} {r['skipped_share']:8.1%} "
                     f"{r['speedup']:7.3f}x {r[metric]:11.4f} {extra}")
    k = result["knee"]
    lines.append(f"knee: budget {k['budget']:.2f}, {k['speedup']:.3f}x, {metric} {k[metric]:.4f}")
    return "\n".join(lines)
