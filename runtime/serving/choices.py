"""How the generation endpoints shape their choices (whole, or streamed as chunks), and a
generation's token events with the counters the metrics take once they end."""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol

from starlette.responses import StreamingResponse

from rbcompile.artifact.guard import GuardedPlan
from rbcompile.runtime.serving.logprob_format import TokenTexts, chat_logprobs, completion_logprobs
from rbcompile.runtime.serving.serve_metrics import Metrics


class ChoiceFormat(Protocol):
    """How a generation endpoint shapes a choice: whole (`choice`), and streamed as the choice
    dicts of the chunks that open it, add text to it, and end it; `logprobs` (the shape of
    `logprobs` objects, logprob_format.py) is None where none were asked."""
    object: str
    chunk_object: str
    id_prefix: str

    def choice(self, index: int, text: str, finish_reason: str, logprobs=None) -> dict: ...

    def opening(self, index: int) -> list[dict]: ...

    def delta(self, index: int, text: str, logprobs=None) -> dict: ...

    def ending(self, index: int, rest: str, finish_reason: str, logprobs=None) -> list[dict]: ...

    def logprobs(self, entries: list, tokens: list[int], texts: TokenTexts,
                 offset: int = 0) -> dict: ...


class CompletionFormat:
    """/v1/completions: `text`; a stream's last chunk per choice carries the rest of the text."""
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def choice(self, index, text, finish_reason, logprobs=None):
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, index):
        return []

    def delta(self, index, text, logprobs=None):
        return self.choice(index, text, None, logprobs)

    def ending(self, index, rest, finish_reason, logprobs=None):
        return [self.choice(index, rest, finish_reason, logprobs)]

    @staticmethod
    def logprobs(entries, tokens, texts, offset=0):
        return completion_logprobs(entries, tokens, texts, offset)


class ChatFormat:
    """/v1/chat/completions: an assistant `message`; streamed as `delta`s, the first giving the
    role, the last empty with the finish_reason."""
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, index, text, finish_reason, logprobs=None):
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, index):
        return [self._chunk(index, {"role": "assistant", "content": ""})]

    def delta(self, index, text, logprobs=None):
        return self._chunk(index, {"content": text}, logprobs=logprobs)

    def ending(self, index, rest, finish_reason, logprobs=None):
        return ([self.delta(index, rest, logprobs)] if rest or logprobs else []) + \
            [self._chunk(index, {}, finish_reason)]

    @staticmethod
    def logprobs(entries, tokens, texts, offset=0):
        return chat_logprobs(entries, texts)

    @staticmethod
    def _chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}


COMPLETION, CHAT = CompletionFormat(), ChatFormat()


class RunStream(StreamingResponse):
    """A stream of a `TokenRun` that closes the run however the response ends, even when the
    client left before its generator started (which then runs no `finally` of its own)."""

    def __init__(self, run: "TokenRun", content, **options):
        super().__init__(content, **options)
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


class TokenRun:
    """A generation's (choice, token) events, and its counters for the metrics once they end
    (`counts()`: draft tokens verified and accepted; the engine's steps are read from the
    engine itself); `close()` runs when the events end."""

    def __init__(self, events, counts: Callable[[], tuple[int, int]],
                 plan: Callable[[], dict], close: Callable[[], None] = lambda: None,
                 requests: list | None = None):
        self.counts, self.plan, self.started, self.tokens = counts, plan, time.perf_counter(), 0
        self.requests = requests or []   # the engine requests of its choices (their logprobs)
        self._close, self.closed = close, False
        self.events = self._counted(events)

    def close(self) -> None:
        """Once: give the client's share back and cancel what still runs (also for events
        never iterated: a stream whose client left before its first chunk)."""
        if not self.closed:
            self.closed = True
            self._close()

    async def _counted(self, events):
        try:
            async for event in events:
                self.tokens += 1
                yield event
        finally:
            self.close()
            await events.aclose()   # its own finally blocks now

    def record(self, metrics: Metrics) -> None:
        drafted, accepted = self.counts()
        metrics.record_generation(self.tokens, time.perf_counter() - self.started, drafted, accepted)


def plan_headers(asked: GuardedPlan) -> dict[str, str]:
    """A stream's headers for its budget: what it asked, what its plan allows, and why less."""
    if asked.requested is None:
        return {}
    headers = {"x-rbcompile-requested-budget": f"{asked.requested:g}",
               "x-rbcompile-budget": f"{asked.budget:g}"}
    if asked.withheld is not None:
        headers["x-rbcompile-withheld"] = asked.withheld
    return headers


def deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int, token: int | None) -> None:
    """Hand an engine event to the request's queue from the model thread (dropped when the
    loop is gone: nobody is listening)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, (index, token))
    except RuntimeError:
        pass
