"""Incremental streaming of a JSON tool-call body, `{"name": N, "arguments": {...}}`.

A call is committed once its name (a string; one of the request's tools when it has tools) and
the opening brace of its arguments object have been written. From then on the arguments' text
goes out as the model writes it (up to the object's closing brace, never into what may be the
start of `</tool_call>`), and the call ends as a tool call whatever follows: its `arguments` are
exactly the text streamed. A body that closes properly gives arguments that are the model's own
JSON text; one cut off by the token limit keeps its partial arguments (as the hosted APIs do);
text after the arguments object other than its closing brace becomes content. Bodies that never
reach the commit point (another shape, an unknown tool, the XML-style form) are parsed whole at
their close, and a malformed one becomes content, so streamed deltas never contradict the final
message."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')
_TAIL = re.compile(r"\s*\}\s*")  # what may follow the arguments object in a proper body


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class LiveCall:
    """A committed tool call whose arguments are being streamed."""

    call: dict[str, Any]  # OpenAI shape; `arguments` holds the text streamed so far
    start: int  # offset in the body of the arguments' opening brace
    scanned: int = 0  # body characters from `start` already streamed
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    end: int | None = None  # offset just past the arguments' closing brace, once written

    @classmethod
    def commit(cls, body: str, names: set[str] | None) -> LiveCall | None:
        """The call `body` (the text after `<tool_call>` so far) starts, once it reaches the
        commit point; None before it, or when it names no tool of `names`."""
        match = _HEAD.match(body)
        if match is None or (names is not None and match[1] not in names):
            return None
        fn = {"name": match[1], "arguments": ""}
        return cls({"id": new_call_id(), "type": "function", "function": fn}, match.end())

    def advance(self, body: str, hold: int = 0) -> str:
        """The arguments text written since the last call (not the last `hold` characters of
        `body`, nor past the object's end); it is appended to the call's arguments."""
        pos = self.start + self.scanned
        limit = len(body) - hold if self.end is None else self.end
        begin = pos
        while pos < limit and self.end is None:
            ch = body[pos]
            pos += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = pos
        delta = body[begin:pos]
        self.scanned = pos - self.start
        self.call["function"]["arguments"] += delta
        return delta

    def close(self, body: str) -> tuple[str, str]:
        """At the body's end (its close, or the end of generation): the last arguments delta,
        and the text after the arguments object that is not the body's closing brace (content;
        usually empty)."""
        delta = self.advance(body)
        if self.end is None:
            return delta, ""
        rest = body[self.end :]
        return delta, "" if _TAIL.fullmatch(rest) or not rest.strip() else rest
