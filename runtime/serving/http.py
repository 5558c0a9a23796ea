"""An OpenAI-compatible HTTP server for a compiled artifact (FastAPI; `rbcompile serve`).

`create_app(compiled)` serves `POST /v1/completions` and `POST /v1/chat/completions` (decoders,
streamed as server-sent events with `stream: true`; chat where the tokenizer has a chat
template), `POST /v1/embeddings` (encoders: mean-pooled, L2-normalised hidden states),
`GET /v1/models`, `GET /health` and `GET /metrics` (Prometheus text).

Both generation endpoints take one path (runtime/serving/completions.py): each prompt's `n` choices
(choice `prompt_index * n + k`) are requests of the continuous-batching engine, which one
model thread steps (`ModelWorker`), so the event loop never waits on the model; tokenising
runs on a thread of its own. A request's choices count against `ServeLimits` and the
queue before anything is queued; a client that disconnects, streaming or not, cancels its
requests. Errors are the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, one
line (runtime/serving/openai_api.py).
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from rbcompile.errors import UserError, first_line
from rbcompile.runtime.control.decode_control import DecodeController
from rbcompile.runtime.control.monitors import ResourceMonitor
from rbcompile.runtime.control.quality_loop import QualityLoop
from rbcompile.runtime.control.result_cache import ResultCache
from rbcompile.runtime.engine.prefix_cache import PrefixCache
from rbcompile.runtime.serving.completions import ClientGone, CompletionEndpoints
from rbcompile.runtime.serving.embeddings import EmbeddingEndpoints
from rbcompile.runtime.serving.gatekeeper import Gatekeeper
from rbcompile.runtime.serving.model_worker import ModelWorker, log
from rbcompile.runtime.serving.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    error_body,
    validation_error,
)
from rbcompile.runtime.serving.quality_metrics import QualityCollector
from rbcompile.runtime.serving.serve_config import ServeConfig
from rbcompile.runtime.serving.serve_metrics import Metrics

SHUTDOWN_JOIN_S = 30   # how long shutdown waits for the model thread's last step

# ---- the app -----------------------------------------------------------------------------------

def create_app(compiled, config: ServeConfig = ServeConfig(), *, policy=None,
               memory: Callable[[], float] | None = None) -> FastAPI:
    """The FastAPI app serving `compiled` (a CompiledModel with a tokenizer) as `config` says
    (runtime/serving/serve_config.py). Completions are admitted by QoS class under the memory
    watermarks (`memory()`: the system memory fraction in use, psutil's by default): from 60%
    the prefix and result caches halve, from 80% the batch class gets 503, from 95% every new
    completion does, with Retry-After; admitted ones always finish. With a `policy` (built
    from `config.policy`: runtime/serving/serve_policy.py; a Ray replica's ClusterPolicy), a
    DecodeController sets the budget of completions that bring none, holding the decode-step
    latency at `config.slo_s`, within what the quality guard and the live agreement checks
    allow (runtime/control/quality_loop.py). A completion's budget field is guarded too; the response
    says which plan ran (`rbcompile.plan`; streams: headers)."""
    if config.guard is not None:
        compiled.guard = config.guard
    metrics, worker = Metrics(), ModelWorker()
    results = ResultCache(int(config.result_cache_mb * (1 << 20))) \
        if compiled.family != "decoder" and config.result_cache_mb > 0 else None
    if results is not None:
        metrics.watch_results(results)
    if compiled.family == "decoder":
        prefix_cache = PrefixCache(capacity_bytes=int(config.prefix_cache_mb * (1 << 20))) \
            if config.prefix_cache_mb > 0 else None
        worker.engine = compiled.batch_engine(config.max_batch, wake=worker.wake,
                                              prefix_cache=prefix_cache,
                                              prefill_chunk=config.prefill_chunk)
        metrics.watch(worker.engine)

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()  # uvicorn has drained (or cut) the open requests
        # the model thread ends its step first: a process that exits mid-forward aborts
        await asyncio.to_thread(worker.thread.join, SHUTDOWN_JOIN_S)
        service.pool.shutdown(wait=False)

    app = FastAPI(title="rbcompile", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.results, app.state.worker = worker.engine, results, worker
    if memory is None:
        memory = ResourceMonitor().memory_fraction
    if policy is not None and worker.engine is not None:
        controller = DecodeController(worker.engine, policy, config.slo_s, memory,
                                      quality_loop=QualityLoop(compiled, config.quality_loop))
        metrics.registry.register(QualityCollector(controller))
    service = _Service(compiled, config.limits, metrics, worker, config.watermarks, memory, results)
    service.tier_weights = config.tier_weights
    service.serve_as(config.served_model_name)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        metrics.refresh()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _add_model_routes(app, service, compiled)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await service.complete(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await service.chat(body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        return await service.embed(body)

    app.add_middleware(Gatekeeper, metrics=metrics, api_key=config.api_key,
                       max_body_bytes=config.limits.max_body_bytes,
                       body_timeout_s=config.limits.body_timeout_s,
                       public_metrics=config.public_metrics)
    return app


def _add_model_routes(app: FastAPI, service, compiled) -> None:
    """/v1/models (and /v1/models/{id}), /version, and vLLM's /tokenize and /detokenize."""
    def model_card() -> dict:
        return {"id": service.name, "object": "model", "created": service.created,
                "owned_by": "rbcompile", "max_model_len": compiled.max_positions}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in service.names:
            raise ApiError(404, f"the model '{model}' does not exist", "model", "model_not_found")
        return model_card()

    @app.get("/version")
    async def rbcompile_version():
        try:
            return {"version": version("rbcompile")}
        except PackageNotFoundError:   # a source tree not installed
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        service._check_model(body.model, compiled.family, "/tokenize", "/tokenize")
        return await service._off_loop(service.tokenize, body.prompt, body.messages,
                                       body.add_special_tokens, body.add_generation_prompt)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        service._check_model(body.model, compiled.family, "/detokenize", "/detokenize")
        return await service._off_loop(service.detokenize, body.tokens)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def refused(request, error: ApiError):
        return error.response()

    @app.exception_handler(UserError)
    async def bad_input(request, error: UserError):
        return ApiError(400, first_line(error)).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        return validation_error(error.errors()).response()

    @app.exception_handler(ClientGone)
    async def gone(request, error: ClientGone):
        return Response(status_code=499)   # nginx's 'client closed request': never sent

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return ApiError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def internal(request, error: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {first_line(error)}",
                                       kind="server_error"), status_code=500)



class _Service(CompletionEndpoints, EmbeddingEndpoints):
    """Every endpoint's work on one compiled model (each checks the artifact's family)."""
