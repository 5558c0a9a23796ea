"""Choose self-consistency's sampling on the router-training split (issue 17): for each sampling
setting, the greedy answer and 7 samples of every training question of
benchmarks/data/consistency-questions.jsonl, and the accuracy of votes over them: samples only
(fixed 3 / fixed 7) and the greedy answer plus 2 / 6 samples (what `consistency="auto"` counts).
Never run on the test split: it is for choosing.

    python benchmarks/sweep_consistency.py build/smollm2-135m [--settings 0.3 0.5 0.7:p0.8]
        [--format cloze|chain]

`--format chain` asks consistency_questions.CHAIN's training questions instead (answers after
a short reasoning chain, up to 48 tokens), to see whether votes over chains beat the greedy one.

A setting is TEMPERATURE[:kK][:pP] (top-k K, top-p P). The answers are labelled and cached by
train_consistency_router.py's `labels` (so training at a swept setting reuses them); the
table goes to benchmarks/results/consistency-sweep.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import consistency_questions as questions  # noqa: E402
from common import pin_threads, print_table, write_json  # noqa: E402
from train_consistency_router import SAMPLES, labels, vote_of  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.runtime.engine.consistency import tally  # noqa: E402


def accuracies(labelled: list[dict]) -> dict[str, float]:
    """Share of right answers: greedy, one sample (mean over the 7), votes of 3 and 7 samples,
    the greedy answer plus 2 and 6 samples, and the right answer among the 8 (an upper bound)."""
    def share(answers):
        return sum(a == item["answer"] for a, item in zip(answers, labelled)) / len(labelled)

    def samples_vote(k):
        return [(tally(item["samples"][:k]) or [None])[0] for item in labelled]
    return {"greedy": share([item["greedy"] for item in labelled]),
            "sample": sum(share([item["samples"][i] for item in labelled])
                          for i in range(SAMPLES)) / SAMPLES,
            "vote 3": share([c and c.answer for c in samples_vote(3)]),
            "vote 7": share([c and c.answer for c in samples_vote(7)]),
            "greedy + 2": share([vote_of(item["greedy"], item["samples"], 3) for item in labelled]),
            "greedy + 6": share([vote_of(item["greedy"], item["samples"], 7) for item in labelled]),
            "right in 8": share([item["answer"] if item["answer"] in [item["greedy"],
                                                                      *item["samples"]] else None
                                 for item in labelled])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="build/smollm2-135m")
    parser.add_argument("--settings", nargs="+", default=["0.3", "0.5", "0.7"])
    parser.add_argument("--format", choices=["cloze", "chain"], default="cloze",
                        help="the question set (consistency_questions.CLOZE or CHAIN)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--json", help="output path (default "
                        "benchmarks/results/consistency-sweep[-chain].json)")
    args = parser.parse_args()
    pin_threads(args.threads)
    form = questions.CHAIN if args.format == "chain" else questions.CLOZE
    model = rbcompile.load(args.artifact)
    labelled = {setting: labels(model, setting, args.max_batch, form=form)
                for setting in args.settings}
    results = {setting: accuracies(items) for setting, items in labelled.items()}
    by_kind = {setting: {kind: accuracies([item for item in items if item["kind"] == kind])
                         for kind in sorted({item["kind"] for item in items})}
               for setting, items in labelled.items()}
    columns = list(next(iter(results.values())))
    print_table([{"setting": setting, **{name: f"{100 * value:.1f}" for name, value in row.items()}}
                 for setting, row in results.items()],
                [("setting", "sampling")] + [(name, f"{name} %") for name in columns])
    name = "consistency-sweep" + ("" if form is questions.CLOZE else f"-{form.name}")
    path = write_json(name, {"artifact": args.artifact, "split": "train", "format": form.name,
                             "questions": len(next(iter(labelled.values()))),
                             "settings": results, "by_kind": by_kind}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
