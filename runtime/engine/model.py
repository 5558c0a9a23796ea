"""The run side's model: an artifact (`CompiledModel`) that decodes with the engine. What
`rbcompile.load` and `rbcompile.compile` return; the artifact itself knows no engine."""
from __future__ import annotations

import math
from dataclasses import fields
from functools import partial

import torch

from rbcompile.artifact.compiled import SELF_DRAFT_BUDGET, CompiledModel
from rbcompile.artifact.executors import check_precision, level_loss, level_step, stored_precisions
from rbcompile.artifact.loading import load_artifact
from rbcompile.errors import UserError
from rbcompile.runtime.engine.core import BatchEngine
from rbcompile.runtime.engine.drafters import LightDrafter, draft_speedup
from rbcompile.runtime.engine.generation import generate
from rbcompile.runtime.engine.generation import stream as stream_tokens
from rbcompile.runtime.engine.requests import FIRST_DRAFT_LENGTH, EngineConfig
from rbcompile.runtime.engine.sampling import SamplingConfig
from rbcompile.runtime.engine.vote_sampling import generate_voted
from rbcompile.runtime.engine.weight_levels import WeightLevel, WeightLevels

# a lower weight level's drafts agree with the full path's where it is unsure too, so it drafts
# to the step's limit (docs/executor.md, "One thread pool, and quantized drafts")
QUANT_DRAFT_THRESHOLD = 0.0


class Model(CompiledModel):
    """A compiled artifact with generation: `generate` (the engine on one batch of requests),
    `batch_engine` (a continuous-batching engine for serving) and the light path it drafts
    with."""

    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop=None,
                 budget: float | None = None, speculate: str = "off",
                 draft_budget: float | None = None, stream: bool = False,
                 consistency="off", vote=None):
        """Generate with the artifact's KV-cached decoder (runtime/engine/generation.py): a
        `GenerationResult` (new tokens per row, full sequences, texts cut at a stop string,
        stats: tokens/s, drafted, accepted), or with `stream=True` an iterator of (row, token)
        as tokens are accepted (its `.result()` afterwards).

        `budget` runs the MLPs of that budget's plan (attention always runs: it writes the
        cache), under `guard` (its decoder's measured loss). `speculate`: "off", "ngram"
        (prompt lookup), "self" (drafts from the light path of `draft_budget`, verified by the
        full path), "quant" (drafts from the decoder at a lower weight level, `quant_drafter`;
        needs the onnxruntime executor), "auto" (picks per request from live acceptance, off
        when drafting does not pay). `draft_budget` defaults to the plan
        calibration chose (`decoder.draft`; "auto" leaves self-drafting out when calibration
        found that no plan pays), else SELF_DRAFT_BUDGET. Greedy output is the full path's
        token for token whatever the drafter; sampling keeps its distribution.

        `consistency`: "off", or 1, 3 or 7 samples of one prompt voted on (self-consistency,
        runtime/engine/vote_sampling.py: the samples share the prompt's K/V, sample i seeded seed + i,
        early stop once the vote is decided), or "auto": as many as the complexity router
        trained for this checkpoint picks from the prompt and its first-token logits
        (runtime/engine/consistency_router.py). A `ConsistencyResult` (the voted answer, its votes,
        the samples, stats); `vote` (`VoteOptions`) sets answer extraction, the semantic
        tie-break, the early stop and the router."""
        if self.decoder is None:
            raise UserError("generate needs a decoder artifact with a KV-cached decoder "
                            "(recompile it with this rbcompile)")
        sampling = SamplingConfig(do_sample, temperature, top_k, top_p, seed)
        if consistency != "off" or vote is not None:
            if consistency == "off":
                raise UserError("vote options need consistency=1, 3, 7 or 'auto'")
            return generate_voted(self, input_ids, attention_mask, consistency, vote=vote,
                                  speculate=speculate, stream=stream,
                                  max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                  budget=budget)
        gates = self.guarded_decoder_gates(budget)
        light = self.light_drafter(draft_budget) if speculate in ("self", "auto") else None
        quant = self.quant_drafter() if speculate in ("quant", "auto") else None
        if speculate == "auto" and not light.in_auto and quant is None:
            speculate = "ngram"
        eos = self.hf_config.get("eos_token_id")
        run = stream_tokens if stream else generate
        return run(partial(self.decoder, gates=gates), torch.as_tensor(input_ids),
                   attention_mask, shape=self.decoder.shape, max_new_tokens=max_new_tokens,
                   sampling=sampling, eos_token_ids=() if eos is None else eos, stop=stop,
                   decode=self.tokenizer.decode if stop else None, speculate=speculate,
                   draft_step=light and light.step, draft_cost=light.cost if light else 1.0,
                   quant=quant, cache_pool=self.decoder.cache_pool,
                   unpadded_prefill=self.decoder.unpadded_prefill)

    def light_drafter(self, draft_budget: float | None = None) -> LightDrafter:
        """The light path that `speculate="self"` drafts with: the plan of `draft_budget`, by
        default the one calibration chose (`decoder.draft`), else SELF_DRAFT_BUDGET's. "auto"
        leaves it out where calibration found that no light plan pays."""
        chosen, in_auto = self.decoder.draft, True
        if draft_budget is None and chosen is not None:
            draft_budget = chosen["budget"]
            in_auto = draft_budget is not None
        measured = draft_budget is not None and draft_budget == (chosen or {}).get("budget")
        gates = self.decoder_gates(SELF_DRAFT_BUDGET if draft_budget is None else draft_budget)
        cost = 0.0 if measured or gates is None else self.decoder.cost(gates)
        return LightDrafter(partial(self.decoder, gates=gates), cost=cost, in_auto=in_auto)

    def quant_drafter(self, drafts: int = FIRST_DRAFT_LENGTH) -> LightDrafter | None:
        """The drafter of `speculate="quant"`: the decoder at the lower weight level whose
        measured batch-1 speedup and top-1 agreement (compile's `precisions`) promise the most
        tokens per step time against the level it decodes at (`drafters.draft_speedup`). None
        without the onnxruntime executor or a level that would pay."""
        if self.decoder is None or self.decoder.executor is None:
            return None
        levels = stored_precisions(self.manifest)
        decoding = levels.get(self.decoder.weights)
        base = (decoding and decoding.speedup) or 1.0
        best, best_speedup = None, 1.0
        for level, measured in levels.items():
            agreement = measured.heldout.get("top1_agreement")
            if level == self.decoder.weights or not measured.speedup or agreement is None:
                continue
            speedup = draft_speedup(agreement, base / measured.speedup, drafts)
            if speedup > best_speedup:
                best, best_speedup = level, speedup
        if best is None:
            return None
        # cost 0: its measurements promise it pays, so `auto` may try it at once
        return LightDrafter(level_step(self, best), threshold=QUANT_DRAFT_THRESHOLD, cost=0.0,
                            level=best)

    def weight_level(self, name: str) -> WeightLevel:
        """Weight level `name` as requests of this artifact's engine may ask it
        (`EngineRequest.weights`): its step and measured loss. A one-line UserError where the
        quality guard refuses it (`check_precision`) or the onnxruntime executor is not in use."""
        if self.decoder.executor is None and name != self.decoder.weights:
            raise UserError(f"{name} weights need the onnxruntime executor (--executor)")
        check_precision(self.manifest, name, self.guard, self.decoder.prefill)
        loss = level_loss(self.manifest, name, self.decoder.prefill)
        loss = math.inf if loss is None else loss
        step = None if name == self.decoder.weights else level_step(self, name)
        return WeightLevel(name, step, loss)

    def batch_engine(self, max_batch: int = 16, **options):
        """A continuous-batching engine on the decoder (runtime/engine/core.py), for serving;
        `options` are `EngineConfig`'s fields (`batch_buckets` defaults to whether the decoder
        runs CUDA graphs, `unpadded_prefill` to whether the decoder takes prefills without a
        mask) and BatchEngine's `wake` and `prefix_cache`."""
        if self.decoder is None:
            raise UserError("continuous batching needs a decoder artifact with a KV-cached decoder")
        eos = self.hf_config.get("eos_token_id")
        decode = self.tokenizer.decode if self.tokenizer_dir is not None else None
        options.setdefault("batch_buckets", self.decoder.graphs is not None)
        options.setdefault("unpadded_prefill", self.decoder.unpadded_prefill)
        names = {field.name for field in fields(EngineConfig)}
        config = EngineConfig(max_batch, **{k: v for k, v in options.items() if k in names})
        return BatchEngine(self.decoder, self.decoder.shape, config,
                           gates_for_budget=self.guarded_decoder_gates,
                           eos_token_ids=() if eos is None else eos, decode=decode,
                           release_cache=self.decoder.forget_cache, light=self.light_drafter(),
                           quant=self.quant_drafter(),
                           levels=WeightLevels(self.weight_level(self.decoder.weights),
                                               self.weight_level),
                           **{k: v for k, v in options.items() if k not in names})


def load(path, device=None, dtype=None) -> Model:
    """Load an artifact folder (checked, see artifact/loading.py) as a `Model`."""
    return load_artifact(path, device, dtype, model_class=Model)
