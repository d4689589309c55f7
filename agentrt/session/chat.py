"""Chat formatting: message validation, rendering through the tokenizer's chat template, the
streaming output parser (reasoning `<think>…</think>`, tool calls `<tool_call>{json}</tool_call>`,
content), incremental detokenisation, and the result/event types of `Runtime.chat`.

The parser works on text, holding back any tail that could be the start of a marker, so the same
code serves streaming and non-streaming calls. Malformed tool-call JSON is returned as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrt.errors import ChatTemplateError, InvalidArgumentError

ROLES = ("system", "user", "assistant", "tool", "developer")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


# ----------------------------------------------------------------------------- results and events


@dataclass
class ChatResult:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]]
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, int]
    timings: dict[str, float]

    def message(self) -> dict[str, Any]:
        """The assistant message in OpenAI shape (for appending to `messages`)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@dataclass
class ChatEvent:
    """One streaming event: `reasoning`/`content` text deltas, a complete `tool_call`, or `done`."""

    type: str
    text: str = ""
    tool_call: dict[str, Any] | None = None
    result: ChatResult | None = None

    @property
    def usage(self) -> dict[str, int] | None:
        return self.result.usage if self.result else None

    @property
    def timings(self) -> dict[str, float] | None:
        return self.result.timings if self.result else None


# ----------------------------------------------------------------------------- messages and rendering


def _text_of(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgumentError(f"{where}: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgumentError(f"{where}: content must be a string, null or a list of text parts")


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate OpenAI-shaped messages and return plain dicts with string contents."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidArgumentError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidArgumentError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        clean = dict(msg)
        clean["role"] = "system" if role == "developer" else role
        clean["content"] = _text_of(msg.get("content"), f"messages[{i}]")
        out.append(clean)
    return out


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None, **template_kwargs) -> str:
    """Render messages (+ tools) with the tokenizer's chat template, ending with the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the tokenizer has no chat template; pass chat_template=FILE")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
    except Exception as exc:  # noqa: BLE001 - template errors are user input errors
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    return text


def opens_in_reasoning(prompt: str) -> bool:
    """True when the rendered prompt leaves a `<think>` block open (the model continues reasoning)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


# ----------------------------------------------------------------------------- detokenisation


class Detokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are already fully emitted
        self.read = 0  # ids[prefix:read] decode to text already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if full.endswith("\ufffd") or len(full) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(done) :]


# ----------------------------------------------------------------------------- output parser


def _holdback(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def parse_tool_call(body: str) -> dict[str, Any] | None:
    """`{"name": ..., "arguments": ...}` -> OpenAI tool call, or None when malformed."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": data["name"], "arguments": args}}


@dataclass
class OutputParser:
    """Streaming splitter of generated text into reasoning, content and tool calls."""

    mode: str = "content"  # content | reasoning | tool_call
    pending: str = ""  # text not yet emitted (held back or a tool-call body)
    at_section_start: bool = True
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> list[ChatEvent]:
        self.pending += text
        events: list[ChatEvent] = []
        while self._step(events):
            pass
        return events

    def _markers(self) -> tuple[str, ...]:
        return {"content": (THINK_OPEN, CALL_OPEN), "reasoning": (THINK_CLOSE,), "tool_call": (CALL_CLOSE,)}[self.mode]

    def _step(self, events: list[ChatEvent]) -> bool:
        """Consume up to the next marker; return True if a marker was found."""
        hits = [(self.pending.find(m), m) for m in self._markers() if m in self.pending]
        if not hits:
            if self.mode != "tool_call":  # emit all but a possible marker start and trailing newlines
                cut = len(self.pending) - _holdback(self.pending, self._markers())
                ready = self.pending[:cut].rstrip("\n")
                self._emit(ready, events)
                self.pending = self.pending[len(ready) :]
            return False
        pos, marker = min(hits)
        before, self.pending = self.pending[:pos], self.pending[pos + len(marker) :]
        if self.mode == "tool_call":
            self._finish_call(before, events)
        else:
            self._emit(before.rstrip("\n"), events)
        self.mode = {THINK_OPEN: "reasoning", CALL_OPEN: "tool_call"}.get(marker, "content")
        self.at_section_start = True
        return True

    def _emit(self, text: str, events: list[ChatEvent]) -> None:
        if self.at_section_start:
            text = text.lstrip("\n")
        if not text:
            return
        self.at_section_start = False
        kind = "reasoning" if self.mode == "reasoning" else "content"
        (self.reasoning if kind == "reasoning" else self.content).append(text)
        events.append(ChatEvent(kind, text))

    def _finish_call(self, body: str, events: list[ChatEvent]) -> None:
        call = parse_tool_call(body.strip())
        if call is None:
            self.mode = "content"
            self.at_section_start = False
            self._emit(f"{CALL_OPEN}{body}{CALL_CLOSE}", events)
            return
        self.tool_calls.append(call)
        events.append(ChatEvent("tool_call", tool_call=call))

    def finish(self) -> list[ChatEvent]:
        """Flush what is left at the end of generation (an unclosed tool call becomes content)."""
        events: list[ChatEvent] = []
        rest, self.pending = self.pending, ""
        if self.mode == "tool_call":
            self.mode, self.at_section_start = "content", False
            rest = CALL_OPEN + rest
        self._emit(rest.rstrip("\n"), events)
        return events
