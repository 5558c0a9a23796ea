"""The OpenAI API as clients use it (issue 47): token-id prompts, `logprobs` / `top_logprobs`
equal to HF's log-softmax (with and without drafting, streamed and not), `echo` with the
prompt's logprobs (what lm-eval's loglikelihood reads), and the fields clients send at values
that change nothing, refused by name at values this server cannot honour."""
import pytest
import torch
from fastapi.testclient import TestClient
from test_serve import CHAT_TEMPLATE, assert_refused

from rbcompile.artifact.guard import QualityGuard
from rbcompile.runtime.serving.http import create_app

PROMPT = "the a of and to in"


@pytest.fixture(scope="module")
def served(compiled_tiny):
    compiled, eager = compiled_tiny["llama"]
    compiled.tokenizer.chat_template = CHAT_TEMPLATE
    compiled.guard = QualityGuard()
    return TestClient(create_app(compiled)), compiled, eager


def _hf_logprobs(eager, ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at every position of `ids` [positions, vocab]."""
    with torch.no_grad():
        logits = eager(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def _complete(client, **body) -> dict:
    response = client.post("/v1/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("speculate", ["off", "ngram"])
def test_completion_logprobs_are_hf_log_softmax(served, speculate):
    """Two prompts batched (rows of different lengths in one step), with and without drafts."""
    client, compiled, eager = served
    batch = [compiled.tokenizer(text)["input_ids"] for text in (PROMPT, "he she and")]
    choices = _complete(client, prompt=batch, max_tokens=6, logprobs=3,
                        rbcompile={"speculate": speculate})["choices"]
    for ids, choice in zip(batch, sorted(choices, key=lambda c: c["index"])):
        logprobs = choice["logprobs"]
        tokens = compiled.generate(torch.tensor([ids]), max_new_tokens=6).tokens[0]
        assert len(logprobs["token_logprobs"]) == len(tokens)
        reference = _hf_logprobs(eager, ids + tokens)[len(ids) - 1:-1]
        expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs["token_logprobs"]), expected, atol=1e-5)
        for top, row in zip(logprobs["top_logprobs"], reference):
            assert len(top) == 3
            assert max(top.values()) == pytest.approx(float(row.max()), abs=1e-5)   # greedy
        offsets = [0]
        for token in logprobs["tokens"][:-1]:
            offsets.append(offsets[-1] + len(token))
        assert logprobs["text_offset"] == offsets


@pytest.mark.parametrize("executor", ["torch", "onnxruntime"])
def test_echo_gives_the_prompts_logprobs_as_lm_eval_reads_them(served, executor, monkeypatch):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1; a prompt
    longer than a chunk of scoring is scored in chunks on one cache."""
    from rbcompile.runtime.engine import logprobs

    client, compiled, eager = served
    monkeypatch.setattr(logprobs, "PROMPT_CHUNK", 3)
    compiled.use_executor(executor)
    batch = [compiled.tokenizer(text)["input_ids"] for text in (PROMPT, "he she and")]
    try:
        data = _complete(client, prompt=batch, max_tokens=1, logprobs=1, echo=True, seed=1234)
    finally:
        compiled.use_executor("torch")
    tolerance = 1e-5 if executor == "torch" else 1e-4   # the executor sums in another order
    for ids, choice in zip(batch, sorted(data["choices"], key=lambda c: c["index"])):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        reference = _hf_logprobs(eager, ids)
        expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = torch.tensor(logprobs["token_logprobs"][1:len(ids)])
        assert torch.allclose(got, expected, atol=tolerance)
        assert choice["text"].startswith(compiled.tokenizer.decode(ids))


def test_chat_logprobs_streamed_equal_whole(served):
    client, _, _ = served
    body = {"messages": [{"role": "developer", "content": "the a"},
                         {"role": "user", "content": [{"type": "text", "text": "he "},
                                                      {"type": "text", "text": "she"}]}],
            "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) >= 1 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in content)
    streamed = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = __import__("json").loads(line[6:])
                for choice in chunk["choices"]:
                    streamed += (choice["logprobs"] or {}).get("content", [])
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content])


def test_token_prompts_give_the_texts_of_their_strings(served):
    client, compiled, _ = served
    ids = compiled.tokenizer(PROMPT)["input_ids"]
    by_text = _complete(client, prompt=PROMPT, max_tokens=5)["choices"][0]["text"]
    assert _complete(client, prompt=ids, max_tokens=5)["choices"][0]["text"] == by_text
    assert _complete(client, prompt=[ids], max_tokens=5)["choices"][0]["text"] == by_text
    vocab = compiled.hf_config["vocab_size"]
    body = {"max_tokens": 2, "temperature": 0}
    assert_refused(client.post("/v1/completions", json={**body, "prompt": [ids[0], vocab]}),
                   f"token id {vocab} is not in the vocabulary", "prompt")
    assert_refused(client.post("/v1/completions", json={**body, "prompt": [[]]}),
                   "holds an empty prompt", "prompt")


def test_fields_clients_send_at_their_defaults_are_accepted(served):
    client, _, _ = served
    plain = _complete(client, prompt=PROMPT, max_tokens=4)["choices"][0]["text"]
    defaults = {"frequency_penalty": 0, "presence_penalty": 0, "best_of": 1, "logprobs": None,
                "echo": False, "logit_bias": {}, "suffix": None, "top_k": -1, "min_p": 0,
                "repetition_penalty": 1.0, "user": "me"}
    assert _complete(client, prompt=PROMPT, max_tokens=4, **defaults)["choices"][0]["text"] == plain


@pytest.mark.parametrize("field, value", [("best_of", 3), ("suffix", "end")])
def test_fields_that_would_change_the_result_are_refused_by_name(served, field, value):
    client, _, _ = served
    reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: value})
    assert_refused(reply, f"'{field}' is not supported by this server", field)


def test_penalties_and_bias_are_honoured(served):
    """The sampler's penalties (tests/engine/test_penalties.py) through the API: a bias of 100
    on one token makes every token that one; penalties change a greedy text; bad biases 400."""
    client, compiled, _ = served
    token = compiled.tokenizer("the")["input_ids"][-1]
    biased = _complete(client, prompt=PROMPT, max_tokens=3, logit_bias={str(token): 100})
    assert biased["choices"][0]["text"].split() == ["the"] * 3
    plain = _complete(client, prompt=PROMPT, max_tokens=8)["choices"][0]["text"]
    penalized = _complete(client, prompt=PROMPT, max_tokens=8, frequency_penalty=2.0,
                          presence_penalty=1.0, repetition_penalty=1.5, min_p=0.05, top_k=5)
    assert penalized["choices"][0]["text"] != plain
    vocab = compiled.hf_config["vocab_size"]
    for bias, message in (({"x": 1}, "maps token ids to values in [-100, 100]"),
                          ({"1": 101}, "maps token ids to values in [-100, 100]"),
                          ({str(vocab): 1}, "is not in the vocabulary")):
        reply = client.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": bias})
        assert_refused(reply, message, "logit_bias")


def test_a_tool_conversation_goes_on(served):
    """A client sends back the assistant's tool call and the tool's answer."""
    client, _, _ = served
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    reply = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        {"role": "user", "content": "he"}, {"role": "assistant", "content": None,
                                           "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "the"}]})
    assert reply.status_code == 200, reply.text


def test_chat_logprob_fields_go_together(served):
    client, _, _ = served
    body = {"messages": [{"role": "user", "content": "he"}], "max_tokens": 2}
    assert_refused(client.post("/v1/chat/completions", json={**body, "top_logprobs": 2}),
                   "top_logprobs needs logprobs: true", "top_logprobs")
    reply = client.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}})
    assert reply.status_code == 200


def test_vllm_serve_conventions(tmp_path, served, monkeypatch, capsys):
    """--api-key, --served-model-name (default: the artifact folder's name; the source's name
    still accepted), /v1/models/{id}, /tokenize, /detokenize, /version, --public-metrics."""
    from conftest import served_by_cli

    from rbcompile.frontend.cli import main

    _, compiled, _ = served
    artifact = compiled.save(tmp_path / "my-model")
    cli = served_by_cli(monkeypatch)
    assert main(["serve", str(artifact), "--port", "0", "--api-key", "k3y",
                 "--api-key-env", "X"]) == 2
    assert "give --api-key or --api-key-env, not both" in capsys.readouterr().err
    assert main(["serve", str(artifact), "--host", "0.0.0.0", "--port", "0", "--api-key", "k3y",
                 "--public-metrics"]) == 0
    client = TestClient(cli["app"])
    key = {"Authorization": "Bearer k3y"}
    assert client.get("/v1/models").status_code == 401
    assert client.get("/metrics").status_code == 200 and client.get("/version").status_code == 200
    assert [m["id"] for m in client.get("/v1/models", headers=key).json()["data"]] == ["my-model"]
    assert client.get("/v1/models/my-model", headers=key).json()["id"] == "my-model"
    missing = client.get("/v1/models/other", headers=key)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    source = compiled.manifest["source"]["name"]
    for name in ("my-model", source):
        body = {"model": name, "prompt": PROMPT, "max_tokens": 2}
        assert client.post("/v1/completions", json=body, headers=key).status_code == 200
    tokens = client.post("/tokenize", json={"prompt": PROMPT}, headers=key).json()
    assert tokens["tokens"] == compiled.tokenizer(PROMPT)["input_ids"]
    assert tokens["count"] == len(tokens["tokens"])
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}, headers=key).json()
    assert text["prompt"] == compiled.tokenizer.decode(tokens["tokens"])
    assert_refused(client.post("/detokenize", json={"tokens": [10**9]}, headers=key),
                   "is not in the vocabulary", "tokens")
