"""Train the complexity router of `consistency="auto"` for a decoder artifact (issue 17).

Each router-training question of benchmarks/data/consistency-questions.jsonl is answered
greedily (its prefill's logits give the router's features, rbcompile/consistency_router.py)
and by 7 samples (temperature 0.7, seeds SEED..SEED+6, one shared prefill), every question in
one continuous batch; the label is the
tier the question needs (`label_tier`: 1 when the 7-sample vote gives the greedy answer, 3 when
the first 3 samples' vote already gives it, else 7). A seeded logistic regression is fitted
and stored as JSON with the checkpoint's sha256, so `consistency="auto"` finds it for any
artifact compiled from that checkpoint. The labels are cached in benchmarks/results/.

    python benchmarks/train_consistency_router.py build/smollm2-135m \\
        -o rbcompile/data/consistency-router-smollm2-135m.json

A benchmarks script rather than a CLI subcommand: labelling needs the question set (a
benchmark file, not part of the package) and minutes of generation, as the classifier
preparation in prepare_classifier.py does.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import consistency_questions as questions  # noqa: E402
from common import RESULTS, pin_threads  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.consistency import (RoutedGroup, SampleGroup, VoteOptions,  # noqa: E402
                                   majority_vote)
from rbcompile.consistency_router import (TIERS, label_tier, train_router)  # noqa: E402
from rbcompile.prefix_cache import PrefixCache  # noqa: E402
from rbcompile.sampling import SamplingConfig  # noqa: E402

SEED = 1000
TEMPERATURE = 0.7
MAX_NEW_TOKENS = 6
HOLDOUT = 0.25          # of the training questions, held out to report the router's accuracy


class Greedy:
    """A router that always picks the greedy tier (the `RoutedGroup` records the features)."""
    tiers = TIERS

    def tier(self, features) -> int:
        return 1


def label(model, rows: list[dict], vote: VoteOptions, max_batch: int) -> list[dict]:
    """Per question: features, greedy answer, the 3- and 7-sample votes, the tier label. Every
    question joins one continuous batch (a shared prefix cache holds the few-shot prefix)."""
    sampling = SamplingConfig(do_sample=True, temperature=TEMPERATURE, seed=SEED)
    engine = model.batch_engine(max_batch=max_batch, prefix_cache=PrefixCache())
    options = dict(max_new_tokens=MAX_NEW_TOKENS, sampling=sampling, stop=questions.STOP,
                   options=vote)
    groups = []
    for row in rows:
        ids = model.tokenizer(questions.prompt(row["question"]))["input_ids"]
        groups.append((RoutedGroup(engine, ids, Greedy(), **options),
                       SampleGroup(engine, ids, 7, **options)))
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
        done = sum(greedy.done and seven.done for greedy, seven in groups)
        print(f"  labelled {done}/{len(rows)} ({time.perf_counter() - started:.0f} s)",
              end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    labelled = []
    for row, (greedy, seven) in zip(rows, groups):
        first = greedy.group.voter.vote().answer
        vote3 = majority_vote([seven.texts[request] for request in seven.requests[:3]],
                              vote).answer
        vote7 = seven.voter.vote().answer
        labelled.append({"id": row["id"], "features": greedy.features, "greedy": first,
                         "vote3": vote3, "vote7": vote7, "answer": row["answer"],
                         "tier": label_tier(first, vote3, vote7)})
    return labelled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", help="a decoder artifact with its tokenizer")
    parser.add_argument("-o", "--out", required=True, help="the router JSON to write")
    parser.add_argument("--seed", type=int, default=0, help="router training seed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=32, help="rows of the batch")
    parser.add_argument("--relabel", action="store_true", help="ignore cached labels")
    args = parser.parse_args()
    pin_threads(args.threads)
    model = rbcompile.load(args.artifact)
    source = model.manifest.get("source") or {}
    cached = RESULTS / f"consistency-labels-{source.get('sha256', 'unknown')[:16]}.json"
    vote = VoteOptions(extract=questions.EXTRACT, early_stop="off")
    rows = questions.load("train")
    if cached.is_file() and not args.relabel:
        labelled = json.loads(cached.read_text())["labelled"]
    else:
        labelled = label(model, rows, vote, args.max_batch)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps({"source": source, "seed": SEED, "temperature": TEMPERATURE,
                                      "labelled": labelled}))
    order = list(range(len(labelled)))
    random.Random(args.seed).shuffle(order)
    held = set(order[:int(len(order) * HOLDOUT)])
    fit = [labelled[i] for i in order if i not in held]
    test = [labelled[i] for i in sorted(held)]

    def accuracy(router, items):
        return sum(router.tier(item["features"]) == item["tier"] for item in items) / len(items)

    holdout = train_router([item["features"] for item in fit], [item["tier"] for item in fit],
                           seed=args.seed)
    counts = {tier: sum(item["tier"] == tier for item in labelled) for tier in TIERS}
    held_accuracy, fit_accuracy = accuracy(holdout, test), accuracy(holdout, fit)
    router = train_router([item["features"] for item in labelled],
                          [item["tier"] for item in labelled], seed=args.seed, info={
                              "source_name": source.get("name"),
                              "source_sha256": source.get("sha256"),
                              "questions": len(labelled), "labels": counts,
                              "holdout_accuracy": round(held_accuracy, 4),
                              "holdout_questions": len(test),
                              "majority_baseline": round(max(counts.values()) / len(labelled), 4),
                              "temperature": TEMPERATURE, "sample_seed": SEED})
    router.save(args.out)
    print(f"labels {counts}; router accuracy {fit_accuracy:.1%} on its {len(fit)} training "
          f"questions, {held_accuracy:.1%} on {len(test)} held out (always tier 1: "
          f"{sum(item['tier'] == 1 for item in test) / len(test):.1%}); wrote {args.out}")


if __name__ == "__main__":
    main()
