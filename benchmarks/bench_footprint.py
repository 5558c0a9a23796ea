"""What each engine costs one user (issue 45): time to first token on a long prompt, decode
tokens/s, peak RSS and the size on disk of what it loads, each engine alone in a fresh process
(peak RSS is per process), runs interleaved across engines, medians reported.

Contenders: rbcompile's onnxruntime executor at fp32 / int4 weights (an artifact), at fp32 with
prompts prefilled at int8, and on a packed artifact (`compile --weights int4`), HF transformers
`generate`, and the peers of
benchmarks/peers.py where installed (`make bench-peers`). Greedy; the prompt is the first
--prompt-tokens tokens of Emma (shared data, else the bundled text).

    python benchmarks/bench_footprint.py --artifact build/smollm2-135m \\
        [--packed-artifact build/smollm2-135m-int4] [--prompt-tokens 512] [--new-tokens 64]
        [--runs 3] [--threads 2] [--contenders ...] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402

# contender -> the executor's (weights, prefill weights); "int4 artifact": one compiled with
# --weights int4, whose stored blocks load as fp32 tensors
RBCOMPILE = {"rbcompile fp32": ("fp32", "fp32"), "rbcompile fp32, int8 prefill": ("fp32", "int8"),
             "rbcompile int4": ("int4", "fp32"), "rbcompile int4 artifact": ("fp32", "fp32")}
# prompt lookup changes decoding, not what a user pays to load and prefill: left out
CONTENDERS = (*RBCOMPILE, "HF generate", *(p for p in peers.PEERS if p not in peers.LOOKUP))


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() \
        else path.stat().st_size


def _timed(tokens):
    """Consumes a token stream: (tokens, seconds to the first, seconds from first to last)."""
    start, out, times = time.perf_counter(), [], []
    for token in tokens:
        out.append(token)
        times.append(time.perf_counter())
    return out, times[0] - start, times[-1] - times[0]


def _rbcompile_child(name: str, args, ids: list[int]) -> dict:
    import torch

    import rbcompile
    folder = args.packed_artifact if name == "rbcompile int4 artifact" else args.artifact
    torch.set_num_threads(args.threads)
    model = rbcompile.load(folder)
    weights, prefill = RBCOMPILE[name]
    model.use_executor("onnxruntime", weights, threads=args.threads, prefill=prefill)
    prompt = torch.tensor([ids])
    model.generate(prompt, torch.ones_like(prompt), max_new_tokens=2)        # sessions built
    return _two_calls(lambda n: model.generate(prompt, torch.ones_like(prompt),
                                               max_new_tokens=n).tokens[0], args, Path(folder))


def _hf_child(args, ids: list[int]) -> dict:
    import torch

    from rbcompile.artifact.models import load_hf_model
    torch.set_num_threads(args.threads)
    model = load_hf_model(Path(args.hf_folder))
    prompt = torch.tensor([ids])

    def run(n):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 do_sample=False, max_new_tokens=n, min_new_tokens=n)
        return out[0, len(ids):].tolist()
    run(2)
    return _two_calls(run, args, Path(args.hf_folder))


def _two_calls(run, args, loaded: Path) -> dict:
    """TTFT from a 1-token call, decode rate from an n-token call less it."""
    start = time.perf_counter()
    run(1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    tokens = run(args.new_tokens)
    total = time.perf_counter() - start
    return {"ttft_s": first, "decode_tok_s": (len(tokens) - 1) / max(total - first, 1e-9),
            "size_bytes": _size(loaded)}


def _peer_child(name: str, args, ids: list[int]) -> dict:
    hf = Path(args.hf_folder)
    if name == peers.GENAI:
        import onnxruntime_genai as og
        folder = peers.genai_folder(hf, args.threads)
        model = og.Model(str(folder))

        def stream():
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + args.new_tokens, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(ids)
            while not generator.is_done():
                generator.generate_next_token()
                yield int(generator.get_next_tokens()[0])
        loaded = folder
    else:
        llama = peers.load_llama(hf, args.threads, peers.LLAMA[name])

        def stream():
            llama.reset()   # the prompt prefilled again, not its cached prefix reused
            for count, token in enumerate(llama.generate(ids, temp=0.0, top_k=1, top_p=1.0,
                                                         min_p=0.0, repeat_penalty=1.0,
                                                         reset=True)):
                yield token
                if count + 1 == args.new_tokens:
                    return
        loaded = peers.gguf_file(hf, peers.LLAMA[name][0])
    list(stream())   # warm
    tokens, ttft, decode = _timed(stream())
    return {"ttft_s": ttft, "decode_tok_s": (len(tokens) - 1) / max(decode, 1e-9),
            "size_bytes": _size(loaded)}


def child(args) -> None:
    """One contender in this process: prints one JSON line."""
    ids = json.loads(Path(args.prompt_file).read_text())
    name = args.child
    result = (_rbcompile_child(name, args, ids) if name in RBCOMPILE else
              _hf_child(args, ids) if name == "HF generate" else _peer_child(name, args, ids))
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def _prompt(args) -> list[int]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.hf_folder)
    text_file = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen-emma.txt"
    if not text_file.exists():
        text_file = Path(__file__).parent.parent / "rbcompile" / "data" / "eval-tempest.txt"
    ids = tokenizer(text_file.read_text()[5000:])["input_ids"][:args.prompt_tokens]
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"{text_file} has fewer than {args.prompt_tokens} tokens")
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--packed-artifact", help="an artifact compiled with --weights int4")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contenders", nargs="+", choices=[c.replace(" ", "-") for c in CONTENDERS])
    parser.add_argument("--json", help="output (default benchmarks/results/bench_footprint.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    parser.add_argument("--hf-folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from common import print_table, write_json

    manifest = json.loads((Path(args.artifact) / "manifest.json").read_text())
    from rbcompile.artifact.models import resolve_checkpoint
    args.hf_folder = str(resolve_checkpoint(manifest["source"]["path"]))
    names = [c.replace("-", " ") for c in args.contenders] if args.contenders else list(CONTENDERS)
    names = [n for n in names if (n != "rbcompile int4 artifact" or args.packed_artifact)
             and (n not in peers.PEERS or not peers.missing_reason(n))]
    prompt_file = Path(args.json or "benchmarks/results/bench_footprint.json").with_suffix(".ids")
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text(json.dumps(_prompt(args)))
    results = {name: [] for name in names}
    for run in range(args.runs):
        for name in (names if run % 2 == 0 else names[::-1]):
            command = [sys.executable, __file__, "--child", name, "--prompt-file", str(prompt_file),
                       "--hf-folder", args.hf_folder, "--artifact", args.artifact,
                       "--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
            if args.packed_artifact:
                command += ["--packed-artifact", args.packed_artifact]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            out = subprocess.run(command, capture_output=True, text=True, env=env)
            if out.returncode:
                raise SystemExit(f"{name} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  run {run + 1} {name}: {results[name][-1]}", flush=True)
    rows = [{"contender": name, **{key: statistics.median(r[key] for r in runs)
                                   for key in runs[0]}} for name, runs in results.items()]
    print(f"\n{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {args.threads} "
          f"threads, median of {args.runs} fresh processes per contender")
    print_table([{"contender": r["contender"], "ttft": f"{r['ttft_s']:.3f}",
                  "decode": f"{r['decode_tok_s']:.1f}", "rss": f"{r['peak_rss_mib']:.0f}",
                  "disk": f"{r['size_bytes'] / 1e6:.0f}"} for r in rows],
                [("contender", "contender"), ("ttft", "TTFT s"), ("decode", "decode tok/s"),
                 ("rss", "peak RSS MiB"), ("disk", "on disk MB")])
    path = write_json("bench_footprint", {"args": vars(args), "summary": rows,
                                          "runs": results}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
