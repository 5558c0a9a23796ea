"""The OpenAI API's shapes as `rbcompile serve` speaks them: request bodies (strict: an unknown
field is a 400), the one-line error body, and pydantic's errors turned into it."""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rbcompile.errors import check_unicode, first_line
from rbcompile.runtime.control.admission import QOS_CLASSES
from rbcompile.runtime.engine.logprobs import MAX_TOP_LOGPROBS
from rbcompile.runtime.engine.requests import SPECULATE_MODES

RETRY_AFTER_S = 1   # what a 503 (overloaded) tells the client to wait


class ApiError(Exception):
    """A request refused with `status` and a one-line message in the OpenAI error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        headers = {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": str(RETRY_AFTER_S)},
                   408: {"Connection": "close"}, 413: {"Connection": "close"}}  # body unread
        return JSONResponse(error_body(self.message, self.param, self.code), status_code=self.status,
                            headers=headers.get(self.status))


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request bodies ----------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

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
    consistency: Literal[1, 3, 7, "auto"] | None = None   # voted samples (runtime/engine/consistency.py)
    extract: str = "first-line"   # with consistency: how an answer is read from a sample


class EmbeddingExtension(_Strict):
    """The `rbcompile` object of an embeddings request."""
    budget: float | None = Field(None, ge=0, le=1)


class StreamOptions(_Strict):
    include_usage: bool = False   # a last chunk with no choices and the request's usage


class _GenerationRequest(_Strict):
    """The fields /v1/completions and /v1/chat/completions share (with vLLM's `top_k`, `min_p`
    and `repetition_penalty`). `unsupported` names a field asked at a value this server cannot
    honour yet."""
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[str, float] | None = None   # token id -> added to its logit
    rbcompile: CompletionExtension = CompletionExtension()

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias):
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.isdigit()) or not -100 <= value <= 100:
                raise ValueError(f"maps token ids to values in [-100, 100], got {token!r}: "
                                 f"{value!r}")
        return bias

    def unsupported(self) -> str | None:
        """The first field asking what this server cannot do yet (None: none)."""
        return None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]   # text, or token ids
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)   # alternatives per token
    echo: bool = False            # the prompt's text and logprobs before the completion's
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def asked_tokens(self) -> tuple[int | None, str]:
        """(new tokens asked for, the field that asked)."""
        return self.max_tokens, "max_tokens"

    def logprob_alternatives(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return self.logprobs

    def unsupported(self) -> str | None:
        if self.best_of not in (None, self.n):
            return "best_of"
        return "suffix" if self.suffix else super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None     # a 'tool' message: the call it answers
    tool_calls: list[dict] | None = None   # an 'assistant' message: the calls it made

    def as_template(self) -> dict:
        """The message as chat templates take it (text parts joined; 'developer' is the
        system role under its newer name; templates that know tools read the rest)."""
        content = self.content if isinstance(self.content, str) or self.content is None \
            else "".join(part.text for part in self.content)
        role = "system" if self.role == "developer" else self.role
        extra = {"name": self.name, "tool_call_id": self.tool_call_id,
                 "tool_calls": self.tool_calls}
        return {"role": role, "content": content or ""} | {
            key: value for key, value in extra.items() if value}


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def logprob_alternatives(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


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


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def validation_error(errors: list[dict]) -> ApiError:
    """Pydantic's errors as a one-line 400 about the first field (a union's alternatives
    joined with 'or')."""
    param = param_name(errors[0]["loc"])
    kind = errors[0]["type"]
    if kind == "extra_forbidden":   # the field's own name, whatever its characters
        parent, name = param_name(errors[0]["loc"][:-1]), ascii(str(errors[0]["loc"][-1]))[1:-1]
        name = f"{parent}.{name}" if parent else name
        return ApiError(400, f"unknown field '{name}'", name)
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {errors[0]['msg']}")
    if param is None:
        return ApiError(400, f"the body must be a JSON object: {errors[0]['msg']}")
    reasons = dict.fromkeys(first_line(e["msg"]).removeprefix("Value error, ")
                            for e in errors if param_name(e["loc"]) == param)
    return ApiError(400, f"'{param}': {' or '.join(reasons)}", param)


def param_name(loc: tuple) -> str | None:
    """'rbcompile.budget' from ('body', 'rbcompile', 'budget'); union tags ('list[str]') left out."""
    fields = [str(part) for part in loc[1:] if isinstance(part, int) or part.isidentifier()
              and part not in ("str", "int", "float", "bool")]
    return ".".join(fields) or None



def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
