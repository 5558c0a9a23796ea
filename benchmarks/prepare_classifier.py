"""Prepare the MR sentence-polarity task for minilm-l6 once, cached (never committed).

1. Fetch Debian's python3-pattern package (apt-get download), extract the 4,000 labelled MR
   movie-review sentences (polarity-en-pang&lee2.csv; personal-use corpus: kept in the cache).
2. Split them (seed 0) into 3,000 train and 1,000 test sentences: train.jsonl / test.jsonl;
   cut the 1,500 labelled full reviews of the same package into two-sentence passages
   (reviews.jsonl: distinct serving traffic for benchmarks/bench_tidal.py).
3. Fine-tune all-MiniLM-L6-v2 with a linear head over mean-pooled normalised embeddings
   (2 epochs, encoder lr 5e-5, head lr 1e-3, batch 32) and save the encoder as an HF checkpoint
   (`encoder/`) plus the head (`head.safetensors`), then report test accuracy.

    python benchmarks/prepare_classifier.py        # prints the cache folder when done
Then:
    rbcompile compile CACHE/encoder --calib CACHE/train.jsonl --calib-head CACHE/head.safetensors \
        --calib-samples 512 -o build/minilm-mr
    rbcompile curve build/minilm-mr --data CACHE/test.jsonl --classifier CACHE/head.safetensors
"""
from __future__ import annotations

import csv
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rbcompile.artifact.models import cache_dir, resolve_checkpoint
from rbcompile.artifact.quality import mean_pool

SENTENCES_CSV = "polarity-en-pang&lee2.csv"   # 4,000 labelled MR sentences
REVIEWS_CSV = "polarity-en-pang&lee1.csv"     # 1,500 labelled full reviews, one sentence a line
CORPORA_IN_PACKAGE = "usr/share/doc/python3-pattern/test/corpora"
REVIEW_PASSAGE_SENTENCES = 2


def fetch_corpora(root: Path) -> None:
    """Copy both polarity corpora from Debian's python3-pattern into `root` (once)."""
    if all((root / name).is_file() for name in (SENTENCES_CSV, REVIEWS_CSV)):
        return
    with tempfile.TemporaryDirectory() as tmp:
        print("fetching python3-pattern (Debian) for the MR corpora ...", file=sys.stderr)
        subprocess.run(["apt-get", "download", "python3-pattern"], cwd=tmp, check=True,
                       capture_output=True)
        deb = next(Path(tmp).glob("python3-pattern_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/out"], check=True)
        root.mkdir(parents=True, exist_ok=True)
        for name in (SENTENCES_CSV, REVIEWS_CSV):
            shutil.copy(Path(tmp) / "out" / CORPORA_IN_PACKAGE / name, root / name)


def read_polarity_csv(path: Path) -> list[tuple[str, int]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        return [(text, 1 if label == "1" else 0) for label, text in csv.reader(f)]


def write_review_passages(root: Path) -> int:
    """reviews.jsonl: every review cut into passages of two consecutive sentences, each with the
    review's label (distinct serving traffic for the tidal benchmark; none of it is trained on)."""
    passages = []
    for text, label in read_polarity_csv(root / REVIEWS_CSV):
        sentences = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
        for i in range(0, len(sentences), REVIEW_PASSAGE_SENTENCES):
            passages.append((" ".join(sentences[i:i + REVIEW_PASSAGE_SENTENCES]), label))
    with open(root / "reviews.jsonl", "w") as f:
        for text, label in passages:
            f.write(json.dumps({"text": text, "label": label}) + "\n")
    return len(passages)


def write_splits(root: Path, rows: list[tuple[str, int]], test_size: int = 1000):
    rows = list(rows)
    random.Random(0).shuffle(rows)
    splits = {"test": rows[:test_size], "train": rows[test_size:]}
    for name, part in splits.items():
        with open(root / f"{name}.jsonl", "w") as f:
            for text, label in part:
                f.write(json.dumps({"text": text, "label": label}) + "\n")
    return splits


def accuracy(encoder, head, tokenizer, rows, batch=64) -> float:
    correct = 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            texts, labels = zip(*rows[i:i + batch])
            enc = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True,
                            max_length=128)
            pooled = mean_pool(encoder(**enc).last_hidden_state, enc["attention_mask"])
            correct += int((head(pooled).argmax(-1) == torch.tensor(labels)).sum())
    return correct / len(rows)


def fine_tune(root: Path, splits, epochs=2, batch=32) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(0)
    base = resolve_checkpoint("minilm-l6")
    tokenizer = AutoTokenizer.from_pretrained(base)
    encoder = AutoModel.from_pretrained(base).train()
    head = torch.nn.Linear(encoder.config.hidden_size, 2)
    optimizer = torch.optim.AdamW([{"params": encoder.parameters(), "lr": 5e-5},
                                   {"params": head.parameters(), "lr": 1e-3}])
    train = list(splits["train"])
    steps = epochs * ((len(train) + batch - 1) // batch)
    start, step = time.time(), 0
    for epoch in range(epochs):
        random.Random(epoch).shuffle(train)
        for i in range(0, len(train), batch):
            texts, labels = zip(*train[i:i + batch])
            enc = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True,
                            max_length=128)
            pooled = mean_pool(encoder(**enc).last_hidden_state, enc["attention_mask"])
            loss = torch.nn.functional.cross_entropy(head(pooled) * 1.0, torch.tensor(labels))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 10 == 0 or step == steps:
                print(f"  step {step}/{steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)",
                      file=sys.stderr)
    encoder.eval()
    result = {"test_accuracy": accuracy(encoder, head, tokenizer, splits["test"]),
              "train_seconds": round(time.time() - start, 1), "epochs": epochs}
    tmp = Path(tempfile.mkdtemp(prefix=".encoder.", dir=root))
    encoder.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, root / "encoder")
    save_file({"weight": head.weight.detach().contiguous(), "bias": head.bias.detach().contiguous()},
              str(root / "head.safetensors"))
    (root / "prepare.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    torch.set_num_threads(2)
    root = cache_dir() / "mr"
    fetch_corpora(root)
    if not (root / "reviews.jsonl").is_file():
        print(f"wrote {write_review_passages(root)} review passages to reviews.jsonl", file=sys.stderr)
    sentences = [(" ".join(text.split()), label)
                 for text, label in read_polarity_csv(root / SENTENCES_CSV)]
    splits = write_splits(root, sentences) if not (root / "test.jsonl").is_file() else {
        name: [(r["text"], r["label"]) for r in map(json.loads, (root / f"{name}.jsonl").read_text().splitlines())]
        for name in ("train", "test")}
    if not (root / "encoder" / "config.json").is_file() or not (root / "head.safetensors").is_file():
        print(f"fine-tuning minilm-l6 on {len(splits['train'])} MR sentences (~5-10 min) ...",
              file=sys.stderr)
        result = fine_tune(root, splits)
    else:
        result = json.loads((root / "prepare.json").read_text())
    print(f"MR classifier ready in {root}: test accuracy {result['test_accuracy']:.4f} "
          f"({len(splits['test'])} held-out sentences)")


if __name__ == "__main__":
    main()
