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
machine with the servers (SSE parsing costs it CPU). A `rbcompile serve` without --max-batch
(before continuous batching) starts both servers without it, and the output says so. Both
servers run serve's default prefix cache; every level's prompts differ, and the warm-up prompt
is none of them.

--workload shared-prefix (issue 16's shared system prompt): every request is the same
~--prefix-tokens prompt prefix (a literature passage as the system message of the chat
template, after a one-line instruction) followed by a short user question of its own (~10-30
tokens: a line of the same book to continue or to relate to the passage), --prefix-new-tokens
max, temperature 0, sent by --prefix-streams concurrent streams x --prefix-requests each. Two
servers at serve's default --max-batch: --prefix-cache-mb 256 ("prefix cache on") and 0
("off"), each warmed by one request that shares no prefix with the workload, so the workload's
first request fills the cache and the hits come from the workload itself. Per contender:
TTFT p50/p99, aggregate tokens/s (as above), rbcompile_prefix_cache_hit_rate from /metrics at
the end (cumulative since start: the probe and warm-up prompts count, without hits); the TTFT
p50 ratio off/on against the target (>= 2x); greedy texts compared on vs off per request.
--workload all runs both (concurrency first, each with servers of its own).

Writes benchmarks/results/bench_serve.json (--json PATH; the shared-prefix workload under the
key "shared_prefix"; a run writes only the workloads it ran), server logs to
benchmarks/results/bench_serve_logs/.

    python benchmarks/bench_serve.py [--artifact FOLDER | --model smollm2-135m]
        [--workload concurrency|shared-prefix|all] [--threads 2] [--json PATH] [--smoke]
        [--concurrency 1 4 8 16] [--requests-per-stream 2] [--new-tokens 128] [--max-batch 16]
        [--prefix-tokens 300] [--prefix-streams 4] [--prefix-requests 4]
        [--prefix-new-tokens 16] [--prefix-cache-mb 256]

--smoke: concurrency 1 and 2, 8 new tokens, one request per stream; shared prefix of ~40 tokens,
2 streams x 1 request, 8 new tokens; both workloads unless --workload says (checks the script).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import (ABBREVIATIONS, LITERATURE, SHARED, _first_tokens,  # noqa: E402
                            _offset, _source, _uptime, continuation_prompt)
from peers import until_eos  # noqa: E402
from common import RESULTS, pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.child import child_env  # noqa: E402
from rbcompile.errors import UserError  # noqa: E402
from rbcompile.artifact.models import load_hf_model, resolve_checkpoint  # noqa: E402
from rbcompile.runtime.engine.prefix_cache import PrefixCache  # noqa: E402
from rbcompile.progress import say, step  # noqa: E402

BATCHED, UNBATCHED, HF = "rbcompile batched", "rbcompile unbatched", "HF generate sequential"
CONTENDERS = (BATCHED, UNBATCHED, HF)
TARGET_STREAMS, TARGET_RATIO = 8, 3.0
CACHE_ON, CACHE_OFF = "prefix cache on", "prefix cache off"
PREFIX_TARGET = 2.0             # TTFT p50 off / on
WORKLOADS = ("concurrency", "shared-prefix")
WARM_INDEX = 10_000             # the warm-up's continuation prompt: one no workload measures


# ---- servers ---------------------------------------------------------------------------------

def serve_help() -> str:
    done = subprocess.run([sys.executable, "-m", "rbcompile.frontend.cli", "serve", "--help"],
                          capture_output=True, text=True, env=child_env())
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
    env = child_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                    HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "rbcompile.frontend.cli", "serve", artifact, "--port", str(port),
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
                      probe: bool = False, rbcompile: dict | None = None) -> dict:
        """One streamed completion: times of its text chunks, its text and finish reason
        (`usage`: ask for the token count in the stream; `rbcompile`: the request's extension
        object). A failure is recorded as `error`, with its HTTP `status` if it had one
        (raised when `probe`)."""
        extra = {"stream_options": {"include_usage": True}} if usage else {}
        if rbcompile:
            extra["extra_body"] = {"rbcompile": rbcompile}
        sent = time.perf_counter()
        times, parts, finish, usage, error, status = [], [], None, None, None, None
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
            status = getattr(exc, "status_code", None)
        return {"sent": sent, "done": time.perf_counter(), "chunk_times": times,
                "text": "".join(parts), "finish_reason": finish, "usage_tokens": usage,
                "error": error, "status": status}

    async def close(self) -> None:
        await self.client.close()


async def drive(endpoint: Endpoint, prompts: list[str], streams: int, max_tokens: int,
                rbcompile: dict | None = None):
    """`streams` concurrent client streams, each taking the next prompt when its last request
    is done (`rbcompile`: every request's extension object). Records in prompt order, and the
    level's wall seconds."""
    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        queue.put_nowait((index, prompt))
    records: list[dict | None] = [None] * len(prompts)

    async def client():
        while not queue.empty():
            index, prompt = queue.get_nowait()
            records[index] = await endpoint.request(prompt, max_tokens, usage=endpoint.usage,
                                                    rbcompile=rbcompile)

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


def read_metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics (Prometheus text): samples, name (with its labels, as written:
    `name{label="value"}`) -> value."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


# ---- shared-prefix prompts -------------------------------------------------------------------

INSTRUCTION = "Answer questions about this passage in a few words."
QUESTIONS = ('Continue this line: "{}"', 'How does "{}" relate to the passage?',
             'Who says or thinks "{}", and why?')


def _chat(tokenizer, system: str, question: str) -> str:
    """The prompt text: the tokenizer's chat template (system, user, generation prompt), or a
    plain layout for a tokenizer without one."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
            tokenize=False, add_generation_prompt=True)
    return f"{system}\n\nQuestion: {question}\nAnswer:"


def _passage(tokenizer, text: str, index: int, tokens: int) -> tuple[int, str]:
    """(offset, passage): real text from a paragraph start, whitespace collapsed, cut at the
    sentence end that brings it nearest `tokens` tokens (a later paragraph is tried when none is
    within a quarter of it; the last try is kept, cut at `tokens`)."""
    for attempt in range(20):
        start = _offset(text, index + 1000 * attempt)
        passage = " ".join(_first_tokens(tokenizer, text[start:], tokens * 5 // 4).split())
        ends = [m.end() for m in re.finditer(ABBREVIATIONS + r"[.!?][\"']?(?= |$)", passage)]
        if ends:
            gap, end = min((abs(len(tokenizer(passage[:end])["input_ids"]) - tokens), end)
                           for end in ends)
            if gap <= tokens / 4:
                return start, passage[:end]
    return start, " ".join(_first_tokens(tokenizer, text[start:], tokens).split())


def shared_prefix_prompts(tokenizer, count: int, prefix_tokens: int) -> dict:
    """`count` prompts: one system message (INSTRUCTION, then a literature passage sized so the
    rendered prefix is about `prefix_tokens` tokens), then user question i: a line of the same
    book (6-18 tokens from paragraph i) to continue or to relate to the passage."""
    name, text = _source(LITERATURE, SHARED, 0)
    overhead = len(tokenizer(_chat(tokenizer, INSTRUCTION + "\n\n", ""))["input_ids"])
    offset, passage = _passage(tokenizer, text, 0, max(8, prefix_tokens - overhead))
    system = f"{INSTRUCTION}\n\n{passage}"
    questions = []
    for i in range(count):
        start = _offset(text, 1 + i)
        line = " ".join(_first_tokens(tokenizer, text[start:], 6 + (i * 5) % 13).split())
        line = line.replace('"', "'")
        questions.append({"offset": start, "text": QUESTIONS[i % len(QUESTIONS)].format(line)})
    texts = [_chat(tokenizer, system, q["text"]) for q in questions]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    shared = min(next((j for j, (a, b) in enumerate(zip(ids[0], other)) if a != b),
                      min(len(ids[0]), len(other))) for other in ids[1:])
    return {"source": name, "passage_offset": offset, "system": system, "questions": questions,
            "texts": texts, "prompt_tokens": [len(x) for x in ids], "shared_tokens": shared}


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
        tokens = until_eos(out[0, input_ids.shape[1]:].tolist(), eos)
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


def print_report(rows: list[dict], identity: dict, args, flag: bool) -> dict:
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
    return {"target": name, "met": met, "verdict": verdict, "evidence": evidence}


def _ratio(a, b):
    return a / b if a is not None and b else None


def print_prefix_report(rows: list[dict], identity: tuple[int, int], work: dict, args) -> dict:
    lengths = [n - work["shared_tokens"] for n in work["prompt_tokens"]]
    print(f"\nShared-prefix workload: every request = one system prompt of "
          f"{work['shared_tokens']} tokens ({work['shared_tokens'] // work['block_tokens']} "
          f"whole {work['block_tokens']}-token blocks; an instruction and a passage of "
          f"{work['source']}, chat template) + a question of its own ({min(lengths)}-"
          f"{max(lengths)} tokens with the turn's markup),\nmax_tokens {args.prefix_new_tokens}, "
          f"temperature 0, {args.prefix_streams} streams x {args.prefix_requests} request(s), "
          f"serve's default --max-batch, torch threads {args.threads} per server.\n"
          f"{CACHE_ON} = serve --prefix-cache-mb {args.prefix_cache_mb:g}, {CACHE_OFF} = "
          f"--prefix-cache-mb 0. Each server was warmed by one request sharing no prefix with "
          f"the workload: the workload's first request fills the cache, the hits come from the "
          f"workload itself.\nColumns: tok/s = completion tokens / wall seconds; TTFT = request "
          f"sent -> first text chunk (server queueing included), ms; hit rate = "
          f"rbcompile_prefix_cache_hit_rate from /metrics at the end (reused prompt tokens / "
          f"prompt tokens looked up since the server started, probe and warm-up prompts "
          f"included); ceiling {100 * work['hit_rate_ceiling']:.1f}% (every whole shared block "
          f"reused after the first request, counted the same way).\n")
    table = [{"who": r["contender"], "c": r["concurrency"], "n": r["requests"],
              "err": r["errors"], "tok": r["completion_tokens"], "s": f"{r['seconds']:.1f}",
              "rate": f"{r['tokens_per_second']:.1f}", "t50": _ms(r["ttft_p50_s"]),
              "t99": _ms(r["ttft_p99_s"]),
              "hit": "- (off)" if r["contender"] == CACHE_OFF else
              "-" if r["prefix_cache_hit_rate"] is None else
              f"{100 * r['prefix_cache_hit_rate']:.1f}%"} for r in rows]
    print_table(table, [("who", "contender"), ("c", "streams"), ("n", "requests"),
                        ("err", "errors"), ("tok", "tokens"), ("s", "wall s"), ("rate", "tok/s"),
                        ("t50", "TTFT p50"), ("t99", "TTFT p99"), ("hit", "hit rate")])
    differ, compared = identity
    print(f"\nGreedy outputs, {CACHE_ON} vs {CACHE_OFF} (texts compared per request): "
          f"{differ} differing of {compared} compared")
    on, off = ({r["contender"]: r for r in rows}[name] for name in (CACHE_ON, CACHE_OFF))
    p50 = _ratio(off["ttft_p50_s"], on["ttft_p50_s"])
    p99 = _ratio(off["ttft_p99_s"], on["ttft_p99_s"])
    print("TTFT off / on: " + ", ".join(f"{label} {'-' if r is None else f'{r:.2f}x'}"
                                         for label, r in (("p50", p50), ("p99", p99))))
    name = f"TTFT >= {PREFIX_TARGET:g}x lower with the prefix cache on the shared-prefix workload"
    if p50 is None:
        met, verdict, evidence = None, "not measured", "no TTFT on one side"
    else:
        met = p50 >= PREFIX_TARGET and not on["errors"] and not off["errors"]
        verdict = "met" if met else "missed"
        evidence = f"TTFT p50 off/on {p50:.2f}x" + (
            f"; errors on {on['errors']}, off {off['errors']}"
            if on["errors"] or off["errors"] else "")
    print(f"\nTarget (issue 16): {name}: {verdict} ({evidence})")
    return {"target": name, "met": met, "verdict": verdict, "evidence": evidence,
            "ttft_p50_ratio_off_on": p50, "ttft_p99_ratio_off_on": p99}


# ---- main ------------------------------------------------------------------------------------

def tally(label: str, records: list[dict], seconds: float, tokenizer, max_tokens: int,
          log: Path | None) -> None:
    """Count each record's completion tokens; say the run's totals."""
    for r in records:
        if "tokens" not in r:
            r["tokens"], r["counted"] = count_tokens(r, tokenizer, max_tokens)
    tokens = sum(r["tokens"] for r in records)
    errors = sum(bool(r["error"]) for r in records)
    say(f"  {label}: {len(records)} requests, {tokens} tokens in {seconds:.1f}s = "
        f"{tokens / seconds:.1f} tok/s"
        + (f", {errors} errors (first: {next(r['error'] for r in records if r['error'])}"
           f"{'' if log is None else f'; server log {log}'})" if errors else ""))


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
            tally(f"{level} stream(s), {name}", records, seconds, tokenizer, args.new_tokens,
                  None if name == HF else endpoints[name].log)
            results[(level, name)] = (records, seconds)
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


def flat_records(results: dict) -> list[dict]:
    """Per-request records for the JSON: {(streams, contender): (records, seconds, ...)}."""
    return [{"concurrency": level, "contender": name, "request": i,
             **{k: v for k, v in r.items() if k not in ("sent", "done", "chunk_times")},
             "seconds": r["done"] - r["sent"],
             "ttft_s": r["chunk_times"][0] - r["sent"] if r["chunk_times"] else None,
             "chunk_offsets_s": [t - r["sent"] for t in r["chunk_times"]]}
            for (level, name), (recs, *_) in results.items() for i, r in enumerate(recs)]


def concurrency_workload(args, ctx, flag: bool) -> dict:
    """Batched vs unbatched vs HF sequential over the concurrency levels; the JSON's keys."""
    tokenizer = ctx.tokenizer
    with step("loading the same weights in transformers"):
        eager = load_hf_model(resolve_checkpoint(ctx.source))

    with step("building prompts (continuation of literature text, one set per level)"):
        prompts, meta, index = {}, {}, 0
        for level in args.concurrency:
            items = [continuation_prompt(tokenizer, index + i)
                     for i in range(level * args.requests_per_stream)]
            index += len(items)
            for item in items:
                item["tokens"] = len(tokenizer(item["text"])["input_ids"])
                if item["tokens"] + args.new_tokens > ctx.positions:
                    raise SystemExit(f"a prompt of {item['tokens']} tokens + "
                                     f"{args.new_tokens} new exceeds {ctx.positions} positions")
            prompts[level] = [item["text"] for item in items]
            meta[level] = items
            lengths = [item["tokens"] for item in items]
            say(f"  {level} stream(s): {len(items)} prompts, {min(lengths)}-{max(lengths)} "
                f"tokens")
        if len(set(args.concurrency)) != len(args.concurrency):
            raise SystemExit("--concurrency lists a level twice")

    extra = ["--max-tokens-limit", str(args.new_tokens)] if args.new_tokens > 1024 else []
    with contextlib.ExitStack() as stack:
        with step("starting the servers"):
            urls = {BATCHED: stack.enter_context(server(
                        BATCHED, ctx.artifact, (["--max-batch", str(args.max_batch)] if flag
                                                else []) + extra,
                        args.threads, ctx.logs, args.startup_timeout)),
                    UNBATCHED: stack.enter_context(server(
                        UNBATCHED, ctx.artifact, (["--max-batch", "1"] if flag else []) + extra,
                        args.threads, ctx.logs, args.startup_timeout))}

        async def session():
            endpoints = {name: Endpoint(*served) for name, served in urls.items()}
            try:
                with step(f"warming up ({max(args.concurrency)} concurrent 8-token requests "
                          "per server, one HF generate; a prompt no level measures)"):
                    await warm_up(endpoints, ctx.warm, max(args.concurrency))
                    hf_sequential(eager, tokenizer, [ctx.warm], ctx.eos, ctx.pad, 8)
                total = sum(len(p) for p in prompts.values())
                with step(f"timing {total} requests per contender over levels "
                          f"{' '.join(map(str, args.concurrency))}"):
                    return await run_levels(endpoints, eager, tokenizer, prompts, ctx.eos,
                                            ctx.pad, args)
            finally:
                for endpoint in endpoints.values():
                    await endpoint.close()

        results = asyncio.run(session())
        say("stopping the servers")

    rows = [summarise(level, name, *results[(level, name)])
            for level in args.concurrency for name in CONTENDERS]
    identity = {}
    for label, (a, b) in {"batched vs unbatched": (BATCHED, UNBATCHED),
                          "batched vs HF": (BATCHED, HF),
                          "unbatched vs HF": (UNBATCHED, HF)}.items():
        pairs = [compare(results[(level, a)][0], results[(level, b)][0])
                 for level in args.concurrency]
        identity[label] = (sum(d for d, _ in pairs), sum(n for _, n in pairs))
    target = print_report(rows, identity, args, flag)
    return {"max_batch_flag": flag,
            "prompts": {str(level): items for level, items in meta.items()},
            "summary": rows,
            "identical": {k: {"differing": d, "compared": n} for k, (d, n) in identity.items()},
            "target": target, "records": flat_records(results)}


def shared_prefix_workload(args, ctx) -> dict:
    """Prefix cache on vs off on one shared system prompt; the JSON's "shared_prefix" value."""
    tokenizer, count = ctx.tokenizer, args.prefix_streams * args.prefix_requests
    with step(f"building {count} shared-prefix prompts (~{args.prefix_tokens}-token system "
              "prompt from literature text, a question of its own each)"):
        work = shared_prefix_prompts(tokenizer, count, args.prefix_tokens)
        block = PrefixCache().block_tokens
        longest = max(work["prompt_tokens"])
        if longest + args.prefix_new_tokens > ctx.positions:
            raise SystemExit(f"a prompt of {longest} tokens + {args.prefix_new_tokens} new "
                             f"exceeds {ctx.positions} positions")
        work["block_tokens"] = block
        lengths = [n - work["shared_tokens"] for n in work["prompt_tokens"]]
        say(f"  shared prefix {work['shared_tokens']} tokens ({work['shared_tokens'] // block} "
            f"whole {block}-token blocks), then {min(lengths)}-{max(lengths)} tokens per "
            f"request; prompts {min(work['prompt_tokens'])}-{longest} tokens")

    extra = ["--max-tokens-limit", str(args.prefix_new_tokens)] \
        if args.prefix_new_tokens > 1024 else []
    with contextlib.ExitStack() as stack:
        with step("starting the servers (serve's default --max-batch)"):
            urls = {name: stack.enter_context(server(
                        name, ctx.artifact, ["--prefix-cache-mb", f"{mb:g}"] + extra,
                        args.threads, ctx.logs, args.startup_timeout))
                    for name, mb in ((CACHE_ON, args.prefix_cache_mb), (CACHE_OFF, 0))}

        async def session():
            endpoints = {name: Endpoint(*served) for name, served in urls.items()}
            try:
                with step("warming up (one 8-token request per server, sharing no prefix with "
                          "the workload)"):
                    await warm_up(endpoints, ctx.warm, 1)
                # the gauge's ceiling: the first request reuses nothing, each later one every
                # whole shared block before its last token; the warm-up prompt adds tokens and
                # no hits, so does the probe when the server took it (stream_options accepted)
                reusable = sum(min(work["shared_tokens"] // block, (n - 1) // block) * block
                               for n in work["prompt_tokens"][1:])
                looked_up = sum(work["prompt_tokens"]) + len(tokenizer(ctx.warm)["input_ids"]) \
                    + (len(tokenizer("probe")["input_ids"]) if endpoints[CACHE_ON].usage else 0)
                work["hit_rate_ceiling"] = reusable / looked_up
                results = {}
                with step(f"timing {count} requests per contender ({args.prefix_streams} "
                          f"streams x {args.prefix_requests}); the workload's first request "
                          "fills the cache"):
                    for name in (CACHE_ON, CACHE_OFF):
                        endpoint = endpoints[name]
                        before = read_metrics(endpoint.base_url)
                        records, seconds = await drive(endpoint, work["texts"],
                                                       args.prefix_streams,
                                                       args.prefix_new_tokens)
                        after = read_metrics(endpoint.base_url)
                        tally(f"{args.prefix_streams} streams, {name}", records, seconds,
                              tokenizer, args.prefix_new_tokens, endpoint.log)
                        if name == CACHE_ON:
                            say(f"    /metrics hit rate {_pct(before)} after the warm-up, "
                                f"{_pct(after)} at the end (ceiling "
                                f"{100 * work['hit_rate_ceiling']:.1f}%); "
                                f"{after.get('rbcompile_prefix_cache_bytes', 0) / 2**20:.1f} MiB "
                                "of K/V held")
                        results[(args.prefix_streams, name)] = (records, seconds, before, after)
                return results
            finally:
                for endpoint in endpoints.values():
                    await endpoint.close()

        results = asyncio.run(session())
        say("stopping the servers")

    rows = []
    for (streams, name), (records, seconds, before, after) in results.items():
        row = summarise(streams, name, records, seconds)
        row.update(prefix_cache_hit_rate=after.get("rbcompile_prefix_cache_hit_rate"),
                   prefix_cache_hit_rate_after_warm_up=before.get(
                       "rbcompile_prefix_cache_hit_rate"),
                   prefix_cache_bytes=after.get("rbcompile_prefix_cache_bytes"),
                   prefix_cache_mb=args.prefix_cache_mb if name == CACHE_ON else 0)
        rows.append(row)
    identity = compare(*(results[(args.prefix_streams, name)][0]
                         for name in (CACHE_ON, CACHE_OFF)))
    target = print_prefix_report(rows, identity, work, args)
    return {"settings": {k: getattr(args, k) for k in (
                "prefix_tokens", "prefix_streams", "prefix_requests", "prefix_new_tokens",
                "prefix_cache_mb", "threads")},
            "prompts": {k: work[k] for k in ("source", "passage_offset", "system", "questions",
                                             "prompt_tokens", "shared_tokens", "block_tokens",
                                             "hit_rate_ceiling")},
            "summary": rows,
            "identical": {"on vs off": {"differing": identity[0], "compared": identity[1]}},
            "target": target, "records": flat_records(results)}


def _pct(metrics: dict) -> str:
    rate = metrics.get("rbcompile_prefix_cache_hit_rate")
    return "-" if rate is None else f"{100 * rate:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="bundled decoder name to compile")
    parser.add_argument("--artifact", help="serve this compiled artifact folder instead")
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"),
                        help="concurrency (batched vs unbatched vs HF, the default), "
                             "shared-prefix (prefix cache on vs off), or all (both; the default "
                             "with --smoke)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per server and HF")
    parser.add_argument("--startup-timeout", type=float, default=300,
                        help="seconds to wait for a server's /health (default 300)")
    parser.add_argument("--json", help="output path (default benchmarks/results/bench_serve.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes of each workload run (see the module docstring)")
    group = parser.add_argument_group("concurrency workload")
    group.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    group.add_argument("--requests-per-stream", type=int, default=2,
                       help="requests each client stream sends back to back (default 2)")
    group.add_argument("--new-tokens", type=int, default=128, help="max_tokens per request")
    group.add_argument("--max-batch", type=int, default=16,
                       help="the batched server's --max-batch")
    group = parser.add_argument_group("shared-prefix workload")
    group.add_argument("--prefix-tokens", type=int, default=300,
                       help="about how many tokens the shared system prompt has (default 300)")
    group.add_argument("--prefix-streams", type=int, default=4,
                       help="concurrent client streams (default 4)")
    group.add_argument("--prefix-requests", type=int, default=4,
                       help="requests each stream sends back to back (default 4)")
    group.add_argument("--prefix-new-tokens", type=int, default=16,
                       help="max_tokens per request (default 16)")
    group.add_argument("--prefix-cache-mb", type=float, default=256,
                       help="the 'prefix cache on' server's --prefix-cache-mb (default 256)")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.new_tokens, args.requests_per_stream = [1, 2], 8, 1
        args.prefix_tokens, args.prefix_streams, args.prefix_requests = 40, 2, 1
        args.prefix_new_tokens = 8
    args.workload = args.workload or ("all" if args.smoke else "concurrency")
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    if min(args.concurrency) < 1 or args.requests_per_stream < 1 or args.new_tokens < 1 \
            or args.threads < 1 or args.max_batch < 1:
        parser.error("--concurrency, --requests-per-stream, --new-tokens, --threads and "
                     "--max-batch must be >= 1")
    if min(args.prefix_streams, args.prefix_requests, args.prefix_new_tokens) < 1 \
            or args.prefix_streams * args.prefix_requests < 2 or args.prefix_tokens < 16 \
            or not args.prefix_cache_mb > 0:
        parser.error("--prefix-streams, --prefix-requests and --prefix-new-tokens must be >= 1, "
                     "with >= 2 requests in all; --prefix-tokens >= 16; --prefix-cache-mb > 0")
    try:
        import openai  # noqa: F401
    except ImportError:
        raise SystemExit("bench_serve needs the openai client: pip install -e '.[dev]'") from None
    pin_threads(args.threads)
    load = {"start": _uptime()}
    say(f"load average at start: {load['start']}; workloads: {', '.join(workloads)}")

    usage = serve_help()
    flag = "--max-batch" in usage
    if "concurrency" in workloads and not flag:
        say("NOTE: `rbcompile serve` has no --max-batch flag yet: both servers run its default "
            "(requests one at a time), so 'batched' and 'unbatched' measure the same server")
    if "shared-prefix" in workloads and "--prefix-cache-mb" not in usage:
        raise SystemExit("the shared-prefix workload needs `rbcompile serve --prefix-cache-mb`, "
                         "which this rbcompile lacks")

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
        ctx = SimpleNamespace(
            artifact=artifact, source=source, tokenizer=tokenizer, eos=eos, logs=logs,
            pad=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos),
            positions=compiled.max_positions,
            warm=continuation_prompt(tokenizer, WARM_INDEX)["text"])
        del compiled

        payload = {"args": vars(args), "model": source, "workloads": list(workloads),
                   "artifact": args.artifact or f"compiled from {args.model} (temporary, removed)",
                   "load_average": load, "eos_token_ids": sorted(eos)}
        for workload in workloads:
            say(f"== workload {workload}")
            if workload == "concurrency":
                payload.update(concurrency_workload(args, ctx, flag))
            else:
                payload["shared_prefix"] = shared_prefix_workload(args, ctx)
    load["end"] = _uptime()
    print(f"\nload average: start {load['start']}, end {load['end']}")

    path = write_json("bench_serve", payload, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:   # rbcompile's own refusals: one line, no traceback
        raise SystemExit(f"bench_serve: {exc}") from None
