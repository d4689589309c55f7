"""The agent's `run_command` safety: approval on a (fake) terminal, refusal without one or with
`--approve never` (as a tool result), the clean environment, capped output, and the bubblewrap
sandbox keeping commands off the network and from writing outside the working directory (those
tests skip, with the reason, where bwrap is absent or cannot create namespaces)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from agentrt.errors import InvalidArgumentError
from agentrt.session import sandbox
from agentrt.session.agent import Tools, run_agent
from agentrt.session.sandbox import DECLINED, MAX_OUTPUT, NEVER, NO_TERMINAL, Sandbox, clean_env

BWRAP_PROBLEM = sandbox.bwrap_problem()
needs_bwrap = pytest.mark.skipif(
    BWRAP_PROBLEM is not None, reason=f"no bwrap sandbox here: {BWRAP_PROBLEM}"
)


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch, answers: list[str]) -> list[str]:
    """Make stdin look like a terminal whose user types `answers`; returns the unused ones."""
    left = list(answers)

    def fake_input(prompt: str = "") -> str:
        assert left, "asked more often than expected"
        return left.pop(0)

    monkeypatch.setattr(sys, "stdin", _FakeTTY())
    monkeypatch.setattr("builtins.input", fake_input)
    return left


def _run(tools: Tools, command: str) -> str:
    return tools.call("run_command", json.dumps({"command": command}))


# ----------------------------------------------------------------------------- approval


def test_terminal_yes_runs_the_command_and_shows_it(tmp_path, monkeypatch, capsys):
    _terminal(monkeypatch, ["y"])
    out = _run(Tools(tmp_path, sandbox="none"), "echo ran")
    assert out == "[exit code 0]\nran\n"
    assert "$ echo ran" in capsys.readouterr().err


def test_terminal_no_refuses(tmp_path, monkeypatch):
    _terminal(monkeypatch, ["n"])
    assert _run(Tools(tmp_path, sandbox="none"), "touch made") == DECLINED
    assert not (tmp_path / "made").exists()


def test_terminal_empty_answer_refuses(tmp_path, monkeypatch):
    _terminal(monkeypatch, [""])
    assert _run(Tools(tmp_path, sandbox="none"), "touch made") == DECLINED


def test_terminal_always_asks_once_per_session(tmp_path, monkeypatch):
    left = _terminal(monkeypatch, ["a"])
    tools = Tools(tmp_path, sandbox="none")
    assert _run(tools, "echo one").startswith("[exit code 0]")
    assert _run(tools, "echo two").startswith("[exit code 0]")  # not asked again
    assert left == []
    _terminal(monkeypatch, ["n"])  # a new session asks again
    assert _run(Tools(tmp_path, sandbox="none"), "echo three") == DECLINED


def test_no_terminal_refuses_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    out = _run(Tools(tmp_path, sandbox="none"), "touch made")
    assert out == NO_TERMINAL and "--approve auto" in out and "not run" in out
    assert not (tmp_path / "made").exists()


def test_never_refuses_even_on_a_terminal(tmp_path, monkeypatch):
    left = _terminal(monkeypatch, ["y"])
    assert _run(Tools(tmp_path, approve="never", sandbox="none"), "touch made") == NEVER
    assert left == ["y"] and not (tmp_path / "made").exists()


def test_bad_modes_are_errors(tmp_path):
    with pytest.raises(InvalidArgumentError):
        Tools(tmp_path, approve="sometimes")
    with pytest.raises(InvalidArgumentError):
        Tools(tmp_path, sandbox="docker")


class _CommandModel:
    """A test double of Runtime.chat: one `run_command` call, then a final answer."""

    def __init__(self, command: str) -> None:
        self.command, self.num_calls = command, 0

    def chat(self, messages, tools=None, max_tokens=0):
        self.num_calls += 1
        args = json.dumps({"command": self.command})
        calls = [
            {"id": "c1", "type": "function", "function": {"name": "run_command", "arguments": args}}
        ]
        calls = calls if self.num_calls == 1 else []
        message = {"role": "assistant", "content": "", **({"tool_calls": calls} if calls else {})}
        return SimpleNamespace(
            content="done" if not calls else "",
            reasoning_content=None,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else "stop",
            usage={"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 1},
            timings={"ttft_s": 0.0},
            message=lambda: message,
        )

    def prepare_ahead(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_refusal_reaches_the_model_as_a_tool_result(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    run = run_agent(_CommandModel("touch made"), "task", Tools(tmp_path, sandbox="none"))
    tool = [m for m in run.messages if m["role"] == "tool"]
    assert run.finished and tool[0]["content"] == NO_TERMINAL
    assert not (tmp_path / "made").exists()


@pytest.mark.parametrize(
    "flags, is_run",
    [([], False), (["--approve", "never"], False), (["--approve", "auto"], True)],
)
def test_cli_approve_option(tmp_path, monkeypatch, flags, is_run):
    import agentrt.cli as cli

    monkeypatch.setattr(cli.chat, "open_runtime", lambda opts, **kw: _CommandModel("touch made"))
    args = ["run", "--workdir", str(tmp_path), "--sandbox", "none", *flags, "make a file"]
    result = CliRunner().invoke(cli.main, args)  # stdin is no terminal
    assert result.exit_code == 0, result.output
    assert (tmp_path / "made").exists() == is_run


# ----------------------------------------------------------------------------- environment


def test_clean_env_allow_list_and_secret_names():
    env = clean_env(
        {
            "PATH": "/usr/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C",
            "LC_AUTH_TOKEN": "x",
            "MY_API_KEY": "x",
            "GITHUB_TOKEN": "x",
            "AWS_SECRET_ACCESS_KEY": "x",
            "PGPASSWORD": "x",
            "PYTHONPATH": "/x",
            "LD_PRELOAD": "/x.so",
        }
    )
    assert env == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C"}


@pytest.mark.parametrize("mode", ["none", pytest.param("bwrap", marks=needs_bwrap)])
def test_command_environment_is_scrubbed(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("MY_API_KEY", "sk-very-secret")
    monkeypatch.setenv("LC_SESSION_COOKIE", "cookie-secret")
    out = _run(Tools(tmp_path, approve="auto", sandbox=mode), "env")
    assert "sk-very-secret" not in out and "cookie-secret" not in out
    assert "MY_API_KEY" not in out and "PATH=" in out


def test_huge_output_is_capped(tmp_path):
    out = _run(Tools(tmp_path, approve="auto", sandbox="none"), "yes | head -c 3000000")
    assert out.startswith("[exit code 0]") and "characters omitted" in out
    assert len(out) < MAX_OUTPUT + 100


# ----------------------------------------------------------------------------- sandbox


def test_sandbox_bwrap_without_bwrap_is_an_error(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap (bubblewrap) is not installed")
    with pytest.raises(InvalidArgumentError, match="--sandbox bwrap"):
        Sandbox.open("bwrap")


def test_cli_sandbox_bwrap_without_bwrap_says_so_in_one_line(tmp_path):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no bwrap on PATH
    cmd = [sys.executable, "-m", "agentrt.cli", "run", "--sandbox", "bwrap", "task"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "error: --sandbox bwrap" in proc.stderr


def test_auto_without_bwrap_says_once_that_commands_are_not_sandboxed(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap (bubblewrap) is not installed")
    sandbox.notice.cache_clear()
    assert Sandbox.open("auto").bwrap is None and Sandbox.open("auto").bwrap is None
    assert capsys.readouterr().err.count("NOT sandboxed") == 1
    sandbox.notice.cache_clear()


@needs_bwrap
def test_sandbox_keeps_writes_inside_the_workdir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    host_tmp = Path("/tmp") / f"agentrt-escape-{tmp_path.name}"
    command = (
        f"echo ok > inside.txt; touch {tmp_path}/outside.txt; touch {host_tmp}; "
        "touch /etc/agentrt-escape; touch /var/tmp/agentrt-escape; cat inside.txt"
    )
    out = _run(Tools(work, approve="auto", sandbox="bwrap"), command)
    assert out.rstrip().endswith("ok") and (work / "inside.txt").read_text() == "ok\n"
    assert not (tmp_path / "outside.txt").exists() and not host_tmp.exists()
    assert not Path("/etc/agentrt-escape").exists()
    assert not Path("/var/tmp/agentrt-escape").exists()
    assert "Read-only file system" in out


@needs_bwrap
def test_sandbox_has_no_network_unless_allowed(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        command = f"bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}' && echo connected"
        closed = _run(Tools(tmp_path, approve="auto", sandbox="bwrap"), command)
        tools = Tools(tmp_path, approve="auto", sandbox="bwrap", allow_network=True)
        opened = _run(tools, command)
    assert "connected" not in closed and not closed.startswith("[exit code 0]")
    assert opened.startswith("[exit code 0]") and "connected" in opened


def test_the_prompt_escapes_what_a_terminal_would_hide(tmp_path, monkeypatch, capsys):
    """A carriage return and an erase-line sequence would show only `ls -la`."""
    _terminal(monkeypatch, ["n"])
    command = "touch PWNED #\r\x1b[2K  $ ls -la\u202e"
    assert _run(Tools(tmp_path, sandbox="none"), command) == DECLINED
    err = capsys.readouterr().err
    assert "$ touch PWNED #\\r\\x1b[2K  $ ls -la\\u202e\n" in err and "\r" not in err
    assert "escaped" in err


def test_an_interrupt_kills_the_running_command(tmp_path, monkeypatch):
    """Ctrl-C reaches agentrt, not the command (its own session): the group is killed."""
    import time

    real_wait = subprocess.Popen.wait

    def interrupted(self, timeout=None):  # (the wait with a timeout is the command's)
        if timeout is None:
            return real_wait(self)
        time.sleep(0.5)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    pid_file = tmp_path / "pid"
    with pytest.raises(KeyboardInterrupt):
        _run(
            Tools(tmp_path, approve="auto", sandbox="none"), f"echo $$ > {pid_file}; exec sleep 30"
        )
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_command_that_leaves_a_background_process_returns_at_once(tmp_path):
    import time

    t0 = time.monotonic()
    out = Tools(tmp_path, approve="auto", sandbox="none", command_timeout=20).call(
        "run_command", json.dumps({"command": "sleep 30 & echo started"})
    )
    assert time.monotonic() - t0 < 10
    assert out == "[exit code 0; the processes it left running were killed]\nstarted\n"


@pytest.mark.parametrize("timeout", ["NaN", "Infinity", "true", "-1"])
def test_timeouts_must_be_finite_positive_numbers(tmp_path, timeout):
    from agentrt.session.agent import _execute

    tools = Tools(tmp_path, approve="auto", sandbox="none")
    args = f'{{"command": "echo hi", "timeout": {timeout}}}'
    out = _execute(tools, {"function": {"name": "run_command", "arguments": args}})
    assert out.startswith("ERROR: 'timeout' must be")


class _FailingModel(_CommandModel):
    """One command, then the prompt no longer fits (as a long agent history does)."""

    def chat(self, messages, tools=None, max_tokens=0):
        from agentrt.errors import PromptTooLongError

        if self.num_calls == 1:
            raise PromptTooLongError("prompt of 40000 tokens does not fit")
        return super().chat(messages, tools, max_tokens)


def test_cli_run_saves_the_turns_before_an_error_and_checks_the_trace_path(tmp_path, monkeypatch):
    import agentrt.cli as cli
    from agentrt.replay.trace import read_trace

    monkeypatch.setattr(cli.chat, "open_runtime", lambda opts, **kw: _FailingModel("echo hi"))
    trace = tmp_path / "run.jsonl"
    args = ["run", "--workdir", str(tmp_path), "--sandbox", "none", "--approve", "auto"]
    result = CliRunner().invoke(cli.main, [*args, "--trace", str(trace), "task"])
    assert result.exit_code == 2 and "does not fit" in result.stderr
    assert len(read_trace(trace).requests) == 1 and "trace saved" in result.stderr
    (tmp_path / "file").write_text("")
    bad = CliRunner().invoke(cli.main, [*args, "--trace", str(tmp_path / "file" / "t.jsonl"), "x"])
    assert bad.exit_code == 2 and "does not exist" in bad.stderr
