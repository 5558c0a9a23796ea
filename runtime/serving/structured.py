"""Structured output for /v1/chat/completions: `response_format` (`json_object`, `json_schema`)
and `tools` with `tool_choice` "required" or a named function, by constrained decoding
(runtime/engine/grammar.py): every choice's text is JSON that the schema accepts.

A tool call is decoded as {"name": ..., "arguments": {...}}, the arguments under the function's
parameter schema, and answered as OpenAI does: `message.tool_calls` with the arguments as a
JSON string, `content` null, finish_reason "tool_calls"; a stream sends the call as one delta
once the choice ends. `tool_choice` "auto" would need a parser for the model's own tool-call
format (as `vllm serve --tool-call-parser`): refused.
"""
from __future__ import annotations

import copy
import json
import uuid

from rbcompile.runtime.serving.choices import ChatFormat
from rbcompile.runtime.serving.openai_api import ApiError, ChatCompletionRequest


def output_schema(body: ChatCompletionRequest) -> tuple[dict | None, bool]:
    """(the JSON schema the choices must follow, None: free text; whether it is a tool call)."""
    if body.tools and body.tool_choice not in (None, "none", "auto"):
        return _tool_call_schema(body.tools, body.tool_choice), True
    if body.tools and body.tool_choice != "none":
        raise ApiError(400, "tool_choice 'auto' (the default with tools) needs a parser for this "
                       "model's tool-call format: send 'required' or name a function",
                       "tool_choice")
    format_ = body.response_format
    if format_ is None or format_.type == "text":
        return None, False
    if format_.type == "json_object":
        return {"type": "object"}, False
    schema = (format_.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format json_schema needs json_schema.schema (an object)",
                       "response_format")
    return schema, False


def _tool_call_schema(tools: list[dict], choice) -> dict:
    functions = {}
    for tool in tools:
        function = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, "each tool must be {'type': 'function', 'function': {'name': "
                           "..., 'parameters': {...}}}", "tools")
        functions[function["name"]] = function.get("parameters") or {"type": "object"}
    if choice == "required":
        names = list(functions)
    elif isinstance(choice, dict) and (choice.get("function") or {}).get("name") in functions:
        names = [choice["function"]["name"]]
    else:
        raise ApiError(400, f"tool_choice must be 'none', 'required' or one of the tools' "
                       f"functions, got {choice!r}", "tool_choice")
    defs: dict = {}
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments":
                                                _arguments_schema(name, functions[name], defs)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name in names]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "$defs": defs} if defs else schema


def _arguments_schema(name: str, parameters: dict, defs: dict) -> dict:
    """A function's `parameters` as the call's `arguments`: its `$defs` / `definitions` moved
    into `defs` under the function's name and its references rewritten (nested under the
    call, references to its own root would not resolve; pydantic writes them)."""
    parameters = copy.deepcopy(parameters)
    for key in ("$defs", "definitions"):
        defs.update({f"{name}.{d}": schema for d, schema in parameters.pop(key, {}).items()})

    def rewrite(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix):
                        node["$ref"] = f"#/$defs/{name}.{ref[len(prefix):]}"
            for value in node.values():
                rewrite(value)
        elif isinstance(node, list):
            for value in node:
                rewrite(value)
    rewrite(parameters)
    for key in [k for k in defs if k.startswith(f"{name}.")]:
        rewrite(defs[key])
    return parameters


class ToolCallFormat(ChatFormat):
    """Chat choices whose text is a tool call: answered as `tool_calls` (streamed as one delta
    when the choice ends: the text is held until then)."""

    def __init__(self):
        self.held: dict[int, str] = {}
        self.held_logprobs: dict[int, list] = {}   # chat logprobs `content` entries

    def choice(self, index, text, finish_reason, logprobs=None):
        call = _tool_call(text) if finish_reason == "stop" else None
        if call is None:   # cut short (length): not a whole call
            return super().choice(index, text, finish_reason, logprobs)
        return {"index": index, "message": {"role": "assistant", "content": None,
                                            "tool_calls": [call]},
                "logprobs": logprobs, "finish_reason": "tool_calls"}

    def delta(self, index, text, logprobs=None):
        self.held[index] = self.held.get(index, "") + text
        self.held_logprobs.setdefault(index, []).extend((logprobs or {}).get("content", []))
        return None

    def ending(self, index, rest, finish_reason, logprobs=None):
        text = self.held.pop(index, "") + rest
        held = self.held_logprobs.pop(index, []) + (logprobs or {}).get("content", [])
        logprobs = {"content": held} if held or logprobs else None
        call = _tool_call(text) if finish_reason == "stop" else None
        if call is None:
            return super().ending(index, text, finish_reason, logprobs)
        return [self._chunk(index, {"tool_calls": [{"index": 0, **call}]}, logprobs=logprobs),
                self._chunk(index, {}, "tool_calls")]


def _tool_call(text: str) -> dict | None:
    try:
        decoded = json.loads(text)
        name, arguments = decoded["name"], decoded["arguments"]
    except (json.JSONDecodeError, KeyError, TypeError):   # not a whole call
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
