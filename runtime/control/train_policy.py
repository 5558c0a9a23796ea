"""`rbcompile train-policy`: measure an artifact's service table on this machine, train the PPO
policy in the serving simulator built from it, compare it on held-out simulated days with static
policies (the full path, the largest budget within 1 point, and the best static setting, which is
chosen on those same days and so flattered), and write policy.safetensors, policy.json and
table.json (atomically: temporary folder, then rename).

Two simulators, one per runtime (`simulator`, CLI `--simulator`): "requests", the in-process
`AdaptiveServer` (whole requests in batches through the tiered executor: runtime/control/simulator.py;
encoders, and decoders replayed by benchmarks/bench_tidal.py), and "decode-step", `rbcompile
serve` (continuous batching, the budget set before engine decode steps by the DecodeController:
runtime/control/decode_simulator.py; decoders only). "auto" (the default) picks decode-step for a
decoder, requests for an encoder. The sections below are the requests path; the decode-step
path is under "Decoders" at the end.

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

Decoders: the settings are the budgets of the plans (an uncalibrated artifact: `DECODER_BUDGETS`
in its fixed skip order), one per distinct set of skipped regions, at full width (the engine's
decoder runs a plan's gates, not its widths). Quality drop per input (128 inputs evenly spaced
over the workload): 1 - top-1 agreement with the full path, teacher-forced over the input with
the plan's gates; the top-1 probabilities of all positions give the plan's confidence quantiles.
Latency through the real continuous-batching engine (`compiled.batch_engine`): per plan, the
median workload input and the longest (its first 128 tokens at most) as prompts at batch sizes
1, 4 and `max_batch`, `DECODE_STEPS` decode steps each (timed as serve's controller times them),
median of 2 interleaved rounds; decode steps fitted as fixed + per_row * batch +
per_token * batch * context, prefill forwards as fixed + per_token * prompts * width. The
simulator serves `--new-tokens` tokens per request, its SLO (`--slo-ms`) is per decode step.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from rbcompile.artifact import quality
from rbcompile.artifact.atomic import check_replaceable, write_folder
from rbcompile.artifact.guard import UNGUARDED
from rbcompile.calibration_data import load_texts, paragraphs
from rbcompile.errors import UserError
from rbcompile.progress import say, step
from rbcompile.runtime.control.complexity import Tiers
from rbcompile.runtime.control.decode_simulator import DecodeSimConfig, DecodeSimulator
from rbcompile.runtime.control.executor import RowResult, TieredExecutor, pad_batch
from rbcompile.runtime.control.policy import BasePolicy, Decision, StaticPolicy
from rbcompile.runtime.control.ppo import META_FILE, WEIGHTS_FILE, PPOConfig, PPOPolicy, train_ppo
from rbcompile.runtime.control.simulator import (
    FREE_DROP,
    ServiceTable,
    ServingSimulator,
    Setting,
    SimConfig,
    WorkloadItem,
    fit_latency,
    fit_step_latency,
)
from rbcompile.runtime.engine.model import load
from rbcompile.runtime.engine.requests import EngineRequest

MIN_INPUTS = 200
MAX_TOKENS = 512
QUALITY_BATCH = 16
LATENCY_ROUNDS = 3
EVALUATION_DAYS = 3
TABLE_FILE = "table.json"
POLICY_KIND = "a policy folder"
POLICY_FILES = {META_FILE, WEIGHTS_FILE, TABLE_FILE}
SIMULATORS = ("auto", "requests", "decode-step")
DECODER_BUDGETS = (0.05, 0.1, 0.15, 0.2, 0.3)
DECODE_STEPS = 4
DECODER_LATENCY_ROUNDS = 2
DECODER_QUALITY_INPUTS = 128   # evenly spaced over the workload
LONGEST_PROMPT = 128           # decoders: the longer prompt of the latency runs, at most
QUALITY_TOKENS = 1024          # decoders: padded tokens per teacher-forced quality forward
CONFIDENCE_QUANTILES = 20


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
    return [Decision(plan.budget, cap) for plan in compiled.plans for cap in caps]


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


# ---- decoders: the decode-step table (see the module docstring) -------------------------------

def _decoder_budgets(compiled) -> list[float]:
    """0 and the plan budgets (an uncalibrated decoder: DECODER_BUDGETS), the smallest budget
    of each distinct set of skipped regions."""
    full = tuple([True] * compiled.num_gates)
    candidates = sorted(p.budget for p in compiled.plans) if compiled.plans else DECODER_BUDGETS
    budgets, seen = [0.0], {full}
    for budget in candidates:
        gates = tuple(compiled.gates_for_budget(budget))
        if gates not in seen:
            seen.add(gates)
            budgets.append(budget)
    return budgets


def _decoder_quality(compiled, inputs: _Inputs, budgets: list[float], measured: list[int]):
    """Per budget: the drop of each input of `measured` (1 - teacher-forced top-1 agreement with
    the full path, under the plan's gates as the engine's decoder runs them) and the quantiles
    of the top-1 probability over every position."""
    order = sorted(measured, key=lambda i: len(inputs.rows[i]))
    groups, group = [], []
    for index in order:   # length-sorted batches of at most QUALITY_TOKENS padded tokens
        if group and (len(group) + 1) * len(inputs.rows[index]) > QUALITY_TOKENS:
            groups.append(group)
            group = []
        group.append(index)
    groups.append(group)
    batches = [(group, *pad_batch([inputs.rows[i] for i in group], inputs.pad_id))
               for group in groups]

    def top1(gates):
        """Per input its top-1 tokens; and every position's top-1 probability."""
        tokens, probabilities = {}, []
        for group, ids, mask in batches:
            logits = compiled(ids, mask, gates=gates)["logits"].float()
            best = logits.softmax(-1).max(-1)
            for row, index in enumerate(group):
                real = mask[row].bool()
                tokens[index] = best.indices[row][real]
                probabilities += best.values[row][real].tolist()
        return tokens, probabilities

    reference, _ = top1(None)
    drops, confidences = {}, {}
    for number, budget in enumerate(budgets, 1):
        tokens, probabilities = top1(compiled.gates_for_budget(budget) if budget else None)
        drops[budget] = [1.0 - float((tokens[i] == reference[i]).float().mean())
                         for i in measured]
        ordered = sorted(probabilities)
        confidences[budget] = tuple(
            ordered[int((q + 0.5) / CONFIDENCE_QUANTILES * len(ordered))]
            for q in range(CONFIDENCE_QUANTILES))
        say(f"  quality: budget {budget:g} ({number}/{len(budgets)}): mean drop "
            f"{statistics.mean(drops[budget]):.2%}")
    return drops, confidences


class _StepTimer:
    """Stands in for the DecodeController on the engine: each decode step's seconds, timed
    where serve's controller times them."""

    def __init__(self):
        self.steps: list[float] = []

    def arrived(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def step_done(self, seconds: float, confidences: list[float]) -> None:
        self.steps.append(seconds)

    def bound(self, budget: float | None) -> float | None:
        return budget   # the table measures each plan as asked

    def prefill_budget(self, budget: float | None) -> float | None:
        return budget

    def check_due(self, budget: float | None) -> bool:
        return False


def _decode_latency(compiled, inputs: _Inputs, budgets: list[float], max_batch: int):
    """Per budget, (batch size, context, median decode-step seconds) and (prompts, prompt
    tokens, prefill seconds) of batches of the median and the longest workload inputs, through
    the engine: interleaved rounds after a warm-up run."""
    room = compiled.decoder.shape.max_positions - DECODE_STEPS - 1
    by_length = sorted(inputs.rows, key=len)
    prompts = [by_length[len(by_length) // 2][:room], by_length[-1][:min(room, LONGEST_PROMPT)]]
    sizes = sorted({1, min(4, max_batch), max_batch})
    runs = [(size, prompt) for size in sizes for prompt in prompts]
    engine = compiled.batch_engine(max_batch, prefill_tokens=max_batch * len(prompts[-1]))
    timer = engine.controller = _StepTimer()

    def run(budget, size, prompt) -> tuple[float, float]:
        """(median decode step, prefill) seconds of `size` requests on `prompt`."""
        engine.budget = budget or None
        timer.steps.clear()
        for _ in range(size):
            engine.submit(EngineRequest(list(prompt), DECODE_STEPS + 1))
        start = time.perf_counter()
        engine.step()
        first = time.perf_counter() - start
        while engine.has_work:
            engine.step()
        return statistics.median(timer.steps), first - timer.steps[0]

    run(0.0, sizes[-1], prompts[-1])   # warm-up
    decode = {budget: [[] for _ in runs] for budget in budgets}
    prefill = {budget: [[] for _ in runs] for budget in budgets}
    for round_index in range(1, DECODER_LATENCY_ROUNDS + 1):
        for budget in budgets:
            for slot, (size, prompt) in enumerate(runs):
                step_s, prefill_s = run(budget, size, prompt)
                decode[budget][slot].append(step_s)
                prefill[budget][slot].append(prefill_s)
        say(f"  latency round {round_index}/{DECODER_LATENCY_ROUNDS}")
    context = lambda prompt: len(prompt) + DECODE_STEPS / 2  # noqa: E731 - mid-run context
    return ({budget: [(size, context(prompt), statistics.median(samples))
                      for (size, prompt), samples in zip(runs, per_run)]
             for budget, per_run in decode.items()},
            {budget: [(size, len(prompt), statistics.median(samples))
                      for (size, prompt), samples in zip(runs, per_run)]
             for budget, per_run in prefill.items()})


def measure_decode_table(compiled, inputs: _Inputs, workload: list[WorkloadItem],
                         max_batch: int, source: str) -> ServiceTable:
    """A decoder's service table: per plan budget, the quality drop vs the full path and
    decode-step and prefill latency through the continuous-batching engine."""
    budgets = _decoder_budgets(compiled)
    every = max(1, -(-len(inputs.rows) // DECODER_QUALITY_INPUTS))
    measured = list(range(0, len(inputs.rows), every))
    with step(f"measuring quality of {len(budgets)} plans on {len(measured)} inputs "
              "(teacher-forced top-1 agreement with the full path)"):
        drops, confidences = _decoder_quality(compiled, inputs, budgets, measured)
    with step(f"measuring decode-step and prefill latency of {len(budgets)} plans at batch "
              f"sizes up to {max_batch} through the engine"):
        decode, prefill = _decode_latency(compiled, inputs, budgets, max_batch)
    rows = []
    for budget in budgets:
        per_input = drops[budget]
        easy = [d for d, i in zip(per_input, measured) if not workload[i].hard]
        hard = [d for d, i in zip(per_input, measured) if workload[i].hard]
        fixed, per_row, per_token = fit_step_latency(decode[budget])
        prefill_fixed, prefill_per_token = fit_latency(prefill[budget])
        gates = compiled.gates_for_budget(budget) if budget else None
        mean = statistics.mean(per_input)
        rows.append(Setting(budget, 1.0, statistics.mean(easy) if easy else mean,
                            statistics.mean(hard) if hard else mean, mean, fixed, per_token,
                            compiled.skipped_share(gates) if gates else 0.0, per_row,
                            prefill_fixed, prefill_per_token, confidences[budget]))
    return ServiceTable(rows, metric="1 - teacher-forced top-1 agreement with the full path; "
                        "latency: one decode step (batch, context) and the newcomers' prefill",
                        source=source)


def evaluate(simulator: ServingSimulator, policies: dict[str, BasePolicy]) -> dict[str, dict]:
    """Each policy over the same held-out simulated days; metrics averaged over the days."""
    results = {}
    for name, policy in policies.items():
        days = [simulator.run(policy, seed=10**9 + day).summary(simulator.config.slo_s)
                for day in range(EVALUATION_DAYS)]
        results[name] = {k: statistics.mean(d[k] for d in days) for k in days[0]}
    return results


def format_results(results: dict[str, dict]) -> str:
    """The comparison as a table; decoders: p50 / p99 of the gaps between a row's tokens, then
    of whole requests."""
    width = max(len(name) for name in results)
    requests = all("request_p99_ms" in r for r in results.values())
    lines = [f"{'policy':<{width}} {'reward':>7} {'p50 ms':>8} {'p99 ms':>8} {'SLO miss':>8} "
             f"{'drop':>7} {'budget':>6}" + (f" {'req p50 ms':>10} {'req p99 ms':>10}"
                                            if requests else "")]
    for name, r in results.items():
        lines.append(f"{name:<{width}} {r['mean_reward']:7.3f} {r['p50_ms']:8.1f} "
                     f"{r['p99_ms']:8.1f} {r['slo_violations']:8.1%} {r['mean_drop']:7.2%} "
                     f"{r['mean_budget']:6.2f}" + (f" {r['request_p50_ms']:10.0f} "
                                                   f"{r['request_p99_ms']:10.0f}"
                                                   if requests else ""))
    return "\n".join(lines)


def _check_options(steps: int, max_batch: int, new_tokens: int, slo_ms: float,
                   simulator: str) -> None:
    if steps < 1 or max_batch < 1 or new_tokens < 1 or not slo_ms > 0:
        raise UserError("--steps, --max-batch and --new-tokens must be >= 1 and --slo-ms > 0")
    if simulator not in SIMULATORS:
        raise UserError(f"--simulator must be one of {', '.join(SIMULATORS)}, got {simulator!r}")


def train_policy(artifact, workload_path, output, *, classifier=None, slo_ms: float = 100.0,
                 steps: int = 20000, max_batch: int = 16, seed: int = 0,
                 new_tokens: int = 32, simulator: str = "auto") -> dict[str, dict]:
    """Measure, train, compare and write the policy folder; returns the comparison."""
    _check_options(steps, max_batch, new_tokens, slo_ms, simulator)
    output = Path(output)
    check_replaceable(output, policy_files, POLICY_KIND)  # before minutes of work
    texts = read_workload(workload_path)
    compiled = load(artifact)
    compiled.guard = UNGUARDED   # it measures every plan; serving clamps what the policy picks
    is_decoder = compiled.family == "decoder" and compiled.decoder is not None
    if simulator == "decode-step" and not is_decoder:
        raise UserError("--simulator decode-step needs a decoder artifact with a KV-cached "
                        "decoder")
    decoder = simulator == "decode-step" or simulator == "auto" and is_decoder
    if not compiled.plans and not decoder:
        raise UserError(f"{artifact} has no calibrated plans: compile it with --calib")
    if classifier and compiled.labels:
        raise UserError(f"this artifact has its own {compiled.task_head} head: --classifier is "
                        "for headless encoders")
    head = quality.load_head(classifier) if classifier else None
    if head is not None and compiled.family != "encoder":
        raise UserError("--classifier needs an encoder artifact")
    inputs = _Inputs(compiled, texts)
    workload = inputs.workload(compiled)
    source = compiled.manifest["source"]["name"]
    if decoder:
        table = measure_decode_table(compiled, inputs, workload, max_batch, source)
        simulator = DecodeSimulator(table, workload, DecodeSimConfig(
            slo_s=slo_ms / 1e3, max_batch=max_batch, new_tokens=new_tokens,
            max_positions=compiled.decoder.shape.max_positions))
        say(f"simulated day (decode steps): {simulator.duration_s:.0f} s, arrival rate "
            f"{simulator.night_rate:.2f} to {simulator.night_rate * simulator.config.swing:.2f} "
            f"requests/s (full path: {simulator.capacity_rps:.2f} requests/s with "
            f"{simulator.config.capacity_rows} streams), {new_tokens} new tokens each")
    else:
        table = measure_table(compiled, inputs, workload, head, max_batch, source)
        config = SimConfig(slo_s=slo_ms / 1e3, max_batch=max_batch,
                           max_length=compiled.max_positions)
        simulator = ServingSimulator(table, workload, config)
        say(f"simulated day: {simulator.duration_s:.2f} s, arrival rate "
            f"{simulator.night_rate:.0f} to {simulator.night_rate * simulator.config.swing:.0f} "
            "requests/s")

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
