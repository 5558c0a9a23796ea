"""Self-consistency on the verifiable question set (issue 17): accuracy, generated tokens and
wall time of greedy 1, fixed 3, fixed 7, the complexity router and the router with early stop,
on the test split of benchmarks/data/consistency-questions.jsonl.

    python benchmarks/bench_consistency.py [build/smollm2-135m] [--limit N]
        [--contenders greedy-1 fixed-7 ...] [--weights fp32 int4]
        [--tier-weights none auto 1=int4,3=int4,7=int4]

--weights runs the contenders once per weight precision on the onnxruntime executor (issue 45:
what a 7-sample vote costs and scores in int4 against fp32); the router's own accuracy is
measured at the first level. --tier-weights runs them once per tier setting instead, on the
onnxruntime executor at fp32: each vote decodes at its tier's level (`VoteOptions.tier_weights`;
'none': the decoder's), so the router sends routine questions to int4 and the rest elsewhere
(issue 45's precision per tier).

Each contender answers every test question in one continuous batch (`--max-batch` rows, a
shared prefix cache holding the few-shot prefix); samples draw at the router's sampling setting
(train_consistency_router.py's SETTING, chosen on the training split by sweep_consistency.py),
sample i of a question with seed 1000 + i (so fixed 3's samples are fixed 7's first three, and
the router's are the same samples). Answers: the completion's first word, normalised; right
when equal to the known answer.
- greedy 1: one greedy answer per question.
- fixed 3 / fixed 7: 3 / 7 samples drawn at once, all counted (no early stop).
- router: `consistency="auto"` (runtime/engine/consistency_router.py): a greedy row, whose prefill
  the router reads to pick 1, 3 or 7 votes: the greedy answer, or it and 2 or 6 samples; all
  counted.
- router + early stop: the same, with Adaptive-Consistency's stop (VoteOptions defaults:
  leader cannot be overtaken, or Beta posterior >= 0.95) and samples drawn in waves
  (`draw="waves"`), so a decided vote leaves samples undrawn.

Measures (per contender): accuracy with a 95% bootstrap interval (2,000 resamples of the
questions, seed 0); generated tokens (every row, cancelled ones and the router's greedy row
included) and their share of fixed 7's; wall time of the whole split (after an untimed warm-up
on one question); rows (the greedy row and samples) drawn per question. The seed's quality score = 0.6 x accuracy + 0.3 x consistency + 0.1 x speed, where
consistency = the mean share of a question's counted samples that give the returned answer
(1 for greedy: one deterministic sample) and speed = greedy's wall time / the contender's
(1 for greedy). The router's own accuracy is measured on the test split too: its tier against
the label the greedy answer and fixed 7's samples give (`label_tier`: the fewest votes whose
answer is right, 1 when greedy is right or none is), next to always picking tier 1.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import consistency_questions as questions  # noqa: E402
from common import pin_threads, print_table, write_json  # noqa: E402
from train_consistency_router import SEED, parse_setting  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.artifact.guard import QualityGuard  # noqa: E402
from rbcompile.runtime.engine.consistency import VoteOptions, normalise, parse_tier_weights  # noqa: E402
from rbcompile.runtime.engine.consistency_router import find_router, label_tier, vote_of  # noqa: E402
from rbcompile.runtime.engine.prefix_cache import PrefixCache  # noqa: E402
from rbcompile.runtime.engine.sampling import SamplingConfig  # noqa: E402
from rbcompile.runtime.engine.vote_sampling import (  # noqa: E402
    RoutedGroup,
    SampleGroup,
    tier_levels,  # noqa: E402
)

RESAMPLES = 2000
CONTENDERS = ("greedy 1", "fixed 3", "fixed 7", "router", "router + early stop")


def bootstrap(correct: list[bool], seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the accuracy over resampled questions."""
    rng = random.Random(seed)
    n = len(correct)
    means = sorted(sum(correct[rng.randrange(n)] for _ in range(n)) / n for _ in range(RESAMPLES))
    return means[int(0.025 * RESAMPLES)], means[int(0.975 * RESAMPLES) - 1]


def run(model, prompts: list[list[int]], make_group, max_batch: int) -> tuple[list, float]:
    """Every prompt's group on one engine, stepped until idle: (groups, seconds)."""
    engine = model.batch_engine(max_batch=max_batch, prefix_cache=PrefixCache())
    started = time.perf_counter()
    groups = [make_group(engine, prompt) for prompt in prompts]
    while engine.has_work:
        engine.step()
        done = sum(group.done for group in groups)
        print(f"  {done}/{len(groups)} ({time.perf_counter() - started:.0f} s)", end="\r",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return groups, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="build/smollm2-135m")
    parser.add_argument("--router", help="router JSON (default: the one shipped for the checkpoint)")
    parser.add_argument("--limit", type=int, help="the first N test questions only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--contenders", nargs="+", choices=[c.replace(" ", "-") for c in CONTENDERS],
                        help="default: all")
    parser.add_argument("--weights", nargs="+", choices=("fp32", "int8", "int4"),
                        help="run the contenders at each of these weight precisions, on the "
                        "onnxruntime executor (default: the torch executor at fp32)")
    parser.add_argument("--tier-weights", nargs="+", metavar="SPEC",
                        help="run the contenders once per tier setting (none, auto, or "
                        "K=LEVEL pairs), on the onnxruntime executor at fp32")
    parser.add_argument("--max-quality-loss", type=float, help="the quality guard the tiers' "
                        "levels must be within (default: the artifact's)")
    parser.add_argument("--json", help="output path (default benchmarks/results/consistency.json)")
    args = parser.parse_args()
    pin_threads(args.threads)
    model = rbcompile.load(args.artifact)
    if args.max_quality_loss is not None:
        model.guard = QualityGuard(args.max_quality_loss)
    router = find_router(model, args.router)
    rows = questions.load("test")[:args.limit]
    form = questions.CLOZE
    prompts = [model.tokenizer(form.prompt(row["question"]))["input_ids"] for row in rows]
    gold = [normalise(row["answer"]) for row in rows]
    setting = router.info.get("setting", "0.7")   # routers trained before the sweep: 0.7
    sampled = parse_setting(setting)
    common = dict(max_new_tokens=form.max_new_tokens, stop=list(form.stop))
    all_counted = VoteOptions(extract=form.extract, early_stop="off")
    early = VoteOptions(extract=form.extract, draw="waves")

    def contenders(tiers: dict[int, str]) -> dict:
        def fixed(k, sampling):
            return lambda e, p: SampleGroup(e, p, k, sampling=sampling, options=all_counted,
                                            weights=tiers.get(k), **common)

        def routed(options):
            return lambda e, p: RoutedGroup(e, p, router, sampling=sampled, options=options,
                                            tiers=tiers, **common)
        chosen = {"greedy 1": fixed(1, SamplingConfig()), "fixed 3": fixed(3, sampled),
                  "fixed 7": fixed(7, sampled), "router": routed(all_counted),
                  "router + early stop": routed(early)}
        return {name: chosen[name] for name in CONTENDERS
                if not args.contenders or name.replace(" ", "-") in args.contenders}
    settings = [(level, None) for level in args.weights or [None]]
    if args.tier_weights:
        settings = [("fp32", spec) for spec in args.tier_weights]
    results, answers, fixed7 = measure(model, settings, contenders, prompts, gold, args)
    summarise(results, answers, fixed7, gold, router, rows, setting, form, args)


def measure(model, settings: list, contenders, prompts, gold, args):
    """Each contender over every prompt at each setting ((weight level, tier spec)), the
    settings interleaved per contender (ABBA): (results, the first setting's answers per
    contender, its fixed 7's sample answers)."""
    tiers = {}
    for level, spec in settings:   # before timing: sessions built, tier levels checked
        if level is not None:
            model.use_executor("onnxruntime", level, threads=args.threads)
        tiers[spec] = {} if spec in (None, "none") else tier_levels(
            model, model.batch_engine(), parse_tier_weights(spec))
        for make_group in contenders(tiers[spec]).values():   # warm-up: every graph it runs
            run(model, prompts[:1], make_group, args.max_batch)
    results, answers, fixed7 = {}, {}, []
    for turn, name in enumerate(contenders({})):
        for index, (level, spec) in (list(enumerate(settings)) if turn % 2 == 0
                                     else list(enumerate(settings))[::-1]):
            if level is not None:
                model.use_executor("onnxruntime", level, threads=args.threads)
            suffix = f" [{spec}]" if spec else "" if index == 0 else f" ({level})"
            print(f"{name}{suffix}: {len(prompts)} questions", file=sys.stderr)
            groups, seconds = run(model, prompts, contenders(tiers[spec])[name], args.max_batch)
            result, votes, samples = describe(groups, seconds, gold)
            result.update(weights=level or "fp32", tier_weights=tiers[spec], setting=index)
            results[name + suffix] = result
            if index == 0:
                answers[name] = [vote.answer for vote in votes]
            if index == 0 and name == "fixed 7":   # each sample's answer, in seed order
                fixed7 = [[group.voter.answer(group.texts[request]) for request in group.requests]
                          for group in samples]
    for result in results.values():   # against the same setting's greedy 1 and fixed 7
        same = {_contender(name): r for name, r in results.items()
                if r["setting"] == result["setting"]}
        seven, greedy = same.get("fixed 7"), same.get("greedy 1")
        result["tokens_vs_fixed7"] = result["tokens"] / seven["tokens"] if seven else None
        result["speed"] = greedy["seconds"] / result["seconds"] if greedy else None
        result["quality"] = (0.6 * result["accuracy"] + 0.3 * result["consistency"]
                             + 0.1 * result["speed"]) if greedy else None
    return results, answers, fixed7


def describe(groups, seconds: float, gold) -> tuple[dict, list, list]:
    """A contender's run: its measures, its votes and its sample groups."""
    samples = [getattr(group, "group", group) for group in groups]
    votes = [group.voter.vote() for group in samples]
    correct = [vote.answer == expected for vote, expected in zip(votes, gold)]
    agreement = [vote.clusters[0].votes / max(len(vote.answers), 1) if vote.clusters else 0.0
                 for vote in votes]
    tiers = [getattr(group, "tier", None) for group in groups]
    return {"accuracy": sum(correct) / len(groups), "accuracy_95": bootstrap(correct),
            "tokens": sum(group.new_tokens for group in groups), "seconds": seconds,
            "rows_per_question": sum(group.drawn for group in samples) / len(groups),
            "consistency": sum(agreement) / len(groups),
            "tiers": {tier: tiers.count(tier) for tier in (1, 3, 7)} if tiers[0] else None,
            "router_tiers": tiers if tiers[0] else None}, votes, samples


def summarise(results, answers, fixed7, gold, router, rows, setting, form, args) -> None:
    """The table, the router's accuracy (when greedy 1, fixed 7 and router ran), the JSON."""
    table = [{"name": name, "acc": f"{100 * r['accuracy']:.1f}",
              "ci": f"[{100 * r['accuracy_95'][0]:.1f}, {100 * r['accuracy_95'][1]:.1f}]",
              "samples": f"{r['rows_per_question']:.2f}", "tokens": r["tokens"],
              "share": _percent(r["tokens_vs_fixed7"]), "wall": f"{r['seconds']:.0f}",
              "tok_s": f"{r['tokens'] / r['seconds']:.1f}", "cons": f"{r['consistency']:.3f}",
              "speed": _fixed(r["speed"], 2), "quality": _fixed(r["quality"], 3)}
             for name, r in results.items()]
    print_table(table, [("name", "contender"), ("acc", "accuracy %"), ("ci", "95% CI"),
                        ("samples", "rows/q"), ("tokens", "tokens"), ("share", "of fixed 7"),
                        ("wall", "wall s"), ("tok_s", "tokens/s"), ("cons", "consistency"),
                        ("speed", "speed"), ("quality", "quality")])
    router_summary = None
    if {"greedy 1", "fixed 7", "router"} <= set(answers):
        router_summary = _router_accuracy(results, answers, fixed7, gold, router, len(rows))
    for result in results.values():
        result.pop("router_tiers")
    path = write_json("consistency", {
        "artifact": args.artifact, "questions": len(rows), "sampling": setting,
        "max_new_tokens": form.max_new_tokens, "sample_seed": SEED, "contenders": results,
        "router": router_summary}, args.json)
    print(f"wrote {path}")


def _contender(name: str) -> str:
    """A result's contender, without its setting's suffix."""
    return name.split(" [")[0].split(" (")[0]


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _fixed(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _router_accuracy(results, answers, fixed7, gold, router, count: int) -> dict:
    labels = [label_tier(first, seven, answer)
              for first, seven, answer in zip(answers["greedy 1"], fixed7, gold)]
    chosen = next(r for name, r in results.items()
                  if r["setting"] == 0 and _contender(name) == "router")["router_tiers"]
    router_accuracy = sum(a == b for a, b in zip(chosen, labels)) / count
    needed = sum((a > 1) == (b > 1) for a, b in zip(chosen, labels)) / count
    # the earlier label: does a 7-vote (greedy + 6 samples) change the greedy answer?
    changed = [vote_of(first, seven, 7) != first
               for first, seven in zip(answers["greedy 1"], fixed7)]
    change = sum((a > 1) == b for a, b in zip(chosen, changed)) / count
    print(f"router on the {count} test questions: tier accuracy {100 * router_accuracy:.1f}% "
          f"(labels {dict((t, labels.count(t)) for t in (1, 3, 7))}; always 1: "
          f"{100 * labels.count(1) / count:.1f}%), 'a vote is needed' accuracy "
          f"{100 * needed:.1f}%; 'a 7-vote changes the greedy answer' accuracy "
          f"{100 * change:.1f}% ({sum(changed)} change; never: "
          f"{100 * (1 - sum(changed) / count):.1f}%); cross-validated at training: "
          f"{router.info.get('cv_tier_accuracy')}")
    return {"test_tier_accuracy": router_accuracy, "test_vote_needed_accuracy": needed,
            "test_change_accuracy": change, "test_changes": sum(changed),
            "test_labels": {t: labels.count(t) for t in (1, 3, 7)}, "info": router.info}


if __name__ == "__main__":
    main()
