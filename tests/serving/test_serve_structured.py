"""Structured output (issue 47): `response_format` json_object / json_schema and tool calls by
constrained decoding (runtime/engine/grammar.py, runtime/serving/structured.py), on real
SmolLM2 weights cut to 2 layers with its real tokenizer: every seeded sample is JSON the
schema accepts, with drafting on too; tool calls and `parse(response_format=PydanticModel)`
work in the openai client, streamed and not."""
import json

import openai
import pydantic
import pytest
from fastapi.testclient import TestClient
from test_serve import assert_refused

import rbcompile
from rbcompile.runtime.serving.http import create_app

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 10}}}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "additionalProperties": False,
                                   "properties": {}}}}


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from transformers import AutoTokenizer

    from rbcompile.artifact.models import load_hf_model, resolve_checkpoint

    path = resolve_checkpoint("smollm2-135m")
    eager = load_hf_model(path)
    eager.model.layers = eager.model.layers[:2]
    eager.config.num_hidden_layers = 2
    folder = tmp_path_factory.mktemp("smol2")
    eager.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return TestClient(create_app(rbcompile.compile(str(folder))))


def _api(client):
    """The openai client on the app, and the served model's id."""
    api = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    return api, client.get("/v1/models").json()["data"][0]["id"]


def _valid(text: str) -> bool:
    person = json.loads(text)
    return (set(person) == {"name", "age"} and isinstance(person["name"], str)
            and len(person["name"]) <= 8 and type(person["age"]) is int
            and 0 <= person["age"] <= 120)


@pytest.mark.real
@pytest.mark.parametrize("speculate", ["off", "ngram"])
def test_every_seeded_sample_follows_the_schema(client, speculate):
    body = {"messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 48, "temperature": 1.0, "n": 5, "rbcompile": {"speculate": speculate},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": SCHEMA}}}
    texts = []
    for seed in range(10):   # 50 seeded samples per drafter: 100 in all
        reply = client.post("/v1/chat/completions", json={**body, "seed": seed})
        assert reply.status_code == 200, reply.text
        texts += [(c["message"]["content"], c["finish_reason"]) for c in reply.json()["choices"]]
    assert all(reason == "stop" and _valid(text) for text, reason in texts), texts


@pytest.mark.real
def test_json_object_and_the_openai_clients_parse(client):
    reply = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 40,
        "temperature": 0, "response_format": {"type": "json_object"}})
    text = reply.json()["choices"][0]["message"]["content"]
    # any object: this 2-layer model writes its first key until max_tokens, but as JSON
    assert text.startswith('{"'), text
    api, model = _api(client)
    parse = getattr(api.chat.completions, "parse", None) or api.beta.chat.completions.parse
    parsed = parse(model=model, messages=[{"role": "user", "content": "A person"}], seed=1,
                   max_tokens=48, response_format=Person).choices[0].message.parsed
    assert isinstance(parsed, Person)


@pytest.mark.real
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_parse_in_the_openai_client(client, stream):
    api, model = _api(client)
    options = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                   tools=[WEATHER, TIME], max_tokens=40, temperature=0)
    for choice, names in (("required", {"weather", "time"}),
                          ({"type": "function", "function": {"name": "weather"}}, {"weather"})):
        if stream:
            calls, finish = {}, None
            for chunk in api.chat.completions.create(**options, tool_choice=choice, stream=True):
                for delta in chunk.choices:
                    finish = delta.finish_reason or finish
                    for call in delta.delta.tool_calls or []:
                        entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                        entry["name"] += call.function.name or ""
                        entry["arguments"] += call.function.arguments or ""
            call = calls[0]
        else:
            reply = api.chat.completions.create(**options, tool_choice=choice).choices[0]
            finish, function = reply.finish_reason, reply.message.tool_calls[0].function
            call = {"name": function.name, "arguments": function.arguments}
        assert finish == "tool_calls" and call["name"] in names
        assert isinstance(json.loads(call["arguments"]), dict)


@pytest.mark.real
def test_structured_requests_it_cannot_honour_are_refused(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert_refused(client.post("/v1/chat/completions", json={**body, "tools": [WEATHER]}),
                   "tool_choice 'auto' (the default with tools) needs a parser", "tool_choice")
    assert_refused(client.post("/v1/chat/completions", json={
        **body, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
        "needs json_schema.schema", "response_format")
    assert_refused(client.post("/v1/chat/completions", json={
        **body, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                    "function": {"name": "nope"}}}),
        "tool_choice must be", "tool_choice")


def test_tool_parameters_with_definitions_keep_their_references():
    """pydantic writes nested models as `$defs` + `$ref`: nested under the call's `arguments`,
    they move to the root under the function's name."""
    from rbcompile.runtime.serving.structured import _tool_call_schema

    class City(pydantic.BaseModel):
        name: str

    class Trip(pydantic.BaseModel):
        start: City
        stops: list[City]

    tool = {"type": "function", "function": {"name": "plan", "parameters": Trip.model_json_schema()}}
    schema = _tool_call_schema([tool], "required")
    arguments = schema["properties"]["arguments"]
    assert "$defs" not in arguments and set(schema["$defs"]) == {"plan.City"}
    assert arguments["properties"]["start"]["$ref"] == "#/$defs/plan.City"
    assert arguments["properties"]["stops"]["items"]["$ref"] == "#/$defs/plan.City"
