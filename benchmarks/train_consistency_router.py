"""Train the complexity router of `consistency="auto"` for a decoder artifact (issue 17).

Each router-training question of benchmarks/data/consistency-questions.jsonl is answered
greedily (its prefill's logits give the router's features, runtime/engine/consistency_router.py)
and by 7 samples (seeds SEED..SEED+6, one shared prefill), every question in one continuous
batch. The label (`label_tier`) is the fewest votes whose answer is right, the vote being the
greedy answer plus 2 or 6 samples as `consistency="auto"` counts it: 1 when the greedy answer is
right or no vote is. A seeded logistic regression is fitted; its threshold on the probability
of tier 1 is chosen by 5-fold cross-validation on these questions: the threshold whose routed
answers are most often right while the votes per question stay within BUDGET (40% of fixed 7's
samples). The router is stored as JSON with the checkpoint's sha256, so `consistency="auto"`
finds it for any artifact compiled from that checkpoint. Answers are cached in
benchmarks/results/ (one file per sampling setting; benchmarks/sweep_consistency.py fills the
same files).

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
from common import RESULTS, pin_threads, print_table  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.runtime.engine.consistency import VoteOptions, normalise  # noqa: E402
from rbcompile.runtime.engine.vote_sampling import RoutedGroup, SampleGroup  # noqa: E402
from rbcompile.runtime.engine.consistency_router import TIERS, label_tier, train_router, vote_of  # noqa: E402
from rbcompile.runtime.engine.prefix_cache import PrefixCache  # noqa: E402
from rbcompile.runtime.engine.sampling import SamplingConfig  # noqa: E402

SEED = 1000
SETTING = "0.3"         # temperature[:kTOP_K][:pTOP_P] of the samples (chosen by the sweep)
SAMPLES = 7
FOLDS = 5
BUDGET = 0.4 * 7        # votes per question the router may spend on average
THRESHOLDS = [None] + [round(0.05 * i, 2) for i in range(1, 20)]


class Greedy:
    """A router that always picks the greedy tier (the `RoutedGroup` records the features)."""
    tiers = TIERS

    def tier(self, features) -> int:
        return 1


def parse_setting(text: str) -> SamplingConfig:
    """'0.5' -> temperature 0.5; '0.7:k5:p0.9' adds top-k 5 and top-p 0.9; seeded SEED."""
    temperature, *filters = text.split(":")
    top_k = next((int(part[1:]) for part in filters if part.startswith("k")), None)
    top_p = next((float(part[1:]) for part in filters if part.startswith("p")), None)
    return SamplingConfig(do_sample=True, temperature=float(temperature), top_k=top_k,
                          top_p=top_p, seed=SEED)


def label(model, rows: list[dict], setting: str, max_batch: int,
          form: questions.Format = questions.CLOZE) -> list[dict]:
    """Per question: the router's features, the greedy answer, the 7 samples' answers (in seed
    order) and the right answer, all normalised, and the tier label. Every question joins one
    continuous batch (a shared prefix cache holds the few-shot prefix)."""
    vote = VoteOptions(extract=form.extract, early_stop="off")
    engine = model.batch_engine(max_batch=max_batch, prefix_cache=PrefixCache())
    options = dict(max_new_tokens=form.max_new_tokens, sampling=parse_setting(setting),
                   stop=list(form.stop), options=vote)
    groups = []
    for row in rows:
        ids = model.tokenizer(form.prompt(row["question"]))["input_ids"]
        groups.append((RoutedGroup(engine, ids, Greedy(), **options),
                       SampleGroup(engine, ids, SAMPLES, **options)))
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
        done = sum(first.done and seven.done for first, seven in groups)
        print(f"  {setting}: labelled {done}/{len(rows)} ({time.perf_counter() - started:.0f} s)",
              end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    labelled = []
    for row, (first, seven) in zip(rows, groups):
        samples = [seven.voter.answer(seven.texts[request]) for request in seven.requests]
        answer, greedy_answer = normalise(row["answer"]), first.group.voter.answers[0]
        labelled.append({"id": row["id"], "kind": row["kind"], "features": first.features,
                         "greedy": greedy_answer, "samples": samples, "answer": answer,
                         "tier": label_tier(greedy_answer, samples, answer)})
    return labelled


def labels(model, setting: str, max_batch: int, relabel: bool = False,
           form: questions.Format = questions.CLOZE) -> list[dict]:
    """The training split of `form` labelled at `setting`, from the cache unless `relabel`."""
    source = model.manifest.get("source") or {}
    suffix = "" if form is questions.CLOZE else f"-{form.name}"
    cached = (RESULTS / f"consistency-labels-{source.get('sha256', 'unknown')[:16]}-"
              f"{setting.replace(':', '-')}{suffix}.json")
    if cached.is_file() and not relabel:
        return json.loads(cached.read_text())["labelled"]
    labelled = label(model, questions.load("train", form), setting, max_batch, form)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps({"source": source, "seed": SEED, "setting": setting,
                                  "labelled": labelled}))
    return labelled


def routed(items: list[dict], tiers: list[int]) -> tuple[float, float]:
    """(accuracy, mean votes per question) of answering each item with its tier's vote."""
    right = sum(vote_of(item["greedy"], item["samples"], tier) == item["answer"]
                for item, tier in zip(items, tiers))
    return right / len(items), sum(tiers) / len(items)


def cross_validate(labelled: list[dict], seed: int) -> dict:
    """Every question's tier under each threshold, from a router trained on the other folds."""
    order = list(range(len(labelled)))
    random.Random(seed).shuffle(order)
    chosen = {threshold: [0] * len(labelled) for threshold in THRESHOLDS}
    for fold in range(FOLDS):
        held = order[fold::FOLDS]
        fit = [labelled[i] for i in order if i not in set(held)]
        router = train_router([item["features"] for item in fit], [item["tier"] for item in fit],
                              seed=seed)
        for threshold in THRESHOLDS:
            router.threshold = threshold
            for i in held:
                chosen[threshold][i] = router.tier(labelled[i]["features"])
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", help="a decoder artifact with its tokenizer")
    parser.add_argument("-o", "--out", required=True, help="the router JSON to write")
    parser.add_argument("--setting", default=SETTING, help="the samples' temperature[:kK][:pP]")
    parser.add_argument("--seed", type=int, default=0, help="router training seed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=32, help="rows of the batch")
    parser.add_argument("--relabel", action="store_true", help="ignore cached labels")
    args = parser.parse_args()
    pin_threads(args.threads)
    model = rbcompile.load(args.artifact)
    labelled = labels(model, args.setting, args.max_batch, args.relabel)
    truth = [item["tier"] for item in labelled]
    counts = {tier: truth.count(tier) for tier in TIERS}
    chosen = cross_validate(labelled, args.seed)
    table, scores = [], {}
    for threshold, tiers in chosen.items():
        accuracy, votes = routed(labelled, tiers)
        tier_accuracy = sum(a == b for a, b in zip(tiers, truth)) / len(truth)
        scores[threshold] = (accuracy, votes, tier_accuracy)
        table.append({"threshold": "argmax" if threshold is None else threshold,
                      "accuracy": f"{100 * accuracy:.1f}", "votes": f"{votes:.2f}",
                      "tier": f"{100 * tier_accuracy:.1f}"})
    fits = [t for t in THRESHOLDS if scores[t][1] <= BUDGET]
    best = max(fits, key=lambda t: (scores[t][0], -scores[t][1]))
    print_table(table, [("threshold", "P(tier 1) threshold"), ("accuracy", "CV answer accuracy %"),
                        ("votes", "votes/question"), ("tier", "CV tier accuracy %")])
    baselines = {f"always {tier}": routed(labelled, [tier] * len(labelled))[0] for tier in TIERS}
    router = train_router([item["features"] for item in labelled], truth, seed=args.seed,
                          threshold=best, info={
                              "source_name": (model.manifest.get("source") or {}).get("name"),
                              "source_sha256": (model.manifest.get("source") or {}).get("sha256"),
                              "questions": len(labelled), "labels": counts,
                              "setting": args.setting, "sample_seed": SEED,
                              "cv_folds": FOLDS, "cv_answer_accuracy": round(scores[best][0], 4),
                              "cv_votes_per_question": round(scores[best][1], 4),
                              "cv_tier_accuracy": round(scores[best][2], 4),
                              "always_1_tier_accuracy": round(counts[1] / len(labelled), 4),
                              "answer_accuracy_always": {k: round(v, 4)
                                                         for k, v in baselines.items()}})
    router.save(args.out)
    print(f"labels {counts}; threshold {best}: cross-validated answer accuracy "
          f"{100 * scores[best][0]:.1f}% at {scores[best][1]:.2f} votes/question (always 1, 3, 7: "
          f"{', '.join(f'{100 * v:.1f}%' for v in baselines.values())}); tier accuracy "
          f"{100 * scores[best][2]:.1f}% (always 1: {100 * counts[1] / len(labelled):.1f}%); "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
