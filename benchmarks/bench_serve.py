"""Serving throughput and latency (issue 16): `rbcompile serve` with continuous batching
(--max-batch 16) and without it (--max-batch 1), driven over HTTP by the `openai` client, against
transformers' `generate` running the same requests one after another in-process (the baseline).

Each server runs as a subprocess on a free port (same torch threads, OMP_NUM_THREADS), both up
for the whole run. Per concurrency level C (1 4 8 16), C client streams (AsyncOpenAI,
/v1/completions, stream=True, temperature 0, --new-tokens max) each send --requests-per-stream
requests back to back, so a level is C x that many requests; every level has prompts of its own
(continuation of literature text, bench_generate's continuation workload), the same for every
contender. Contenders take turns per level (ABBA order over levels).
  tokens/s    completion tokens summed over the level's requests / wall time of the level
              (first request sent to last stream done); for HF sequential: the same tokens
              over the summed wall time of its generate calls, one request after another.
  TTFT        request sent -> first streamed chunk with text (queueing in the server
              included); HF: generate called (tokenising included) -> first new token reaching
              a transformers streamer, with no queueing since nothing runs alongside.
  ITL         gaps between streamed text chunks of a request (HF: between new tokens), p99
              over all the level's gaps.
Completion tokens: the server's `usage` when it sends it in the stream (stream_options), else
max_tokens for finish_reason "length", else the text re-tokenised + 1 (the EOS). Greedy texts
are compared batched vs unbatched (and each vs HF) per request. The client process shares the
machine with the servers (SSE parsing costs it CPU). Writes benchmarks/results/bench_serve.json
(--json PATH), server logs to benchmarks/results/bench_serve_logs/. A `rbcompile serve` without
--max-batch (before continuous batching) starts both servers without it, and the output says so.

    python benchmarks/bench_serve.py [--artifact FOLDER | --model smollm2-135m]
        [--concurrency 1 4 8 16] [--requests-per-stream 2] [--new-tokens 128] [--threads 2]
        [--max-batch 16] [--json PATH] [--smoke]

--smoke: concurrency 1 and 2, 8 new tokens, one request per stream (checks the script).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import _until_eos, _uptime, continuation_prompt  # noqa: E402
from common import RESULTS, pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.errors import UserError  # noqa: E402
from rbcompile.models import load_hf_model, resolve_checkpoint  # noqa: E402
from rbcompile.progress import say, step  # noqa: E402

BATCHED, UNBATCHED, HF = "rbcompile batched", "rbcompile unbatched", "HF generate sequential"
CONTENDERS = (BATCHED, UNBATCHED, HF)
TARGET_STREAMS, TARGET_RATIO = 8, 3.0


# ---- servers ---------------------------------------------------------------------------------

def serve_help() -> str:
    done = subprocess.run([sys.executable, "-m", "rbcompile.cli", "serve", "--help"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"`rbcompile serve --help` failed ({done.returncode}): "
                         f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return done.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


@contextlib.contextmanager
def server(name: str, artifact: str, extra: list[str], threads: int, logs: Path,
           timeout: float):
    """`rbcompile serve` as a subprocess on a free port; yields (base URL, log path) once
    /health answers; SIGTERM afterwards (SIGKILL if it has not exited 20 s later)."""
    port = free_port()
    log = logs / f"server-{name.split()[-1]}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "rbcompile.cli", "serve", artifact, "--port", str(port),
               *extra]
    say(f"  {name}: {' '.join(command[1:])} (log {log})")
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{name}: the server exited ({process.returncode}) before "
                                 f"/health answered: {_tail(log)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: /health did not answer within {timeout:.0f}s "
                                 f"(log {log}: {_tail(log)})")
            time.sleep(0.25)
        yield f"http://127.0.0.1:{port}/v1", log
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                say(f"  {name}: no exit 20 s after SIGTERM, killing it")
                process.kill()
                process.wait()


# ---- HTTP clients ----------------------------------------------------------------------------

class Endpoint:
    """One server: an AsyncOpenAI client, its model id, whether it streams `usage`."""

    def __init__(self, base_url: str, log: Path):
        from openai import AsyncOpenAI
        self.base_url, self.log = base_url, log
        self.client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                  timeout=1800)
        self.model = None
        self.usage = False

    async def setup(self) -> None:
        """The served model's id, and whether the server accepts stream_options.include_usage
        (one 1-token request)."""
        import openai
        self.model = (await self.client.models.list()).data[0].id
        try:
            record = await self.request("probe", 1, usage=True, probe=True)
            self.usage = record["error"] is None and record["usage_tokens"] is not None
        except openai.BadRequestError:
            self.usage = False

    async def request(self, prompt: str, max_tokens: int, *, usage: bool = False,
                      probe: bool = False) -> dict:
        """One streamed completion: times of its text chunks, its text and finish reason
        (`usage`: ask for the token count in the stream). A failure is recorded as `error`
        (raised when `probe`)."""
        extra = {"stream_options": {"include_usage": True}} if usage else {}
        sent = time.perf_counter()
        times, parts, finish, usage, error = [], [], None, None, None
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                stream=True, **extra)
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.text:
                        times.append(now)
                        parts.append(choice.text)
                    finish = choice.finish_reason or finish
        except Exception as exc:
            if probe:
                raise
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return {"sent": sent, "done": time.perf_counter(), "chunk_times": times,
                "text": "".join(parts), "finish_reason": finish, "usage_tokens": usage,
                "error": error}

    async def close(self) -> None:
        await self.client.close()


async def drive(endpoint: Endpoint, prompts: list[str], streams: int, max_tokens: int):
    """`streams` concurrent client streams, each taking the next prompt when its last request
    is done. Records in prompt order, and the level's wall seconds."""
    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        queue.put_nowait((index, prompt))
    records: list[dict | None] = [None] * len(prompts)

    async def client():
        while not queue.empty():
            index, prompt = queue.get_nowait()
            records[index] = await endpoint.request(prompt, max_tokens, usage=endpoint.usage)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    return records, time.perf_counter() - start


def count_tokens(record: dict, tokenizer, max_tokens: int) -> tuple[int, str]:
    """(completion tokens, how they were counted)."""
    if record["error"]:
        return 0, "error"
    if record["usage_tokens"] is not None:
        return record["usage_tokens"], "usage"
    if record["finish_reason"] == "length":
        return max_tokens, "length"
    ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
    return min(len(ids) + 1, max_tokens), "retokenised"


# ---- HF sequential ---------------------------------------------------------------------------

def hf_sequential(eager, tokenizer, prompts: list[str], eos: set[int], pad: int,
                  max_tokens: int) -> tuple[list[dict], float]:
    """transformers `generate`, greedy, one prompt after another; a streamer stamps every new
    token. Records like the HTTP ones, and the summed wall seconds."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times, self.prompt_seen = [], False

        def put(self, value):
            if self.prompt_seen:   # the first put is the prompt
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self):
            pass

    records, total = [], 0.0
    for prompt in prompts:
        clock = Clock()
        sent = time.perf_counter()
        input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = eager.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 do_sample=False, max_new_tokens=max_tokens, pad_token_id=pad,
                                 eos_token_id=sorted(eos), streamer=clock)
        done = time.perf_counter()
        total += done - sent
        tokens = _until_eos(out[0, input_ids.shape[1]:].tolist(), eos)
        records.append({"sent": sent, "done": done, "chunk_times": clock.times[:len(tokens)],
                        "text": tokenizer.decode(tokens, skip_special_tokens=True),
                        "finish_reason": "length" if len(tokens) == max_tokens else "stop",
                        "usage_tokens": None, "error": None, "tokens": len(tokens),
                        "counted": "generate"})
    return records, total


# ---- summary ---------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarise(level: int, name: str, records: list[dict], seconds: float) -> dict:
    ok = [r for r in records if not r["error"]]
    ttft = [r["chunk_times"][0] - r["sent"] for r in ok if r["chunk_times"]]
    gaps = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    tokens = sum(r["tokens"] for r in records)
    counted: dict[str, int] = {}
    for r in records:
        counted[r["counted"]] = counted.get(r["counted"], 0) + 1
    return {"concurrency": level, "contender": name, "requests": len(records),
            "errors": len(records) - len(ok), "completion_tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "tokens_counted_by": counted}


def compare(a: list[dict], b: list[dict]) -> tuple[int, int]:
    """(differing texts, requests compared), skipping requests that failed on either side."""
    pairs = [(x, y) for x, y in zip(a, b) if not x["error"] and not y["error"]]
    return sum(x["text"] != y["text"] for x, y in pairs), len(pairs)


def _ms(seconds):
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def print_report(rows: list[dict], identity: dict, args, flag: bool, load: dict) -> dict:
    print(f"\nStreamed greedy completions, max_tokens {args.new_tokens}, "
          f"{args.requests_per_stream} request(s) per client stream, torch threads "
          f"{args.threads} per server and for HF.\nrbcompile batched = serve --max-batch "
          f"{args.max_batch}, unbatched = serve --max-batch 1"
          + ("" if flag else " -- NOTE: this `rbcompile serve` has no --max-batch flag, both "
             "servers ran its default (one request at a time), so batched = unbatched here")
          + ".\nHF generate sequential = transformers generate in the client process, the same "
          "requests one after another (concurrency only sets which prompts).\nColumns: tok/s "
          "= completion tokens / wall seconds of the level (HF: summed generate seconds); "
          "vs HF = tok/s / HF sequential's tok/s at that level;\nTTFT = request sent -> first "
          "text chunk (server queueing included; HF: generate called -> first new token); "
          "ITL = gap between streamed chunks (HF: tokens); ms.\n")
    hf = {r["concurrency"]: r["tokens_per_second"] for r in rows if r["contender"] == HF}
    table = [{"c": r["concurrency"], "who": r["contender"], "n": r["requests"],
              "err": r["errors"], "tok": r["completion_tokens"], "s": f"{r['seconds']:.1f}",
              "rate": f"{r['tokens_per_second']:.1f}",
              "vs": f"{r['tokens_per_second'] / hf[r['concurrency']]:.2f}x"
              if hf.get(r["concurrency"]) else "-",
              "t50": _ms(r["ttft_p50_s"]), "t99": _ms(r["ttft_p99_s"]),
              "i99": _ms(r["itl_p99_s"])} for r in rows]
    print_table(table, [("c", "streams"), ("who", "contender"), ("n", "requests"),
                        ("err", "errors"), ("tok", "tokens"), ("s", "wall s"), ("rate", "tok/s"),
                        ("vs", "vs HF seq"), ("t50", "TTFT p50"), ("t99", "TTFT p99"),
                        ("i99", "ITL p99")])
    print("\nGreedy outputs, same prompts (texts compared per request):")
    for key, (differ, compared) in identity.items():
        print(f"  {key}: {differ} differing of {compared} compared")
    batched = {r["concurrency"]: r for r in rows if r["contender"] == BATCHED}
    name = (f">= {TARGET_RATIO:g}x HF sequential aggregate tokens/s at {TARGET_STREAMS} "
            f"concurrent streams")
    if TARGET_STREAMS in batched and hf.get(TARGET_STREAMS):
        ratio = batched[TARGET_STREAMS]["tokens_per_second"] / hf[TARGET_STREAMS]
        met = ratio >= TARGET_RATIO and batched[TARGET_STREAMS]["errors"] == 0
        verdict = "met" if met else "missed"
        evidence = f"rbcompile batched {ratio:.2f}x"
    else:
        met, verdict, evidence = None, "not measured", f"no level with {TARGET_STREAMS} streams"
    if not flag:
        evidence += "; this server has no --max-batch"
    print(f"\nTarget (issue 16): {name}: {verdict} ({evidence})")
    print(f"\nload average: start {load['start']}, end {load['end']}")
    return {"target": name, "met": met, "verdict": verdict, "evidence": evidence}


# ---- main ------------------------------------------------------------------------------------

async def run_levels(endpoints: dict, eager, tokenizer, prompts: dict[int, list[str]], eos,
                     pad, args) -> dict:
    """Every level, every contender (ABBA order over levels). {(level, name): (records, s)}."""
    results = {}
    for turn, (level, texts) in enumerate(prompts.items()):
        order = list(CONTENDERS) if turn % 2 == 0 else list(CONTENDERS)[::-1]
        for name in order:
            if name == HF:
                records, seconds = hf_sequential(eager, tokenizer, texts, eos, pad,
                                                 args.new_tokens)
            else:
                records, seconds = await drive(endpoints[name], texts, level, args.new_tokens)
            for r in records:
                if "tokens" not in r:
                    r["tokens"], r["counted"] = count_tokens(r, tokenizer, args.new_tokens)
            results[(level, name)] = (records, seconds)
            tokens = sum(r["tokens"] for r in records)
            errors = sum(bool(r["error"]) for r in records)
            say(f"  {level} stream(s), {name}: {len(records)} requests, {tokens} tokens in "
                f"{seconds:.1f}s = {tokens / seconds:.1f} tok/s"
                + (f", {errors} errors (first: {next(r['error'] for r in records if r['error'])}"
                   f"{'' if name == HF else f'; server log {endpoints[name].log}'})"
                   if errors else ""))
    return results


async def warm_up(endpoints: dict, prompt: str, streams: int) -> None:
    for name, endpoint in endpoints.items():
        try:
            await endpoint.setup()
        except Exception as exc:
            raise SystemExit(f"{name}: {type(exc).__name__}: {exc} (server log: {endpoint.log}: "
                             f"{_tail(endpoint.log)})") from None
        records, _ = await drive(endpoint, [prompt] * streams, streams, 8)
        failed = [r["error"] for r in records if r["error"]]
        if failed:
            raise SystemExit(f"{name}: warm-up request failed: {failed[0]} (server log: "
                             f"{endpoint.log}: {_tail(endpoint.log)})")
        say(f"  {name}: model '{endpoint.model}', usage in stream: "
            f"{'yes' if endpoint.usage else 'no (tokens from finish_reason / re-tokenised)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="bundled decoder name to compile")
    parser.add_argument("--artifact", help="serve this compiled artifact folder instead")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="requests each client stream sends back to back (default 2)")
    parser.add_argument("--new-tokens", type=int, default=128, help="max_tokens per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per server and HF")
    parser.add_argument("--max-batch", type=int, default=16, help="the batched server's --max-batch")
    parser.add_argument("--startup-timeout", type=float, default=300,
                        help="seconds to wait for a server's /health (default 300)")
    parser.add_argument("--json", help="output path (default benchmarks/results/bench_serve.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="concurrency 1 and 2, 8 new tokens, 1 request per stream")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.new_tokens, args.requests_per_stream = [1, 2], 8, 1
    if min(args.concurrency) < 1 or args.requests_per_stream < 1 or args.new_tokens < 1 \
            or args.threads < 1 or args.max_batch < 1:
        parser.error("--concurrency, --requests-per-stream, --new-tokens, --threads and "
                     "--max-batch must be >= 1")
    try:
        import openai  # noqa: F401
    except ImportError:
        raise SystemExit("bench_serve needs the openai client: pip install -e '.[dev]'") from None
    pin_threads(args.threads)
    load = {"start": _uptime()}
    say(f"load average at start: {load['start']}")

    flag = "--max-batch" in serve_help()
    if not flag:
        say("NOTE: `rbcompile serve` has no --max-batch flag yet: both servers run its default "
            "(requests one at a time), so 'batched' and 'unbatched' measure the same server")
    extra = ["--max-tokens-limit", str(args.new_tokens)] if args.new_tokens > 1024 else []

    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_serve-")))
        logs = RESULTS / "bench_serve_logs"
        logs.mkdir(parents=True, exist_ok=True)
        if args.artifact:
            with step(f"loading the artifact {args.artifact} (tokenizer, source, positions)"):
                compiled = rbcompile.load(args.artifact)
                artifact, source = args.artifact, compiled.manifest["source"]["path"]
        else:
            with step(f"compiling {args.model}"):
                compiled = rbcompile.compile(args.model)
                artifact, source = str(compiled.save(scratch / "artifact")), args.model
        tokenizer = compiled.tokenizer
        eos = compiled.hf_config.get("eos_token_id")
        eos = set([eos] if isinstance(eos, int) else eos or [])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        positions = compiled.max_positions
        del compiled
        with step("loading the same weights in transformers"):
            eager = load_hf_model(resolve_checkpoint(source))

        with step("building prompts (continuation of literature text, one set per level)"):
            prompts, meta, index = {}, {}, 0
            for level in args.concurrency:
                items = [continuation_prompt(tokenizer, index + i)
                         for i in range(level * args.requests_per_stream)]
                index += len(items)
                for item in items:
                    item["tokens"] = len(tokenizer(item["text"])["input_ids"])
                    if item["tokens"] + args.new_tokens > positions:
                        raise SystemExit(f"a prompt of {item['tokens']} tokens + "
                                         f"{args.new_tokens} new exceeds {positions} positions")
                prompts[level] = [item["text"] for item in items]
                meta[level] = items
                lengths = [item["tokens"] for item in items]
                say(f"  {level} stream(s): {len(items)} prompts, {min(lengths)}-{max(lengths)} "
                    f"tokens")
            if len(set(args.concurrency)) != len(args.concurrency):
                raise SystemExit("--concurrency lists a level twice")

        with step("starting the servers"):
            urls = {BATCHED: stack.enter_context(server(
                        BATCHED, artifact, (["--max-batch", str(args.max_batch)] if flag else [])
                        + extra, args.threads, logs, args.startup_timeout)),
                    UNBATCHED: stack.enter_context(server(
                        UNBATCHED, artifact, (["--max-batch", "1"] if flag else []) + extra,
                        args.threads, logs, args.startup_timeout))}

        async def session():
            endpoints = {name: Endpoint(*served) for name, served in urls.items()}
            try:
                with step(f"warming up ({max(args.concurrency)} concurrent 8-token requests "
                          "per server, one HF generate)"):
                    first = next(iter(prompts.values()))[0]
                    await warm_up(endpoints, first, max(args.concurrency))
                    hf_sequential(eager, tokenizer, [first], eos, pad, 8)
                total = sum(len(p) for p in prompts.values())
                with step(f"timing {total} requests per contender over levels "
                          f"{' '.join(map(str, args.concurrency))}"):
                    return await run_levels(endpoints, eager, tokenizer, prompts, eos, pad, args)
            finally:
                for endpoint in endpoints.values():
                    await endpoint.close()

        results = asyncio.run(session())
        say("stopping the servers")
    load["end"] = _uptime()

    rows = [summarise(level, name, *results[(level, name)])
            for level in args.concurrency for name in CONTENDERS]
    identity = {}
    for label, (a, b) in {"batched vs unbatched": (BATCHED, UNBATCHED),
                          "batched vs HF": (BATCHED, HF),
                          "unbatched vs HF": (UNBATCHED, HF)}.items():
        pairs = [compare(results[(level, a)][0], results[(level, b)][0])
                 for level in args.concurrency]
        identity[label] = (sum(d for d, _ in pairs), sum(n for _, n in pairs))
    target = print_report(rows, identity, args, flag, load)

    records = [{"concurrency": level, "contender": name, "request": i,
                **{k: v for k, v in r.items() if k not in ("sent", "done", "chunk_times")},
                "seconds": r["done"] - r["sent"],
                "ttft_s": r["chunk_times"][0] - r["sent"] if r["chunk_times"] else None,
                "chunk_offsets_s": [t - r["sent"] for t in r["chunk_times"]]}
               for (level, name), (recs, _) in results.items() for i, r in enumerate(recs)]
    payload = {"args": vars(args), "model": source,
               "artifact": args.artifact or f"compiled from {args.model} (temporary, removed)",
               "max_batch_flag": flag, "load_average": load, "eos_token_ids": sorted(eos),
               "prompts": {str(level): items for level, items in meta.items()},
               "summary": rows,
               "identical": {k: {"differing": d, "compared": n} for k, (d, n) in identity.items()},
               "target": target, "records": records}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload},
                                   indent=1))
    else:
        path = write_json("bench_serve", payload)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:   # rbcompile's own refusals: one line, no traceback
        raise SystemExit(f"bench_serve: {exc}") from None
