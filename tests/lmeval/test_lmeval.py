"""lm-evaluation-harness against `rbcompile serve` (issue 47's must-hold): its `local-completions`
model with default settings (token-id prompts; loglikelihoods through `echo` and `logprobs`)
runs a multiple-choice and a generate-until task on real SmolLM2 weights with no failed request,
and scores what lm-eval's own `hf` model scores on the same checkpoint: accuracy identical,
each loglikelihood within 1e-4.

`make test-lmeval` (a venv of its own: lm-eval and its dependencies are not in CI's install).
The tasks are local (no hub): questions of benchmarks/data/consistency-questions.jsonl, the
capitals as four-way multiple choice, further capitals and calendar questions generated.
"""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from conftest import wait_for_health  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.artifact.models import resolve_checkpoint  # noqa: E402

QUESTIONS = Path(__file__).parents[2] / "benchmarks/data/consistency-questions.jsonl"
MC_TASK = """task: rbc_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""
GEN_TASK = """task: rbc_questions
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", ".", ","]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: [" "]
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    capitals = [row for row in rows if row["kind"] == "capital"][:24]
    answers, seeded = sorted({row["answer"] for row in capitals}), random.Random(0)
    folder = tmp_path_factory.mktemp("tasks")
    with open(folder / "capitals.jsonl", "w") as out:
        for row in capitals:
            choices = seeded.sample([a for a in answers if a != row["answer"]], 3) + [row["answer"]]
            seeded.shuffle(choices)
            out.write(json.dumps({"question": row["question"], "choices": [f" {c}" for c in choices],
                                  "label": choices.index(row["answer"])}) + "\n")
    with open(folder / "questions.jsonl", "w") as out:
        for row in [row for row in rows if row["kind"] in ("capital", "calendar")][24:56]:
            out.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    (folder / "capitals.yaml").write_text(MC_TASK.format(data=folder / "capitals.jsonl"))
    (folder / "questions.yaml").write_text(GEN_TASK.format(data=folder / "questions.jsonl"))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    artifact = rbcompile.compile("smollm2-135m").save(tmp_path_factory.mktemp("art") / "smol")
    port = 18000 + random.Random().randrange(1000)
    process = subprocess.Popen([sys.executable, "-m", "rbcompile", "serve", str(artifact),
                                "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", process, timeout=300)
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        process.terminate()
        process.wait(30)


def _evaluate(model: str, model_args: str, tasks: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args,
                                   tasks=["rbc_capitals", "rbc_questions"], log_samples=True,
                                   task_manager=TaskManager(include_path=str(tasks)))


def test_lm_eval_through_serve_scores_what_its_hf_model_scores(server, tasks):
    checkpoint = resolve_checkpoint("smollm2-135m")
    served = _evaluate("local-completions", f"model=smol,base_url={server},"
                       f"tokenizer={checkpoint},tokenizer_backend=huggingface,max_retries=1",
                       tasks)
    hf = _evaluate("hf", f"pretrained={checkpoint},dtype=float32,device=cpu", tasks)
    assert served["results"]["rbc_capitals"]["acc,none"] == hf["results"]["rbc_capitals"]["acc,none"]
    assert served["results"]["rbc_questions"]["exact_match,none"] == \
        hf["results"]["rbc_questions"]["exact_match,none"]
    differences = []
    for ours, theirs in zip(served["samples"]["rbc_capitals"], hf["samples"]["rbc_capitals"]):
        pairs = zip((resp[0] for resp in ours["resps"]), (resp[0] for resp in theirs["resps"]))
        for (ll, greedy), (expected, expected_greedy) in pairs:
            differences.append(abs(ll - expected))
            assert greedy == expected_greedy
    print(f"capitals acc {served['results']['rbc_capitals']['acc,none']:.3f} (hf "
          f"{hf['results']['rbc_capitals']['acc,none']:.3f}), {len(differences)} "
          f"loglikelihoods, largest difference {max(differences):.2e}; questions exact match "
          f"{served['results']['rbc_questions']['exact_match,none']:.3f} (hf "
          f"{hf['results']['rbc_questions']['exact_match,none']:.3f})")
    assert max(differences) <= 1e-4
    for ours, theirs in zip(served["samples"]["rbc_questions"], hf["samples"]["rbc_questions"]):
        assert ours["resps"] == theirs["resps"]
