"""The one thread that runs the model for the server."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable

from rbcompile.runtime.serving.openai_api import ApiError

log = logging.getLogger("rbcompile.serve")


class ModelWorker:
    """The one thread that runs the model: the continuous-batching engine's steps (decoders)
    and, between them, other work (embeddings; speculative `generate`, one token per job), so
    the event loop never waits on the model and nothing runs it twice at once."""

    def __init__(self):
        self.wake = threading.Condition()
        self.jobs: deque[Callable[[], None]] = deque()
        self.engine = None   # set by create_app for decoders, built with `wake`
        self.closed = False
        self.watches: list[tuple[Callable[[], bool], Future]] = []   # the model thread's own
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

    async def until(self, done: Callable[[], bool]) -> None:
        """Return once `done()` holds, asked on the model thread now and after every job and
        engine step (e.g. a vote's samples, which the engine's thread finishes)."""
        future = Future()

        def watch():
            self.watches.append((done, future))
            self._check_watches()

        await self.call(watch)
        await asyncio.wrap_future(future)

    def _check_watches(self) -> None:
        for watch in list(self.watches):
            done, future = watch
            if future.done() or done():
                self.watches.remove(watch)
                if not future.done():
                    future.set_result(None)

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not (self.jobs or self.closed or (self.engine and self.engine.has_work)):
                    self.wake.wait()
                if self.closed and not self.jobs:
                    break
                job = self.jobs.popleft() if self.jobs else None
            if job is not None:
                job()
            if self.engine is not None and self.engine.has_work:
                try:
                    self.engine.step()
                except Exception:  # the engine has ended the requests it hit with the error
                    log.exception("a batch step failed")
            self._check_watches()
        for _, future in self.watches:
            if not future.done():
                future.set_exception(ApiError(503, "the server is shutting down"))
