"""The HTTP server under `rbcompile serve`: uvicorn, with the limits production servers set on
connections. A client that opens sockets and sends nothing, drips its headers, or holds half a
body cannot keep the server's sockets or its shutdown: request headers must arrive within
`header_timeout_s`, connections over the caps (all, and per client address) get a 503 and are
closed, a SIGTERM drains for at most `drain_timeout_s` before the connections still open are
cut (one log line counts them), and the accept loop's errors (EMFILE) are logged once a second.
The body's deadline is the Gatekeeper's (gatekeeper.py, `ServeLimits.body_timeout_s`)."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from rbcompile.errors import UserError
from rbcompile.runtime.serving.limits import ConnectionLimits
from rbcompile.runtime.serving.openai_api import error_body

log = logging.getLogger("uvicorn.error")
REFUSED_GRACE_S = 1.0   # a refused connection is closed this long after its 503 (or on data)
REFUSED_HELD = 64       # at most this many wait out their grace; more are closed at once


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, before anything says "serving" (a port in use is a
    one-line UserError)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror} (another server is "
                        "there, or pick another --port)") from None
    sock.set_inheritable(True)
    return sock


def serve(app, sock: socket.socket, limits: ConnectionLimits, log_level: str = "info") -> None:
    """Serve `app` on the bound `sock` until SIGINT / SIGTERM, then drain (see the module)."""
    server(app, limits, log_level).run(sockets=[sock])


def server(app, limits: ConnectionLimits, log_level: str = "info") -> DrainingServer:
    """The uvicorn server of `serve` (`run(sockets=[sock])` it; from a thread other than the
    main one it handles no signals: set `should_exit` to drain)."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "refused": set()})
    config = uvicorn.Config(app, http=protocol, log_level=log_level,
                            timeout_keep_alive=limits.keep_alive_s,
                            timeout_graceful_shutdown=limits.drain_timeout_s + 5)
    return DrainingServer(config, limits.drain_timeout_s)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and the connection caps (`limits` and
    `refused`, the refused connections still open, are set on a subclass by `server`)."""
    limits: ConnectionLimits
    refused: set

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.header_timer, self.timed_cycle = None, None
        if self._over_caps():
            self.connections.discard(self)
            self._refuse()
            return
        self._expect_headers()

    def data_received(self, data: bytes) -> None:
        if self not in self.connections:   # refused: its 503 is sent, close now
            self.transport.close()
            return
        super().data_received(data)
        if self.header_timer is not None and self.cycle is not self.timed_cycle:
            self.header_timer.cancel()      # a request's headers are in
            self.header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()   # may start a pipelined request's cycle at once
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._expect_headers()

    def connection_lost(self, exc) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        self.refused.discard(self)
        super().connection_lost(exc)

    def _expect_headers(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        self.timed_cycle = self.cycle
        self.header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a bad Content-Length, say): the OpenAI error shape."""
        self.transport.write(_raw_response(400, "Bad Request", msg))
        self.transport.close()

    def _headers_late(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing() and self.cycle is self.timed_cycle:
            self.transport.write(_raw_response(408, "Request Timeout", "the request headers did "
                                 f"not arrive within {self.limits.header_timeout_s:g} s"))
            self.transport.close()

    def _over_caps(self) -> bool:
        if len(self.connections) > self.limits.connections:
            return True
        cap = self.limits.max_client_connections
        if not cap or self.client is None:
            return False
        return sum(other.client is not None and other.client[0] == self.client[0]
                   for other in self.connections) > cap

    def _refuse(self) -> None:
        """A 503, then close: once the request arrives (closing on unread data would reset
        the connection before the client reads it) or after a grace; at once when many
        refused ones are open (a flood: descriptors first)."""
        self.transport.write(_raw_response(503, "Service Unavailable", "too many open connections"
                                           " (from this client, or in all); retry later",
                                           {"Retry-After": "1"}))
        if len(self.refused) >= REFUSED_HELD:
            self.transport.close()
            return
        self.refused.add(self)
        self.loop.call_later(REFUSED_GRACE_S, self.transport.close)


def _raw_response(status: int, reason: str, message: str, headers: dict | None = None) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body, closing the connection: for a
    connection whose request is not (or not wholly) read."""
    body = json.dumps(error_body(message), separators=(",", ":")).encode()   # as the app's
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close",
             *(f"{name}: {value}" for name, value in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class DrainingServer(uvicorn.Server):
    """uvicorn's server: on SIGTERM it stops accepting and waits for the open requests; past
    `drain_timeout_s` it closes the connections still open (their requests see a disconnect
    and cancel their work), logging how many were cut."""

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float):
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(_OncePerSecond())
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        cutter = asyncio.get_running_loop().call_later(self.drain_timeout_s, self._cut)
        try:
            await super().shutdown(sockets)
        finally:
            cutter.cancel()

    def _cut(self) -> None:
        open_connections = list(self.server_state.connections)
        requests = sum(connection.cycle is not None and not connection.cycle.response_complete
                       for connection in open_connections)
        log.warning("drain deadline of %g s passed: cutting %d open connection(s), %d request(s) "
                    "unfinished", self.drain_timeout_s, len(open_connections), requests)
        for connection in open_connections:
            connection.transport.abort()


class _OncePerSecond:
    """The event loop's exception handler: each kind of error (its message) logged at most
    once a second, with a count of those left out (asyncio's accept loop out of descriptors
    reports every one of its up to `backlog` attempts: thousands a second)."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self.skipped: dict[str, int] = {}

    def __call__(self, loop, context: dict) -> None:
        message, now = context.get("message", "error"), time.monotonic()
        if now - self.last.get(message, -1.0) < 1.0:
            self.skipped[message] = self.skipped.get(message, 0) + 1
            return
        self.last[message] = now
        skipped = self.skipped.pop(message, 0)
        error = context.get("exception")
        log.error("%s%s%s", message, f": {error!r}" if error is not None else "",
                  f" ({skipped} more like it since the last)" if skipped else "")
