"""Issue 43's input errors on `rbcompile serve` (runtime/serving/http.py): every one is a 400 in
OpenAI's shape naming its field, never a 500; any integer seed is taken (modulo 2**64)."""
import json

import pytest
from fastapi.testclient import TestClient

import rbcompile
from rbcompile.runtime.serving.http import create_app


@pytest.fixture(scope="module")
def client(tiny_checkpoints):
    compiled = rbcompile.compile(tiny_checkpoints["llama"])
    compiled.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return TestClient(create_app(compiled))


def post(client, path: str, raw: str):
    """A body as raw JSON text (escapes such as \\ud800 reach the server as written)."""
    return client.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path,raw,param,where", [
    ("/v1/completions", '{"prompt": "\\ud800 the", "max_tokens": 2}', "prompt", "0 ('\\ud800')"),
    ("/v1/completions", '{"prompt": ["the", "a \\udfff"], "max_tokens": 2}', "prompt",
     "2 ('\\udfff')"),
    ("/v1/completions", '{"prompt": "the", "model": "\\ud800", "max_tokens": 2}', "model",
     "0 ('\\ud800')"),
    ("/v1/completions", '{"prompt": "the", "stop": ["\\ud800"], "max_tokens": 2}', "stop",
     "0 ('\\ud800')"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content", "0 ('\\ud800')"),
])
def test_an_unpaired_surrogate_is_a_400_naming_its_field(client, path, raw, param, where):
    response = post(client, path, raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": f"'{param}': the text is not valid Unicode: character {where} cannot be "
                   "encoded as UTF-8",
        "type": "invalid_request_error", "param": param, "code": None}


def test_an_unknown_field_is_named_whatever_its_characters(client):
    response = post(client, "/v1/completions", '{"prompt": "the", "a-b": 1}')
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "unknown field 'a-b'"
    assert response.json()["error"]["param"] == "a-b"
    nested = post(client, "/v1/completions", '{"prompt": "the", "rbcompile": {"x-y": 1}}')
    assert nested.json()["error"]["message"] == "unknown field 'rbcompile.x-y'"


@pytest.mark.parametrize("seed", [2**63, 2**64 + 7, -(2**63) - 1, 10**30])
def test_any_integer_seed_samples_and_repeats(client, seed):
    body = {"prompt": "the a of", "max_tokens": 6, "temperature": 1.0, "seed": seed}
    texts = []
    for _ in range(2):
        response = post(client, "/v1/completions", json.dumps(body))
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    same = post(client, "/v1/completions", json.dumps({**body, "seed": seed % 2**64}))
    assert same.json()["choices"][0]["text"] == texts[0]
