"""Synthetic coding-agent sessions, seeded: a system prompt with tool schemas, a task, then dozens
of turns of reasoning + tool calls whose outputs are real files of this machine (the Python
standard library: listings, file contents, grep hits) and plausible command output, until the
transcript reaches a target size (10K-100K tokens). Each request repeats the whole history, as
agent frameworks do. The same seed on the same Python installation gives the same trace.
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from pathlib import Path
from typing import Any

from agentrt.replay.trace import FORMAT, Header, Request, Response, Trace
from agentrt.session.agent import function_tool

CHARS_PER_TOKEN = 3.0  # these sessions rendered with the Qwen3 tokenizer and template: 2.97-3.09


TOOLS = [
    function_tool("list_dir", "List a directory.", ["path"], path="string"),
    function_tool(
        "read_file",
        "Read a text file.",
        ["path"],
        path="string",
        start_line="integer",
        end_line="integer",
    ),
    function_tool(
        "grep", "Search files for a regex.", ["pattern", "path"], pattern="string", path="string"
    ),
    function_tool(
        "run_command", "Run a shell command.", ["command"], command="string", timeout="integer"
    ),
]
SYSTEM = (
    "You are a careful software engineering agent working in a repository. Use the tools to "
    "inspect files and run commands. Think before each step, make minimal changes, and verify "
    "them with the test suite. When done, summarise what you changed."
)
_THOUGHTS = [
    "I need to understand how {name} is structured before changing anything.",
    "The failure mentions {name}; let me look at where it is defined.",
    "Let me search for other uses of {word} to see what depends on it.",
    "That output shows the relevant code path. Next I should check the tests around {word}.",
    "Before editing, I want to confirm the behaviour by running the tests for {name}.",
    "The function handles {word} differently from what the issue says; I'll read more context.",
]


class _Source:
    """Real files of this machine to draw tool outputs from."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        root = Path(sysconfig.get_paths()["stdlib"])
        self.root = root
        self.dirs = sorted(
            p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))
        )
        self.files = sorted(p for p in root.glob("*.py"))

    def pick(self, seq):
        return seq[int(self.rng.random() * len(seq))]

    def listing(self, directory: Path) -> str:
        entries = sorted(directory.iterdir())[:200]
        return "\n".join(
            f"{'d' if e.is_dir() else '-'} {e.stat().st_size:>9} {e.name}" for e in entries
        )

    def read(self, path: Path, max_lines: int) -> tuple[str, int, int]:
        lines = path.read_text(errors="replace").splitlines()
        start = int(self.rng.random() * max(len(lines) - max_lines, 1))
        end = min(start + max_lines, len(lines))
        body = "\n".join(f"{i + 1:>5}  {line}" for i, line in enumerate(lines[start:end], start))
        return body, start + 1, end

    def grep(self, word: str, limit: int = 60) -> str:
        hits = []
        for path in self.files:
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(rf"\b{re.escape(word)}\b", line):
                    hits.append(f"{path.name}:{i}: {line.strip()[:160]}")
                    if len(hits) >= limit:
                        return "\n".join(hits)
        return "\n".join(hits) or "(no matches)"

    def word_from(self, path: Path) -> str:
        names = re.findall(r"def ([a-z_]{4,30})\(", path.read_text(errors="replace"))
        return self.pick(names) if names else path.stem


def _call(index: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{index:04d}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _test_output(rng: random.Random, name: str) -> str:
    passed = 20 + int(rng.random() * 400)
    failed = int(rng.random() * 3)
    lines = [f"tests/test_{name}.py::test_case_{i} PASSED" for i in range(min(passed, 40))]
    lines += [f"FAILED tests/test_{name}.py::test_edge_{i} - AssertionError" for i in range(failed)]
    lines.append(f"===== {passed} passed, {failed} failed in {rng.random() * 9 + 0.5:.2f}s =====")
    return "\n".join(lines)


def _step(src: _Source, rng: random.Random, index: int) -> tuple[str, dict[str, Any], str]:
    """(reasoning, tool call, tool output) of one agent step."""
    path = src.pick(src.files)
    word = src.word_from(path)
    thought = src.pick(_THOUGHTS).format(name=path.stem, word=word)
    roll = rng.random()
    if roll < 0.15:
        directory = src.pick(src.dirs)
        return thought, _call(index, "list_dir", {"path": str(directory)}), src.listing(directory)
    if roll < 0.6:
        body, start, end = src.read(path, 60 + int(rng.random() * 240))
        args = {"path": str(path), "start_line": start, "end_line": end}
        return thought, _call(index, "read_file", args), body
    if roll < 0.85:
        return (
            thought,
            _call(index, "grep", {"pattern": word, "path": str(src.root)}),
            src.grep(word),
        )
    command = f"python -m pytest -q tests/test_{path.stem}.py"
    return (
        thought,
        _call(index, "run_command", {"command": command, "timeout": 120}),
        _test_output(rng, path.stem),
    )


def _task(src: _Source) -> str:
    path = src.pick(src.files)
    word = src.word_from(path)
    return (
        f"The test suite reports a regression in `{path.name}`: calling `{word}` with an empty "
        f"input raises instead of returning the default. Find the cause, fix it, and make sure "
        f"the existing tests still pass."
    )


def estimated_tokens(trace: Trace) -> int:
    """The size of `trace`'s final request in tokens, as `generate` estimates it."""
    return int(_chars(trace.requests[-1].messages) / CHARS_PER_TOKEN) if trace.requests else 0


def _chars(messages: list[dict[str, Any]]) -> int:
    """The characters of `messages`' text: contents, reasoning and tool-call arguments."""
    calls = [c for m in messages for c in m.get("tool_calls") or []]
    text = sum(
        len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in messages
    )
    return text + sum(len(c["function"]["arguments"]) for c in calls)


def generate(seed: int = 0, target_tokens: int = 30_000, max_turns: int = 150) -> Trace:
    """One synthetic session whose final request is about `target_tokens` tokens."""
    rng = random.Random(seed)
    src = _Source(rng)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": _task(src)},
    ]
    requests = []
    size = _chars(messages)
    for index in range(max_turns):
        if size / CHARS_PER_TOKEN >= target_tokens:
            break
        thought, call, output = _step(src, rng, index)
        response = Response(reasoning_content=thought, tool_calls=[call])
        requests.append(
            Request(f"gen{seed}-{index}", list(messages), TOOLS, max_tokens=512, response=response)
        )
        turn = [
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": thought,
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": output},
        ]
        messages, size = messages + turn, size + _chars(turn)
    final = "I fixed the default handling for empty input and the test suite passes."
    response = Response(content=final)
    requests.append(
        Request(
            f"gen{seed}-{len(requests)}", list(messages), TOOLS, max_tokens=512, response=response
        )
    )
    header = Header(
        FORMAT,
        "agentrt-generator",
        f"synthetic coding-agent session, seed {seed}, ~{target_tokens} tokens",
    )
    return Trace(header, requests, f"synthetic-seed{seed}.jsonl")
