"""The ASGI middleware in front of the app's routes: metrics for every request, the API key, and
the request body read within its limit."""
from __future__ import annotations

import asyncio
import hmac
import time

from rbcompile.runtime.serving.openai_api import ApiError
from rbcompile.runtime.serving.serve_metrics import Metrics

PUBLIC_PATHS = ("/health", "/version")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health",
             "/metrics", "/tokenize", "/detokenize", "/version")


class Gatekeeper:
    """ASGI middleware before routing: metrics for every request, the API key, the body limit.
    The body is read here (at most `max_body_bytes`, within `body_timeout_s`: 413 or 408) and
    replayed to the app; a client gone before its body is whole gets nothing."""

    def __init__(self, app, *, metrics: Metrics, api_key: str | None, max_body_bytes: int,
                 body_timeout_s: float = 30.0, public_metrics: bool = False):
        self.app, self.metrics, self.api_key, self.max_body_bytes = app, metrics, api_key, max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.public = PUBLIC_PATHS + (("/metrics",) if public_metrics else ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status, started = 499, time.perf_counter()   # 499: gone before any response

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
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(scope, receive)
        except ApiError as error:
            return await error.response()(scope, receive, send)
        except TimeoutError:
            error = ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s")
            return await error.response()(scope, receive, send)
        if body is None:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check_key(self, scope) -> None:
        if self.api_key is None or scope["path"] in self.public:
            return
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body; None when the client disconnected first."""
        too_large = ApiError(413, f"the request body is over the {self.max_body_bytes}-byte limit")
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise too_large
            if not message.get("more_body"):
                return b"".join(chunks)
