"""Issue 43: `rbcompile serve` against hostile and careless clients. Each attack runs on a real
server (uvicorn on a socket, in a thread or a process) on the tiny llama: /health answers within
1 s during it, and no request can queue unbounded work, hold rows after its client left, stall
the other streams, or keep the server from exiting."""
import asyncio
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import httpx
import pytest
import torch
from conftest import wait_for_health
from fastapi.testclient import TestClient

import rbcompile
from rbcompile.runtime.engine.core import EngineRequest
from rbcompile.runtime.serving import connections
from rbcompile.runtime.serving.http import create_app
from rbcompile.runtime.serving.limits import ConnectionLimits, ServeLimits
from rbcompile.runtime.serving.serve_config import ServeConfig
from rbcompile.runtime.serving.text_stream import StopPrefix, TextStream

PROMPT = "the a of and to in"


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return rbcompile.compile(tiny_checkpoints["llama"])


def slowed(app, seconds: float):
    """`app` whose engine takes at least `seconds` a forward (time for a client to act)."""
    engine, step = app.state.engine, app.state.engine.step_fn

    def slow_step(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)

    engine.step_fn = slow_step
    return app


@contextmanager
def live(app, limits: ConnectionLimits = ConnectionLimits()):
    """`app` served by `rbcompile serve`'s server on a free port, in a thread: its base URL."""
    sock = connections.bind("127.0.0.1", 0)
    server = connections.server(app, limits, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def health_latencies(base: str, seconds: float) -> list[float]:
    """GET /health on new connections for `seconds`: each one's latency."""
    latencies, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    return latencies


def run_threads(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)


def during(attack, check):
    """Run `attack()` in a thread while `check()` runs here; `check`'s result."""
    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    try:
        return check()
    finally:
        thread.join(60)


# ---- 1. stop strings ------------------------------------------------------------------------

def test_stop_prefix_is_the_longest_end_of_the_text_that_begins_a_stop():
    def naive(text: str, stop: str) -> int:
        return max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)

    rng = random.Random(0)
    for _ in range(3000):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 9)))
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        assert StopPrefix(stop).length(text) == naive(text, stop), (stop, text)
    stream = TextStream("".join, ["a" * 200 + "b"])
    assert "".join(stream.add(c) for c in "x" + "a" * 300) == "x" + "a" * 100
    assert stream.finish() == "a" * 200


def test_stop_strings_are_bounded_and_a_huge_one_is_refused_before_anything_runs(llama):
    client = TestClient(create_app(llama))
    body = {"prompt": PROMPT, "max_tokens": 2, "n": 8, "stream": True}
    huge = client.post("/v1/completions", json={**body, "stop": "x" * 500_000})
    assert huge.status_code == 400 and huge.json()["error"] == {
        "message": "a stop string of 500000 characters: this server takes at most 256",
        "type": "invalid_request_error", "param": "stop", "code": None}
    five = client.post("/v1/completions", json={**body, "stop": list("abcde")})
    assert five.status_code == 400
    assert five.json()["error"]["message"] == "5 stop strings: this server takes at most 4"
    assert client.app.state.engine.stats.prefills == 0


def test_the_longest_stop_strings_stream_while_health_answers(llama):
    app = slowed(create_app(llama), 0.01)
    stops = ["q" * 255 + str(i) for i in range(4)]
    body = {"prompt": PROMPT, "max_tokens": 40, "n": 8, "stream": True, "stop": stops,
            "temperature": 0}
    with live(app) as base:
        streamed = []
        latencies = during(lambda: streamed.append(httpx.post(f"{base}/v1/completions", json=body,
                                                              timeout=60)),
                           lambda: health_latencies(base, 1.0))
    assert streamed[0].status_code == 200 and streamed[0].text.endswith("data: [DONE]\n\n")
    assert max(latencies) < 1.0


# ---- 2. work per request, per client --------------------------------------------------------

def test_prompts_times_n_are_bounded_before_anything_is_tokenised_or_queued(llama):
    client = TestClient(create_app(llama))
    response = client.post("/v1/completions", json={"prompt": ["a"] * 4000, "n": 8, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == ("4000 prompts x n=8 make 32000 choices, over "
                                                   "this server's limit of 64 a request")
    assert response.json()["error"]["param"] == "prompt"
    assert client.app.state.engine.queued == 0 and client.app.state.engine.stats.prefills == 0


def test_a_request_counts_all_its_choices_against_the_queue_and_its_client(llama):
    app = slowed(create_app(llama, ServeConfig(max_batch=1, limits=ServeLimits(
        max_queue=4, max_choices=4, max_client_choices=6))), 0.02)
    long = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    with live(app) as base:
        holder = threading.Thread(target=httpx.post, args=(f"{base}/v1/completions",),
                                  kwargs={"json": long, "timeout": 60})
        holder.start()
        while not app.state.engine.running:
            time.sleep(0.01)
        queued = threading.Thread(target=httpx.post, args=(f"{base}/v1/completions",),
                                  kwargs={"json": {**long, "prompt": [PROMPT] * 4}, "timeout": 60})
        queued.start()
        while app.state.engine.queued < 4:
            time.sleep(0.01)
        shed = httpx.post(f"{base}/v1/completions", json={**long, "max_tokens": 1})
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "overloaded"
        assert "queue full (4 of 4 requests waiting, 1 more asked)" in shed.json()["error"]["message"]
        holder.join(60)
        queued.join(60)
    limited = create_app(llama, ServeConfig(limits=ServeLimits(max_client_choices=2)))
    with live(slowed(limited, 0.02)) as base:
        streaming = threading.Thread(target=httpx.post, args=(f"{base}/v1/completions",),
                                     kwargs={"json": {**long, "n": 2, "stream": True}, "timeout": 60})
        streaming.start()
        while len(limited.state.engine.running) < 2:
            time.sleep(0.01)
        refused = httpx.post(f"{base}/v1/completions", json={**long, "max_tokens": 1})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.json()["error"]["message"].startswith("this client has 2 choices queued")
        streaming.join(60)
        assert httpx.post(f"{base}/v1/completions", json={**long, "max_tokens": 1}).status_code == 200
        assert "rbcompile_client_refusals_total 1.0" in httpx.get(f"{base}/metrics").text


def test_freed_rows_go_to_the_client_holding_the_fewest(llama):
    engine = llama.batch_engine(2)
    prompt = llama.tokenizer(PROMPT)["input_ids"]
    flood = [engine.submit(EngineRequest(prompt, 8, client="flood")) for _ in range(4)]
    other = engine.submit(EngineRequest(prompt, 8, client="other"))
    while engine.has_work:
        engine.step()
    assert other.first_token_at < flood[1].first_token_at   # joined with the flood's first
    alone = llama.generate(torch.tensor([prompt]), max_new_tokens=8).tokens[0]
    assert other.tokens == alone and all(request.tokens == alone for request in flood)


def test_a_client_under_its_share_preempts_a_row_of_one_over_it(llama):
    """Two rows, both the flood's: a second client's request takes one of them at the next
    step (the flood's row goes back to the queue and rejoins by recompute); every request
    still gets the tokens it gets alone."""
    engine = llama.batch_engine(2)
    prompt = llama.tokenizer(PROMPT)["input_ids"]
    flood = [engine.submit(EngineRequest(prompt, 30, client="flood")) for _ in range(2)]
    for _ in range(5):
        engine.step()
    other = engine.submit(EngineRequest(prompt, 8, client="other"))
    engine.step()
    assert other in engine.running and engine.stats.preempted == 1
    while engine.has_work:
        engine.step()
    alone = llama.generate(torch.tensor([prompt]), max_new_tokens=30).tokens[0]
    assert other.tokens == alone[:8] and all(request.tokens == alone for request in flood)


# ---- 3. a client gone -----------------------------------------------------------------------

def test_a_non_streaming_client_that_leaves_cancels_its_work(llama):
    app = slowed(create_app(llama), 0.02)
    engine, submitted = app.state.engine, []
    submit = engine.submit_samples
    engine.submit_samples = lambda group: submitted.extend(group) or submit(group)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 50, "temperature": 0}).encode()
    with live(app) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            while not (submitted and submitted[0].tokens):
                time.sleep(0.01)
        deadline = time.monotonic() + 2
        while submitted[0].finish_reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert submitted[0].finish_reason == "cancelled" and len(submitted[0].tokens) < 50
        assert not engine.running
        metrics = httpx.get(f"{base}/metrics").text
    assert 'rbcompile_requests_total{endpoint="/v1/completions",status="499"} 1.0' in metrics


def test_a_stream_left_at_once_gives_back_its_rows_and_its_client_share(llama):
    def memory() -> float:   # admission reads it: the client is gone by the time it returns
        time.sleep(0.2)
        return 0.0

    app = slowed(create_app(llama, ServeConfig(limits=ServeLimits(max_client_choices=2)), memory=memory), 0.05)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 50, "n": 2, "stream": True}).encode()
    with live(app) as base:
        port = int(base.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as client:
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                               b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(0.5)   # the server has read it, and seen the client leave
            deadline = time.monotonic() + 3
            while (app.state.engine.running or app.state.engine.queued) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not app.state.engine.running and app.state.engine.queued == 0
        again = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2})
    assert again.status_code == 200, again.text


def test_shutdown_returns_once_the_model_thread_has_left_its_step(llama):
    """The drain ends with the app's shutdown, and the process exits right after it: a model
    thread still inside a forward then aborts the process (exit 134, "terminate called")."""
    app = slowed(create_app(llama), 0.2)
    engine, worker = app.state.engine, app.state.worker
    engine.submit(EngineRequest(llama.tokenizer(PROMPT)["input_ids"], 50))
    while not engine.running:
        time.sleep(0.01)

    async def start_and_stop():
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(start_and_stop())
    assert not worker.thread.is_alive()


# ---- 4. a vote ------------------------------------------------------------------------------

def test_a_vote_runs_in_the_shared_batch_while_other_streams_keep_their_pace(llama):
    app = slowed(create_app(llama), 0.02)
    stream = {"prompt": PROMPT, "max_tokens": 50, "temperature": 0, "stream": True}
    vote = {"prompt": "he she", "max_tokens": 30, "temperature": 0.9, "seed": 1,
            "rbcompile": {"consistency": 7, "extract": "regex:(\\w+)"}}
    arrivals, window = [], {}
    with live(app) as base:
        def read_stream():
            with httpx.stream("POST", f"{base}/v1/completions", json=stream, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())

        reader = threading.Thread(target=read_stream)
        reader.start()
        while len(arrivals) < 3:
            time.sleep(0.01)
        window["start"] = time.monotonic()
        voted = httpx.post(f"{base}/v1/completions", json=vote, timeout=60)
        window["end"] = time.monotonic()
        reader.join(60)
    assert voted.status_code == 200 and voted.json()["rbcompile"]["samples"] == 7
    inside = [t for t in arrivals if window["start"] < t < window["end"]]
    assert len(inside) >= 5, (len(inside), window["end"] - window["start"])
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert max(gaps) < 0.5


# ---- 8. long prompts ------------------------------------------------------------------------

def test_megabyte_prompts_are_tokenised_off_the_event_loop(llama):
    app = create_app(llama)
    prompt = "the a of " * ((1 << 20) // 9 - 10)   # within the 1 MiB body limit

    def attack():
        run_threads([threading.Thread(target=httpx.post, args=(f"{base}/v1/completions",),
                                      kwargs={"json": {"prompt": prompt}, "timeout": 60})
                     for _ in range(8)])

    with live(app) as base:
        latencies = during(attack, lambda: health_latencies(base, 1.5))
    assert max(latencies) < 1.0


def test_a_request_http_cannot_parse_gets_the_openai_error_shape(llama):
    with live(create_app(llama)) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
            reply = b""
            while chunk := client.recv(4096):
                reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"Content-Type: application/json" in head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    nan = TestClient(create_app(llama)).post(
        "/v1/completions", content='{"prompt": "a", "temperature": NaN}',
        headers={"content-type": "application/json"})
    assert nan.status_code == 400 and "finite number" in nan.json()["error"]["message"]


# ---- the event loop's errors ----------------------------------------------------------------

def test_the_loop_logs_a_repeated_error_once_a_second(caplog):
    handler = connections._OncePerSecond()
    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        for _ in range(1000):
            handler(None, {"message": "socket.accept() out of system resource",
                           "exception": OSError(24, "Too many open files")})
    assert len(caplog.records) == 1


# ---- 5, 6, 10: a real `rbcompile serve` -----------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_port_in_use_is_refused_before_serving_is_said(llama, tmp_path):
    artifact = llama.save(tmp_path / "artifact")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "rbcompile.frontend.cli", "serve", str(artifact),
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"rbcompile: error: cannot listen on 127.0.0.1:{port}: "
                                   "Address already in use (another server is there, or pick "
                                   "another --port)")


def test_idle_sockets_time_out_and_sigterm_cuts_a_stalled_body_at_the_drain_deadline(llama, tmp_path):
    """500 idle, half-header and half-body sockets from one address under a 512-descriptor
    limit: /health answers within 1 s and a completion within 2x its time; they are closed
    after --header-timeout or --body-timeout. Then SIGTERM with a client holding half a body: exit 0
    within --drain-timeout + 5 s, one line counting what was cut."""
    artifact = llama.save(tmp_path / "artifact")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "rbcompile.frontend.cli", "serve", str(artifact), "--port", str(port),
         "--header-timeout", "1", "--body-timeout", "4", "--keep-alive-timeout", "1",
         "--drain-timeout", "1", "--max-client-connections", "32"],
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_NOFILE,
                                                            (512, 512)))
    attackers = []
    try:
        wait_for_health(base, process)
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}

        def completion_s() -> float:
            times = []
            for _ in range(3):
                started = time.monotonic()
                assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
                times.append(time.monotonic() - started)
            return sorted(times)[1]

        unloaded, resting = completion_s(), open_fds(process.pid)

        def attack():
            for i in range(500):
                attacker = socket.socket()
                attacker.bind(("127.0.0.2", 0))
                try:
                    attacker.connect(("127.0.0.1", port))
                    attacker.sendall([b"", b"POST /v1/completions HTTP/1.1\r\nHost:",
                                      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                      b"Content-Length: 100\r\n\r\n{\"pro"][i % 3])
                except OSError:
                    pass
                attackers.append(attacker)

        latencies = during(attack, lambda: health_latencies(base, 1.0))
        loaded = completion_s()
        assert max(latencies) < 1.0 and loaded < 2 * unloaded, (latencies, loaded, unloaded)
        deadline = time.monotonic() + 15   # half bodies: --body-timeout, then keep-alive
        while open_fds(process.pid) > resting + 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert open_fds(process.pid) <= resting + 4

        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{}")
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(1 + 5 + 2) == 0
        assert time.monotonic() - started < 1 + 5
        log = process.stderr.read()
        assert ("drain deadline of 1 s passed: cutting 1 open connection(s), 1 request(s) "
                "unfinished") in log
        assert len(log.splitlines()) < 60, log[-3000:]
    finally:
        process.kill()
        for attacker in attackers:
            attacker.close()


# ---- the soak -------------------------------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak_request(client: httpx.Client, base: str, kind: int, rng: random.Random) -> int | None:
    """One request of the soak's mix: its status, or None when the client left on purpose."""
    body = {"prompt": PROMPT, "max_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.8]),
            "n": rng.randint(1, 2)}
    if kind < 5:
        return client.post(f"{base}/v1/completions", json=body).status_code
    if kind < 7:
        with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as response:
            text = "".join(response.iter_text())
            assert response.status_code != 200 or text.endswith("data: [DONE]\n\n")
            return response.status_code
    if kind == 7:   # leaves mid-stream
        with client.stream("POST", f"{base}/v1/completions",
                           json={**body, "stream": True, "max_tokens": 40}) as response:
            next(response.iter_lines())
        return None
    if kind == 8:   # leaves before a non-streamed answer
        port = int(base.rsplit(":", 1)[1])
        raw = json.dumps({**body, "max_tokens": 40}).encode()
        with socket.create_connection(("127.0.0.1", port)) as leaving:
            leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
            time.sleep(0.01)
        return None
    bad = rng.choice(['{"prompt": ', '{"prompt": "a", "max_tokens": -1}', '{"prompt": "\\ud800"}',
                      '{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', '[]'])
    return client.post(f"{base}/v1/completions", content=bad,
                       headers={"content-type": "application/json"}).status_code


def test_a_soak_of_mixed_requests_loses_none_and_keeps_its_memory(llama):
    """1,000 requests from 8 clients (completions, streams, clients leaving mid-stream or
    before the answer, bad inputs) and one request of 64 choices: no 5xx, every request answered
    but those whose client left, the engine idle after, and RSS within 10% of warm-up's."""
    app = create_app(llama)
    app.state.engine.config = replace(app.state.engine.config, idle_cache_bytes=0)
    statuses, lock = [], threading.Lock()

    def client_thread(seed: int, count: int):
        rng = random.Random(seed)
        with httpx.Client(timeout=60) as client:
            for _ in range(count):
                status = soak_request(client, base, rng.randrange(10), rng)
                with lock:
                    statuses.append(status)

    def run(requests: int, seed: int):
        run_threads([threading.Thread(target=client_thread, args=(seed + i, requests // 8))
                     for i in range(8)])

    with live(app) as base:
        run(96, 0)
        warm = rss_bytes()
        batch = httpx.post(f"{base}/v1/completions", timeout=120,
                           json={"prompt": [PROMPT] * 16, "n": 4, "max_tokens": 4})
        assert batch.status_code == 200 and len(batch.json()["choices"]) == 64
        run(904, 100)
        deadline = time.monotonic() + 10
        while (app.state.engine.running or app.state.engine.queued) and time.monotonic() < deadline:
            time.sleep(0.05)
        after = rss_bytes()
    answered = [status for status in statuses if status is not None]
    assert len(statuses) == 1000 and all(status < 500 for status in answered)
    assert sorted(set(answered)) == [200, 400]
    assert not app.state.engine.running and app.state.engine.queued == 0
    assert after <= 1.1 * warm, (warm, after)
