"""The built-in agent loop (`agentrt run`): a small tool registry (read a file, list a directory,
grep, run a command with a timeout in the working directory, outputs truncated), turns through
the same `Runtime.chat` (and so the same state cache), until a final answer or the turn limit.
Invalid tool calls (unknown tool, bad arguments) go back to the model as tool errors.
Each request can be recorded as a trace. How a command is approved, sandboxed and run belongs
to `agentrt.session.sandbox`."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrt.session.sandbox import Approver, Sandbox, truncate

GREPPER = Path(__file__).with_name("grepper.py")  # (run as a script: see its docstring)
MAX_ENTRIES = 500  # of a directory listing

SYSTEM = (
    "You are a software agent working in the directory {cwd}. Use the tools to inspect files and "
    "run commands, one step at a time. When you have the answer, reply without calling a tool."
)


class ToolError(Exception):
    pass


def function_tool(name: str, description: str, required: list[str], **props: str) -> dict[str, Any]:
    """An OpenAI function-tool schema with simple typed properties."""
    properties = {k: {"type": v} for k, v in props.items()}
    params = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": params},
    }


TOOL_SCHEMAS = [
    function_tool(
        "read_file",
        "Read a text file (relative to the working directory).",
        ["path"],
        path="string",
    ),
    function_tool("list_dir", "List a directory.", [], path="string"),
    function_tool(
        "grep",
        "Search files under a directory for a regular expression.",
        ["pattern"],
        pattern="string",
        path="string",
    ),
    function_tool(
        "run_command",
        "Run a shell command in the working directory.",
        ["command"],
        command="string",
        timeout="integer",
    ),
]


@dataclass
class Tools:
    """Tool implementations confined to `cwd`. Commands need approval (`approve`: ask on the
    terminal, `auto`, or `never`) and run in a sandbox where bwrap works (`sandbox`: auto,
    bwrap, none), without network unless `allow_network`."""

    cwd: Path
    command_timeout: float = 30.0
    approve: str = "ask"
    sandbox: str = "auto"
    allow_network: bool = False
    approver: Approver = field(init=False, repr=False)
    box: Sandbox = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.cwd = Path(self.cwd).resolve()
        self.approver = Approver(self.approve)
        quiet = self.approve == "never"  # no command will run: no notice about the sandbox
        self.box = Sandbox.open(self.sandbox, self.allow_network, quiet=quiet)

    def _inside(self, path: Path) -> bool:
        return self.cwd in (path, *path.parents)

    def _path(self, raw: Any) -> Path:
        if not isinstance(raw, str) or not raw:
            raise ToolError("'path' must be a non-empty string")
        path = (self.cwd / raw).resolve()
        if not self._inside(path):
            raise ToolError(f"{raw} is outside the working directory")
        return path

    def read_file(self, path: str) -> str:
        target = self._path(path)
        if not target.is_file():
            raise ToolError(f"{path}: no such file")
        return truncate(target.read_text(errors="replace"))

    def list_dir(self, path: str = ".") -> str:
        target = self._path(path)
        if not target.is_dir():
            raise ToolError(f"{path}: not a directory")
        entries = sorted(target.iterdir())
        lines = [f"{e.name}{'/' if e.is_dir() else ''}" for e in entries[:MAX_ENTRIES]]
        if len(entries) > MAX_ENTRIES:
            lines.append(f"[... {len(entries) - MAX_ENTRIES} more entries]")
        return truncate("\n".join(lines)) or "(empty)"

    def grep(self, pattern: str, path: str = ".") -> str:
        """Lines matching `pattern` in a file or under a directory, searched by a process of
        its own stopped after the command timeout (a pattern may backtrack forever)."""
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ToolError(f"bad pattern: {exc}") from None
        if "\0" in pattern:
            raise ToolError("bad pattern: it contains a NUL character")
        root = self._path(path)
        if not root.exists():
            raise ToolError(f"{path}: no such file or directory")
        argv = [sys.executable, "-I", str(GREPPER), pattern, str(root), str(self.cwd)]
        try:
            proc = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.command_timeout
            )
        except subprocess.TimeoutExpired as exc:
            found = (exc.stdout or b"").decode(errors="replace")
            return truncate(f"{found}[search stopped after {self.command_timeout:g} s]")
        if proc.returncode != 0:
            reason = (proc.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
            raise ToolError(f"search failed: {reason}")
        return truncate(proc.stdout.decode(errors="replace").rstrip("\n"))

    def run_command(self, command: str, timeout: int | None = None) -> str:
        """`/bin/sh -c command` in the working directory once approved (a refusal is the
        result), sandboxed where bwrap works, in a clean environment; on timeout the whole
        process group is killed."""
        if not isinstance(command, str) or not command.strip():
            raise ToolError("'command' must be a non-empty string")
        number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if timeout is not None and not (number and math.isfinite(timeout) and timeout > 0):
            raise ToolError("'timeout' must be a positive number of seconds")
        refusal = self.approver.refusal(command, self.box.describe(self.cwd))
        if refusal is not None:
            return refusal
        limit = min(float(timeout or self.command_timeout), self.command_timeout)
        return self.box.run(command, self.cwd, limit)

    def call(self, name: str, arguments: str) -> str:
        fn: Callable | None = {
            s["function"]["name"]: getattr(self, s["function"]["name"]) for s in TOOL_SCHEMAS
        }.get(name)
        if fn is None:
            known = ", ".join(s["function"]["name"] for s in TOOL_SCHEMAS)
            raise ToolError(f"unknown tool {name!r}; available: {known}")
        try:
            args = json.loads(arguments or "{}")
        except ValueError as exc:
            raise ToolError(f"arguments are not valid JSON: {exc}") from None
        if not isinstance(args, dict):
            raise ToolError("arguments must be a JSON object")
        try:
            return fn(**args)
        except ToolError:
            raise
        except TypeError as exc:
            raise ToolError(f"bad arguments for {name}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a tool failure is reported to the model
            raise ToolError(f"{name} failed: {type(exc).__name__}: {exc}") from None


@dataclass
class AgentRun:
    messages: list[dict[str, Any]]
    turns: int = 0
    finished: bool = False
    cut: bool = False  # the last reply ran into the token limit without a tool call
    requests: list[dict[str, Any]] = field(default_factory=list)  # trace entries


def run_agent(
    rt,
    task: str,
    tools: Tools,
    max_turns: int = 10,
    max_tokens: int = 512,
    on_event=None,
    into: AgentRun | None = None,
) -> AgentRun:
    """Loop: ask the model, execute its tool calls, feed results back, until it answers (a
    reply cut by `max_tokens` without a tool call stops the run unfinished). `into` (a fresh
    `AgentRun`) collects the run as it goes, so a caller keeps what ran before an error."""
    emit = on_event or (lambda kind, payload: None)
    run = into if into is not None else AgentRun([])
    run.messages[:] = [
        {"role": "system", "content": SYSTEM.format(cwd=tools.cwd)},
        {"role": "user", "content": task},
    ]
    t0 = time.perf_counter()
    while run.turns < max_turns:
        run.turns += 1
        sent, t_sent = [dict(m) for m in run.messages], time.perf_counter() - t0
        result = rt.chat(run.messages, tools=TOOL_SCHEMAS, max_tokens=max_tokens)
        emit("assistant", result)
        run.requests.append(
            {
                "id": f"run-{run.turns}",
                "t": round(t_sent, 3),
                "messages": sent,
                "tools": TOOL_SCHEMAS,
                "max_tokens": max_tokens,
                "response": _response(result),
            }
        )
        run.messages.append(result.message())
        if not result.tool_calls:
            run.cut = result.finish_reason == "length"
            run.finished = not run.cut
            break
        # the engine prepares for the next turn (KV, graphs) while the tools run
        ahead = threading.Thread(target=rt.prepare_ahead, name="agentrt-ahead")
        ahead.start()
        try:
            for call in result.tool_calls:
                output = _execute(tools, call)
                emit("tool", (call, output))
                run.messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        finally:
            ahead.join()
    return run


def _execute(tools: Tools, call: dict[str, Any]) -> str:
    fn = call["function"]
    try:
        return tools.call(fn["name"], fn.get("arguments", "{}"))
    except ToolError as exc:
        return f"ERROR: {exc}"


def _response(result) -> dict[str, Any]:
    out = {"content": result.content, "usage": result.usage}
    if result.reasoning_content:
        out["reasoning_content"] = result.reasoning_content
    if result.tool_calls:
        out["tool_calls"] = result.tool_calls
    return out
