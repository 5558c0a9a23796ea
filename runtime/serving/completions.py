"""/v1/completions and /v1/chat/completions: each prompt's `n` choices (choice
`prompt_index * n + k`) as requests of the continuous-batching engine, counted against
`ServeLimits`, the queue and the client's share before anything is queued; answered whole or
streamed as server-sent events; a client that disconnects cancels its requests."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Callable

from fastapi import Request

from rbcompile.artifact.guard import DECODER, GuardedPlan, guard_budget
from rbcompile.errors import first_line
from rbcompile.runtime.control.admission import QOS_CLASSES, Overloaded, admit
from rbcompile.runtime.engine.consistency import VoteOptions
from rbcompile.runtime.engine.grammar import Constraint
from rbcompile.runtime.engine.logprobs import prompt_logprobs
from rbcompile.runtime.engine.penalties import Penalties
from rbcompile.runtime.engine.requests import EngineRequest
from rbcompile.runtime.engine.sampling import SamplingConfig
from rbcompile.runtime.engine.vote_sampling import check_vote, start_vote, vote_result, vote_rows
from rbcompile.runtime.serving.choices import (
    CHAT,
    COMPLETION,
    ChoiceFormat,
    RunStream,
    TokenRun,
    deliver,
    plan_headers,
)
from rbcompile.runtime.serving.logprob_format import (
    Echo,
    StreamLogprobs,
    join_logprobs,
    kept_tokens,
)
from rbcompile.runtime.serving.model_worker import log
from rbcompile.runtime.serving.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    usage,
)
from rbcompile.runtime.serving.service import Service
from rbcompile.runtime.serving.structured import ToolCallFormat, output_schema
from rbcompile.runtime.serving.text_stream import TextStream, cut_at_stop


class CompletionEndpoints(Service):
    """The generation endpoints of a decoder artifact; votes decode each tier at
    `tier_weights` (`ServeConfig.tier_weights`)."""
    tier_weights: dict[int, str] | str | None = None

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

    async def complete(self, body: CompletionRequest, request: Request):
        self._check_model(body.model, "decoder", "/v1/completions", "/v1/embeddings")
        one = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))
        prompts = [body.prompt] if one else body.prompt
        stop = self._check_work(body, len(prompts), "prompt")
        if prompts and not isinstance(prompts[0], str):   # token ids
            batch = self._token_batch(prompts, "prompt")
        else:
            batch = await self._off_loop(self._encode, prompts, "prompt")
        return await self._respond(body, batch, stop, COMPLETION, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model, "decoder", "/v1/chat/completions", "/v1/embeddings")
        if self.tokenizer.chat_template is None:
            raise ApiError(400, f"model '{self.name}' has no chat template: use /v1/completions")
        if not body.messages:
            raise ApiError(400, "'messages' is an empty list", "messages")
        stop = self._check_work(body, 1, "messages")
        schema, tool_call = output_schema(body)   # structured output: a grammar per choice
        return await self._respond(body, await self._off_loop(self._chat_batch, body.messages),
                                   stop, ToolCallFormat() if tool_call else CHAT, request,
                                   schema)

    def _chat_batch(self, messages: list) -> dict:
        # the template writes the special tokens it wants (a BOS): none are added again
        return self._encode([self._chat_text(messages)], "messages", add_special_tokens=False)

    def _check_work(self, body: CompletionRequest | ChatCompletionRequest, prompts: int,
                    param: str) -> list[str]:
        """The request's work within `ServeLimits`, before anything is tokenised or queued;
        its stop strings."""
        limits = self.limits
        if body.n > limits.max_n:
            raise ApiError(400, f"n={body.n} is over this server's limit of {limits.max_n}", "n")
        if prompts * body.n > limits.max_choices:
            raise ApiError(400, f"{prompts} prompts x n={body.n} make {prompts * body.n} "
                           f"choices, over this server's limit of {limits.max_choices} a request",
                           param)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options goes with stream: true", "stream_options")
        self._check_vocabulary([int(token) for token in body.logit_bias or {}], "logit_bias")
        if field := body.unsupported():
            raise ApiError(400, f"'{field}' is not supported by this server at that value "
                           f"(only its default, which changes nothing)", field)
        if body.rbcompile.consistency is not None and (
                body.logprob_alternatives() is not None or getattr(body, "echo", False)
                or getattr(body, "response_format", None) or getattr(body, "tools", None)):
            raise ApiError(400, "rbcompile.consistency answers with a voted sample's text: no "
                           "logprobs, echo, response_format or tools", "rbcompile")
        return self._stops(body.stop)

    def _stops(self, stop: str | list[str] | None) -> list[str]:
        stop, limits = [stop] if isinstance(stop, str) else stop or [], self.limits
        if len(stop) > limits.max_stop:
            raise ApiError(400, f"{len(stop)} stop strings: this server takes at most "
                           f"{limits.max_stop}", "stop")
        if longest := max((len(s) for s in stop if len(s) > limits.max_stop_chars), default=0):
            raise ApiError(400, f"a stop string of {longest} characters: this server takes at "
                           f"most {limits.max_stop_chars}", "stop")
        return stop

    async def _respond(self, body: CompletionRequest | ChatCompletionRequest, batch,
                       stop: list[str], fmt: ChoiceFormat, request: Request,
                       schema: dict | None = None):
        """Generate `body.n` choices per row of `batch` (choice `row * n + k`), cut at `stop`
        (each following `schema`, a JSON schema, where given): the response, or with `stream`
        its server-sent events."""
        max_tokens = self._max_new_tokens(*body.asked_tokens(), batch["input_ids"].shape[1])
        prompt_tokens = int(batch["attention_mask"].sum())
        choices = len(batch["input_ids"]) * body.n
        job = _Job(body, batch, stop, max_tokens, self._plan(body.rbcompile.budget),
                   request.client.host if request.client else "", choices)
        header = {"id": f"{fmt.id_prefix}-{uuid.uuid4().hex}",
                  "object": fmt.chunk_object if body.stream else fmt.object,
                  "created": int(time.time()), "model": self.name}
        if body.rbcompile.consistency is not None:
            return await self._voted(job, header, fmt, prompt_tokens, request)
        await self._admit(body.rbcompile.qos, job)
        try:
            self.metrics.drafter.labels(body.rbcompile.speculate).inc()
            if body.rbcompile.budget is not None:  # what runs: the guarded plan's budget
                body.rbcompile.budget = job.asked.budget
            job.echo = await self._echo(job) if getattr(body, "echo", False) else None
            if schema is not None:   # compiled off the event loop, once
                job.grammar = await self._off_loop(self._compile, schema,
                                                   "tools" if body.tools else "response_format")
            run = self._batched(job)
        except BaseException:
            job.release()
            raise
        if body.stream:
            counted = prompt_tokens if body.stream_options and body.stream_options.include_usage else None
            return RunStream(run, self._sse(run, job, header, fmt, counted),
                             media_type="text/event-stream", headers=plan_headers(job.asked))
        tokens = await until_disconnected(request, _collect(run, choices))
        run.record(self.metrics)
        return {**header,
                "choices": [self._choice(job, run, fmt, index, row)
                            for index, row in enumerate(tokens)],
                "usage": usage(prompt_tokens, sum(len(row) for row in tokens)),
                "rbcompile": {"plan": run.plan()}}

    async def _echo(self, job: "_Job") -> list[Echo]:
        """`echo`: each prompt's text and, with `logprobs`, its tokens' logprobs (one more
        forward of the full path over it, on the model thread)."""
        top, decoder, echoes = job.body.logprob_alternatives(), self.compiled.decoder, []
        for prompt in job.prompts:
            entries = None if top is None else await self.worker.call(
                prompt_logprobs, decoder, decoder.shape, prompt, top)
            # special tokens kept: the text its tokens' offsets point into
            echoes.append(Echo(self.tokenizer.decode(prompt), prompt, entries))
        return echoes

    def _choice(self, job: "_Job", run: TokenRun, fmt: ChoiceFormat, index: int,
                tokens: list[int]) -> dict:
        """A whole choice: its text cut at a stop string, its finish_reason, and with
        `logprobs` those of the tokens its text holds; with `echo`, the prompt's before them."""
        text, reason = self._ending(tokens, job.stop, job.max_tokens)
        echo = job.echo[index // job.body.n] if job.echo else None
        logprobs = None
        if job.body.logprob_alternatives() is not None:
            kept = kept_tokens(tokens, text, self._decode)
            logprobs = fmt.logprobs(run.requests[index].token_logprobs[:kept], tokens[:kept],
                                    self.token_texts, len(echo.text) if echo else 0)
            if echo:
                logprobs = join_logprobs(fmt.logprobs(echo.entries, echo.tokens,
                                                      self.token_texts), logprobs)
        return fmt.choice(index, echo.text + text if echo else text, reason, logprobs)

    async def _admit(self, qos: str, job: "_Job") -> None:
        """Refuse a request's choices with 503 when the watermarks or the queue say so (and
        relieve memory, see `_relieve_memory`), with 429 when its client holds its share;
        else count them against the client until `job.release()`."""
        memory, engine = await self._relieve_memory(), self.worker.engine
        try:
            admit(qos, memory, engine.queued, self.watermarks, self.limits.max_queue, job.choices)
        except Overloaded as exc:
            self.metrics.refused.labels(exc.reason).inc()
            raise ApiError(503, str(exc), code="overloaded") from None
        if not self.clients.take(job.client, job.choices):
            self.metrics.refused_by_client.inc()
            raise ApiError(429, f"this client has {self.clients.held.get(job.client, 0)} choices "
                           f"queued or running and asks {job.choices} more: at most "
                           f"{self.limits.max_client_choices} at once; retry later",
                           code="rate_limit_exceeded")
        job.release = partial(self.clients.give_back, job.client, job.choices)

    def _batched(self, job: "_Job") -> TokenRun:
        """The choices as requests of the continuous-batching engine, the n choices of a prompt
        as one group that shares its prefill (when the batch has rows for all n); choice i
        samples with seed `seed + i` (its own generator: the same prompt, seed and choice index
        give the same text whatever else is in the batch). Each choice drafts with its own
        `speculate` drafter, verified in the engine's batch steps."""
        body, batch = job.body, job.batch
        engine, loop, queue = self.worker.engine, asyncio.get_running_loop(), asyncio.Queue()
        requests = []
        try:
            for row, mask in zip(batch["input_ids"], batch["attention_mask"]):
                prompt, group = row[mask.bool()].tolist(), []
                for _ in range(body.n):
                    index = len(requests) + len(group)
                    group.append(EngineRequest(
                        prompt, job.max_tokens, _sampling(body, index), job.stop,
                        body.rbcompile.budget, priority=QOS_CLASSES.index(body.rbcompile.qos),
                        client=job.client, speculate=body.rbcompile.speculate,
                        logprobs=body.logprob_alternatives(),
                        grammar=job.grammar and job.grammar.fork(),
                        on_token=partial(deliver, loop, queue, index),
                        on_finish=lambda request, index=index: deliver(loop, queue, index, None)))
                if len(group) <= engine.max_batch:
                    requests += engine.submit_samples(group)
                else:
                    requests += [engine.submit(request) for request in group]
        except Exception:
            for request in requests:
                engine.cancel(request)
            raise
        def close():
            job.release()
            for request in requests:
                if request.finish_reason is None:
                    engine.cancel(request)

        return TokenRun(self._engine_events(requests, queue), lambda: (
            sum(r.drafted for r in requests), sum(r.accepted for r in requests)),
            lambda: self._plan_report(job.asked, max(r.budget_run for r in requests),
                                      [r.weights_run for r in requests]), close, requests)

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

    async def _voted(self, job: "_Job", header: dict, fmt: ChoiceFormat, prompt_tokens: int,
                     request: Request) -> dict:
        """`rbcompile.consistency`: one choice, the text of a sample giving the answer voted
        over 1, 3 or 7 samples (or as many as the complexity router picks: 'auto'), drawn as
        forked requests of the shared engine (the other rows keep decoding); `rbcompile` in the
        response holds the answer, its votes and the samples."""
        body, engine = job.body, self.worker.engine
        if body.n != 1 or body.stream:
            raise ApiError(400, "rbcompile.consistency gives one voted choice: it takes n=1 and "
                           "no stream", "rbcompile")
        vote = VoteOptions(extract=body.rbcompile.extract, tier_weights=self.tier_weights)
        sampling = _sampling(body, 0)
        check_vote(body.rbcompile.consistency, speculate=body.rbcompile.speculate, stream=False,
                   sampling=sampling)
        job.choices = vote_rows(body.rbcompile.consistency)
        if job.choices > engine.max_batch:
            raise ApiError(400, f"a vote of {job.choices} samples needs as many batch rows; this "
                           f"server has {engine.max_batch} (--max-batch)", "rbcompile.consistency")
        await self._admit(body.rbcompile.qos, job)
        prompt = job.batch["input_ids"][0][job.batch["attention_mask"][0].bool()].tolist()
        started, before = time.perf_counter(), (engine.stats.prefills, engine.stats.decode_steps)
        try:
            group = await self.worker.call(
                start_vote, self.compiled, engine, prompt, body.rbcompile.consistency,
                options=vote, max_new_tokens=job.max_tokens, sampling=sampling, stop=job.stop,
                budget=job.asked.budget if body.rbcompile.budget is not None else None,
                client=job.client, priority=QOS_CLASSES.index(body.rbcompile.qos))
            try:
                await until_disconnected(request, self.worker.until(lambda: group.done))
            finally:
                if not group.done:
                    with contextlib.suppress(ApiError):   # 503: shutting down, nothing runs
                        await self.worker.call(group.cancel)
        finally:
            job.release()
        result = vote_result(group, started, engine.stats.prefills - before[0],
                             engine.stats.decode_steps - before[1])
        self.metrics.tier.labels(str(result.stats.tier or body.rbcompile.consistency)).inc()
        winner = next((sample for sample in result.samples
                       if sample.voted and sample.text == result.text), None)
        reason = "length" if winner is not None and winner.finish_reason == "length" else "stop"
        stats = result.stats
        return {**header, "choices": [fmt.choice(0, result.text or "", reason)],
                "usage": usage(prompt_tokens, stats.new_tokens),
                "rbcompile": {"answer": result.answer, "votes": result.votes,
                              "samples": stats.drawn, "voted": stats.voted,
                              "stopped_early": stats.stopped_early, "tier": stats.tier,
                              "weights": stats.weights or self.compiled.decoder.weights,
                              "plan": self._plan_report(job.asked, job.asked.budget)}}

    def _plan(self, budget: float | None) -> GuardedPlan:
        """The plan a budget runs: the guard's, and the live checks' where a controller runs
        them."""
        controller = getattr(self.worker.engine, "controller", None)
        if controller is not None and controller.quality_loop is not None:
            return controller.quality_loop.plan(budget)
        return guard_budget(self.compiled.plans, budget, self.compiled.guard,
                            self.compiled.loss_path(DECODER))

    def _plan_report(self, asked: GuardedPlan, ran_budget: float,
                     weights_run: list[str | None] = ()) -> dict:
        """`rbcompile.plan` of a response: the budget asked for and why less ran, the largest
        budget its tokens ran (a controller's too: the engine records them bounded) and that
        plan's measured quality loss; the least precise weight level they ran, the level prompts
        were prefilled at, and the loss of the two together."""
        ran = guard_budget(self.compiled.plans, ran_budget, self.compiled.guard,
                           self.compiled.loss_path(DECODER))
        limit = self.compiled.guard.max_quality_loss
        weights = self.worker.engine.levels.least_precise(weights_run)
        return {**asked.as_json(), "budget": ran.budget, "quality_loss": ran.quality_loss,
                "weights": weights.name, "prefill_weights": self.compiled.decoder.prefill,
                "weights_quality_loss": weights.loss,
                "max_quality_loss": limit if limit != float("inf") else None}

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _ending(self, tokens: list[int], stop: list[str], max_tokens: int) -> tuple[str, str]:
        """A row's text, cut at a stop string, and its finish_reason."""
        text, stopped = cut_at_stop(self._decode(tokens), stop)
        ended = stopped or (tokens and tokens[-1] in self.eos) or len(tokens) < max_tokens
        return text, "stop" if ended else "length"

    async def _sse(self, run: TokenRun, job: "_Job", header: dict, fmt: ChoiceFormat,
                   usage_prompt_tokens: int | None = None):
        """Server-sent events: the chunks opening each choice (with `echo`, the prompt), a
        chunk per token with the text it adds (and the logprobs of the tokens since the last),
        the chunks ending each choice with its finish_reason, with `usage_prompt_tokens` a chunk
        with no choices and the usage, then [DONE]."""
        def chunk(choice: dict) -> str:
            return f"data: {_json({**header, 'choices': [choice]})}\n\n"

        stop, max_tokens, choices = job.stop, job.max_tokens, job.choices
        logprobs = StreamLogprobs(run, fmt, self.token_texts, job)
        for index in range(choices):
            for choice in fmt.opening(index):
                yield chunk(choice)
            if job.echo:
                yield chunk(fmt.delta(index, *logprobs.echo(index)))
        streams = [TextStream(self._decode, stop) for _ in range(choices)]
        first = True
        try:
            async for row, token in run.events:
                if first:
                    self.metrics.ttft.observe(time.perf_counter() - run.started)
                    first = False
                if (delta := streams[row].add(token)) and (choice := fmt.delta(
                        row, delta, logprobs.since(row, streams[row].tokens))) is not None:
                    yield chunk(choice)
        except Exception as exc:  # the 200 is sent: report in the stream
            log.exception("generation failed mid-stream")
            yield f"data: {_json(error_body(first_line(exc), kind='server_error'))}\n\n"
            return
        run.record(self.metrics)
        for row, stream in enumerate(streams):
            rest, (text, reason) = stream.finish(), self._ending(stream.tokens, stop, max_tokens)
            kept = stream.tokens[:kept_tokens(stream.tokens, text, self._decode)]  # not past a stop
            for choice in fmt.ending(row, rest, reason, logprobs.since(row, kept)):
                yield chunk(choice)
        if usage_prompt_tokens is not None:
            total = usage(usage_prompt_tokens, sum(len(stream.tokens) for stream in streams))
            yield f"data: {_json({**header, 'choices': [], 'usage': total})}\n\n"
        yield "data: [DONE]\n\n"


@dataclass(eq=False)
class _Job:
    """A generation request once checked: its choices' token batch, stop strings, new tokens,
    plan, and the client its choices are counted against until `release()`."""
    body: CompletionRequest | ChatCompletionRequest
    batch: dict
    stop: list[str]
    max_tokens: int
    asked: GuardedPlan
    client: str
    choices: int
    release: Callable[[], None] = lambda: None
    echo: list[Echo] | None = None   # per prompt, with `echo`
    grammar: Constraint | None = None   # the JSON schema every choice follows, forked per choice

    @property
    def prompts(self) -> list[list[int]]:
        """Each prompt's token ids, padding left out."""
        return [row[mask.bool()].tolist() for row, mask in
                zip(self.batch["input_ids"], self.batch["attention_mask"])]


def _sampling(body: CompletionRequest | ChatCompletionRequest, index: int) -> SamplingConfig:
    """Choice `index`'s sampling: seeded `seed + index`, so each choice repeats on its own."""
    penalties = Penalties(body.presence_penalty, body.frequency_penalty, body.repetition_penalty,
                          tuple((int(t), v) for t, v in (body.logit_bias or {}).items()))
    return SamplingConfig(body.temperature > 0, body.temperature or 1.0,
                          body.top_k if body.top_k and body.top_k > 0 else None,
                          body.top_p if body.top_p < 1 else None,
                          None if body.seed is None else body.seed + index,
                          min_p=body.min_p or None,
                          penalties=penalties if penalties.active else None)


async def _collect(run: TokenRun, choices: int) -> list[list[int]]:
    tokens = [[] for _ in range(choices)]
    async for index, token in run.events:
        tokens[index].append(token)
    return tokens


async def until_disconnected(request: Request, work):
    """Await `work` (a coroutine); a client that disconnects first cancels it (its `finally`
    blocks cancel its engine requests) and gets nothing: a ClientGone error."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})   # its finally blocks run now
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    """Return when the client has gone (the body is read: what comes next is a disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client left before its response: nothing to send."""


def _json(payload: dict) -> str:
    return json.dumps(payload, separators=(",", ":"))
