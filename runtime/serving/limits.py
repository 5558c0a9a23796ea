"""What one request and one client may ask of `rbcompile serve`: checked before anything is
queued, so no request can fill the queue or the batch for everyone else."""
from __future__ import annotations

import resource
import threading
from dataclasses import dataclass

from rbcompile.errors import UserError

FD_RESERVE = 128   # descriptors kept for the process's own files (weights, logs, /proc)


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-client limits.

    `max_body_bytes`: a request body; `max_tokens_limit`: new tokens per choice (also capped by
    the positions the prompt leaves); `max_n`: choices per prompt; `max_choices`: prompts x n
    in one request; `max_stop` / `max_stop_chars`: stop strings and the length of each;
    `max_queue`: choices waiting for a batch row over all clients, more are shed (503);
    `max_client_choices`: choices one client (its address) may have queued or running at once
    (0: no limit), more are shed (429); `body_timeout_s`: a request's whole body, from its
    headers (408)."""
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 1024
    max_n: int = 8
    max_choices: int = 64
    max_stop: int = 4
    max_stop_chars: int = 256
    max_queue: int = 1024
    max_client_choices: int = 256
    body_timeout_s: float = 30.0

    def __post_init__(self):
        counts = (self.max_body_bytes, self.max_tokens_limit, self.max_n, self.max_choices,
                  self.max_stop, self.max_stop_chars, self.max_queue)
        if min(counts) < 1 or self.max_client_choices < 0 or not self.body_timeout_s > 0:
            raise UserError("serve limits must be >= 1 (--max-client-choices >= 0, "
                            "--body-timeout > 0)")
        if self.max_choices > self.max_queue:
            raise UserError(f"--max-choices ({self.max_choices}) must not exceed the queue "
                            f"({self.max_queue}): such a request could never be queued")


@dataclass(frozen=True)
class ConnectionLimits:
    """`max_connections`: open at once (0: the descriptor limit less a reserve, at most 4096);
    `max_client_connections`: open at once from one client address (0: no limit);
    `header_timeout_s`: from a connection's start, or its last response, to a request's whole
    headers; `keep_alive_s`: an idle connection after a response; `drain_timeout_s`: after
    SIGTERM, before open requests are cut."""
    max_connections: int = 0
    max_client_connections: int = 64
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    drain_timeout_s: float = 30.0

    def __post_init__(self):
        if self.max_connections < 0 or self.max_client_connections < 0:
            raise UserError("--max-connections and --max-client-connections must be >= 0")
        if not (self.header_timeout_s > 0 and self.keep_alive_s > 0 and self.drain_timeout_s >= 0):
            raise UserError("--header-timeout and --keep-alive-timeout must be > 0, "
                            "--drain-timeout >= 0")

    @property
    def connections(self) -> int:
        """The cap on open connections in force."""
        if self.max_connections:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, min(4096, soft - FD_RESERVE))


class ClientChoices:
    """Choices each client has queued or running; `take` refuses a request that would put its
    client over `limit` (0: none)."""

    def __init__(self, limit: int):
        self.limit, self.held, self.lock = limit, {}, threading.Lock()

    def take(self, client: str, choices: int) -> bool:
        """Count `choices` more for `client`; False (nothing counted) when over the limit."""
        with self.lock:
            held = self.held.get(client, 0)
            if self.limit and held + choices > self.limit:
                return False
            self.held[client] = held + choices
            return True

    def give_back(self, client: str, choices: int = 1) -> None:
        with self.lock:
            left = self.held.get(client, 0) - choices
            if left > 0:
                self.held[client] = left
            else:
                self.held.pop(client, None)
