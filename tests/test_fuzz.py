"""Fuzzing of the input surfaces that take outside data (seeded, CI-sized): mutated and random
bodies for every HTTP endpoint of the server, and random, mutated and truncated files for every
`agentrt trace import` format and for the trace reader (the state cache: test_fuzz_statecache).

Every input must end in a clear answer: HTTP 2xx, or 4xx with an OpenAI-style JSON error (never
a 5xx, an error event inside a stream, or a hang), and the server answers a valid request after
each input; the CLI succeeds or prints one `error: ...` line; the reader returns a trace or
raises `TraceError`. The examples each target tried are printed at the end of the module.
"""

from __future__ import annotations

import http.client
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zstandard
from click.testing import CliRunner
from conftest import SHARED
from util import TOOLS

pytest.importorskip("hypothesis", reason="hypothesis is a test extra")
from fuzzing import (  # noqa: E402
    DEEP,
    check_cli,
    dumps,
    fuzz_settings,
    fuzzed_json_bytes,
    json_values,
    mutate,
    mutate_bytes,
    one_in,
    print_counts,
    tally,
)
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEY = "sk-agentrt-fuzz"
TRACES_DEV = SHARED / "traces-dev"
REPO_TRACES = Path(__file__).resolve().parents[1] / "traces"


@pytest.fixture(scope="module", autouse=True)
def _counts(request):
    yield
    print_counts(request.config)


# ----------------------------------------------------------------------------- HTTP server


class _Server:
    """uvicorn on a free loopback port in a thread, serving the given runtime."""

    def __init__(self, runtime) -> None:
        import socket

        import uvicorn

        from agentrt.server.app import ServerConfig, build_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = ServerConfig(port=self.port, api_key=KEY, max_request_bytes=2**20)
        self.app, self.chat = build_app(runtime, config)
        uv = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="critical")
        self.server = uvicorn.Server(uv)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheader("content-type") or "", resp.read()
        finally:
            conn.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.chat.worker.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from agentrt import Runtime
    from agentrt.statecache.config import StateCacheConfig

    state = tmp_path_factory.mktemp("fuzz-server-state")
    rt = Runtime.open(
        "tiny", cache="semantic", state_cache=StateCacheConfig(state_dir=state, min_distance=0)
    )
    srv = _Server(rt)
    yield srv
    srv.stop()
    rt.close()


CALL = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}
USER = {"role": "user", "content": "hi"}
BODIES = [  # small valid requests, one feature each (a mutation then hits it more often)
    {"model": "tiny", "messages": [USER], "max_tokens": 2},
    {
        "model": "tiny",
        "messages": [USER],
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["\n\n", "END"],
        "n": 1,
        "max_completion_tokens": 2,
    },
    {
        "model": "tiny",
        "messages": [USER],
        "tools": TOOLS[1:],
        "tool_choice": {"type": "function", "function": {"name": "run"}},
    },
    {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "", "reasoning_content": "ls", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "main.py\n"},
        ],
        "tools": TOOLS,
    },
    {
        "model": "tiny",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "hello"}], "name": "u1"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
    },
]
# inputs that once got a 5xx: kept as seeds (sent as they are, and mutated)
FOUND = [
    BODIES[0] | {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
    BODIES[1] | {"seed": 2**64},
    BODIES[1] | {"seed": -(2**63) - 1},
    BODIES[2] | {"tool_choice": {"type": "function", "function": {"name": ["run"]}}},
]
VALID = json.dumps(BODIES[0] | {"max_tokens": 1}).encode()
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _capped(body: bytes) -> bytes:
    """A body the server accepts gets at most 3 new tokens (a valid request may ask for up to
    the whole context, which the fuzz has no time for; `test_huge_max_tokens_...` covers it)."""
    from agentrt.server import schema

    try:
        req = schema.decode(body)
    except Exception:  # noqa: BLE001 - the server's verdict is what is tested, not this one
        return body
    end = body.rindex(b"}")  # a later duplicate key wins: the body is otherwise unchanged
    cap = min(schema.max_tokens(req) or 3, 3)
    return body[:end] + b', "max_completion_tokens": %d' % cap + body[end:]


def check_http(status: int, ctype: str, body: bytes, method: str) -> str:
    """A clear answer: 2xx (a complete stream when it is one) or 4xx with a JSON error."""
    assert status < 500, (status, body[:500])
    if status >= 400 and method != "HEAD":
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"], body[:500]
        assert err["type"] == "invalid_request_error" or status in (401, 429), body[:500]
    if ctype.startswith("text/event-stream"):
        events = [line for line in body.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", body[-500:]
        assert not any('"error"' in e for e in events[:-1]), body[:800]
    return str(status)


def check_still_serving(server: _Server) -> None:
    status, _, body = server.request("POST", "/v1/chat/completions", VALID, AUTH)
    assert status == 200, body[:300]


@fuzz_settings(max_examples=200)
@given(data=st.data())
@pytest.mark.slow
def test_fuzz_chat_completions(server, data):
    """Small valid requests (and ones that once failed) mutated, as trees and as bytes, with
    odd headers now and then."""
    body = _capped(fuzzed_json_bytes(data, BODIES + FOUND))
    headers = dict(AUTH)
    if one_in(data, 20, "auth"):
        headers["Authorization"] = data.draw(st.sampled_from(["", "Bearer", "Bearer x" * 50]))
    if data.draw(st.booleans(), label="content type"):
        headers["Content-Type"] = data.draw(st.sampled_from(["text/plain", "", "a/b; x=\u00e9"]))
    status, ctype, reply = server.request("POST", "/v1/chat/completions", body, headers)
    tally("POST /v1/chat/completions", check_http(status, ctype, reply, "POST"))
    check_still_serving(server)


ENDPOINTS = ["/v1/chat/completions", "/v1/models", "/health", "/metrics"]
PATHS = st.sampled_from(ENDPOINTS) | st.builds(
    lambda base, junk: base + junk,
    st.sampled_from([*ENDPOINTS, "/", "/v1/"]),
    st.sampled_from(
        ["", "/", "?x=1", "?%ff%00", "/../..", "%2e%2e", "//x", "/%ff", "?" + "a" * 3000]
    ),
)


@pytest.mark.slow
@fuzz_settings(max_examples=60)
@given(data=st.data())
def test_fuzz_every_endpoint(server, data):
    """Any method on any route (and near-misses of them) with a junk body."""
    method = data.draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]))
    path = data.draw(PATHS, label="path")
    body = (
        fuzzed_json_bytes(data, [{}, *BODIES[:1]])
        if method != "GET" or data.draw(st.booleans())
        else None
    )
    body = _capped(body) if body is not None else None
    headers = AUTH if data.draw(st.booleans(), label="auth") else {}
    status, ctype, reply = server.request(method, path, body, headers)
    tally(f"{method} (any route)", check_http(status, ctype, reply, method))
    if status == 200 and path in ("/v1/models", "/health") and method == "GET":
        assert json.loads(reply)
    check_still_serving(server)


@pytest.mark.parametrize("max_tokens", [2**31, 2**63 - 1, 2**64 - 1])
def test_huge_max_tokens_streams_and_stops_on_disconnect(server, max_tokens):
    """A valid request for (nearly) the whole context starts streaming; a client that leaves
    stops it, and the server keeps answering."""
    body = json.dumps(BODIES[0] | {"max_tokens": max_tokens, "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers=AUTH)
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()  # the stream has started
    conn.close()
    deadline = time.time() + 20
    while server.chat.worker.depth() and time.time() < deadline:
        time.sleep(0.05)
    assert server.chat.worker.depth() == 0  # stopped long before the context is full
    check_still_serving(server)


# ----------------------------------------------------------------------------- trace files

SYSTEM = {"role": "system", "content": "You are an agent."}
ASK = {"role": "user", "content": "List the files."}
ANSWER = {"role": "assistant", "content": "Done."}
TOOL_OUT = {"role": "tool", "tool_call_id": "c1", "content": "main.py\n"}
CALLING = {"role": "assistant", "content": None, "reasoning_content": "ls", "tool_calls": [CALL]}
IMPORT_SEEDS: dict[str, list[Any]] = {
    "tau-bench": [
        [
            {
                "task_id": 3,
                "trial": 0,
                "reward": 1.0,
                "traj": [SYSTEM, ASK, CALLING, TOOL_OUT, ANSWER],
            }
        ]
    ],
    "openhands": [
        {
            "messages": [{"role": "system", "content": [{"type": "text", "text": "Agent."}]}, ASK],
            "tools": TOOLS[:1],
            "response": {"choices": [{"message": CALLING}], "usage": {"prompt_tokens": 9}},
            "timestamp": 1757015025.9,
        }
    ],
    "mini-swe-agent": [
        {
            "instance_id": "repo__issue-1",
            "trajectory_format": "mini-swe-agent-1",
            "messages": [
                SYSTEM,
                ASK,
                CALLING | {"extra": {"response": {"usage": {"prompt_tokens": 9}}}},
                TOOL_OUT,
                ANSWER,
            ],
        }
    ],
}
REAL_FILES = {
    "tau-bench": ["tau-bench/gpt-4o-airline.json"],
    "openhands": sorted(
        str(p.relative_to(TRACES_DEV)) for p in TRACES_DEV.glob("openhands-llm-logs/*/*.json")
    )[:3],
    "mini-swe-agent": sorted(
        str(p.relative_to(TRACES_DEV)) for p in TRACES_DEV.glob("mini-swe-agent/*.traj.json")
    )[:1],
}
_real_cache: dict[str, tuple[list[Any], list[bytes]]] = {}


def _trimmed(value: Any) -> Any:
    """A real sample cut down to a few entries and messages (mutations stay fast)."""
    if isinstance(value, list):
        return [_trimmed(v) for v in value[:2]]
    out = dict(value)
    for key in ("traj", "messages"):
        if isinstance(out.get(key), list):
            out[key] = out[key][:6]
    return out


def real_samples(fmt: str) -> tuple[list[Any], list[bytes]]:
    """(trimmed parsed samples, whole files' bytes) of the development traces, when present."""
    if fmt not in _real_cache:
        paths = [TRACES_DEV / name for name in REAL_FILES[fmt] if (TRACES_DEV / name).is_file()]
        raw = [p.read_bytes() for p in paths]
        _real_cache[fmt] = ([_trimmed(json.loads(b)) for b in raw], raw)
    return _real_cache[fmt]


def fuzzed_file(data, seeds: list[Any], whole: list[bytes]) -> bytes:
    """A mutated seed, a real file cut short or damaged, or random bytes."""
    kind = data.draw(st.sampled_from(["tree"] * 6 + ["whole", "random"]), label="file kind")
    if kind == "whole" and whole:
        return mutate_bytes(data, whole[data.draw(st.integers(0, len(whole) - 1), label="file")])
    if kind == "random":
        return data.draw(st.binary(max_size=300), label="random file")
    return fuzzed_json_bytes(data, seeds)


def _import_inputs(data, fmt: str, root: Path, seeds: list[Any], whole: list[bytes]) -> list[str]:
    """Files for one `agentrt trace import` call, laid out as the format expects."""
    if fmt == "tau-bench":
        (root / "tau.json").write_bytes(fuzzed_file(data, seeds, whole))
        return [str(root / "tau.json")]
    session = root / "session"
    session.mkdir()
    if fmt == "openhands":
        files = [session / f"call{i}.json" for i in range(data.draw(st.integers(1, 3)))]
        for f in files:
            f.write_bytes(fuzzed_file(data, seeds, whole))
        return [str(session)] if data.draw(st.booleans(), label="as dir") else list(map(str, files))
    (session / "run.traj.json").write_bytes(fuzzed_file(data, seeds, whole))
    if data.draw(st.booleans(), label="tools.json"):
        tools = mutate(data, TOOLS) if data.draw(st.booleans()) else data.draw(json_values)
        (session / "tools.json").write_bytes(dumps(data, tools))
    return (
        [str(session)]
        if data.draw(st.booleans(), label="as dir")
        else [str(session / "run.traj.json")]
    )


IMPORT_FLAGS = [
    [],
    ["--zst"],
    ["--drop-reasoning"],
    ["--truncate-tool-outputs", "5"],
    ["--limit", "1"],
]


def _import_example(fmt: str, data) -> None:
    from agentrt.cli import main
    from agentrt.replay.trace import read_trace

    real, whole = real_samples(fmt)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = _import_inputs(data, fmt, root, IMPORT_SEEDS[fmt] + real, whole)
        flags = data.draw(st.sampled_from(IMPORT_FLAGS), label="flags")
        args = ["trace", "import", "--format", fmt, *inputs, "-o", str(root / "out"), *flags]
        outcome = check_cli(CliRunner().invoke(main, args))
        tally(f"trace import --format {fmt}", outcome)
        for path in sorted((root / "out").glob("*.jsonl*")) if outcome == "ok" else []:
            read_trace(path)  # what an importer writes, the reader reads
            shown = CliRunner().invoke(main, ["trace", "show", "--requests", str(path)])
            assert check_cli(shown) == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(IMPORT_SEEDS))
@fuzz_settings(max_examples=70)
@given(data=st.data())
def test_fuzz_trace_import(fmt, data):
    """Mutated seeds (built in, and trimmed development traces when present), damaged real
    files or random bytes: a trace the reader reads back, or one `error: ...` line."""
    _import_example(fmt, data)


# ----------------------------------------------------------------------------- trace reader

SMALL_TRACE = [
    {"agentrt_trace": 1, "source": "fuzz", "description": "seed"},
    {"id": "r0", "t": 0.0, "messages": [SYSTEM, ASK], "tools": TOOLS, "max_tokens": 64},
    {
        "id": "r1",
        "t": 1.5,
        "messages": [SYSTEM, ASK, CALLING, TOOL_OUT],
        "tools": TOOLS,
        "response": {"content": "Done.", "usage": {"prompt_tokens": 40}},
    },
]
_shipped: list[Any] = []


def shipped_traces() -> list[bytes]:
    """The compressed example traces the repository ships."""
    if not _shipped:
        _shipped.extend(p.read_bytes() for p in sorted(REPO_TRACES.glob("*.jsonl.zst")))
    return _shipped


def _trace_lines(data) -> bytes:
    """The small trace's lines, some or all mutated, joined by a (possibly odd) separator."""
    lines = (
        mutate(data, SMALL_TRACE)
        if data.draw(st.booleans(), label="mutate all")
        else [
            mutate(data, line) if data.draw(st.booleans(), label="mutate line") else line
            for line in SMALL_TRACE
        ]
    )
    if not isinstance(lines, list):
        lines = [lines]
    sep = data.draw(st.sampled_from(["\n", "\r\n", "\n\n", "\u2028"]), label="separator")
    text = sep.join(dumps(data, line).decode("utf-8", "surrogatepass") for line in lines)
    return mutate_bytes(data, text.encode("utf-8", "surrogatepass"))


def _trace_bytes(data) -> tuple[bytes, str]:
    """Trace file contents and suffix: mutated lines, plain or compressed; or a shipped trace,
    damaged."""
    if one_in(data, 4, "shipped") and shipped_traces():
        shipped = shipped_traces()
        raw = shipped[data.draw(st.integers(0, len(shipped) - 1), label="shipped trace")]
        return mutate_bytes(data, raw), ".jsonl.zst"
    raw = _trace_lines(data)
    if data.draw(st.booleans(), label="zst"):
        compressed = zstandard.ZstdCompressor(level=1).compress(raw)
        return mutate_bytes(data, compressed), ".jsonl.zst"
    return raw, ".jsonl"


@fuzz_settings(max_examples=150)
@given(data=st.data())
def test_fuzz_trace_reader(data):
    """A trace or `TraceError`; what is read survives the transforms and a write round trip;
    `agentrt trace show --requests` succeeds or prints one error line."""
    from agentrt.cli import main
    from agentrt.replay.trace import (
        TraceError,
        drop_reasoning,
        read_trace,
        truncate_tool_outputs,
        write_trace,
    )

    raw, suffix = _trace_bytes(data)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"t{suffix}"
        path.write_bytes(raw)
        try:
            trace = read_trace(path)
        except TraceError:
            tally("read_trace", "TraceError")
        else:
            tally("read_trace", "ok")
            truncate_tool_outputs(drop_reasoning(trace), 5)
            assert (
                read_trace(write_trace(trace, Path(tmp) / "back.jsonl")).requests == trace.requests
            )
        result = CliRunner().invoke(main, ["trace", "show", "--requests", str(path)])
        tally("trace show --requests", check_cli(result))


@pytest.mark.parametrize("fmt", [None, *sorted(IMPORT_SEEDS)])
def test_deeply_nested_json_is_a_clear_error(tmp_path, fmt):
    """JSON nested past Python's recursion limit, in a trace line or an imported file."""
    from agentrt.cli import main

    deep = "[" * 100_000 + "]" * 100_000
    if fmt is None:
        path = tmp_path / "deep.jsonl"
        header = json.dumps(SMALL_TRACE[0])
        path.write_text(f'{header}\n{{"id": "r", "messages": [{{"x": {deep}}}]}}\n')
        args = ["trace", "show", str(path)]
    else:
        path = tmp_path / ("run.traj.json" if fmt == "mini-swe-agent" else "in.json")
        path.write_text(deep)
        args = ["trace", "import", "--format", fmt, str(path), "-o", str(tmp_path / "out")]
    assert check_cli(CliRunner().invoke(main, args)) == "error"
