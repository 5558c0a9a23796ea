"""`rbcompile serve`: the OpenAI-compatible HTTP app (runtime/serving/http.py) through TestClient and the
openai client, on tiny llama and bert artifacts, and the CLI's refusals (no server is started)."""
import asyncio
import base64
import json
import time
from dataclasses import replace

import numpy as np
import openai
import pytest
import torch
from conftest import served_by_cli, text_streamed_through_sigterm, wait_for_health
from fastapi.testclient import TestClient
from tokenizers.processors import TemplateProcessing

import rbcompile
from rbcompile.artifact.quality import mean_pool
from rbcompile.frontend.cli import main
from rbcompile.runtime.serving.http import create_app
from rbcompile.runtime.serving.limits import ServeLimits
from rbcompile.runtime.serving.model_worker import ModelWorker
from rbcompile.runtime.serving.serve_config import ServeConfig
from rbcompile.runtime.serving.text_stream import TextStream

PROMPTS = ["the a of and to in", "he she"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {{ eos_token }} {% endfor %}"
                 "{% if add_generation_prompt %}he was{% endif %}")
MESSAGES = [{"role": "system", "content": "the a of"}, {"role": "user", "content": "he she and"}]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    """The tiny llama, its tokenizer given a chat template (the tiny word-level one has none)."""
    compiled = rbcompile.compile(tiny_checkpoints["llama"])
    compiled.tokenizer.chat_template = CHAT_TEMPLATE
    return compiled


@pytest.fixture(scope="module")
def bert(tiny_checkpoints):
    return rbcompile.compile(tiny_checkpoints["bert"])


@pytest.fixture(scope="module")
def decoder_client(llama):
    return TestClient(create_app(llama, ServeConfig(limits=ServeLimits(max_tokens_limit=40))))


@pytest.fixture(scope="module")
def encoder_client(bert):
    return TestClient(create_app(bert))


def greedy_texts(compiled, prompts, max_tokens, stop=None):
    batch = compiled.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    result = compiled.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=max_tokens,
                               stop=stop)
    return [compiled.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in result.tokens]


def greedy_chat_text(compiled, messages, max_tokens):
    """`generate` on the chat template's tokens (transformers tokenizes them as they are)."""
    input_ids = torch.tensor([compiled.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                     return_dict=False)])
    tokens = compiled.generate(input_ids, max_new_tokens=max_tokens).tokens[0]
    return compiled.tokenizer.decode(tokens, skip_special_tokens=True)


def stream_events(client, path, body) -> list[dict]:
    """The chunks of a streamed request, checked to be server-sent events ending in [DONE]."""
    response = client.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [block for block in response.text.split("\n\n") if block]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(event[len("data: "):]) for event in events[:-1]]


def stream_texts(client, body) -> tuple[dict, dict]:
    """A streamed completion's {index: concatenated text}, {index: finish_reason}."""
    texts, finish = {}, {}
    for chunk in stream_events(client, "/v1/completions", body):
        choice = chunk["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        finish[choice["index"]] = choice["finish_reason"]
    return texts, finish


def openai_client(client: TestClient) -> openai.OpenAI:
    """The openai client speaking to the app through `client` (an httpx.Client)."""
    return openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client,
                         max_retries=0)


def assert_refused(response, message, param):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and "\n" not in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None


def test_completion_is_generate_greedy(decoder_client, llama):
    body = {"model": llama.manifest["source"]["name"], "prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
    response = decoder_client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["object"] == "text_completion" and payload["id"].startswith("cmpl-")
    assert [c["text"] for c in payload["choices"]] == greedy_texts(llama, PROMPTS, 8)
    assert [c["index"] for c in payload["choices"]] == [0, 1]
    assert all(c["finish_reason"] in ("stop", "length") and c["logprobs"] is None for c in payload["choices"])
    usage = payload["usage"]
    assert usage["prompt_tokens"] == 8 and usage["total_tokens"] == 8 + usage["completion_tokens"]

    texts, finish = stream_texts(decoder_client, body)
    assert texts == {i: c["text"] for i, c in enumerate(payload["choices"])}
    assert finish == {i: c["finish_reason"] for i, c in enumerate(payload["choices"])}


def test_stop_string_cuts_the_text(decoder_client, llama):
    full = greedy_texts(llama, PROMPTS[:1], 12)[0]
    stop = " " + full.split()[2]  # the third word
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stop": [stop]}
    choice = decoder_client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == full[:full.index(stop)] and choice["finish_reason"] == "stop"
    assert stream_texts(decoder_client, body) == ({0: choice["text"]}, {0: "stop"})


def test_seeded_sampling_repeats(decoder_client):
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 3,
            "rbcompile": {"speculate": "ngram"}}
    first, second = (decoder_client.post("/v1/completions", json=body).json() for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_openai_client_completions(decoder_client, llama):
    client = openai_client(decoder_client)
    body = {"model": llama.manifest["source"]["name"], "prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
    completion = client.completions.create(**body)
    assert completion.object == "text_completion"
    assert [c.text for c in completion.choices] == greedy_texts(llama, PROMPTS, 8)
    streamed = {}
    for chunk in client.completions.create(**body, stream=True):
        choice = chunk.choices[0]
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in completion.choices}


def test_stream_options_include_usage(decoder_client, llama):
    """The openai client's stream_options: a last chunk with no choices carries the usage,
    the same as the non-streamed response's."""
    client = openai_client(decoder_client)
    body = {"model": llama.manifest["source"]["name"], "prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
    usage = client.completions.create(**body).usage
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == usage
    assert all(chunk.usage is None for chunk in chunks[:-1])
    chat = {"model": body["model"], "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    streamed = list(client.chat.completions.create(**chat, stream=True,
                                                   stream_options={"include_usage": True}))
    assert streamed[-1].usage == client.chat.completions.create(**chat).usage
    refused = decoder_client.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    assert refused.status_code == 400 and "stream_options goes with stream: true" in refused.text


def test_openai_client_chat(decoder_client, llama):
    client = openai_client(decoder_client)
    body = {"model": llama.manifest["source"]["name"], "messages": MESSAGES, "temperature": 0}
    chat = client.chat.completions.create(**body, max_tokens=10)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    [choice] = chat.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == greedy_chat_text(llama, MESSAGES, 10)
    template_tokens = llama.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                          return_dict=False)
    assert chat.usage.prompt_tokens == len(template_tokens) == 11
    chunks = list(client.chat.completions.create(**body, max_completion_tokens=10, stream=True))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_chat_adds_no_second_bos(decoder_client, llama, monkeypatch):
    """A tokenizer that adds [BOS] itself (as llama's do) adds none to the template's text."""
    monkeypatch.setattr(llama.tokenizer.backend_tokenizer, "post_processor",
                        TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)]))
    assert llama.tokenizer("he")["input_ids"] == [1, 14]
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    chat = decoder_client.post("/v1/chat/completions", json=body).json()
    assert chat["usage"]["prompt_tokens"] == 11  # [BOS] the a of [EOS] he she and [EOS] he was
    assert chat["choices"][0]["message"]["content"] == greedy_chat_text(llama, MESSAGES, 4)


def test_chat_stream_chunks(decoder_client):
    chunks = stream_events(decoder_client, "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "n": 2})
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    for index in (0, 1):
        choices = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert choices[0] == {"index": index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
        assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in choices[1:-1])
        assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] in ("stop", "length")


def test_n_choices_per_prompt(decoder_client, llama):
    body = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 3}
    payload = decoder_client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in payload["choices"]] == list(range(6))  # prompt_index * n + k
    greedy = greedy_texts(llama, PROMPTS, 6)
    assert [c["text"] for c in payload["choices"]] == [text for text in greedy for _ in range(3)]
    assert payload["usage"]["prompt_tokens"] == 8  # each prompt counted once
    assert stream_texts(decoder_client, body)[0] == {c["index"]: c["text"] for c in payload["choices"]}
    chat = decoder_client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6,
                                                             "temperature": 0, "n": 3}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in chat["choices"]} == {greedy_chat_text(llama, MESSAGES, 6)}


def test_sampled_choices_differ_and_a_seed_repeats_them(decoder_client):
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 5}
    first, second = ([c["message"]["content"] for c in decoder_client.post("/v1/chat/completions", json=body)
                      .json()["choices"]] for _ in range(2))
    assert first == second and len(set(first)) == 3


def test_chat_fills_the_positions_left_by_default(llama):
    client = TestClient(create_app(llama, ServeConfig(limits=ServeLimits(max_tokens_limit=5))))
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == greedy_chat_text(llama, MESSAGES, 5)


def test_chat_needs_a_chat_template(decoder_client, llama, monkeypatch):
    body, name = {"messages": MESSAGES, "max_tokens": 2}, llama.manifest["source"]["name"]
    monkeypatch.setattr(llama.tokenizer, "chat_template", None)
    assert_refused(decoder_client.post("/v1/chat/completions", json=body),
                   f"model '{name}' has no chat template: use /v1/completions", None)
    monkeypatch.setattr(llama.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    assert_refused(decoder_client.post("/v1/chat/completions", json=body),
                   "the chat template refused the messages: roles must alternate", "messages")


@pytest.mark.parametrize("body, message, param", [
    ({"messages": MESSAGES, "logit_bias": {"x": 5}}, "maps token ids to values", "logit_bias"),
    ({"messages": MESSAGES, "prompt": "the"}, "unknown field 'prompt'", "prompt"),
    ({"messages": []}, "'messages' is an empty list", "messages"),
    ({"messages": [{"role": "robot", "content": "the"}]},
     "'system', 'developer', 'user', 'assistant' or 'tool'", "messages.0.role"),
    ({"messages": [{"role": "user", "content": "the", "audio": "he"}]},
     "unknown field 'messages.0.audio'", "messages.0.audio"),
    ({"messages": MESSAGES, "max_tokens": 4, "max_completion_tokens": 4}, "not both", "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": 41},
     "max_completion_tokens=41 is over this server's limit", "max_completion_tokens"),
    ({"messages": MESSAGES, "n": 9}, "n=9 is over this server's limit of 8", "n"),
    ({"messages": MESSAGES, "rbcompile": {"budget": 2}}, "less than or equal to 1", "rbcompile.budget"),
])
def test_bad_chat_requests(decoder_client, body, message, param):
    assert_refused(decoder_client.post("/v1/chat/completions", json=body), message, param)


def test_openai_client_embeddings_and_models(encoder_client, bert):
    client = openai_client(encoder_client)
    name, texts = bert.manifest["source"]["name"], ["the a of", "he she was in the"]
    embeddings = client.embeddings.create(model=name, input=texts)  # the client asks for base64
    expected = encoder_client.post("/v1/embeddings", json={"input": texts}).json()["data"]
    assert np.allclose([row.embedding for row in embeddings.data], [row["embedding"] for row in expected],
                       atol=1e-6)
    assert [model.id for model in client.models.list()] == [name]


def test_embeddings_are_unit_mean_pooled(encoder_client, bert):
    texts = ["the a of", "he she was in the"]
    payload = encoder_client.post("/v1/embeddings", json={"input": texts}).json()
    vectors = torch.tensor([row["embedding"] for row in payload["data"]])
    assert vectors.shape == (2, 32)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(2), atol=1e-5)
    batch = bert.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
    expected = mean_pool(bert(batch["input_ids"], batch["attention_mask"])["last_hidden_state"],
                         batch["attention_mask"])
    assert torch.allclose(vectors, expected, atol=1e-5)
    assert payload["usage"]["prompt_tokens"] == 8
    encoded = encoder_client.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(encoded.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vectors[0].numpy(), atol=1e-6)



def test_repeated_embedding_inputs_come_from_the_result_cache(bert):
    """Inputs embedded before (same tokens, same budget) are answered from the result cache
    with the vectors computed then; a batch mixing them with new ones computes only the new
    (one forward of 1 row); another budget misses; /metrics shows the hit rate; under memory
    pressure the cache holds half its capacity; --result-cache-mb 0 turns it off."""
    level = {"memory": 0.1}
    client = TestClient(create_app(bert, ServeConfig(result_cache_mb=1), memory=lambda: level["memory"]))
    texts = ["the a of", "he she was in the"]
    first = client.post("/v1/embeddings", json={"input": texts}).json()["data"]
    calls = []
    original = type(bert).__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(bert), "__call__", lambda self, ids, *a, **k: calls.append(tuple(ids.shape))
                      or original(self, ids, *a, **k))
        again = client.post("/v1/embeddings", json={"input": texts}).json()["data"]
        mixed = client.post("/v1/embeddings", json={"input": [texts[1], "she was"]}).json()["data"]
        client.post("/v1/embeddings", json={"input": texts[0], "rbcompile": {"budget": 0.5}})
    assert again == first and mixed[0]["embedding"] == first[1]["embedding"]
    assert calls == [(1, 2), (1, 3)]     # "she was" (2 tokens), then texts[0] at budget 0.5
    fresh = TestClient(create_app(bert, ServeConfig(result_cache_mb=0))).post(
        "/v1/embeddings", json={"input": ["she was"]}).json()["data"][0]["embedding"]
    assert np.allclose(mixed[1]["embedding"], fresh, atol=1e-6)
    metrics = client.get("/metrics").text
    rate = next(line for line in metrics.splitlines() if line.startswith("rbcompile_result_cache_hit_rate "))
    assert float(rate.split()[-1]) == pytest.approx(3 / 7)        # 3 hits of 7 lookups
    level["memory"] = 0.7
    client.post("/v1/embeddings", json={"input": "of"})
    results = client.app.state.results
    assert results.budget == results.max_bytes // 2 and results.nbytes <= results.budget
    level["memory"] = 0.1
    client.post("/v1/embeddings", json={"input": "of"})
    assert results.budget == results.max_bytes

def test_models_health_metrics(decoder_client, llama):
    models = decoder_client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [llama.manifest["source"]["name"]]
    assert decoder_client.get("/health").json() == {"status": "ok"}
    decoder_client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "stream": True,
                                                 "temperature": 0})
    decoder_client.post("/v1/completions", json={"prompt": PROMPTS[0], "n": 99})
    decoder_client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    text = decoder_client.get("/metrics").text
    for line in ('rbcompile_requests_total{endpoint="/v1/completions",status="200"}',
                 'rbcompile_requests_total{endpoint="/v1/completions",status="400"}',
                 'rbcompile_requests_total{endpoint="/v1/chat/completions",status="200"}',
                 'rbcompile_request_seconds_count{endpoint="/v1/completions"}',
                 "rbcompile_time_to_first_token_seconds_count", "rbcompile_generated_tokens_total",
                 "rbcompile_tokens_per_second", "rbcompile_speculative_drafted_tokens_total",
                 "rbcompile_speculative_accepted_tokens_total", "rbcompile_requests_in_flight"):
        assert line in text, line
    generated = next(l for l in text.splitlines() if l.startswith("rbcompile_generated_tokens_total"))
    assert float(generated.split()[-1]) >= 4


@pytest.mark.parametrize("body, message, param", [
    ({"prompt": "the", "logit_bias": {"x": 5}}, "maps token ids to values", "logit_bias"),
    ({"prompt": "the", "rbcompile": {"qos": "urgent"}}, "'interactive', 'standard' or 'batch'", "rbcompile.qos"),
    ({"prompt": "the", "rbcompile": {"tier": 2}}, "unknown field 'rbcompile.tier'", "rbcompile.tier"),
    ({"prompt": "the", "n": 9}, "n=9 is over this server's limit of 8", "n"),
    ({"prompt": "the", "n": 0}, "greater than or equal to 1", "n"),
    ({"prompt": "the", "max_tokens": "many"}, "valid integer", "max_tokens"),
    ({"prompt": 7}, "valid string or", "prompt"),
    ({"prompt": "the", "max_tokens": 41}, "over this server's limit of 40", "max_tokens"),
    ({"prompt": "the " * 30, "max_tokens": 40}, "over the 34 positions left after the 30-token prompt", "max_tokens"),
    ({"prompt": "the " * 64}, "a prompt has 64 tokens; at most 63", "prompt"),
    ({"prompt": []}, "'prompt' is an empty list", "prompt"),
    ({"prompt": "the", "model": "gpt-4"}, "unknown model 'gpt-4'", "model"),
    ({"prompt": "the", "rbcompile": {"budget": 2}}, "less than or equal to 1", "rbcompile.budget"),
    ({"prompt": "the", "stop": [""]}, "stop strings must not be empty", None),
])
def test_bad_completion_requests(decoder_client, body, message, param):
    assert_refused(decoder_client.post("/v1/completions", json=body), message, param)


def test_malformed_json_and_wrong_family(decoder_client, encoder_client):
    response = decoder_client.post("/v1/completions", content=b"{not json",
                                   headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = decoder_client.post("/v1/embeddings", json={"input": "the"})
    assert response.status_code == 400
    assert "serves encoder artifacts, not decoders: use /v1/completions" in response.json()["error"]["message"]
    response = encoder_client.post("/v1/completions", json={"prompt": "the"})
    assert response.status_code == 400
    assert "serves decoder artifacts, not encoders: use /v1/embeddings" in response.json()["error"]["message"]
    response = encoder_client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert "serves decoder artifacts, not encoders: use /v1/embeddings" in response.json()["error"]["message"]


def test_body_limit(llama):
    client = TestClient(create_app(llama, ServeConfig(limits=ServeLimits(max_body_bytes=64))))
    response = client.post("/v1/completions", json={"prompt": "the " * 40})
    assert response.status_code == 413
    assert response.json()["error"]["message"] == "the request body is over the 64-byte limit"


def test_api_key(llama):
    client = TestClient(create_app(llama, ServeConfig(api_key="s3cret")))
    body = {"prompt": "the", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = client.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/metrics").status_code == 401
    assert client.get("/health").json() == {"status": "ok"}
    good = {"Authorization": "Bearer s3cret"}
    assert client.post("/v1/completions", json=body, headers=good).status_code == 200
    assert client.get("/v1/models", headers=good).status_code == 200


def test_worker_stops_when_the_stream_is_dropped():
    produced = []

    def tokens():
        for token in range(500):
            produced.append(token)
            time.sleep(0.002)
            yield token

    async def read_one_then_leave():
        worker = ModelWorker()
        stream = worker.iterate(tokens())
        assert await anext(stream) == 0
        await stream.aclose()
        await worker.call(lambda: None)  # queued behind the producer: it has returned

    asyncio.run(read_one_then_leave())
    assert len(produced) < 50


def test_text_stream_holds_back_a_possible_stop_string():
    stream = TextStream("".join, ["xy"])
    assert [stream.add(c) for c in "abx"] == ["a", "b", ""]
    assert stream.add("y") == "" and stream.finish() == ""
    held = TextStream("".join, ["xy"])
    assert [held.add(c) for c in "ax"] == ["a", ""] and held.finish() == "x"


def test_cli_refuses_an_open_host_without_a_key(tmp_path, capsys, monkeypatch):
    assert main(["serve", str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "--host 0.0.0.0 is not a loopback address" in capsys.readouterr().err
    monkeypatch.delenv("RBC_TEST_KEY", raising=False)
    assert main(["serve", str(tmp_path), "--host", "0.0.0.0", "--api-key-env", "RBC_TEST_KEY"]) == 2
    assert "RBC_TEST_KEY: that environment variable is not set" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--max-tokens-limit", "0"]) == 2
    assert main(["serve", str(tmp_path), "--prefill-chunk", "-1"]) == 2
    assert "--prefill-chunk must be >= 0 (0: never chunk), got -1" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--result-cache-mb", "-1"]) == 2
    assert "--result-cache-mb must be >= 0, got -1.0" in capsys.readouterr().err


def test_cli_serves_with_a_key(tmp_path, llama, monkeypatch):
    served = served_by_cli(monkeypatch)
    monkeypatch.setenv("RBC_TEST_KEY", "k3y")
    artifact = llama.save(tmp_path / "artifact")
    assert main(["serve", str(artifact), "--host", "0.0.0.0", "--port", "0",
                 "--api-key-env", "RBC_TEST_KEY"]) == 0
    assert served["address"][0] == "0.0.0.0" and served["address"][1] > 0
    assert served["app"].state.engine.config.prefill_chunk == 512          # the default
    client = TestClient(served["app"])
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k3y"}).status_code == 200


def test_cli_serve_compiles_plans_and_refuses_cuda_graphs_on_cpu(tmp_path, llama, monkeypatch,
                                                                capsys):
    served = served_by_cli(monkeypatch)
    artifact = llama.save(tmp_path / "artifact")
    assert main(["serve", str(artifact), "--cuda-graphs"]) == 2
    assert capsys.readouterr().err.strip() == ("rbcompile: error: CUDA graphs need the model on "
                                               "a CUDA device (it is on cpu)")
    assert main(["serve", str(artifact), "--ray", "--compile-plans"]) == 2
    assert "are not passed to Ray replicas" in capsys.readouterr().err
    assert not served
    assert main(["serve", str(artifact), "--compile-plans", "--device", "cpu",
                 "--dtype", "fp32"]) == 0
    assert "decode steps: torch executor, fp32 weights" in capsys.readouterr().err
    client = TestClient(served["app"])
    expected = llama.generate([llama.tokenizer("the a of")["input_ids"]], max_new_tokens=6)
    response = client.post("/v1/completions", json={"prompt": "the a of", "max_tokens": 6,
                                                    "temperature": 0})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == llama.tokenizer.decode(expected.tokens[0])
    assert served["app"].state.engine.step_fn.plan_graphs.stats.compiles >= 1


def test_concurrent_completions_share_batch_steps_and_keep_their_tokens(llama):
    """Six completions at once (ASGI, concurrently), with every drafter (off, ngram, the light
    path, auto): the engine decodes them together, verifying the drafts in its batch steps, and
    each text is generate's on that prompt alone; /metrics counts the drafts and the steps by
    drafter."""
    import httpx

    app = create_app(llama, ServeConfig(max_batch=4))
    speculation = app.state.engine.speculation
    speculation.light = replace(speculation.light, threshold=0.0)   # flat tiny model: drafts
    modes = ["ngram", "off", "self", "auto", "ngram", "self"]
    prompts = ["the a of the a", "he she and to", "in the in the in", "of and to in he", "she", "a the of and"]

    async def post_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "rbcompile": {"speculate": mode}})
                for mode, prompt in zip(modes, prompts)))
            return responses, (await client.get("/metrics")).text

    responses, metrics = asyncio.run(post_all())
    texts = [response.json()["choices"][0]["text"] for response in responses]
    assert texts == [greedy_texts(llama, [prompt], 12)[0] for prompt in prompts]
    stats = app.state.engine.stats
    assert stats.prefills == len(prompts) and stats.decode_rows > stats.decode_steps
    assert stats.speculative_steps > 0 and stats.drafted > 0
    assert f"rbcompile_speculative_drafted_tokens_total {float(stats.drafted)}" in metrics
    assert 'rbcompile_completions_by_drafter_total{drafter="ngram"} 2.0' in metrics
    assert 'rbcompile_completions_by_drafter_total{drafter="self"} 2.0' in metrics
    for mode in ("ngram", "self"):
        assert stats.steps_by_drafter[mode] > 0
        assert f'rbcompile_decode_steps_by_drafter_total{{drafter="{mode}"}} ' \
               f'{float(stats.steps_by_drafter[mode])}' in metrics


def test_a_client_leaving_mid_stream_frees_its_row(llama):
    app = create_app(llama)
    engine = app.state.engine
    submitted = []
    submit = engine.submit_samples   # a prompt's choices join as one group
    engine.submit_samples = lambda group: submitted.extend(group) or submit(group)
    step = engine.step_fn

    def slow_step(*args, **kwargs):   # 10 ms a forward: 50 tokens take longer than leaving
        time.sleep(0.01)
        return step(*args, **kwargs)

    engine.step_fn = slow_step
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 50, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}

    async def read_one_chunk_then_leave():
        first_token, asked = asyncio.Event(), False

        async def receive():
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await first_token.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and b'"text"' in message.get("body", b""):
                first_token.set()

        await app(scope, receive, send)

    asyncio.run(read_one_chunk_then_leave())
    deadline = time.monotonic() + 10
    while submitted[0].finish_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert submitted[0].finish_reason == "cancelled" and len(submitted[0].tokens) < 50
    assert not engine.running


def test_sigterm_drains_the_requests_in_flight_and_exits_0(llama, tmp_path):
    """`rbcompile serve` in a process: SIGTERM while a stream is open lets that stream finish
    ([DONE]), refuses new connections, and the server exits 0."""
    import socket
    import subprocess
    import sys

    import httpx

    artifact = llama.save(tmp_path / "artifact")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "rbcompile.frontend.cli", "serve", str(artifact),
                                "--port", str(port)], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, process)
        body = {"prompt": PROMPTS[0], "max_tokens": 50, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            text = text_streamed_through_sigterm(response, process)
        assert text == greedy_texts(llama, [PROMPTS[0]], 50)[0]
        assert process.wait(60) == 0, process.stderr.read()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health")
    finally:
        process.kill()


def test_memory_watermarks_refuse_with_503_by_qos_class(llama):
    """80%: the batch class gets 503 (others are served); 95%: every completion gets 503 with
    Retry-After; 60%: the prefix cache is halved first. Counted in /metrics."""
    level = {"memory": 0.5}
    client = TestClient(create_app(llama, ServeConfig(prefix_cache_mb=0.01), memory=lambda: level["memory"]))
    body = {"prompt": " ".join([PROMPTS[0]] * 3), "max_tokens": 4, "temperature": 0}   # 18 tokens
    assert client.post("/v1/completions", json=body).status_code == 200
    cache = client.app.state.engine.prefix_cache
    filled = cache.nbytes
    assert filled > cache.capacity_bytes // 2
    level["memory"] = 0.65
    assert client.post("/v1/completions", json=body).status_code == 200
    assert cache.nbytes <= cache.capacity_bytes // 2 < filled   # halved, and kept so
    level["memory"] = 0.5
    assert client.post("/v1/completions", json=body).status_code == 200
    assert cache.nbytes == filled                                # lifted
    level["memory"] = 0.85
    batch = client.post("/v1/completions", json={**body, "rbcompile": {"qos": "batch"}})
    assert batch.status_code == 503 and "not admitting QoS class 'batch'" in batch.json()["error"]["message"]
    assert client.post("/v1/completions", json={**body, "rbcompile": {"qos": "interactive"}}).status_code == 200
    level["memory"] = 0.97
    shed = client.post("/v1/completions", json=body)
    assert shed.status_code == 503 and shed.headers["Retry-After"] == "1"
    assert shed.json()["error"]["code"] == "overloaded" and "97%" in shed.json()["error"]["message"]
    metrics = client.get("/metrics").text
    assert 'rbcompile_overload_refusals_total{reason="shed"} 1.0' in metrics
    assert 'rbcompile_overload_refusals_total{reason="rejected"} 1.0' in metrics
    assert "rbcompile_memory_watermark 3.0" in metrics
    assert 'rbcompile_queued_requests_by_qos{qos="batch"} 0.0' in metrics


def test_engine_admits_by_qos_class_then_arrival(llama):
    from rbcompile.runtime.engine.core import EngineRequest

    engine = llama.batch_engine(max_batch=1)
    finished = []
    for name, priority in [("batch", 2), ("standard", 1), ("interactive", 0), ("standard 2", 1)]:
        engine.submit(EngineRequest([4, 5, 6], 2, priority=priority,
                                    on_finish=lambda request, name=name: finished.append(name)))
    assert engine.queued_by_priority() == {0: 1, 1: 2, 2: 1}
    while engine.has_work:
        engine.step()
    assert finished == ["interactive", "standard", "standard 2", "batch"]


@pytest.mark.parametrize("slo_s,lighter", [(1e-6, True), (100.0, False)])
def test_pid_controller_sets_the_budget_of_requests_without_one(llama, slo_s, lighter):
    """Decode steps slower than the SLO raise the engine's budget (requests with no budget of
    their own then run a light plan); steps well within it leave the full path."""
    from rbcompile.runtime.control.decode_control import DecodeController
    from rbcompile.runtime.control.pid import PIDConfig
    from rbcompile.runtime.control.policy import PIDPolicy
    from rbcompile.runtime.engine.core import EngineRequest

    engine = llama.batch_engine(max_batch=4)
    controller = DecodeController(engine, PIDPolicy(PIDConfig(setpoint=slo_s, period_s=0.0)),
                                  slo_s, memory=lambda: 0.5, period_s=0.0)
    budgets = []
    engine.gates_for_budget = lambda budget: budgets.append(budget) or llama.decoder_gates(budget)
    request = engine.submit(EngineRequest([7, 8, 9], 20))
    while engine.has_work:
        engine.step()
    assert controller.state().latency_p99 > 0 and controller.quality.snapshot()["count"] == 19
    if lighter:
        assert budgets[0] is None and budgets[-1] > 0 and engine.budget == budgets[-1]
    else:
        assert set(budgets) == {None}
        assert request.tokens == llama.generate(torch.tensor([[7, 8, 9]]), max_new_tokens=20).tokens[0]


def test_cli_serves_with_a_policy(tmp_path, llama, monkeypatch, capsys):
    from rbcompile.runtime.control.policy import PIDPolicy

    served = served_by_cli(monkeypatch)
    artifact = llama.save(tmp_path / "artifact")
    assert main(["serve", str(artifact), "--policy", "pid", "--slo-ms", "50"]) == 0
    controller = served["app"].state.engine.controller
    assert isinstance(controller.policy, PIDPolicy) and controller.slo_s == 0.05
    assert main(["serve", str(artifact), "--policy", "ppo"]) == 2
    assert "--policy ppo needs it" in capsys.readouterr().err
    assert main(["serve", str(artifact), "--policy", "ppo", "--policy-file", str(tmp_path / "none")]) == 2
    assert "no such policy folder" in capsys.readouterr().err


def test_the_n_choices_of_a_prompt_share_one_prefill(llama):
    client = TestClient(create_app(llama))
    body = {"prompt": PROMPTS, "max_tokens": 6, "n": 3, "temperature": 0.8, "seed": 4}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert [choice["index"] for choice in choices] == list(range(6))
    assert client.app.state.engine.stats.prefills == 2          # one per prompt, not per choice


def test_consistency_field_answers_with_the_voted_sample(decoder_client, llama):
    """`rbcompile.consistency`: one choice, the text of a sample giving the voted answer, as
    `generate(consistency=3)` on the same tokens, seed and extractor gives; chat too."""
    from rbcompile.runtime.engine.consistency import VoteOptions

    options = dict(max_new_tokens=5, do_sample=True, temperature=0.9, seed=3, consistency=3,
                   vote=VoteOptions(extract="regex:(\\w+)"))
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0.9, "seed": 3,
            "rbcompile": {"consistency": 3, "extract": "regex:(\\w+)"}}
    data = decoder_client.post("/v1/completions", json=body).json()
    expected = llama.generate(llama.tokenizer([PROMPTS[0]], return_tensors="pt")["input_ids"], **options)
    assert [choice["text"] for choice in data["choices"]] == [expected.text]
    assert data["rbcompile"]["votes"] == expected.votes and data["rbcompile"]["answer"] == expected.answer
    assert data["rbcompile"]["samples"] == 3 and data["usage"]["completion_tokens"] == expected.stats.new_tokens
    chat = decoder_client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 5, "temperature": 0.9, "seed": 3,
        "rbcompile": {"consistency": 3, "extract": "regex:(\\w+)"}}).json()
    ids = torch.tensor([llama.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                            return_dict=False)])
    assert chat["choices"][0]["message"]["content"] == llama.generate(ids, **options).text
    assert 'rbcompile_consistency_tier_total{tier="3"}' in decoder_client.get("/metrics").text


def test_votes_decode_at_the_servers_tier_weights(llama):
    """`serve --tier-weights`: a vote's tier decodes at its level, reported in the response; a
    level this server cannot run is a 400 naming why."""
    client = TestClient(create_app(llama, ServeConfig(tier_weights={3: "int4"})))
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0.9, "seed": 3,
            "rbcompile": {"consistency": 3}}
    assert_refused(client.post("/v1/completions", json=body),
                   "int4 weights need the onnxruntime executor", None)
    body["rbcompile"]["consistency"] = 1
    assert client.post("/v1/completions", json=body).json()["rbcompile"]["weights"] == "fp32"


@pytest.mark.parametrize("extension, extra, message, param", [
    ({"consistency": 3}, {"n": 2}, "takes n=1 and no stream", "rbcompile"),
    ({"consistency": 3}, {"stream": True}, "takes n=1 and no stream", "rbcompile"),
    ({"consistency": "auto"}, {}, "no complexity router for this artifact", None),
    ({"consistency": 3, "speculate": "ngram"}, {}, "does not combine with speculate", None),
    ({"consistency": 3, "extract": "middle"}, {}, "unknown answer extractor 'middle'", None),
    ({"consistency": 5}, {}, "1, 3, 7 or 'auto'", "rbcompile.consistency"),
])
def test_bad_consistency_requests(decoder_client, extension, extra, message, param):
    body = {"prompt": "the", "max_tokens": 4, "temperature": 0.9, "rbcompile": extension, **extra}
    assert_refused(decoder_client.post("/v1/completions", json=body), message, param)
