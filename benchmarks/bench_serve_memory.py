"""Where `rbcompile serve`'s memory goes, and whether it comes back (issue 43).

The serve process runs on a free port. The script reads its RSS (/proc/PID/status) and, from
/metrics, the K/V cache of the running batch and the prefix cache at these points:
  ready     /health answers
  warm      after 4 short completions
  peak      the most seen while --streams concurrent completions of --new-tokens run, each on
            its own passage of real text (Emma)
  idle      --idle-s after they end
It runs two rounds of long completions. RSS at idle after round 2 must not grow past RSS at
idle after round 1 (no leak). Idle RSS should sit near warm RSS plus what the prefix cache
holds (its --prefix-cache-mb bound). An idle engine gives back its grown K/V cache.

    python benchmarks/bench_serve_memory.py [--artifact build/smollm2-135m] [--streams 16]
        [--new-tokens 256] [--prompt-tokens 256] [--threads 2] [--idle-s 3] [--json PATH]

Writes benchmarks/results/bench_serve_memory.json.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench_serve import read_metrics, server  # noqa: E402
from common import DATA, RESULTS, print_table, write_json  # noqa: E402

MIB = 1 << 20


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MIB


def server_pid(port: int) -> int:
    """The pid of the process listening on `port` (the serve subprocess)."""
    for connection in psutil.net_connections(kind="tcp"):
        if connection.laddr and connection.laddr.port == port and connection.status == "LISTEN":
            return connection.pid
    raise SystemExit(f"no process listens on port {port}")


def passages(count: int, words: int) -> list[str]:
    text = (DATA / "emma-excerpt.txt").read_text().split()
    return [" ".join(text[i * words:(i + 1) * words]) for i in range(count)]


def snapshot(name: str, pid: int, base: str) -> dict:
    metrics = read_metrics(base)
    return {"point": name, "rss_mib": round(rss_mib(pid), 1),
            "kv_cache_mib": round(metrics.get("rbcompile_kv_cache_bytes", 0) / MIB, 1),
            "prefix_cache_mib": round(metrics.get("rbcompile_prefix_cache_bytes", 0) / MIB, 1)}


def long_round(name: str, pid: int, base: str, prompts: list[str], new_tokens: int) -> dict:
    """The prompts as concurrent completions; the snapshot with the most RSS while they ran."""
    done, peak = [], snapshot(name, pid, base)

    def complete(prompt: str):
        body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0}
        done.append(httpx.post(f"{base}/completions", json=body, timeout=3600).status_code)

    threads = [threading.Thread(target=complete, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        now = snapshot(name, pid, base)
        peak = now if now["rss_mib"] > peak["rss_mib"] else peak
        time.sleep(0.5)
    if done.count(200) != len(prompts):
        raise SystemExit(f"{name}: statuses {sorted(done)}")
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="build/smollm2-135m")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="about this many (words x 1.3)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    logs = RESULTS / "bench_serve_memory_logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    with server("rbcompile serve", args.artifact, [], args.threads, logs, 600) as (base, _):
        pid = server_pid(int(base.split(":")[2].split("/")[0]))
        rows.append(snapshot("ready", pid, base))
        for prompt in passages(4, 20):
            httpx.post(f"{base}/completions", json={"prompt": prompt, "max_tokens": 8}, timeout=600)
        rows.append(snapshot("warm", pid, base))
        words = int(args.prompt_tokens / 1.3)
        for round_ in (1, 2):
            prompts = passages(args.streams * round_, words)[args.streams * (round_ - 1):]
            rows.append(long_round(f"peak {round_}", pid, base, prompts, args.new_tokens))
            time.sleep(args.idle_s)
            rows.append(snapshot(f"idle {round_}", pid, base))
    print_table(rows, [("point", "point"), ("rss_mib", "RSS MiB"), ("kv_cache_mib", "K/V cache MiB"),
                       ("prefix_cache_mib", "prefix cache MiB")])
    by = {row["point"]: row for row in rows}
    leak = by["idle 2"]["rss_mib"] - by["idle 1"]["rss_mib"]
    unexplained = by["idle 2"]["rss_mib"] - by["warm"]["rss_mib"] - by["idle 2"]["prefix_cache_mib"]
    print(f"idle 2 - idle 1: {leak:+.1f} MiB; idle 2 - warm - prefix cache: {unexplained:+.1f} MiB")
    path = write_json("bench_serve_memory", {"args": vars(args), "rows": rows,
                                             "idle_growth_mib": round(leak, 1),
                                             "idle_unexplained_mib": round(unexplained, 1)}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
