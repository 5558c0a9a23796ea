"""`rbcompile train-policy`: measure an artifact's service table on this machine, train the PPO
policy in the serving simulator built from it, compare it on held-out simulated days with static
policies (the full path, the largest budget within 1 point, and the best static setting, which is
chosen on those same days and so flattered), and write policy.safetensors, policy.json and
table.json (atomically: temporary folder, then rename).

Workload: a JSONL file (one "text" per line) or a text file (one input per paragraph) of at
least 200 inputs, each truncated to 512 tokens (or the model's positions). The more complex half
of the inputs (by `compiled.complexity`) counts as hard.

Table: every (plan budget, width cap) pair, the caps being 1.0 and the artifact's width levels
(a cap narrows each running region of the plan to at most that width), each served the way the
runtime serves it: through the tiered executor with its default tiers and early exit at the
off-ramps (the confidence fallback is left out). Quality drop per input vs the full path: with a
classifier head, 1 if its argmax differs from the full path's; else decoders 1 - top-1
agreement, encoders 1 - cosine of pooled embeddings. Latency: the shortest and the longest
inputs at batch sizes 1, 4 and `max_batch`, median of 3 interleaved rounds, fitted per setting
as fixed + per_token * batch * tokens.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from . import quality
from .calibration_data import load_texts, paragraphs
from .atomic import check_replaceable, write_folder
from .compiled import load
from .errors import UserError
from .progress import say, step
from .runtime.complexity import Tiers
from .runtime.executor import RowResult, TieredExecutor, pad_batch
from .runtime.policy import BasePolicy, Decision, StaticPolicy
from .runtime.ppo import META_FILE, WEIGHTS_FILE, PPOConfig, PPOPolicy, train_ppo
from .runtime.simulator import (FREE_DROP, ServiceTable, ServingSimulator, Setting, SimConfig,
                                WorkloadItem, fit_latency)

MIN_INPUTS = 200
MAX_TOKENS = 512
QUALITY_BATCH = 16
LATENCY_ROUNDS = 3
EVALUATION_DAYS = 3
TABLE_FILE = "table.json"
POLICY_KIND = "a policy folder"
POLICY_FILES = {META_FILE, WEIGHTS_FILE, TABLE_FILE}


def policy_files(folder: Path) -> set[str] | None:
    """The files of an earlier policy folder (its policy.json parses), or None: not ours."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return POLICY_FILES if isinstance(meta, dict) else None


def read_workload(path) -> list[str]:
    """The inputs of a workload file (see module docstring); fewer than 200 is a UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"workload file not found: {path}")
    texts = load_texts(path)
    if path.suffix != ".jsonl":
        texts = paragraphs(texts[0])
    if len(texts) < MIN_INPUTS:
        raise UserError(f"{path}: {len(texts)} inputs; train-policy needs at least {MIN_INPUTS}")
    return texts


class _Inputs:
    """The tokenised workload, batched for measurement."""

    def __init__(self, compiled, texts: list[str]):
        tokenizer = compiled.tokenizer
        limit = min(MAX_TOKENS, compiled.max_positions)
        encoded = tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
        self.rows = [row for row in encoded if row]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batches = [pad_batch(self.rows[i:i + QUALITY_BATCH], self.pad_id)
                        for i in range(0, len(self.rows), QUALITY_BATCH)]

    def workload(self, compiled) -> list[WorkloadItem]:
        scores = torch.cat([compiled.complexity(ids, mask) for ids, mask in self.batches]).tolist()
        by_score = sorted(range(len(scores)), key=lambda i: (scores[i], i))
        hard = set(by_score[len(by_score) // 2:])
        return [WorkloadItem(len(row), scores[i], i in hard) for i, row in enumerate(self.rows)]

    def latency_batches(self, max_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The shortest and the longest inputs at batch sizes 1, 4 and max_batch."""
        by_length = sorted(self.rows, key=len)
        sizes = sorted({1, min(4, max_batch), max_batch})
        return [pad_batch(rows, self.pad_id) for size in sizes
                for rows in (by_length[:size], by_length[-size:])]


def _settings(compiled) -> list[Decision]:
    """Every (plan budget, width cap) decision; a cap narrows each running region to at most it."""
    caps = (1.0, *getattr(compiled.module, "WIDTH_LEVELS", ()))
    return [Decision(plan["budget"], cap) for plan in compiled.plans for cap in caps]


def _answers(executor: TieredExecutor, batches, decision: Decision) -> list[RowResult]:
    return [row for ids, mask in batches for row in executor.run(ids, mask, decision)]


def _drop(answer: dict, reference: dict, head) -> float:
    """One input's quality drop against the full path's answer (see module docstring)."""
    if head is not None:
        def label(summary):
            logits = summary["logits"] if "logits" in summary else \
                summary["embedding"] @ head[0].T + head[1]
            return int(logits.argmax())
        return float(label(answer) != label(reference))
    if "top1" in reference:
        return 1.0 - float((answer["top1"] == reference["top1"]).float().mean())
    return max(0.0, 1.0 - float(answer["embedding"] @ reference["embedding"]))


def _drops(compiled, inputs: _Inputs, head, decisions: list[Decision]):
    """Per decision, each input's quality drop vs the full path, and the mean share of prunable
    FLOPs skipped, as the server's executor runs it."""
    full = TieredExecutor(compiled, tiers=Tiers(0.0, 0.0), early_exit=False)
    references = [r.outputs for r in _answers(full, inputs.batches, Decision())]
    executor = TieredExecutor(compiled)
    drops, skipped = {}, {}
    for index, decision in enumerate(decisions, 1):
        answers = _answers(executor, inputs.batches, decision)
        drops[decision] = [_drop(a.outputs, ref, head) for a, ref in zip(answers, references)]
        skipped[decision] = statistics.mean(a.skipped for a in answers)
        say(f"  quality: setting {index}/{len(decisions)} (budget {decision.budget:g}, width "
            f"{decision.width:g}): mean drop {statistics.mean(drops[decision]):.2%}")
    return drops, skipped


def _latency_points(compiled, batches, decisions: list[Decision]) -> dict[Decision, list]:
    """Per decision, (batch size, tokens per request, median seconds) of each batch through the
    executor: interleaved rounds after a warm-up round."""
    executor = TieredExecutor(compiled)
    times = {decision: [[] for _ in batches] for decision in decisions}
    for round_index in range(LATENCY_ROUNDS + 1):
        for decision in decisions:
            for slot, (ids, mask) in enumerate(batches):
                start = time.perf_counter()
                executor.run(ids, mask, decision)
                if round_index:
                    times[decision][slot].append(time.perf_counter() - start)
        if round_index:
            say(f"  latency round {round_index}/{LATENCY_ROUNDS}")
    return {decision: [(ids.shape[0], ids.shape[1], statistics.median(samples))
                       for (ids, _), samples in zip(batches, per_batch)]
            for decision, per_batch in times.items()}


def measure_table(compiled, inputs: _Inputs, workload: list[WorkloadItem], head,
                  max_batch: int, source: str) -> ServiceTable:
    """Measure quality drop and latency of every (budget, width cap) setting, served the way the
    runtime serves it (complexity tiers, early exit at off-ramps; no confidence fallback)."""
    decisions = _settings(compiled)
    with step(f"measuring quality of {len(decisions)} settings on {len(inputs.rows)} inputs"):
        drops, skipped = _drops(compiled, inputs, head, decisions)
    with step(f"measuring latency of {len(decisions)} settings at batch sizes up to {max_batch}"):
        points = _latency_points(compiled, inputs.latency_batches(max_batch), decisions)
    rows = []
    for decision in decisions:
        per_input = drops[decision]
        easy = [d for d, w in zip(per_input, workload) if not w.hard]
        hard = [d for d, w in zip(per_input, workload) if w.hard]
        fixed, per_token = fit_latency(points[decision])
        rows.append(Setting(decision.budget, decision.width, sum(easy) / len(easy),
                            sum(hard) / len(hard), sum(per_input) / len(per_input), fixed,
                            per_token, skipped[decision]))
    if head is not None:
        metric = "classifier argmax disagreement with the full path"
    elif compiled.family == "decoder":
        metric = "1 - top-1 agreement with the full path"
    else:
        metric = "1 - cosine of mean-pooled embeddings to the full path"
    return ServiceTable(rows, metric=metric, source=source)


def evaluate(simulator: ServingSimulator, policies: dict[str, BasePolicy]) -> dict[str, dict]:
    """Each policy over the same held-out simulated days; metrics averaged over the days."""
    results = {}
    for name, policy in policies.items():
        days = [simulator.run(policy, seed=10**9 + day).summary(simulator.config.slo_s)
                for day in range(EVALUATION_DAYS)]
        results[name] = {k: statistics.mean(d[k] for d in days) for k in days[0]}
    return results


def format_results(results: dict[str, dict]) -> str:
    width = max(len(name) for name in results)
    lines = [f"{'policy':<{width}} {'reward':>7} {'p50 ms':>8} {'p99 ms':>8} {'SLO miss':>8} "
             f"{'drop':>7} {'budget':>6}"]
    for name, r in results.items():
        lines.append(f"{name:<{width}} {r['mean_reward']:7.3f} {r['p50_ms']:8.1f} "
                     f"{r['p99_ms']:8.1f} {r['slo_violations']:8.1%} {r['mean_drop']:7.2%} "
                     f"{r['mean_budget']:6.2f}")
    return "\n".join(lines)


def train_policy(artifact, workload_path, output, *, classifier=None, slo_ms: float = 100.0,
                 steps: int = 20000, max_batch: int = 16, seed: int = 0) -> dict[str, dict]:
    """Measure, train, compare and write the policy folder; returns the comparison."""
    if steps < 1 or max_batch < 1 or not slo_ms > 0:
        raise UserError("--steps and --max-batch must be >= 1 and --slo-ms > 0")
    output = Path(output)
    check_replaceable(output, policy_files, POLICY_KIND)  # before minutes of work
    texts = read_workload(workload_path)
    compiled = load(artifact)
    if not compiled.plans:
        raise UserError(f"{artifact} has no calibrated plans: compile it with --calib")
    if classifier and compiled.labels:
        raise UserError(f"this artifact has its own {compiled.task_head} head: --classifier is "
                        "for headless encoders")
    head = quality.load_head(classifier) if classifier else None
    if head is not None and compiled.family != "encoder":
        raise UserError("--classifier needs an encoder artifact")
    inputs = _Inputs(compiled, texts)
    workload = inputs.workload(compiled)
    table = measure_table(compiled, inputs, workload, head, max_batch,
                          compiled.manifest["source"]["name"])
    config = SimConfig(slo_s=slo_ms / 1e3, max_batch=max_batch,
                       max_length=compiled.max_positions)
    simulator = ServingSimulator(table, workload, config)
    say(f"simulated day: {simulator.duration_s:.2f} s, arrival rate {simulator.night_rate:.0f} "
        f"to {simulator.night_rate * simulator.config.swing:.0f} requests/s")

    every = max(1, steps // (10 * PPOConfig.rollout))  # about ten lines

    def progress(entry):
        if entry["steps"] == steps or entry["iteration"] % every == 0:
            say(f"  iteration {entry['iteration']}: {entry['steps']}/{steps} decisions, "
                f"mean reward {entry['mean_reward']:+.3f}")
    with step(f"training PPO for {steps} decisions"):
        network, log = train_ppo(simulator, steps, seed, progress=progress)
    policy = PPOPolicy(network, simulator.levels)
    within = table.within_one_point()
    with step("comparing with static policies on held-out simulated days"):
        results = evaluate(simulator, {
            "ppo (int8)": policy,
            "static full": StaticPolicy(0.0, 1.0, True),
            f"static budget {within.budget:g} width {within.width:g} "
            f"({'<= 1 pt' if within.drop <= FREE_DROP else 'least drop'})":
                StaticPolicy(within.budget, within.width, True)})
        statics = evaluate(simulator, {
            f"best static: budget {s.budget:g} width {s.width:g}":
                StaticPolicy(s.budget, s.width, True) for s in table.settings})
    best = max(statics, key=lambda name: statics[name]["mean_reward"])
    results[best] = statics[best]
    policy.info = {**simulator.describe(), "training": {"steps": steps, "seed": seed, "log": log},
                   "evaluation": results}
    table_json = {**table.to_json(), "workload": [dataclasses.asdict(w) for w in workload],
                  "measured_on": {"platform": platform.platform(), "torch": torch.__version__,
                                  "threads": torch.get_num_threads()}}

    def write(folder: Path) -> None:
        policy.save(folder)
        (folder / TABLE_FILE).write_text(json.dumps(table_json, indent=1))
    write_folder(output, write, policy_files, POLICY_KIND)
    print(format_results(results))
    print(f"wrote {output}: {', '.join(sorted(p.name for p in output.iterdir()))}")
    return results
