"""Small helpers shared by tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def load_benchmark(path: str):
    """A module of `benchmarks/` (`path` under it, e.g. "routing_probe.py"), from its file."""
    file = Path(__file__).resolve().parents[1] / "benchmarks" / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_ids(n: int, vocab: int = 320, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_under_triton_interpreter(module: str, cases: str, limit: float) -> None:
    """Asserts that `module.cases("cpu")` (the worst error over its cases) is at most `limit`
    with Triton's interpreter chosen: in a new interpreter (Triton reads `TRITON_INTERPRET` at
    import), the tests directory first on its path."""
    pytest.importorskip("triton")
    code = (
        f"import sys; from {module} import {cases}; "
        f"worst = {cases}('cpu'); print(worst); sys.exit(worst > {limit})"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-c", code]
    run = subprocess.run(command, env=env, cwd=here, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def open_engine(path, chunk: int = 2048):
    """A CPU fp32 engine for a checkpoint directory."""
    from agentrt.engine import Engine
    from agentrt.engine.config import EngineConfig
    from agentrt.models.loader import load_model

    model = load_model(path, "cpu", torch.float32)
    return Engine(
        model, EngineConfig(device="cpu", dtype="float32", prefill_chunk=chunk, linear_attn="torch")
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    },
]


def _call(i: int, name: str, args: str) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}


def agent_requests(tag: str = "", output_len: int = 400) -> list[list[dict]]:
    """The requests a coding-agent framework sends over one session (full history each time),
    including the edits frameworks make: reasoning dropped once a new user turn arrives (by the
    template) and an old tool output truncated (by the framework)."""
    out1 = f"def main():\n    return 1  # {tag}\n" * (output_len // 25)
    out2 = f"tests passed {tag}\n" * (output_len // 20)
    history = [
        {"role": "system", "content": f"You are a coding agent. {tag}"},
        {"role": "user", "content": f"Fix the bug in main.py {tag}"},
    ]
    requests = [list(history)]
    history += [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Read the file first.",
            "tool_calls": [_call(1, "read_file", '{"path": "main.py"}')],
        },
        {"role": "tool", "tool_call_id": "c1", "content": out1},
    ]
    requests.append(list(history))
    history += [
        {
            "role": "assistant",
            "content": "Now run the tests.",
            "reasoning_content": "Looks fine.",
            "tool_calls": [_call(2, "run", '{"cmd": "pytest -q"}')],
        },
        {"role": "tool", "tool_call_id": "c2", "content": out2},
    ]
    requests.append(list(history))
    history += [
        {"role": "assistant", "content": "The bug is fixed."},
        {"role": "user", "content": "Also add a docstring."},
    ]
    requests.append(list(history))  # earlier reasoning disappears from the rendered prompt
    truncated = [dict(m) for m in history]
    truncated[3]["content"] = out1[:60] + "\n[... truncated]"
    requests.append(truncated)  # the framework truncates an old tool output
    return requests


def run_cli(*args: str, env: dict | None = None, timeout: int = 300):
    """Run `python -m agentrt.cli ARGS...` and capture its output (text): the command as a user
    starts it (a new interpreter: 3-6 s of imports on 2 cores)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "agentrt.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def invoke_cli(*args: str, env: dict | None = None, timeout: int = 300):
    """`agentrt ARGS...` run in this process by click's runner, answering as `run_cli` does
    (returncode, stdout, stderr): for commands whose start in a new interpreter is not what a
    test checks. An exception other than a user error (which the command group turns into a
    one-line message and exit 2) propagates, so a traceback fails the test as it would show."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    from agentrt.cli import main

    del timeout  # (the same signature as `run_cli`)
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def script_replies(monkeypatch, runtime, replies: list[str]) -> None:
    """Make the engine sample `replies` (each ends the turn) instead of the tiny model's random
    tokens: the whole serving path still runs (prefill, state cache, parsing)."""
    import collections

    from agentrt.engine import engine as engine_module

    tok = runtime.tokenizer
    queue = collections.deque(
        t for text in replies for t in tok.encode(text + "<|im_end|>", add_special_tokens=False)
    )
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda *a, **k: queue.popleft() if queue else real(*a, **k)
    )


def chat_with_call(call_id: str) -> list[dict]:
    """A chat-completions conversation with a system prompt, reasoning, a tool call (id
    `call_id`) and its result: the reference the other APIs' shapes of it must render like."""
    call = {"name": "read_file", "arguments": '{"path": "main.py"}'}
    return [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Read main.py"},
        {
            "role": "assistant",
            "content": "Reading.",
            "reasoning_content": "I should read it.",
            "tool_calls": [{"id": call_id, "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "print(1)"},
        {"role": "user", "content": "Now explain it."},
    ]


def thinking_text_and_call():
    """The chat events of a turn that thinks ("Hm" "m."), says "Reading." and calls read_file
    (not streamed), then ends (50 prompt tokens, 30 of them cached, 3 generated)."""
    from agentrt.session.chat import ChatEvent, ChatResult

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
    }
    result = ChatResult(
        content="Reading.",
        reasoning_content="Hmm.",
        tool_calls=[call],
        token_ids=[1, 2, 3],
        finish_reason="tool_calls",
        usage={"prompt_tokens": 50, "cached_tokens": 30, "completion_tokens": 3},
        timings={},
    )
    return [
        ChatEvent("reasoning", "Hm"),
        ChatEvent("reasoning", "m."),
        ChatEvent("content", "Reading."),
        ChatEvent("tool_call", tool_call=call),
        ChatEvent("done", result=result),
    ]
