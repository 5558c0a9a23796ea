"""An OpenAI-compatible HTTP server for a compiled artifact (FastAPI; `rbcompile serve`).

`create_app(compiled)` serves `POST /v1/completions` and `POST /v1/chat/completions` (decoders:
the KV-cached `generate`, streamed as server-sent events with `stream: true`; chat where the
tokenizer has a chat template), `POST /v1/embeddings` (encoders: mean-pooled, L2-normalised hidden
states), `GET /v1/models`, `GET /health` and `GET /metrics` (Prometheus text).

Both generation endpoints take one path (`_Service._respond`): the prompts' token batch, each
row repeated `n` times (choice `prompt_index * n + k`), goes through `generate` once, and a
`ChoiceFormat` per endpoint shapes its choices and stream chunks. A `seed` seeds the one
generator the whole batch draws from, row after row: a request with a seed repeats exactly, and
its n choices differ because each row draws its own numbers from that generator (the same prompt
and seed in a request with another batch can give other text). Requests run through the model
one at a time on a single worker thread, so the event loop stays free; a streaming client that
disconnects stops its generation at the next token. Errors are the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`, one line.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable, Literal, Protocol

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from rbcompile.engine import EngineRequest
from rbcompile.errors import UserError, check_unicode, first_line
from rbcompile.generation import SPECULATE_MODES
from rbcompile.prefix_cache import PrefixCache
from rbcompile.runtime.admission import QOS_CLASSES, Overloaded, Watermarks, admit
from rbcompile.guard import DECODER, GuardedPlan, guard_budget
from rbcompile.runtime.decode_control import DecodeController
from rbcompile.runtime.quality_loop import QualityLoop, QualityLoopConfig
from rbcompile.runtime.quality_metrics import QualityCollector
from rbcompile.runtime.result_cache import ResultCache, fingerprint
from rbcompile.sampling import SamplingConfig
from rbcompile.quality import mean_pool

log = logging.getLogger("rbcompile.serve")
PUBLIC_PATHS = ("/health",)
RETRY_AFTER_S = 1   # what a 503 (overloaded) tells the client to wait
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health",
             "/metrics")


@dataclass(frozen=True)
class ServeLimits:
    """Per-request limits: body bytes, new tokens per completion (also capped by the positions
    the prompt leaves), and choices per prompt (`n`)."""
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 1024
    max_n: int = 8
    max_queue: int = 1024          # completions waiting for a batch row; more are shed (503)


class ApiError(Exception):
    """A request refused with `status` and a one-line message in the OpenAI error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        headers = {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": str(RETRY_AFTER_S)}}
        return JSONResponse(error_body(self.message, self.param, self.code), status_code=self.status,
                            headers=headers.get(self.status))


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request bodies ----------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value):
        """Strings (and lists of them) must encode as UTF-8: a lone surrogate ("\\ud800" in
        JSON) is a 400 naming the field, never the tokenizer's error."""
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                check_unicode(text, "the text")
        return value


class CompletionExtension(_Strict):
    """The `rbcompile` object of a completion request."""
    budget: float | None = Field(None, ge=0, le=1)
    speculate: Literal[SPECULATE_MODES] = "off"
    qos: Literal[QOS_CLASSES] = "standard"
    consistency: Literal[1, 3, 7, "auto"] | None = None   # voted samples (rbcompile/consistency.py)
    extract: str = "first-line"   # with consistency: how an answer is read from a sample


class EmbeddingExtension(_Strict):
    """The `rbcompile` object of an embeddings request."""
    budget: float | None = Field(None, ge=0, le=1)


class StreamOptions(_Strict):
    include_usage: bool = False   # a last chunk with no choices and the request's usage


class _GenerationRequest(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    rbcompile: CompletionExtension = CompletionExtension()


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)

    def asked_tokens(self) -> tuple[int | None, str]:
        """(new tokens asked for, the field that asked)."""
        return self.max_tokens, "max_tokens"


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def asked_tokens(self) -> tuple[int | None, str]:
        """(new tokens asked for, the field that asked); None: as many as fit."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(400, "give max_completion_tokens or max_tokens, not both", "max_tokens")
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    rbcompile: EmbeddingExtension = EmbeddingExtension()


# ---- metrics -----------------------------------------------------------------------------------

class Metrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("rbcompile_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram("rbcompile_request_seconds", "Request latency (to the last byte)",
                                 ["endpoint"], registry=r)
        self.ttft = Histogram("rbcompile_time_to_first_token_seconds",
                              "Streams: request start to the first token", registry=r)
        self.tokens = Counter("rbcompile_generated_tokens", "Tokens generated", registry=r)
        self.tokens_per_second = Gauge("rbcompile_tokens_per_second",
                                       "Generation speed of the last completion", registry=r)
        self.drafted = Counter("rbcompile_speculative_drafted_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("rbcompile_speculative_accepted_tokens", "Draft tokens kept", registry=r)
        self.in_flight = Gauge("rbcompile_requests_in_flight", "Requests being served", registry=r)
        self.batch_rows = Gauge("rbcompile_batch_rows", "Rows in the running decode batch", registry=r)
        self.queued = Gauge("rbcompile_queued_requests", "Completions waiting for a batch row", registry=r)
        self.prefix_hit_rate = Gauge("rbcompile_prefix_cache_hit_rate",
                                     "Share of prompt tokens whose K/V came from the prefix cache", registry=r)
        self.prefix_bytes = Gauge("rbcompile_prefix_cache_bytes", "K/V bytes the prefix cache holds", registry=r)
        self.queued_by_qos = Gauge("rbcompile_queued_requests_by_qos", "Completions waiting, per QoS class",
                                   ["qos"], registry=r)
        self.refused = Counter("rbcompile_overload_refusals", "Requests refused with 503: shed (memory or "
                               "queue) or rejected (QoS class not admitted)", ["reason"], registry=r)
        self.watermark = Gauge("rbcompile_memory_watermark", "Memory watermark reached at the last "
                               "admission: 0 none, 1 shrink (60%), 2 protect (80%), 3 shed (95%)", registry=r)
        self.budget = Gauge("rbcompile_decode_budget", "Budget (skipped MLP share) the controller "
                            "sets for completions without their own", registry=r)
        self.result_hit_rate = Gauge("rbcompile_result_cache_hit_rate", "Share of embedding inputs "
                                     "answered from the result cache (exact repeats)", registry=r)
        self.result_bytes = Gauge("rbcompile_result_cache_bytes", "Bytes the result cache holds", registry=r)
        self.drafter = Counter("rbcompile_completions_by_drafter", "Completions by the speculation "
                               "they asked for", ["drafter"], registry=r)
        self.tier = Counter("rbcompile_consistency_tier", "Voted completions by samples tier (1, 3, "
                            "7; under auto, the router's choice)", ["tier"], registry=r)
        self.steps = DrafterSteps()
        r.register(self.steps)
        self.engine = None

    def record_generation(self, tokens: int, seconds: float, drafted: int = 0, accepted: int = 0) -> None:
        self.tokens.inc(tokens)
        if seconds > 0:
            self.tokens_per_second.set(tokens / seconds)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def refresh(self) -> None:
        """Labelled gauges read at a scrape."""
        if self.engine is not None:
            counts = self.engine.queued_by_priority()
            for priority, qos in enumerate(QOS_CLASSES):
                self.queued_by_qos.labels(qos).set(counts.get(priority, 0))

    def watch(self, engine) -> None:
        """Batch and queue gauges read from `engine` at each scrape."""
        self.engine = self.steps.engine = engine
        self.batch_rows.set_function(lambda: len(engine.running))
        self.budget.set_function(lambda: engine.budget or 0.0)
        self.queued.set_function(lambda: engine.queued)
        if engine.prefix_cache is not None:
            self.prefix_hit_rate.set_function(lambda: engine.prefix_cache.stats.hit_rate)
            self.prefix_bytes.set_function(lambda: engine.prefix_cache.nbytes)

    def watch_results(self, cache: ResultCache) -> None:
        def hit_rate() -> float:
            stats = cache.stats
            looked_up = stats["hits"] + stats["misses"]
            return stats["hits"] / looked_up if looked_up else 0.0
        self.result_hit_rate.set_function(hit_rate)
        self.result_bytes.set_function(lambda: cache.nbytes)


class DrafterSteps:
    """A Prometheus collector: decode steps by the drafter that ran them, from the engine's
    batch steps (n-gram when any row verified drafts, else off) and speculative `generate`'s
    steps (`add`; under 'auto', the modes it chose)."""

    def __init__(self):
        self.engine, self.generated = None, {}

    def add(self, steps_by_mode: dict[str, int]) -> None:
        for mode, count in steps_by_mode.items():
            self.generated[mode] = self.generated.get(mode, 0) + count

    def collect(self):
        counts = dict(self.generated)
        if self.engine is not None:
            stats = self.engine.stats
            counts["off"] = counts.get("off", 0) + stats.decode_steps - stats.speculative_steps
            counts["ngram"] = counts.get("ngram", 0) + stats.speculative_steps
        family = CounterMetricFamily("rbcompile_decode_steps_by_drafter", "Decode steps by the "
                                     "drafter that ran them (auto: the modes it chose)", labels=["drafter"])
        for mode, count in sorted(counts.items()):
            family.add_metric([mode], count)
        yield family


class Gatekeeper:
    """ASGI middleware before routing: metrics for every request, the API key, the body limit.
    The body is read here (at most `max_body_bytes`) and replayed to the app."""

    def __init__(self, app, *, metrics: Metrics, api_key: str | None, max_body_bytes: int):
        self.app, self.metrics, self.api_key, self.max_body_bytes = app, metrics, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status, started = 500, time.perf_counter()

        async def send_watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self._admit(scope, receive, send_watched)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    async def _admit(self, scope, receive, send):
        try:
            self._check_key(scope)
            body = await self._read_body(scope, receive)
        except ApiError as error:
            return await error.response()(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check_key(self, scope) -> None:
        if self.api_key is None or scope["path"] in PUBLIC_PATHS:
            return
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def _read_body(self, scope, receive) -> bytes:
        too_large = ApiError(413, f"the request body is over the {self.max_body_bytes}-byte limit")
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b""
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise too_large
            if not message.get("more_body"):
                return b"".join(chunks)


# ---- the model's worker ------------------------------------------------------------------------

class ModelWorker:
    """The one thread that runs the model: the continuous-batching engine's steps (decoders)
    and, between them, other work (embeddings; speculative `generate`, one token per job), so
    the event loop never waits on the model and nothing runs it twice at once."""

    def __init__(self):
        self.wake = threading.Condition()
        self.jobs: deque[Callable[[], None]] = deque()
        self.engine = None   # set by create_app for decoders, built with `wake`
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="rbcompile-model", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop after the jobs queued so far."""
        with self.wake:
            self.closed = True
            self.wake.notify()

    async def call(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the model thread, between engine steps."""
        future = Future()

        def job():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)

        with self.wake:
            if self.closed:
                raise ApiError(503, "the server is shutting down")
            self.jobs.append(job)
            self.wake.notify()
        return await asyncio.wrap_future(future)

    async def iterate(self, events):
        """Yield `events`' items, each advanced by its own job; the async caller stopping (a
        client gone) stops advancing it."""
        iterator, end = iter(events), object()
        while (item := await self.call(next, iterator, end)) is not end:
            yield item

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not (self.jobs or self.closed or (self.engine and self.engine.has_work)):
                    self.wake.wait()
                if self.closed and not self.jobs:
                    return
                job = self.jobs.popleft() if self.jobs else None
            if job is not None:
                job()
            if self.engine is not None and self.engine.has_work:
                try:
                    self.engine.step()
                except Exception:  # the engine has ended the requests it hit with the error
                    log.exception("a batch step failed")


# ---- text ------------------------------------------------------------------------------------

def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` up to its first stop string (excluded), and whether one was found."""
    found = [index for s in stop if (index := text.find(s)) >= 0]
    return (text[:min(found)], True) if found else (text, False)


def _held_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` not to stream yet: an undecodable byte sequence so far,
    or the start of a stop string."""
    if text.endswith("\ufffd"):
        return 1
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class TextStream:
    """One row's text as its tokens arrive: each call returns the text not sent yet, cut
    before a stop string (the row's whole tokens are decoded each time)."""

    def __init__(self, decode, stop: list[str]):
        self.decode, self.stop, self.tokens, self.sent = decode, stop, [], ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text, _ = cut_at_stop(self.decode(self.tokens), self.stop)
        return self._delta(text[:len(text) - _held_back(text, self.stop)])

    def finish(self) -> str:
        return self._delta(cut_at_stop(self.decode(self.tokens), self.stop)[0])

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent):  # a re-tokenised prefix: wait for a stable one
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


# ---- choices ---------------------------------------------------------------------------------

class ChoiceFormat(Protocol):
    """How a generation endpoint shapes a choice: whole (`choice`), and streamed as the choice
    dicts of the chunks that open it, add text to it, and end it."""
    object: str
    chunk_object: str
    id_prefix: str

    def choice(self, index: int, text: str, finish_reason: str) -> dict: ...

    def opening(self, index: int) -> list[dict]: ...

    def delta(self, index: int, text: str) -> dict: ...

    def ending(self, index: int, rest: str, finish_reason: str) -> list[dict]: ...


class CompletionFormat:
    """/v1/completions: `text`; a stream's last chunk per choice carries the rest of the text."""
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def choice(self, index, text, finish_reason):
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def opening(self, index):
        return []

    def delta(self, index, text):
        return self.choice(index, text, None)

    def ending(self, index, rest, finish_reason):
        return [self.choice(index, rest, finish_reason)]


class ChatFormat:
    """/v1/chat/completions: an assistant `message`; streamed as `delta`s, the first giving the
    role, the last empty with the finish_reason."""
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, index, text, finish_reason):
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def opening(self, index):
        return [self._chunk(index, {"role": "assistant", "content": ""})]

    def delta(self, index, text):
        return self._chunk(index, {"content": text})

    def ending(self, index, rest, finish_reason):
        return ([self.delta(index, rest)] if rest else []) + [self._chunk(index, {}, finish_reason)]

    @staticmethod
    def _chunk(index: int, delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


COMPLETION, CHAT = CompletionFormat(), ChatFormat()


# ---- the app -----------------------------------------------------------------------------------

def create_app(compiled, *, api_key: str | None = None, limits: ServeLimits = ServeLimits(),
               max_batch: int = 16, prefix_cache_mb: float = 256, prefill_chunk: int | None = 512,
               result_cache_mb: float = 256, watermarks: Watermarks = Watermarks(),
               memory: Callable[[], float] | None = None, policy=None, slo_s: float = 0.1,
               quality_loop: QualityLoopConfig = QualityLoopConfig()) -> FastAPI:
    """The FastAPI app serving `compiled` (a CompiledModel with a tokenizer). With `api_key`,
    every path but /health needs `Authorization: Bearer <api_key>`. Decoders' completions are
    continuously batched, at most `max_batch` rows at a time (1: one after another), with a
    prefix cache of `prefix_cache_mb` MiB of K/V blocks (0: none), prompts longer than
    `prefill_chunk` tokens prefilled in chunks of it between decode steps (None: whole).
    Encoders' embeddings of exact repeats come from a result cache of `result_cache_mb` MiB (0:
    none). Completions are admitted by QoS class under the memory `watermarks` (`memory()`: the
    system memory fraction in use, psutil's by default): from 60% the prefix and result caches
    halve, from 80% the batch class gets 503, from 95% every new completion does, with
    Retry-After; admitted ones always finish. With a `policy` (runtime/policy.py), a
    DecodeController sets the budget of completions that bring none, holding the decode-step
    latency at `slo_s`, within what `compiled.guard` and the live agreement checks of
    `quality_loop` allow (runtime/quality_loop.py). A completion's budget field is guarded
    too; the response says which plan ran (`rbcompile.plan`; streams: headers)."""
    metrics, worker = Metrics(), ModelWorker()
    results = ResultCache(int(result_cache_mb * (1 << 20))) \
        if compiled.family != "decoder" and result_cache_mb > 0 else None
    if results is not None:
        metrics.watch_results(results)
    if compiled.family == "decoder":
        prefix_cache = PrefixCache(capacity_bytes=int(prefix_cache_mb * (1 << 20))) if prefix_cache_mb > 0 else None
        worker.engine = compiled.batch_engine(max_batch, wake=worker.wake, prefix_cache=prefix_cache,
                                              prefill_chunk=prefill_chunk)
        metrics.watch(worker.engine)

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()  # uvicorn has waited for the open requests: nothing is left running

    app = FastAPI(title="rbcompile", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.results = worker.engine, results
    if memory is None:
        from rbcompile.runtime.monitors import ResourceMonitor
        memory = ResourceMonitor().memory_fraction
    if policy is not None and worker.engine is not None:
        controller = DecodeController(worker.engine, policy, slo_s, memory,
                                      quality_loop=QualityLoop(compiled, quality_loop))
        metrics.registry.register(QualityCollector(controller))
    service = _Service(compiled, limits, metrics, worker, watermarks, memory, results)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        metrics.refresh()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": service.created,
                                            "owned_by": "rbcompile"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await service.complete(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await service.chat(body)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        return await service.embed(body)

    app.add_middleware(Gatekeeper, metrics=metrics, api_key=api_key, max_body_bytes=limits.max_body_bytes)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def refused(request, error: ApiError):
        return error.response()

    @app.exception_handler(UserError)
    async def bad_input(request, error: UserError):
        return ApiError(400, first_line(error)).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        return _validation_error(error.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return ApiError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def internal(request, error: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {first_line(error)}",
                                       kind="server_error"), status_code=500)


def _validation_error(errors: list[dict]) -> ApiError:
    """Pydantic's errors as a one-line 400 about the first field (a union's alternatives
    joined with 'or')."""
    param = _param(errors[0]["loc"])
    kind = errors[0]["type"]
    if kind == "extra_forbidden":   # the field's own name, whatever its characters
        parent, name = _param(errors[0]["loc"][:-1]), ascii(str(errors[0]["loc"][-1]))[1:-1]
        name = f"{parent}.{name}" if parent else name
        return ApiError(400, f"unknown field '{name}'", name)
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {errors[0]['msg']}")
    if param is None:
        return ApiError(400, f"the body must be a JSON object: {errors[0]['msg']}")
    reasons = dict.fromkeys(first_line(e["msg"]).removeprefix("Value error, ")
                            for e in errors if _param(e["loc"]) == param)
    return ApiError(400, f"'{param}': {' or '.join(reasons)}", param)


def _param(loc: tuple) -> str | None:
    """'rbcompile.budget' from ('body', 'rbcompile', 'budget'); union tags ('list[str]') left out."""
    fields = [str(part) for part in loc[1:] if isinstance(part, int) or part.isidentifier()
              and part not in ("str", "int", "float", "bool")]
    return ".".join(fields) or None


class _Service:
    """The endpoints' work on one compiled model."""

    def __init__(self, compiled, limits: ServeLimits, metrics: Metrics, worker: ModelWorker,
                 watermarks: Watermarks, memory: Callable[[], float], results: ResultCache | None):
        self.compiled, self.limits, self.metrics, self.worker = compiled, limits, metrics, worker
        self.watermarks, self.memory, self.results = watermarks, memory, results
        self.fingerprint = fingerprint(compiled)
        self.name = compiled.manifest["source"]["name"]
        self.created = int(time.time())
        self.tokenizer = compiled.tokenizer
        if self.tokenizer.pad_token is None:  # left padding is masked: any token will do
            self.tokenizer.pad_token = self.tokenizer.eos_token
        eos = compiled.hf_config.get("eos_token_id")
        self.eos = set([eos] if isinstance(eos, int) else eos or [])

    def _check_model(self, model: str | None, family: str, endpoint: str, other: str) -> None:
        if self.compiled.family != family:
            raise ApiError(400, f"{endpoint} serves {family} artifacts, not "
                           f"{self.compiled.family}s: use {other}")
        if model is not None and model != self.name:
            raise ApiError(400, f"unknown model '{model}': this server serves '{self.name}'", "model")

    def _encode(self, texts: list[str], param: str, add_special_tokens: bool = True):
        """The texts as one batch (decoders left-padded for generate, encoders right-padded so
        positions start at 0); refused when empty or longer than the model."""
        if not texts:
            raise ApiError(400, f"'{param}' is an empty list", param)
        side = "left" if self.compiled.family == "decoder" else "right"
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side=side,
                               add_special_tokens=add_special_tokens)
        longest = int(batch["attention_mask"].sum(1).max())
        most = self.compiled.max_positions - (self.compiled.family == "decoder")  # room for 1 token
        if longest > most:
            raise ApiError(400, f"a prompt has {longest} tokens; at most {most} fit the model's "
                           f"{self.compiled.max_positions} positions", param)
        return batch

    def _max_new_tokens(self, asked: int | None, param: str, prompt_tokens: int) -> int:
        """`asked`, checked against the server's limit and the positions the prompt leaves;
        None: as many as both allow."""
        left = self.compiled.max_positions - prompt_tokens
        if asked is None:
            return min(self.limits.max_tokens_limit, left)
        if asked > self.limits.max_tokens_limit:
            raise ApiError(400, f"{param}={asked} is over this server's limit of "
                           f"{self.limits.max_tokens_limit}", param)
        if asked > left:
            raise ApiError(400, f"{param}={asked} is over the {left} positions left after "
                           f"the {prompt_tokens}-token prompt (the model has "
                           f"{self.compiled.max_positions})", param)
        return asked

    # ---- completions and chat ----------------------------------------------------------------

    async def complete(self, body: CompletionRequest):
        self._check_model(body.model, "decoder", "/v1/completions", "/v1/embeddings")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        return await self._respond(body, self._encode(prompts, "prompt"), COMPLETION)

    async def chat(self, body: ChatCompletionRequest):
        self._check_model(body.model, "decoder", "/v1/chat/completions", "/v1/embeddings")
        if self.tokenizer.chat_template is None:
            raise ApiError(400, f"model '{self.name}' has no chat template: use /v1/completions")
        if not body.messages:
            raise ApiError(400, "'messages' is an empty list", "messages")
        try:
            text = self.tokenizer.apply_chat_template([m.model_dump() for m in body.messages],
                                                      add_generation_prompt=True, tokenize=False)
        except TemplateError as error:
            raise ApiError(400, f"the chat template refused the messages: {first_line(error)}",
                           "messages") from error
        # the template writes the special tokens it wants (a BOS): none are added again
        batch = self._encode([text], "messages", add_special_tokens=False)
        return await self._respond(body, batch, CHAT)

    async def _respond(self, body: CompletionRequest | ChatCompletionRequest, batch, fmt: ChoiceFormat):
        """Generate `body.n` choices per row of `batch` (choice `row * n + k`): the response, or
        with `stream` its server-sent events."""
        if body.n > self.limits.max_n:
            raise ApiError(400, f"n={body.n} is over this server's limit of {self.limits.max_n}", "n")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options goes with stream: true", "stream_options")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        max_tokens = self._max_new_tokens(*body.asked_tokens(), batch["input_ids"].shape[1])
        prompt_tokens = int(batch["attention_mask"].sum())
        choices = len(batch["input_ids"]) * body.n
        header = {"id": f"{fmt.id_prefix}-{uuid.uuid4().hex}",
                  "object": fmt.chunk_object if body.stream else fmt.object,
                  "created": int(time.time()), "model": self.name}
        await self._admit(body.rbcompile.qos)
        self.metrics.drafter.labels(body.rbcompile.speculate).inc()
        asked = self._plan(body.rbcompile.budget)
        if body.rbcompile.budget is not None:  # what runs: the guarded plan's budget
            body.rbcompile.budget = asked.budget
        if body.rbcompile.consistency is not None:
            return await self._voted(body, batch, stop, max_tokens, header, fmt, prompt_tokens, asked)
        if body.rbcompile.speculate in ("off", "ngram"):
            run = self._batched(body, batch, stop, max_tokens, asked)
        else:
            run = await self._generated(body, batch, stop, max_tokens, asked)
        if body.stream:
            usage = prompt_tokens if body.stream_options and body.stream_options.include_usage else None
            return StreamingResponse(self._sse(run, header, fmt, choices, stop, max_tokens, usage),
                                     media_type="text/event-stream", headers=_plan_headers(asked))
        tokens = [[] for _ in range(choices)]
        async for index, token in run.events:
            tokens[index].append(token)
        run.record(self.metrics)
        return {**header,
                "choices": [fmt.choice(index, *self._ending(row, stop, max_tokens))
                            for index, row in enumerate(tokens)],
                "usage": _usage(prompt_tokens, sum(len(row) for row in tokens)),
                "rbcompile": {"plan": run.plan()}}

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

    async def _admit(self, qos: str) -> None:
        """Refuse a completion with 503 when the watermarks or the queue say so (and relieve
        memory, see `_relieve_memory`)."""
        memory, engine = await self._relieve_memory(), self.worker.engine
        try:
            admit(qos, memory, engine.queued, self.watermarks, self.limits.max_queue)
        except Overloaded as exc:
            self.metrics.refused.labels(exc.reason).inc()
            raise ApiError(503, str(exc), code="overloaded") from None

    def _batched(self, body, batch, stop: list[str], max_tokens: int,
                 asked: GuardedPlan) -> "_TokenRun":
        """The choices as requests of the continuous-batching engine, the n choices of a prompt
        as one group that shares its prefill (when the batch has rows for all n); choice i
        samples with seed `seed + i` (its own generator: the same prompt, seed and choice index
        give the same text whatever else is in the batch). `speculate: ngram` drafts are
        verified in the engine's batch steps."""
        engine, loop, queue = self.worker.engine, asyncio.get_running_loop(), asyncio.Queue()
        requests = []
        try:
            for row, mask in zip(batch["input_ids"], batch["attention_mask"]):
                prompt, group = row[mask.bool()].tolist(), []
                for _ in range(body.n):
                    index = len(requests) + len(group)
                    sampling = SamplingConfig(body.temperature > 0, body.temperature or 1.0, None,
                                              body.top_p if body.top_p < 1 else None,
                                              None if body.seed is None else body.seed + index)
                    group.append(EngineRequest(
                        prompt, max_tokens, sampling, stop, body.rbcompile.budget,
                        priority=QOS_CLASSES.index(body.rbcompile.qos),
                        speculate=body.rbcompile.speculate == "ngram",
                        on_token=partial(_deliver, loop, queue, index),
                        on_finish=lambda request, index=index: _deliver(loop, queue, index, None)))
                if len(group) <= engine.max_batch:
                    requests += engine.submit_samples(group)
                else:
                    requests += [engine.submit(request) for request in group]
        except Exception:
            for request in requests:
                engine.cancel(request)
            raise
        return _TokenRun(self._engine_events(requests, queue), lambda: (
            sum(r.drafted for r in requests), sum(r.accepted for r in requests), {}),
            lambda: self._plan_report(asked, max(r.budget_run for r in requests)))

    async def _engine_events(self, requests: list[EngineRequest], queue: asyncio.Queue):
        """(choice, token) as the engine emits them; stopping early (a client gone) cancels
        the requests not finished, which frees their rows."""
        unfinished = len(requests)
        try:
            while unfinished:
                index, token = await queue.get()
                if token is not None:
                    yield index, token
                    continue
                unfinished -= 1
                if requests[index].error is not None:
                    raise requests[index].error
        finally:
            for request in requests:
                if request.finish_reason is None:
                    self.worker.engine.cancel(request)

    async def _voted(self, body, batch, stop: list[str], max_tokens: int, header: dict,
                     fmt: ChoiceFormat, prompt_tokens: int, asked: GuardedPlan) -> dict:
        """`rbcompile.consistency`: one choice, the text of a sample giving the answer voted
        over 1, 3 or 7 samples (or as many as the complexity router picks: 'auto'), drawn by
        `generate(consistency=...)` on the model thread (its own batch, between the engine's
        steps); `rbcompile` in the response holds the answer, its votes and the samples."""
        from rbcompile.consistency import VoteOptions

        if body.n != 1 or body.stream:
            raise ApiError(400, "rbcompile.consistency gives one voted choice: it takes n=1 and "
                           "no stream", "rbcompile")
        vote = VoteOptions(extract=body.rbcompile.extract)
        result = await self.worker.call(
            self.compiled.generate, batch["input_ids"], batch["attention_mask"],
            max_new_tokens=max_tokens, do_sample=body.temperature > 0,
            temperature=body.temperature or 1.0, top_p=body.top_p if body.top_p < 1 else None,
            seed=body.seed, stop=stop or None, budget=body.rbcompile.budget,
            speculate=body.rbcompile.speculate, consistency=body.rbcompile.consistency, vote=vote)
        self.metrics.tier.labels(str(result.stats.tier or body.rbcompile.consistency)).inc()
        winner = next((sample for sample in result.samples
                       if sample.voted and sample.text == result.text), None)
        reason = "length" if winner is not None and winner.finish_reason == "length" else "stop"
        stats = result.stats
        return {**header, "choices": [fmt.choice(0, result.text or "", reason)],
                "usage": _usage(prompt_tokens, stats.new_tokens),
                "rbcompile": {"answer": result.answer, "votes": result.votes,
                              "samples": stats.drawn, "voted": stats.voted,
                              "stopped_early": stats.stopped_early, "tier": stats.tier,
                              "plan": self._plan_report(asked, asked.budget)}}

    async def _generated(self, body, batch, stop: list[str], max_tokens: int,
                         asked: GuardedPlan) -> "_TokenRun":
        """The choices through speculative `generate` as one batch on the model thread (the
        engine drafts by n-gram only: 'self' and 'auto' need the light path's draft forwards
        per request); `seed` seeds the one generator the batch draws from."""
        events = await self.worker.call(
            self.compiled.generate, batch["input_ids"].repeat_interleave(body.n, 0),
            batch["attention_mask"].repeat_interleave(body.n, 0),
            max_new_tokens=max_tokens, do_sample=body.temperature > 0,
            temperature=body.temperature or 1.0, top_p=body.top_p if body.top_p < 1 else None,
            seed=body.seed, stop=stop or None, budget=body.rbcompile.budget,
            speculate=body.rbcompile.speculate, stream=True)   # checks, before the 200
        def counts():
            stats = events.result().stats
            return stats.drafted, stats.accepted, stats.steps_by_mode
        return _TokenRun(self.worker.iterate(events), counts,
                         lambda: self._plan_report(asked, asked.budget))

    def _plan(self, budget: float | None) -> GuardedPlan:
        """The plan a budget runs: the guard's, and the live checks' where a controller runs
        them."""
        controller = getattr(self.worker.engine, "controller", None)
        if controller is not None and controller.quality_loop is not None:
            return controller.quality_loop.plan(budget)
        return guard_budget(self.compiled.plans, budget, self.compiled.guard, DECODER)

    def _plan_report(self, asked: GuardedPlan, ran_budget: float) -> dict:
        """`rbcompile.plan` of a response: the budget asked for and why less ran, the largest
        budget its tokens ran (a controller's too: the engine records them bounded) and that
        plan's measured quality loss."""
        ran = guard_budget(self.compiled.plans, ran_budget, self.compiled.guard, DECODER)
        limit = self.compiled.guard.max_quality_loss
        return {**asked.as_json(), "budget": ran.budget, "quality_loss": ran.quality_loss,
                "max_quality_loss": limit if limit != float("inf") else None}

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _ending(self, tokens: list[int], stop: list[str], max_tokens: int) -> tuple[str, str]:
        """A row's text, cut at a stop string, and its finish_reason."""
        text, stopped = cut_at_stop(self._decode(tokens), stop)
        ended = stopped or (tokens and tokens[-1] in self.eos) or len(tokens) < max_tokens
        return text, "stop" if ended else "length"

    async def _sse(self, run: "_TokenRun", header: dict, fmt: ChoiceFormat, choices: int, stop: list[str],
                   max_tokens: int, usage_prompt_tokens: int | None = None):
        """Server-sent events: the chunks opening each choice, a chunk per token with the text
        it adds, the chunks ending each choice with its finish_reason, with
        `usage_prompt_tokens` a chunk with no choices and the usage, then [DONE]."""
        def chunk(choice: dict) -> str:
            return f"data: {_json({**header, 'choices': [choice]})}\n\n"

        for index in range(choices):
            for choice in fmt.opening(index):
                yield chunk(choice)
        streams = [TextStream(self._decode, stop) for _ in range(choices)]
        first = True
        try:
            async for row, token in run.events:
                if first:
                    self.metrics.ttft.observe(time.perf_counter() - run.started)
                    first = False
                if delta := streams[row].add(token):
                    yield chunk(fmt.delta(row, delta))
        except Exception as exc:  # the 200 is sent: report in the stream
            log.exception("generation failed mid-stream")
            yield f"data: {_json(error_body(first_line(exc), kind='server_error'))}\n\n"
            return
        run.record(self.metrics)
        for row, stream in enumerate(streams):
            rest = stream.finish()
            for choice in fmt.ending(row, rest, self._ending(stream.tokens, stop, max_tokens)[1]):
                yield chunk(choice)
        if usage_prompt_tokens is not None:
            usage = _usage(usage_prompt_tokens, sum(len(stream.tokens) for stream in streams))
            yield f"data: {_json({**header, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    # ---- embeddings --------------------------------------------------------------------------

    async def embed(self, body: EmbeddingRequest):
        """Mean-pooled, L2-normalised embeddings; inputs whose tokens (under the same artifact
        and budget) were embedded before come from the result cache, the others are computed
        together and cached."""
        self._check_model(body.model, "encoder", "/v1/embeddings", "/v1/completions")
        await self._relieve_memory()
        texts = [body.input] if isinstance(body.input, str) else body.input
        batch = self._encode(texts, "input")
        plan = f"budget={body.rbcompile.budget or 0:.4f}"
        keys = [ResultCache.key(self.fingerprint, plan, ids[mask.bool()])
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        hits = [self.results.get(key) if self.results is not None else None for key in keys]
        missing = [i for i, hit in enumerate(hits) if hit is None]
        if missing:
            rows = batch if len(missing) == len(texts) else self._encode([texts[i] for i in missing], "input")
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




class _TokenRun:
    """A generation's (choice, token) events, and its counters for the metrics once they end
    (`counts()`: draft tokens verified and accepted, and `generate`'s decode steps by mode;
    the engine's steps are read from the engine itself)."""

    def __init__(self, events, counts: Callable[[], tuple[int, int, dict]],
                 plan: Callable[[], dict]):
        self.counts, self.plan, self.started, self.tokens = counts, plan, time.perf_counter(), 0
        self.events = self._counted(events)

    async def _counted(self, events):
        async for event in events:
            self.tokens += 1
            yield event

    def record(self, metrics: Metrics) -> None:
        drafted, accepted, steps_by_mode = self.counts()
        metrics.record_generation(self.tokens, time.perf_counter() - self.started, drafted, accepted)
        metrics.steps.add(steps_by_mode)


def _plan_headers(asked: GuardedPlan) -> dict[str, str]:
    """A stream's headers for its budget: what it asked, what its plan allows, and why less."""
    if asked.requested is None:
        return {}
    headers = {"x-rbcompile-requested-budget": f"{asked.requested:g}",
               "x-rbcompile-budget": f"{asked.budget:g}"}
    if asked.withheld is not None:
        headers["x-rbcompile-withheld"] = asked.withheld
    return headers


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int, token: int | None) -> None:
    """Hand an engine event to the request's queue from the model thread (dropped when the
    loop is gone: nobody is listening)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, (index, token))
    except RuntimeError:
        pass


def _encoded(vector: torch.Tensor, encoding_format: str):
    if encoding_format == "base64":  # what the openai client asks for: little-endian float32
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _json(payload: dict) -> str:
    return json.dumps(payload, separators=(",", ":"))
