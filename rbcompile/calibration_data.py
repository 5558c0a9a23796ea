"""Calibration text: where it comes from and how it becomes token batches.

A source is a UTF-8 text file, a JSONL file (one JSON string, or an object with a "text" field,
per line), or "default" (the bundled Emma excerpt in rbcompile/data). Truncation is documented:
decoders read the texts as one token stream cut into windows of `seq_len` tokens; encoders read
each paragraph (texts split at blank lines) as one sequence, truncated to `seq_len` tokens.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from rbcompile.errors import UserError, check_unicode

DEFAULT_SOURCE = "default"
DATA = Path(__file__).parent / "data"   # the texts and files rbcompile ships
DEFAULT_CORPUS = DATA / "calibration-emma.txt"


def load_texts(source: str | Path) -> list[str]:
    """The texts of a calibration source (see module docstring)."""
    return load_labelled(source)[0]


def load_labelled(source: str | Path) -> tuple[list[str], list[int] | None]:
    """(texts, labels): labels when every JSONL object has an integer "label", else None."""
    path = DEFAULT_CORPUS if str(source) == DEFAULT_SOURCE else Path(source)
    if not path.is_file():
        raise UserError(f"calibration source not found: {source}")
    try:
        raw = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"calibration source {path} is not UTF-8 text (byte {exc.start})") from None
    labels: list = []
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{number}: not JSON ({exc.msg})") from None
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise UserError(f'{path}:{number}: expected a string or an object with "text"')
            if text.strip():
                texts.append(check_unicode(text, f"{path}:{number}: the text"))
                labels.append(item.get("label") if isinstance(item, dict) else None)
    else:
        texts = [raw] if raw.strip() else []
    if not texts:
        raise UserError(f"calibration source {path} has no text")
    labelled = all(isinstance(x, int) and not isinstance(x, bool) for x in labels) and labels
    return texts, (labels if labelled else None)


@dataclass
class Batches:
    """Token batches for calibration and for held-out verification."""
    calibration: list[tuple[torch.Tensor, torch.Tensor]]
    heldout: list[tuple[torch.Tensor, torch.Tensor]]
    calibration_labels: list[torch.Tensor] | None = None  # per batch, for a task loss
    heldout_labels: list[torch.Tensor] | None = None

    def to(self, device) -> "Batches":
        """The same batches and labels on `device` (the model's)."""
        def pairs(batches):
            return [(ids.to(device), mask.to(device)) for ids, mask in batches]

        def labels(per_batch):
            return None if per_batch is None else [tensor.to(device) for tensor in per_batch]
        return Batches(pairs(self.calibration), pairs(self.heldout),
                       labels(self.calibration_labels), labels(self.heldout_labels))


def _batched(ids: torch.Tensor, mask: torch.Tensor, batch_size: int):
    return [(ids[i:i + batch_size], mask[i:i + batch_size]) for i in range(0, len(ids), batch_size)]


def decoder_windows(tokenizer, texts: list[str], seq_len: int, windows: int) -> torch.Tensor:
    """[n, seq_len] consecutive token windows of the texts joined by EOS; n <= windows. When the
    tokenizer starts every sequence with BOS (Gemma's, Llama 3's), so does each window (then
    seq_len - 1 text tokens): such models read a sequence without it as noise."""
    first = tokenizer("")["input_ids"][:1]
    prefix = first if tokenizer.bos_token_id is not None and first == [tokenizer.bos_token_id] else []
    body = seq_len - len(prefix)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        if len(stream) >= body * windows:
            break
    count = min(windows, len(stream) // body) if body > 0 else 0
    if count == 0:
        raise UserError(f"calibration text has {len(stream)} tokens, fewer than one window of "
                        f"{seq_len}")
    return torch.tensor([prefix + stream[i * body:(i + 1) * body] for i in range(count)])


def paragraphs(text: str) -> list[str]:
    """The paragraphs of a text (split at blank lines), each on one line."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def make_batches(tokenizer, texts: list[str], family: str, *, seq_len: int, samples: int,
                 batch_size: int, heldout_fraction: float = 0.25, labels=None) -> Batches:
    """Split the source into calibration and held-out batches (held-out = the last samples).
    Encoders with `labels` (one per text) read each text as one sample and keep its label."""
    if family == "decoder":
        ids = decoder_windows(tokenizer, texts, seq_len, samples)
        mask = torch.ones_like(ids)
    else:
        if labels is not None:
            sentences, labels = texts[:samples], torch.tensor(labels[:samples])
        else:
            sentences = [p for text in texts for p in paragraphs(text)][:samples]
        enc = tokenizer(sentences, return_tensors="pt", padding=True, truncation=True,
                        max_length=seq_len)
        ids, mask = enc["input_ids"], enc["attention_mask"]
    if len(ids) < 2:
        raise UserError("calibration source gives fewer than 2 samples; give more text")
    heldout = max(1, int(round(len(ids) * heldout_fraction)))
    split = len(ids) - heldout
    batches = Batches(_batched(ids[:split], mask[:split], batch_size),
                      _batched(ids[split:], mask[split:], batch_size))
    if family == "encoder" and labels is not None:
        batches.calibration_labels = list(labels[:split].split(batch_size))
        batches.heldout_labels = list(labels[split:].split(batch_size))
    return batches
