"""The state the HTTP endpoints share (runtime/serving/completions.py, runtime/serving/embeddings.py)."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable

import torch
from jinja2 import TemplateError

from rbcompile.errors import UserError, first_line
from rbcompile.runtime.control.admission import Watermarks
from rbcompile.runtime.control.result_cache import ResultCache, fingerprint
from rbcompile.runtime.engine.grammar import Constraint, GrammarCompiler
from rbcompile.runtime.serving.limits import ClientChoices, ServeLimits
from rbcompile.runtime.serving.logprob_format import TokenTexts
from rbcompile.runtime.serving.model_worker import ModelWorker
from rbcompile.runtime.serving.openai_api import ApiError
from rbcompile.runtime.serving.serve_metrics import Metrics


class Service:
    """What the endpoints share on one compiled model: its tokenizer, the model thread, the
    limits, metrics and memory watermarks, and tokenising off the event loop."""

    def __init__(self, compiled, limits: ServeLimits, metrics: Metrics, worker: ModelWorker,
                 watermarks: Watermarks, memory: Callable[[], float], results: ResultCache | None):
        self.compiled, self.limits, self.metrics, self.worker = compiled, limits, metrics, worker
        self.watermarks, self.memory, self.results = watermarks, memory, results
        self.fingerprint = fingerprint(compiled)
        self.name = compiled.manifest["source"]["name"]
        self.names = {self.name}   # the ids a request may name (`serve_as` adds the served one)
        self.created = int(time.time())
        self.tokenizer = compiled.tokenizer
        self.token_texts = TokenTexts(self.tokenizer)   # logprobs' token strings
        self._grammars: GrammarCompiler | None = None
        if self.tokenizer.pad_token is None:  # left padding is masked: any token will do
            self.tokenizer.pad_token = self.tokenizer.eos_token
        eos = compiled.hf_config.get("eos_token_id")
        self.eos = set([eos] if isinstance(eos, int) else eos or [])
        # one thread: the fast tokenizer's padding settings are not safe to change concurrently
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rbcompile-tokenize")
        self.clients = ClientChoices(limits.max_client_choices)

    def _check_model(self, model: str | None, family: str, endpoint: str, other: str) -> None:
        if self.compiled.family != family:
            raise ApiError(400, f"{endpoint} serves {family} artifacts, not "
                           f"{self.compiled.family}s: use {other}")
        if model is not None and model not in self.names:
            raise ApiError(400, f"unknown model '{model}': this server serves '{self.name}'", "model")

    def serve_as(self, name: str | None) -> None:
        """Serve the model as `name` (None: its source checkpoint's name), which stays
        accepted too."""
        if name is not None:
            self.name = name
            self.names.add(name)

    def _compile(self, schema: dict, param: str) -> Constraint:
        """Structured output's constraint of a JSON schema (the compiler for this tokenizer
        built on first use; off the event loop: `_off_loop`); a schema it cannot enforce is a
        400 naming `param`."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer)
        try:
            return self._grammars.json_schema(schema)
        except UserError as error:
            raise ApiError(400, str(error), param) from None

    def _chat_text(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The chat template's text of `messages` (`ChatMessage`s), the assistant's turn open
        (with `add_generation_prompt`)."""
        if self.tokenizer.chat_template is None:
            raise ApiError(400, f"model '{self.name}' has no chat template: use /v1/completions")
        try:
            return self.tokenizer.apply_chat_template([m.as_template() for m in messages],
                                                      add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except TemplateError as error:
            raise ApiError(400, f"the chat template refused the messages: {first_line(error)}",
                           "messages") from error

    def tokenize(self, prompt: str | None, messages: list | None, add_special_tokens: bool,
                 add_generation_prompt: bool = True) -> dict:
        """vLLM's /tokenize: a prompt's token ids (or the chat template's of `messages`)."""
        if (prompt is None) == (messages is None):
            raise ApiError(400, "give 'prompt' or 'messages'", "prompt")
        if messages is not None:
            prompt, add_special_tokens = self._chat_text(messages, add_generation_prompt), False
        tokens = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        return {"count": len(tokens), "max_model_len": self.compiled.max_positions,
                "tokens": tokens}

    def detokenize(self, tokens: list[int]) -> dict:
        """vLLM's /detokenize: token ids' text (ids checked against the vocabulary)."""
        self._check_vocabulary(tokens, "tokens")
        return {"prompt": self.tokenizer.decode(tokens)}

    def _encode(self, texts: list[str], param: str, add_special_tokens: bool = True):
        """The texts as one batch (decoders left-padded for generate, encoders right-padded so
        positions start at 0); refused when empty or longer than the model."""
        if not texts:
            raise ApiError(400, f"'{param}' is an empty list", param)
        side = "left" if self.compiled.family == "decoder" else "right"
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side=side,
                               add_special_tokens=add_special_tokens)
        self._check_length(int(batch["attention_mask"].sum(1).max()), param)
        return batch

    def _token_batch(self, prompts: list[list[int]], param: str) -> dict:
        """Prompts given as token ids, as `_encode`'s batch (left-padded); every id checked
        against the vocabulary."""
        if not prompts or not all(prompts):
            raise ApiError(400, f"'{param}' holds an empty prompt", param)
        for prompt in prompts:
            self._check_vocabulary(prompt, param)
        longest = max(map(len, prompts))
        self._check_length(longest, param)
        pad = self.tokenizer.pad_token_id
        return {"input_ids": torch.tensor([[pad] * (longest - len(p)) + p for p in prompts]),
                "attention_mask": torch.tensor([[0] * (longest - len(p)) + [1] * len(p)
                                                for p in prompts])}

    def _check_vocabulary(self, tokens: list[int], param: str) -> None:
        vocab = self.compiled.hf_config["vocab_size"]
        if (bad := next((t for t in tokens if not 0 <= t < vocab), None)) is not None:
            raise ApiError(400, f"token id {bad} is not in the vocabulary (0 to {vocab - 1})",
                           param)

    def _check_length(self, longest: int, param: str) -> None:
        most = self.compiled.max_positions - (self.compiled.family == "decoder")  # room for 1 token
        if longest > most:
            raise ApiError(400, f"a prompt has {longest} tokens; at most {most} fit the model's "
                           f"{self.compiled.max_positions} positions", param)


    async def _off_loop(self, fn, *args):
        """`fn(*args)` on the tokenising pool: a long prompt never stalls the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args))

    async def _relieve_memory(self) -> float:
        """The memory fraction in use now; from the shrink watermark on, the prefix cache (set on
        the model thread, its owner) and the result cache hold half their capacity."""
        memory, engine = self.memory(), self.worker.engine
        self.metrics.watermark.set(self.watermarks.level(memory))
        pressed = memory >= self.watermarks.shrink
        cache = engine.prefix_cache if engine is not None else None
        if cache is not None:
            limit = cache.capacity_bytes // 2 if pressed else None
            if cache.limit_bytes != limit:
                await self.worker.call(cache.set_limit, limit)
        if self.results is not None:
            if pressed:
                self.results.limit(self.results.max_bytes // 2)
            else:
                self.results.restore()
        return memory
