"""What constrained decoding and penalties cost (issue 47): the batch engine in-process on the
artifact, the same chat prompts decoded free, under a JSON schema (runtime/engine/grammar.py,
llguidance) and with penalties (runtime/engine/penalties.py: presence 0.5, frequency 0.5,
repetition 1.1), interleaved per prompt (rotated order), greedy, one request at a time:
  tokens/s      new tokens / the request's engine time
  mask ms/tok   llguidance's mask computation per emitted token (`Constraint.seconds`)
and whether each constrained output parses as JSON the schema's keys fill.

    python benchmarks/bench_structured.py [build/smollm2-135m] [--prompts 6] [--new-tokens 64]
        [--speculate off] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import load_executed, print_table, write_json  # noqa: E402

from rbcompile.runtime.engine.grammar import GrammarCompiler  # noqa: E402
from rbcompile.runtime.engine.penalties import Penalties  # noqa: E402
from rbcompile.runtime.engine.requests import EngineRequest  # noqa: E402
from rbcompile.runtime.engine.sampling import SamplingConfig  # noqa: E402

KINDS = ("free", "schema", "penalized")
PENALTIES = Penalties(presence=0.5, frequency=0.5, repetition=1.1)

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "city", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "city": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "hobbies": {"type": "array", "maxItems": 3,
                                     "items": {"type": "string", "maxLength": 16}}}}
SUBJECTS = ["a baker in Lyon", "a retired sailor", "a student of music", "a nurse in Oslo",
            "a farmer who keeps bees", "a young chess player", "a painter of harbours",
            "a librarian in Cairo"]


def decode(model, prompt: list[int], new_tokens: int, speculate: str, grammar,
           penalties: Penalties | None = None) -> dict:
    engine = model.batch_engine(max_batch=1)
    request = engine.submit(EngineRequest(prompt, new_tokens, SamplingConfig(penalties=penalties),
                                          speculate=speculate, grammar=grammar))
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - started
    tokens = len(request.tokens)
    return {"tokens": tokens, "tokens_per_second": tokens / seconds,
            "mask_ms_per_token": 1e3 * grammar.seconds / tokens if grammar else 0.0,
            "text": model.tokenizer.decode(request.tokens, skip_special_tokens=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="build/smollm2-135m")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--speculate", default="off")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="default benchmarks/results/bench_structured.json")
    args = parser.parse_args()
    model = load_executed(args.artifact, args.threads)
    compiler = GrammarCompiler(model.tokenizer)
    texts = [model.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {subject} as JSON with name, city, age and "
                                     f"hobbies."}], add_generation_prompt=True, tokenize=False)
        for subject in SUBJECTS[:args.prompts]]
    prompts = [model.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    decode(model, prompts[0], 8, args.speculate, None)   # warm-up
    rows = []
    for index, prompt in enumerate(prompts):
        order = KINDS[index % 3:] + KINDS[:index % 3]
        for kind in order:
            grammar = compiler.json_schema(SCHEMA) if kind == "schema" else None
            result = decode(model, prompt, args.new_tokens, args.speculate, grammar,
                            PENALTIES if kind == "penalized" else None)
            if grammar is not None:
                try:
                    result["valid"] = set(json.loads(result["text"])) == set(SCHEMA["required"])
                except json.JSONDecodeError:
                    result["valid"] = False
            rows.append({"prompt": index, "kind": kind, **result})
    summary = []
    for kind in KINDS:
        mine = [row for row in rows if row["kind"] == kind]
        summary.append({"kind": kind, "tps": statistics.median(r["tokens_per_second"] for r in mine),
                        "mask": statistics.median(r["mask_ms_per_token"] for r in mine),
                        "valid": sum(r.get("valid", False) for r in mine) if kind == "schema"
                        else "-"})
    print_table([{**s, "tps": f"{s['tps']:.1f}", "mask": f"{s['mask']:.2f}"} for s in summary],
                [("kind", "decoding"), ("tps", "tokens/s (median)"), ("mask", "mask ms/token"),
                 ("valid", f"valid JSON of {len(prompts)}")])
    path = write_json("bench_structured", {"artifact": args.artifact, "speculate": args.speculate,
                                           "new_tokens": args.new_tokens, "rows": rows,
                                           "summary": summary}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
