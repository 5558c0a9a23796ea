"""Generation speed: rbcompile's KV-cached `generate` (speculate off / ngram / self / auto)
against transformers' `generate` on the same weights, greedy, on real text (issue 15); the
decode steps run op by op in torch ("rbcompile", "engine") or as onnxruntime graphs
("onnxruntime", issue 45) at fp32, int8, int4 or int4-fp32 weights (low precisions change
tokens: their "identical" column is their quality, and they are left out of the identity target).

Three workloads, prompts cut at deterministic offsets:
  continuation  open continuation of literature (Emma, Macbeth, The Tempest), 64-128 tokens;
  grounded      input-grounded: a 150-250 token passage of those texts that the user asks, in
                the chat template, to repeat word for word, so the model continues by
                copying (the case n-gram drafting is for);
  technical     Vim's manual (/usr/share/vim/vim90/doc), 64-128 tokens.
Batch 1 runs --samples prompts per workload; batch 8 one batch of 8 left-padded prompts per
workload. Every contender runs every (sample, round) in turn, ABBA order, so machine noise hits
all alike; tokens/s is new tokens (per row up to and including EOS) over the wall time of the
whole call, median over samples and rounds; "vs HF" is that median over HF generate's median in
the same run. Greedy tokens are compared with HF's per row, up to and including EOS.
Writes benchmarks/results/bench_generate.json (every raw time) or --json PATH.

--contenders picks among HF generate (always run: the reference), rbcompile off / ngram / self
/ auto (`generate`, a static batch) and engine off / ngram: the continuous-batching engine
(`batch_engine`, what `rbcompile serve` runs) given the batch's prompts unpadded at once, with
`speculate` n-gram drafts verified in its batch steps for engine ngram; and the peers users
pick instead (benchmarks/peers.py, installed by `make bench-peers`): ORT GenAI fp32, llama.cpp F32
(with and without prompt lookup), Q8_0 and the shipped Q4_1.

    python benchmarks/bench_generate.py [--samples 3] [--rounds 1] [--new-tokens 128]
        [--batches 1 8] [--workloads continuation grounded technical] [--threads 2] [--dtype bf16]
        [--contenders rbcompile-off ...] [--artifact FOLDER] [--json PATH] [--smoke]

--smoke: 1 sample, 8 new tokens, batch 2, the grounded workload (checks the script in ~2 min).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import pin_threads, print_table, write_json  # noqa: E402
from peers import PEER_TARGETS, PEERS, peer_contenders, until_eos  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.artifact.ort_threads import share_threads  # noqa: E402
from rbcompile.runtime.engine.core import EngineRequest  # noqa: E402
from rbcompile.artifact.models import load_hf_model, resolve_checkpoint  # noqa: E402
from rbcompile.artifact.placement import parse_dtype  # noqa: E402
from rbcompile.progress import say, step  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"   # ../shared next to the repo
LITERATURE = ["austen-emma.txt", "shakespeare-macbeth.txt", "shakespeare-tempest.txt"]
VIM_DOC = Path("/usr/share/vim/vim90/doc")
MANUAL = ["usr_02.txt", "motion.txt", "usr_03.txt", "change.txt", "usr_04.txt", "pattern.txt"]
WORKLOADS = ("continuation", "grounded", "technical")
MODES = ("off", "ngram", "self", "auto")
ENGINE_MODES = ("off", "ngram")
# the onnxruntime step executor (rbcompile/artifact/executors.py): (weights, speculate) each
EXECUTED = (("fp32", "off"), ("fp32", "ngram"), ("fp32", "quant"), ("fp32", "auto"),
            ("int8", "off"), ("int4", "off"), ("int4", "ngram"), ("int4-fp32", "off"),
            ("int4-fp32", "ngram"), ("int4-fp32", "quant"))
ORT = {f"onnxruntime{'' if w == 'fp32' else ' ' + w} {m}": (w, m) for w, m in EXECUTED}
CONTENDERS = ("HF generate", *(f"rbcompile {m}" for m in MODES), *ORT,
              *(f"engine {m}" for m in ENGINE_MODES), *PEERS)
GOLDEN = (math.sqrt(5) - 1) / 2


# ---- prompts ---------------------------------------------------------------------------------

def _read(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    if path.name.startswith("austen"):   # join the hard-wrapped prose lines of a paragraph
        text = re.sub(r"(?<!\n)\n(?!\n)", " ", text)
    return text


def _offset(text: str, index: int) -> int:
    """A paragraph start at a deterministic spot in the middle 80% of `text` (index-th point of
    a golden-ratio sequence, so nearby indices land far apart)."""
    at = int(len(text) * (0.1 + 0.8 * ((index + 1) * GOLDEN % 1.0)))
    found = text.find("\n\n", at)
    start = (found if found >= 0 else at)
    while start < len(text) and text[start] in "\n \t":
        start += 1
    return start


def _first_tokens(tokenizer, text: str, count: int) -> str:
    ids = tokenizer(text[:count * 12], add_special_tokens=False)["input_ids"][:count]
    return tokenizer.decode(ids)


def _source(files: list[str], folder: Path, index: int) -> tuple[str, str]:
    name = files[index % len(files)]
    return name, _read(folder / name)


def continuation_prompt(tokenizer, index: int) -> dict:
    name, text = _source(LITERATURE, SHARED, index)
    start = _offset(text, index)
    length = 64 + (index * 23) % 65
    return {"source": name, "offset": start, "text": _first_tokens(tokenizer, text[start:], length)}


def technical_prompt(tokenizer, index: int) -> dict:
    name, text = _source(MANUAL, VIM_DOC, index)
    start = _offset(text, index)
    length = 64 + (index * 23) % 65
    return {"source": name, "offset": start, "text": _first_tokens(tokenizer, text[start:], length)}


ABBREVIATIONS = r"(?<!\bMr)(?<!\bMrs)(?<!\bDr)(?<!\bSt)(?<!\bMs)"


def grounded_prompt(tokenizer, index: int) -> dict:
    """A passage (whitespace collapsed, cut at a sentence end) the user asks the model, in its
    chat template, to repeat word for word. (SmolLM2-135M closes the quote at once when asked
    to quote a sentence of the passage from its first words; asked to repeat, it copies.)"""
    name, text = _source(LITERATURE, SHARED, index)
    for attempt in range(20):
        start = _offset(text, index + 1000 * attempt)
        passage = " ".join(_first_tokens(tokenizer, text[start:], 150 + (index * 41) % 101).split())
        ends = [m.end() for m in re.finditer(ABBREVIATIONS + r"[.!?][\"']?(?= )", passage)]
        if ends and len(tokenizer(passage[:ends[-1]])["input_ids"]) >= 120:
            passage = passage[:ends[-1]]
            request = f"Repeat this text word for word:\n\n{passage}"
            text = tokenizer.apply_chat_template([{"role": "user", "content": request}],
                                                 tokenize=False, add_generation_prompt=True)
            return {"source": name, "offset": start, "text": text}
    raise SystemExit(f"no grounded prompt for index {index} in {name}")


PROMPTS = {"continuation": continuation_prompt, "grounded": grounded_prompt,
           "technical": technical_prompt}


def batches(tokenizer, workload: str, batch: int, samples: int) -> list[dict]:
    """`samples` batches (batch 1) or one batch of `batch` prompts, left-padded."""
    make = PROMPTS[workload]
    groups = [[make(tokenizer, i)] for i in range(samples)] if batch == 1 else \
        [[make(tokenizer, i) for i in range(batch)]]
    tokenizer.padding_side = "left"
    out = []
    for group in groups:
        encoded = tokenizer([p["text"] for p in group], return_tensors="pt", padding=True)
        out.append({"prompts": group, "input_ids": encoded["input_ids"],
                    "attention_mask": encoded["attention_mask"],
                    "prompt_tokens": encoded["attention_mask"].sum(-1).tolist()})
    return out


# ---- contenders ------------------------------------------------------------------------------

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_contenders(compiled, eager, eos: set[int], pad: int, new_tokens: int, threads: int):
    """name -> fn(input_ids, attention_mask) -> (tokens per row, stats or None). "rbcompile"
    and "engine" run the torch executor, "onnxruntime" the step executor at its weights."""
    eos_list = sorted(eos)

    def hf(input_ids, mask):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = eager.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=pad,
                                 eos_token_id=eos_list)
        return [until_eos(row, eos) for row in out[:, input_ids.shape[1]:].tolist()], None

    def rb(mode, executor="torch", weights="fp32"):
        def run(input_ids, mask):
            compiled.use_executor(executor, weights, threads=threads)
            result = compiled.generate(input_ids, mask, max_new_tokens=new_tokens, speculate=mode)
            return result.tokens, result.stats
        return run

    def engine(mode):
        def run(input_ids, mask):
            compiled.use_executor("torch")
            batch = compiled.batch_engine(max_batch=input_ids.shape[0])
            requests = [batch.submit(EngineRequest(row[keep.bool()].tolist(), new_tokens,
                                                   speculate=mode))
                        for row, keep in zip(input_ids, mask)]
            while batch.has_work:
                batch.step()
            return [request.tokens for request in requests], batch.stats
        return run

    return {"HF generate": hf, **{f"rbcompile {m}": rb(m) for m in MODES},
            **{name: rb(mode, "onnxruntime", weights) for name, (weights, mode) in ORT.items()},
            **{f"engine {m}": engine(m) for m in ENGINE_MODES}}


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _stats_dict(stats) -> dict | None:
    if stats is None:
        return None
    if not hasattr(stats, "steps_by_mode"):   # the engine's: steps counted per row (mean len)
        return {"new_tokens": stats.tokens, "drafted": stats.drafted, "accepted": stats.accepted,
                "decode_steps": stats.decode_rows, "step_tokens": stats.tokens - stats.prefills,
                "steps_by_mode": {}}
    return {"prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
            "engine_seconds": stats.seconds, "forward_calls": stats.forward_calls,
            "drafted": stats.drafted, "accepted": stats.accepted,
            "decode_steps": stats.decode_steps, "step_tokens": stats.step_tokens,
            "steps_by_mode": dict(stats.steps_by_mode)}


def measure(contenders: dict, work: dict[tuple[int, str], list[dict]], rounds: int,
            device) -> list[dict]:
    """Every (batch, workload, sample, round): each contender once, ABBA order. Raw records."""
    records = []
    units = [(key, s) for key, samples in work.items() for s in range(len(samples))]
    total = len(units) * rounds
    done = 0
    for round_index in range(rounds):
        for (batch, workload), sample in units:
            item = work[(batch, workload)][sample]
            order = list(contenders.items())
            if (round_index + sample) % 2:
                order = order[::-1]
            for name, fn in order:
                _sync(device)
                start = time.perf_counter()
                tokens, stats = fn(item["input_ids"], item["attention_mask"])
                _sync(device)
                seconds = time.perf_counter() - start
                records.append({"batch": batch, "workload": workload, "sample": sample,
                                "round": round_index, "contender": name, "seconds": seconds,
                                "new_tokens": sum(len(row) for row in tokens),
                                "tokens": tokens, "stats": _stats_dict(stats)})
            done += 1
            line = "  ".join(f"{r['contender'].replace('rbcompile ', '')} "
                             f"{r['new_tokens'] / r['seconds']:.1f}"
                             for r in records[-len(contenders):])
            say(f"  [{done}/{total}] round {round_index + 1} batch {batch} {workload} "
                f"sample {sample + 1}: tokens/s {line}")
    return records


# ---- summary ---------------------------------------------------------------------------------

def summarise(records: list[dict]) -> list[dict]:
    rows = []
    keys = sorted({(r["batch"], r["workload"]) for r in records},
                  key=lambda k: (k[0], WORKLOADS.index(k[1])))
    for batch, workload in keys:
        group = [r for r in records if (r["batch"], r["workload"]) == (batch, workload)]
        reference = {(r["sample"], r["round"]): r for r in group if r["contender"] == "HF generate"}
        hf_rate = statistics.median(r["new_tokens"] / r["seconds"] for r in reference.values())
        for name in CONTENDERS:
            mine = [r for r in group if r["contender"] == name]
            if not mine:
                continue
            rate = statistics.median(r["new_tokens"] / r["seconds"] for r in mine)
            paired = statistics.median(
                (r["new_tokens"] / r["seconds"]) / (ref["new_tokens"] / ref["seconds"])
                for r in mine for ref in [reference[(r["sample"], r["round"])]])
            rows_compared, mismatched, first = 0, set(), None
            for r in mine:
                ref = reference[(r["sample"], r["round"])]
                for row, (got, want) in enumerate(zip(r["tokens"], ref["tokens"])):
                    rows_compared += r["round"] == 0
                    if got != want:
                        mismatched.add((r["sample"], row))
                        if first is None:
                            first = {"sample": r["sample"], "row": row, "round": r["round"],
                                     "position": _first_difference(got, want),
                                     "lengths": [len(got), len(want)]}
            stats = [r["stats"] for r in mine if r["stats"]]
            drafted = sum(s["drafted"] for s in stats)
            modes: dict[str, int] = {}
            for s in stats:
                for mode, count in s["steps_by_mode"].items():
                    modes[mode] = modes.get(mode, 0) + count
            steps = sum(s["decode_steps"] for s in stats)
            rows.append({
                "batch": batch, "workload": workload, "contender": name,
                "calls": len(mine),
                "new_tokens_median": statistics.median(r["new_tokens"] for r in mine),
                "tokens_per_second": rate, "vs_hf": rate / hf_rate, "vs_hf_paired": paired,
                "seconds_median": statistics.median(r["seconds"] for r in mine),
                "acceptance_rate": sum(s["accepted"] for s in stats) / drafted if drafted else None,
                "mean_accepted_length": (sum(s["step_tokens"] for s in stats) / steps) if steps else None,
                "drafted": drafted if stats else None,
                "steps_by_mode": modes or None,
                "rows_compared": rows_compared, "mismatched_rows": len(mismatched),
                "first_mismatch": first,
            })
    return rows


def targets(rows: list[dict]) -> list[tuple[str, bool | None, str]]:
    """(target, met, evidence); met is None when the run did not measure it."""
    def ratios(contender, workloads=WORKLOADS, batches=None):
        return [r for r in rows if r["contender"] == contender and r["workload"] in workloads
                and (batches is None or r["batch"] in batches)]

    def at_least(contender, peer, batch):
        base = {r["workload"]: r["tokens_per_second"] for r in ratios(peer, batches=[batch])}
        found = {r["workload"]: r["tokens_per_second"] / base[r["workload"]]
                 for r in ratios(contender, batches=[batch]) if r["workload"] in base}
        if found:
            out.append((f"{contender} >= {peer} at batch {batch}", min(found.values()) >= 1.0,
                        ", ".join(f"{w} {ratio:.2f}x" for w, ratio in found.items())))

    out = []
    for batch in sorted({r["batch"] for r in rows}):
        at_least("onnxruntime off", "rbcompile off", batch)
        for contender, peer in PEER_TARGETS:
            at_least(contender, peer, batch)
        found = ratios("rbcompile off", batches=[batch])
        out.append((f"off >= 1.0x HF at batch {batch} (every workload)",
                    all(r["vs_hf"] >= 1.0 for r in found) if found else None,
                    ", ".join(f"{r['workload']} {r['vs_hf']:.2f}x" for r in found)))
    for workload, goal in (("grounded", 1.5), ("continuation", 1.2)):
        for batch in sorted({r["batch"] for r in rows}):
            found = ratios("rbcompile auto", [workload], [batch])
            if found:
                out.append((f"auto >= {goal}x HF on {workload}, batch {batch}",
                            found[0]["vs_hf"] >= goal, f"{found[0]['vs_hf']:.2f}x"))
    lossless = [r for r in rows if r["contender"] not in ("HF generate", *PEERS)
                and ORT.get(r["contender"], ("fp32",))[0] == "fp32"]
    compared = sum(r["rows_compared"] for r in lossless)
    mismatched = sum(r["mismatched_rows"] for r in lossless)
    out.append(("identical greedy tokens to HF on every sample", mismatched == 0,
                f"{mismatched} mismatched of {compared} rows compared"))
    return out


def _fmt(value, spec, empty="-"):
    return empty if value is None else format(value, spec)


def print_report(rows: list[dict], args, load: dict) -> list:
    print(f"\nGreedy generation in {args.dtype}, {args.new_tokens} new tokens max, torch threads "
          f"{args.threads}, {args.rounds} round(s); contenders interleaved per sample and round "
          f"(ABBA).\nColumns: calls = timed calls (samples x rounds); new tok = median new tokens "
          f"per call, summed over rows (a row ends at EOS, EOS counted);\ntok/s = median of new "
          f"tokens / wall seconds of the whole generate call; vs HF = that median / HF generate's "
          f"median in the same run (>1x: faster);\npaired = median of per-call ratios to HF on "
          f"the same sample and round; accept = drafts kept / drafts verified (rbcompile stats); "
          f"mean len = tokens per row per decode step (1 + accepted drafts);\nidentical = rows "
          f"whose greedy tokens equal HF's (up to and including EOS) / rows compared; auto modes = "
          f"decode steps per mode that 'auto' chose.\n")
    table = []
    for r in rows:
        first = r["first_mismatch"]
        ident = f"{r['rows_compared'] - r['mismatched_rows']}/{r['rows_compared']}"
        if first:
            ident += f" (1st diff: sample {first['sample']} row {first['row']} pos {first['position']})"
        table.append({
            "workload": r["workload"], "batch": r["batch"], "contender": r["contender"],
            "calls": r["calls"], "new": f"{r['new_tokens_median']:g}",
            "rate": f"{r['tokens_per_second']:.1f}", "vs": f"{r['vs_hf']:.2f}x",
            "paired": f"{r['vs_hf_paired']:.2f}x",
            "accept": _fmt(r["acceptance_rate"], ".0%") if r["drafted"] else "-",
            "len": _fmt(r["mean_accepted_length"], ".2f"),
            "ident": "-" if r["contender"] == "HF generate" else ident,
            "modes": " ".join(f"{m}:{c}" for m, c in r["steps_by_mode"].items())
            if r["contender"] == "rbcompile auto" and r["steps_by_mode"] else "",
        })
    print_table(table, [("workload", "workload"), ("batch", "batch"), ("contender", "contender"),
                        ("calls", "calls"), ("new", "new tok"), ("rate", "tok/s"),
                        ("vs", "vs HF"), ("paired", "paired"), ("accept", "accept"),
                        ("len", "mean len"), ("ident", "identical"), ("modes", "auto modes")])
    print("\nIssue 15's targets (ratios: median tokens/s vs HF generate in this run):")
    checks = targets(rows)
    for name, met, evidence in checks:
        print(f"  [{'MET' if met else 'not met' if met is not None else 'n/a'}] {name}: {evidence}")
    print(f"\nload average: start {load['start']}, end {load['end']}")
    return checks


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip() \
            .split("load average:")[-1].strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="bundled decoder name to compile")
    parser.add_argument("--artifact", help="load this artifact folder instead of compiling")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the precision both models run in (an --artifact is compiled in it)")
    parser.add_argument("--samples", type=int, default=3, help="batch-1 prompts per workload")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds over all samples")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contenders", nargs="+", choices=[c.replace(" ", "-") for c in CONTENDERS[1:]],
                        default=[f"rbcompile-{m}" for m in MODES],
                        help="besides HF generate (default: rbcompile off ngram self auto)")
    parser.add_argument("--json", help="output path (default benchmarks/results/bench_generate.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="1 sample, 8 new tokens, batch 2, grounded only")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.rounds, args.new_tokens = 1, 1, 8
        args.batches, args.workloads = [2], ["grounded"]
    if args.samples < 1 or args.rounds < 1 or args.new_tokens < 1 or min(args.batches) < 1:
        parser.error("--samples, --rounds, --new-tokens and --batches must be >= 1")
    pin_threads(args.threads)
    share_threads(args.threads)   # the executor's sessions take turns on one pool
    load = {"start": _uptime()}
    say(f"load average at start: {load['start']}")

    if args.artifact:
        with step(f"loading the artifact {args.artifact}"):
            compiled = rbcompile.load(args.artifact, dtype=parse_dtype(args.dtype))
            source = compiled.manifest["source"]["path"]
    else:
        with step(f"compiling {args.model} in {args.dtype}"):
            compiled = rbcompile.compile(args.model, dtype=args.dtype)
            source = args.model
    with step("loading the same weights in transformers"):
        eager = load_hf_model(resolve_checkpoint(source), dtype=parse_dtype(args.dtype))
    tokenizer = compiled.tokenizer
    eos = compiled.hf_config.get("eos_token_id")
    eos = set([eos] if isinstance(eos, int) else eos or [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    positions = compiled.decoder.shape.max_positions

    with step("building prompts"):
        work = {}
        for batch in args.batches:
            for workload in args.workloads:
                work[(batch, workload)] = batches(tokenizer, workload, batch, args.samples)
                for item in work[(batch, workload)]:
                    if item["input_ids"].shape[1] + args.new_tokens > positions:
                        raise SystemExit(f"{workload}: prompt + new tokens exceed {positions}")
        for (batch, workload), items in work.items():
            lengths = [n for item in items for n in item["prompt_tokens"]]
            say(f"  batch {batch} {workload}: {len(items)} call(s), prompt tokens "
                f"{min(lengths)}-{max(lengths)}")

    typed = {c.replace(" ", "-"): c for c in CONTENDERS}
    chosen = {"HF generate", *(typed[c] for c in args.contenders)}
    contenders = {name: fn for name, fn in make_contenders(compiled, eager, eos, pad, args.new_tokens, args.threads).items()
                  if name in chosen}
    peers = peer_contenders([p for p in PEERS if p in chosen], resolve_checkpoint(source), args.threads)
    contenders.update({name: make(args.new_tokens) for name, make in peers.items()})
    with step("warming up every contender (each batch size, 8 new tokens)"):
        warm = {name: fn for name, fn in make_contenders(compiled, eager, eos, pad, min(8, args.new_tokens), args.threads).items()
                if name in chosen}
        warm.update({name: make(min(8, args.new_tokens)) for name, make in peers.items()})
        for batch in args.batches:
            item = work[(batch, args.workloads[0])][0]
            for fn in warm.values():
                fn(item["input_ids"], item["attention_mask"])

    calls = sum(len(v) for v in work.values()) * args.rounds * len(contenders)
    say(f"== timing {calls} generate calls ({len(contenders)} contenders)")
    started = time.perf_counter()
    records = measure(contenders, work, args.rounds, compiled.device)
    say(f"  timed in {time.perf_counter() - started:.0f}s")
    load["end"] = _uptime()

    rows = summarise(records)
    checks = print_report(rows, args, load)

    payload = {"args": vars(args), "model": source, "load_average": load,
               "eos_token_ids": sorted(eos), "pad_token_id": pad,
               "prompts": {f"batch{b}/{w}": [{**p, "tokens": n}
                                              for item in items
                                              for p, n in zip(item["prompts"], item["prompt_tokens"])]
                           for (b, w), items in work.items()},
               "summary": rows,
               "targets": [{"target": n, "met": m, "evidence": e} for n, m, e in checks],
               "records": records}
    path = write_json("bench_generate", payload, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
