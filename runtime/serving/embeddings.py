"""/v1/embeddings: mean-pooled, L2-normalised hidden states of an encoder artifact, exact
repeats from the result cache."""
from __future__ import annotations

import base64

import torch

from rbcompile.artifact.quality import mean_pool
from rbcompile.runtime.control.result_cache import ResultCache
from rbcompile.runtime.serving.openai_api import EmbeddingRequest
from rbcompile.runtime.serving.service import Service


class EmbeddingEndpoints(Service):
    """The embeddings endpoint."""

    async def embed(self, body: EmbeddingRequest):
        """Mean-pooled, L2-normalised embeddings; inputs whose tokens (under the same artifact
        and budget) were embedded before come from the result cache, the others are computed
        together and cached."""
        self._check_model(body.model, "encoder", "/v1/embeddings", "/v1/completions")
        await self._relieve_memory()
        texts = [body.input] if isinstance(body.input, str) else body.input
        batch = await self._off_loop(self._encode, texts, "input")
        plan = f"budget={body.rbcompile.budget or 0:.4f}"
        keys = [ResultCache.key(self.fingerprint, plan, ids[mask.bool()])
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        hits = [self.results.get(key) if self.results is not None else None for key in keys]
        missing = [i for i, hit in enumerate(hits) if hit is None]
        if missing:
            rows = batch if len(missing) == len(texts) else \
                await self._off_loop(self._encode, [texts[i] for i in missing], "input")
            out = await self.worker.call(self.compiled, rows["input_ids"], rows["attention_mask"],
                                         budget=body.rbcompile.budget)
            pooled = mean_pool(out["last_hidden_state"].float().cpu(), rows["attention_mask"])
            for i, row in zip(missing, pooled):
                hits[i] = {"embedding": row}
                if self.results is not None:
                    self.results.put(keys[i], hits[i])
        tokens = int(batch["attention_mask"].sum())
        return {"object": "list", "model": self.name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": _encoded(hit["embedding"], body.encoding_format)}
                         for i, hit in enumerate(hits)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: torch.Tensor, encoding_format: str):
    if encoding_format == "base64":  # what the openai client asks for: little-endian float32
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
