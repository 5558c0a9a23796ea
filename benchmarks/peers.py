"""The engines CPU users pick instead of rbcompile, as `bench_generate.py` contenders (issue 45).

- "ORT GenAI fp32": ONNX Runtime GenAI on the same HF folder, converted once (offline, ~15 s)
  by its model builder to build/peers/ort-genai-fp32, greedy, the same thread count. Batches
  are left-padded with its pad token, as its API takes them.

Peers are installed by `make bench-peers` (a venv of their own, .venv-peers); where a peer's
package is missing its contender is left out and the reason printed.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

BUILD = Path(__file__).resolve().parent.parent / "build" / "peers"
GENAI = "ORT GenAI fp32"
PEERS = (GENAI,)


def missing_reason(name: str) -> str | None:
    """Why peer `name` cannot run here (None: it can)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return f"{name}: onnxruntime-genai is not installed (make bench-peers)"
    return None


def genai_folder(hf_folder: Path, threads: int) -> Path:
    """The ORT GenAI model of `hf_folder` (built once), set to run on `threads` threads."""
    target = BUILD / "ort-genai-fp32"
    stamp = target / "source.txt"
    if not stamp.exists() or stamp.read_text() != str(hf_folder):
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder",
                        "-i", str(hf_folder), "-o", str(target), "-p", "fp32", "-e", "cpu",
                        "-c", str(BUILD / "cache")], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        stamp.write_text(str(hf_folder))
    config_path = target / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"].update(
        intra_op_num_threads=threads, inter_op_num_threads=1)
    config_path.write_text(json.dumps(config, indent=2))
    return target


def genai_contender(hf_folder: Path, threads: int):
    """make(new_tokens) -> fn(input_ids, attention_mask) -> (new tokens per row, None), greedy,
    for ORT GenAI (one model loaded for every `make`)."""
    import onnxruntime_genai as og

    folder = genai_folder(hf_folder, threads)
    model = og.Model(str(folder))
    pad = json.loads((folder / "genai_config.json").read_text())["model"]["pad_token_id"]
    return lambda new_tokens: functools.partial(_genai_run, og, model, pad, new_tokens)


def _genai_run(og, model, pad: int, new_tokens: int, input_ids, attention_mask):
    rows = [row[keep.bool()].tolist() for row, keep in zip(input_ids, attention_mask)]
    width = max(len(row) for row in rows)
    batch = np.array([[pad] * (width - len(row)) + row for row in rows], dtype=np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + new_tokens, do_sample=False,
                              batch_size=len(rows))
    generator = og.Generator(model, params)
    generator.append_tokens(batch)
    steps = []
    while not generator.is_done():
        generator.generate_next_token()
        steps.append(generator.get_next_tokens().tolist())
    return [list(row) for row in zip(*steps)], None


def peer_contenders(names: list[str], hf_folder: Path, threads: int) -> dict:
    """name -> make(new_tokens) -> contender, for each peer of `names` that can run here."""
    contenders = {}
    for name in names:
        reason = missing_reason(name)
        if reason:
            print(f"  left out: {reason}")
            continue
        contenders[name] = genai_contender(hf_folder, threads)
    return contenders
