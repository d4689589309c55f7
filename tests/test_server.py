"""The OpenAI-compatible server on 127.0.0.1, driven by the real `openai` client: streaming and
not, a tool-call round trip with state reuse, malformed requests (4xx, server keeps answering),
API key, queue limit, client disconnect, context overflow, models/health/metrics."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from util import TOOLS

openai = pytest.importorskip("openai", reason="the openai client is a test extra")
KEY = "sk-agentrt-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, runtime, **config) -> None:
        import uvicorn

        from agentrt.server.app import ServerConfig, build_app

        self.port = _free_port()
        self.app, self.chat = build_app(runtime, ServerConfig(port=self.port, **config))
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.chat.worker.stop()

    def raw(
        self,
        path: str,
        body: bytes | None = None,
        method: str = "POST",
        key: str | None = KEY,
        headers=None,
    ):
        req = urllib.request.Request(
            self.base + path, data=body, method=method, headers=headers or {}
        )
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


def serve_tiny(tmp_path_factory, name: str):
    """The embedded model with the semantic cache (every boundary a checkpoint) behind a server
    that needs `KEY` and takes bodies up to 1 MiB (for a module-scoped fixture to yield from)."""
    from agentrt import Runtime
    from agentrt.statecache.config import StateCacheConfig

    state = tmp_path_factory.mktemp(name)
    rt = Runtime.open(
        "tiny", cache="semantic", state_cache=StateCacheConfig(state_dir=state, min_distance=0)
    )
    srv = _Server(rt, api_key=KEY, max_request_bytes=2**20)
    yield srv
    srv.stop()
    rt.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory, "server-state")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


def _reference(messages, tools=None, max_tokens=8):
    from agentrt import Runtime

    return Runtime.open("tiny", cache="off").chat(messages, tools=tools, max_tokens=max_tokens)


def test_non_streaming_and_streaming(client):
    messages = [{"role": "user", "content": "Say something about files."}]
    ref = _reference(messages)
    res = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    assert (
        res.choices[0].message.content == (ref.content or None)
        or res.choices[0].message.content == ref.content
    )
    assert res.usage.completion_tokens == 8 and res.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (ref.content or "")
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_tool_call_round_trip_reuses_state(client):
    messages = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Read main.py"},
    ]
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "main.py"}'},
    }
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "def main():\n    return 1\n"},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def _chat_body(**overrides) -> bytes:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    } | overrides
    return json.dumps(body).encode()


TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}
MALFORMED = {
    "not json": b"{not json",
    "json array": b"[1, 2]",
    "missing messages": json.dumps({"model": "tiny"}).encode(),
    "missing model": json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
    "messages not a list": _chat_body(messages="hello"),
    "empty messages": _chat_body(messages=[]),
    "unknown role": _chat_body(messages=[{"role": "wizard", "content": "hi"}]),
    "content is a number": _chat_body(messages=[{"role": "user", "content": 5}]),
    "image content part": _chat_body(
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    ),
    "temperature is a string": _chat_body(temperature="hot"),
    "temperature out of range": _chat_body(temperature=5),
    "top_p zero": _chat_body(top_p=0),
    "negative max_tokens": _chat_body(max_tokens=-3),
    "max_tokens is a string": _chat_body(max_tokens="10"),
    "n = 2": _chat_body(n=2),
    "tools not a list": _chat_body(tools={"type": "function"}),
    "tool type not function": _chat_body(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
    "tool without name": _chat_body(tools=[{"type": "function", "function": {"description": "x"}}]),
    "tool name with spaces": _chat_body(
        tools=[{"type": "function", "function": {"name": "read file"}}]
    ),
    "tool parameters a string": _chat_body(
        tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]
    ),
    "tool parameters not an object schema": _chat_body(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
    ),
    "duplicate tool names": _chat_body(tools=[TOOL, TOOL]),
    "tool_choice names unknown tool": _chat_body(
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}
    ),
    "tool_choice required without tools": _chat_body(tool_choice="required"),
    "tool message without tool_call_id": _chat_body(messages=[{"role": "tool", "content": "x"}]),
    "tool call arguments not a string": _chat_body(
        messages=[
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
            }
        ]
    ),
    "stop is a number": _chat_body(stop=7),
    "reasoning_effort unknown": _chat_body(reasoning_effort="max"),
    "stream is a string": _chat_body(stream="yes"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_requests_get_4xx_and_server_stays_up(server, kind):
    status, body = server.raw(
        "/v1/chat/completions", MALFORMED[kind], headers={"Content-Type": "application/json"}
    )
    assert 400 <= status < 500, (kind, status, body)
    err = json.loads(body)["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert server.raw("/health", method="GET")[0] == 200


def test_protocol_errors(server):
    # a declared body above the limit is refused before it is read (raw socket: the client must
    # not be mid-upload when the server answers, or it would see a reset instead of the 413)
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    sock.sendall((head + f"Content-Length: {2**20 + 10}\r\n\r\n").encode())
    reply = sock.recv(4096).decode(errors="replace")
    sock.close()
    assert reply.startswith("HTTP/1.1 413")
    assert server.raw("/v1/chat/completions", method="GET")[0] == 405
    assert server.raw("/v1/nothing", method="GET")[0] == 404
    status, _ = server.raw("/v1/chat/completions", _chat_body())
    assert status == 200
    status, _ = server.raw("/v1/chat/completions", _chat_body(reasoning_effort="low"))
    assert status == 200


def test_api_key_is_enforced(server):
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert server.raw("/v1/models", method="GET", key=None)[0] == 401
    status, body = server.raw("/v1/models", method="GET")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"


def test_metrics_and_health(server, client):
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    status, body = server.raw("/metrics", method="GET", key=None)
    text = body.decode()
    assert (
        status == 200
        and "agentrt_ttft_seconds_bucket" in text
        and "agentrt_cached_tokens_total" in text
    )
    assert json.loads(server.raw("/health", method="GET", key=None)[1])["status"] == "ok"


def _count_decode_steps(monkeypatch) -> list[int]:
    """Counts the engine's decode steps (one per generated token after the first)."""
    from agentrt.engine import Engine

    steps, real = [0], Engine.decode_step

    def counted(self, state, token_id):
        steps[0] += 1
        return real(self, state, token_id)

    monkeypatch.setattr(Engine, "decode_step", counted)
    return steps


def _settled(steps: list[int], worker, seconds: float = 20) -> int:
    """The decode steps once the worker's queue is empty and no step ran for 0.5 s."""
    deadline, last = time.time() + seconds, -1
    while time.time() < deadline and (worker.depth() or steps[0] != last):
        last = steps[0]
        time.sleep(0.5)
    return steps[0]


def test_client_disconnect_stops_generation(server, monkeypatch):
    steps = _count_decode_steps(monkeypatch)
    req = urllib.request.Request(
        server.base + "/v1/chat/completions",
        _chat_body(max_tokens=100000, stream=True),
        headers={"Authorization": f"Bearer {KEY}"},
    )
    resp = urllib.request.urlopen(req, timeout=30)
    resp.readline()  # the stream has started
    resp.close()
    generated = _settled(steps, server.chat.worker)
    assert server.chat.worker.depth() == 0
    # stopped early: far below max_tokens, and below the context left after the prompt
    assert generated < server.chat.runtime.engine.max_context // 2
    assert server.raw("/v1/chat/completions", _chat_body())[0] == 200


@pytest.mark.slow
def test_full_queue_answers_429(tmp_path):
    """One request running and one waiting fill a queue of 1: the next gets 429, both others
    200."""
    from agentrt import Runtime

    rt = Runtime.open("tiny", cache="off")
    srv = _Server(rt, queue_size=1)
    worker, statuses = srv.chat.worker, []

    def fire():
        body = _chat_body(max_tokens=200, temperature=1, seed=1)
        statuses.append(srv.raw("/v1/chat/completions", body, key=None)[0])

    def start_and_wait(depth: int) -> threading.Thread:
        thread = threading.Thread(target=fire)
        thread.start()
        deadline = time.time() + 30
        while worker.depth() < depth and time.time() < deadline:
            time.sleep(0.01)
        return thread

    running, waiting = start_and_wait(1), start_and_wait(2)
    assert worker.depth() == 2
    beyond = srv.raw("/v1/chat/completions", _chat_body(), key=None)[0]
    running.join()
    waiting.join()
    srv.stop()
    assert beyond == 429 and statuses == [200, 200]


def test_prompt_longer_than_context_is_a_400(tmp_path):
    from agentrt import Runtime
    from agentrt.models.tiny import ensure_tiny

    small = tmp_path / "tiny-small"
    shutil.copytree(ensure_tiny(), small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    rt = Runtime.open(str(small), cache="off")
    srv = _Server(rt)
    status, body = srv.raw(
        "/v1/chat/completions",
        _chat_body(messages=[{"role": "user", "content": "word " * 200}]),
        key=None,
    )
    srv.stop()
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"


def test_non_streaming_disconnect_stops_generation(server, monkeypatch):
    steps = _count_decode_steps(monkeypatch)
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = _chat_body(max_tokens=100000, temperature=1)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(1.0)
    sock.close()
    generated = _settled(steps, server.chat.worker)
    assert server.chat.worker.depth() == 0
    assert 0 < generated < server.chat.runtime.engine.max_context // 2  # stopped early


@pytest.mark.slow
def test_stream_starts_before_the_first_token_and_keeps_alive(server, monkeypatch):
    import agentrt.server.app as app_module

    monkeypatch.setattr(app_module, "KEEPALIVE_S", 0.02)
    long_prompt = [{"role": "user", "content": "word " * 6000}]
    req = urllib.request.Request(
        server.base + "/v1/chat/completions",
        _chat_body(messages=long_prompt, stream=True),
        headers={"Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        lines = [line.decode() for line in resp if line.strip()]
    assert '"role": "assistant"' in lines[0]
    assert any(line.startswith(": keep-alive") for line in lines)  # sent while prefilling
    assert lines[-1].strip() == "data: [DONE]"


def test_metrics_keep_integer_precision():
    from agentrt.server.app import Metrics

    m = Metrics()
    m.add("prompt_tokens_total", 12_345_678)
    m.add("prompt_tokens_total", 1)
    assert "agentrt_prompt_tokens_total 12345679" in m.render(0)


def test_an_idle_worker_prepares_the_engine_for_the_next_turn():
    """After a job, with nothing queued, the engine worker calls `prepare_ahead` (KV grown and
    graphs captured between turns)."""
    import asyncio
    from types import SimpleNamespace

    from agentrt.server.worker import DONE, EngineWorker, Job

    class Fake:
        def __init__(self) -> None:
            self.prepared = 0

        def chat_prepared(self, prepared, stream, should_stop, **kwargs):
            yield SimpleNamespace(type="done")

        def prepare_ahead(self) -> bool:
            self.prepared += 1
            return True

    loop = asyncio.new_event_loop()
    try:
        runtime = Fake()
        worker = EngineWorker(runtime, queue_size=4)
        job = Job(prepared=None, kwargs={}, loop=loop)
        worker.submit(job)

        async def drain() -> list:
            items = []
            while not items or items[-1] is not DONE:
                items.append(await asyncio.wait_for(job.events.get(), 10))
            return items

        assert loop.run_until_complete(drain())[0].type == "done"
        deadline = time.time() + 10
        while (worker.busy or not runtime.prepared) and time.time() < deadline:
            time.sleep(0.01)
        assert runtime.prepared == 1 and worker.depth() == 0
        worker.stop()
    finally:
        loop.close()


def test_a_job_whose_client_left_while_it_waited_still_ends():
    """A queued job cancelled before the worker reaches it (its client went away) is skipped
    but still ends (DONE), so the request handler waiting on it returns and the server can shut
    down; it never runs."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from agentrt.server.worker import DONE, EngineWorker, Job

    release, ran = threading.Event(), []

    class Fake:
        def chat_prepared(self, prepared, stream, should_stop, **kwargs):
            ran.append(prepared)
            release.wait(10)
            yield SimpleNamespace(type="done", result=prepared)

        def prepare_ahead(self) -> bool:
            return False

    loop = asyncio.new_event_loop()
    try:
        worker = EngineWorker(Fake(), queue_size=4)
        first, second = (Job(prepared=n, kwargs={}, loop=loop) for n in ("first", "second"))
        worker.submit(first)
        worker.submit(second)
        second.cancelled = True
        release.set()

        async def drain(job: Job) -> list:
            items = []
            while not items or items[-1] is not DONE:
                items.append(await asyncio.wait_for(job.events.get(), 10))
            return items

        assert loop.run_until_complete(drain(second)) == [DONE] and second.finished
        assert ran == ["first"]
        worker.stop()
    finally:
        loop.close()


def test_a_tool_without_a_description_gets_an_empty_one():
    """OpenAI makes a function's description optional; chat templates such as gpt-oss's read
    it, so the chat API fills in an empty one, as the Responses and Anthropic APIs do."""
    from agentrt.server import schema

    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    _, tools = schema.to_plain(schema.decode(json.dumps(body).encode()))
    assert tools[0]["function"] == {"name": "f", "description": ""}


def test_a_stop_ends_the_running_waiting_and_later_jobs_at_once():
    """`end_all` (a stop signal) ends the running job at its next token and every waiting or
    later job at once, each with ShuttingDown (503 / a streamed error) and then DONE, so a
    graceful shutdown does not wait for whole generations."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from agentrt.server.worker import DONE, EngineWorker, Job, ShuttingDown

    started, tokens = threading.Event(), []

    class Fake:
        def chat_prepared(self, prepared, stream, should_stop, **kwargs):
            started.set()
            while not should_stop() and len(tokens) < 1000:
                tokens.append(1)
                yield SimpleNamespace(type="token")
                time.sleep(0.01)
            yield SimpleNamespace(type="done", result=prepared)

        def prepare_ahead(self) -> bool:
            return False

    async def drain(job: Job) -> list:
        items = []
        while not items or items[-1] is not DONE:
            items.append(await asyncio.wait_for(job.events.get(), 10))
        return items

    loop = asyncio.new_event_loop()
    try:
        worker = EngineWorker(Fake(), queue_size=4)
        running, waiting, later = (Job(prepared=n, kwargs={}, loop=loop) for n in "abc")
        worker.submit(running)
        worker.submit(waiting)
        assert started.wait(10)
        worker.end_all()
        worker.submit(later)
        for job in (waiting, later):
            items = loop.run_until_complete(drain(job))
            assert isinstance(items[0], ShuttingDown) and items[1:] == [DONE] and job.finished
        items = loop.run_until_complete(drain(running))
        assert any(isinstance(item, ShuttingDown) for item in items) and len(tokens) < 1000
        worker.stop()
    finally:
        loop.close()


@pytest.mark.slow
def test_sigterm_ends_a_long_stream_and_the_server_promptly(tmp_path):
    """`agentrt serve` stopped by SIGTERM during a long streamed generation: the stream ends with
    an error event, the process exits 143 within seconds (not after the generation)."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, AGENTRT_HOME=str(tmp_path / "home"))
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", "--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(cmd + ["--cache", "off"], env=env, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        body["max_tokens"] = 2000
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(body).encode(), headers
        )
        with urllib.request.urlopen(request, timeout=60) as stream:
            stream.readline()  # (the first chunk: generation under way)
            proc.send_signal(signal.SIGTERM)
            stopped = time.time()
            rest = stream.read().decode()
        assert "server shutting down" in rest
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.time() - stopped < 20
    finally:
        proc.kill()
        proc.wait()


def test_a_request_without_a_limit_may_generate_to_the_context_end(server, monkeypatch):
    """No max_tokens (chat completions) or max_output_tokens (responses): the generation may
    run to the end of the context, as OpenAI's APIs do, not the Python API's 256. (The jobs
    are ended unrun, as a stopping server does: 503.)"""
    seen = []
    monkeypatch.setattr(server.chat.worker, "submit", lambda job: (seen.append(job), job.end()))
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert server.raw("/v1/chat/completions", body.encode())[0] == 503
    assert server.raw("/v1/chat/completions", _chat_body(max_tokens=3))[0] == 503
    body = json.dumps({"model": "tiny", "input": "hi"})
    assert server.raw("/v1/responses", body.encode())[0] == 503
    context = server.chat.runtime.engine.max_context
    assert [job.kwargs["max_tokens"] for job in seen] == [context, 3, context]


def test_requests_without_a_seed_draw_theirs_from_the_servers_seed():
    """`serve --seed`: requests that name no seed get one drawn in arrival order from the
    runtime's seed, so they sample differently from each other, and a server started again
    with the same seed answers the same requests the same way; a request's own seed wins."""
    from starlette.testclient import TestClient

    from agentrt import Runtime
    from agentrt.server.app import ServerConfig, build_app

    rt = Runtime.open("tiny", cache="off", seed=5)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    def replies(**extra) -> list[str]:
        app, chat = build_app(rt, ServerConfig())
        try:
            with TestClient(app) as http:
                answers = [
                    http.post("/v1/chat/completions", json={**body, **extra}) for _ in range(3)
                ]
                return [json.dumps(a.json()["choices"][0]["message"]) for a in answers]
        finally:
            chat.worker.stop()

    try:
        first = replies()
        assert replies() == first and len(set(first)) > 1
        assert len(set(replies(seed=11))) == 1
    finally:
        rt.close()
