"""The harmony chat format (gpt-oss): messages prepared for its chat template, and the streaming
parser of its output channels.

A harmony reply is a run of messages, each `<|start|>assistant` + header + `<|message|>` + body,
ended by `<|end|>`, `<|call|>` (a tool call: a stop token) or `<|return|>` (the reply's end: a
stop token). The header names a channel (`<|channel|>analysis|commentary|final`) and may name a
recipient (`to=functions.NAME`, before or after the channel) and a content type. The prompt
already ends with the first `<|start|>assistant`. Bodies map to the OpenAI shapes: `analysis` ->
`reasoning_content`, `final` and `commentary` -> `content`, a message to `functions.NAME` (a
tool of the request, or any name when the request lists none) -> a tool call whose arguments are
the body's text, streamed as it is written; a message to any other recipient stays content.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from agentrt.session.chat import ChatEvent, _holdback, tool_names
from agentrt.session.toolstream import new_call_id

START, MESSAGE, END, CALL, RETURN, CHANNEL = (
    "<|start|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|channel|>",
)
_BODY_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


def is_harmony(tokenizer) -> bool:
    """Whether `tokenizer` speaks harmony (has its channel and message tokens)."""
    vocab = tokenizer.get_vocab()
    return CHANNEL in vocab and MESSAGE in vocab and START in vocab


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as the gpt-oss template reads them, nothing dropped that it would
    drop or refuse: `reasoning_content` as `thinking`; an assistant message with tool calls,
    reasoning and content gets its content appended to the reasoning (the template refuses both,
    and renders the content of such a message as reasoning anyway); a system message after the
    first as a user message (the template renders only the first); an assistant message with
    several tool calls split into one message per call, each followed by its result where the
    results follow in order (the template renders only an assistant message's first call and
    names a result after the last call)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        msg = copy.deepcopy(messages[i])
        if msg["role"] == "system" and i > 0:
            msg["role"] = "user"
        if msg["role"] == "assistant" and msg.get("reasoning_content"):
            msg["thinking"] = msg.pop("reasoning_content")
            if msg.get("tool_calls") and msg.get("content"):
                msg["thinking"] += "\n\n" + msg["content"]
                msg["content"] = ""
        calls = msg.get("tool_calls") or []
        results = messages[i + 1 : i + 1 + len(calls)]
        ids = [c.get("id") for c in calls]
        if len(calls) > 1 and [r.get("tool_call_id") for r in results] == ids:
            for j, (call, result) in enumerate(zip(calls, results, strict=True)):
                part = {**msg, "tool_calls": [call]} if j == 0 else _call_only(msg, call)
                out += [part, copy.deepcopy(result)]
            i += 1 + len(calls)
            continue
        out.append(msg)
        i += 1
    return out


def harmony_forced(tool_choice) -> str:
    """Text after the assistant header that starts a tool call (`required`: to some function,
    the model writes the name; named: to that function), or nothing."""
    if tool_choice in (None, "auto", "none"):
        return ""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return f"{CHANNEL}commentary to=functions.{name} <|constrain|>json{MESSAGE}"
    return f"{CHANNEL}commentary to=functions."


def _call_only(msg: dict[str, Any], call: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [call]}


@dataclass
class HarmonyParser:
    """Streaming splitter of a harmony reply (text with its special tokens) into reasoning,
    content and tool calls: the same interface as `chat.OutputParser`."""

    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True  # False (tool_choice "none"): messages to functions become content
    pending: str = ""
    state: str = "header"  # header | body | between (after a message's end)
    channel: str = ""
    recipient: str = ""
    call: dict[str, Any] | None = None  # the tool call whose arguments are being written
    arguments: str = ""
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    names: set[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.names = tool_names(self.tools)

    @property
    def in_call(self) -> bool:
        """Whether a message to a function is open (its end not read yet)."""
        return self.state == "body" and self._function() is not None

    def feed(self, text: str) -> list[ChatEvent]:
        self.pending += text
        events: list[ChatEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ChatEvent]:
        """The reply ended (a stop token, the token limit): close an open message."""
        events: list[ChatEvent] = []
        if self.state == "body":
            self._body(self.pending, events)
            self._end_message(events)
        self.pending, self.state = "", "between"
        return events

    # ---- states

    def _step(self, events: list[ChatEvent]) -> bool:
        if self.state == "header":
            return self._header()
        if self.state == "between":
            return self._between()
        ends = [(self.pending.find(m), m) for m in _BODY_ENDS if m in self.pending]
        if not ends:
            cut = len(self.pending) - _holdback(self.pending, _BODY_ENDS)
            self._body(self.pending[:cut], events)
            self.pending = self.pending[cut:]
            return False
        pos, marker = min(ends)
        self._body(self.pending[:pos], events)
        self.pending = self.pending[pos + len(marker) :]
        self._end_message(events)
        self.state = "between"
        return True

    def _header(self) -> bool:
        pos = self.pending.find(MESSAGE)
        if pos < 0:
            return False
        header, self.pending = self.pending[:pos], self.pending[pos + len(MESSAGE) :]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel[1] if channel else ""
        self.recipient = recipient[1] if recipient else ""
        self.state = "body"
        return True

    def _between(self) -> bool:
        pos = self.pending.find(START)
        if pos < 0:  # (text between messages is not shown)
            self.pending = self.pending[len(self.pending) - _holdback(self.pending, (START,)) :]
            return False
        self.pending = self.pending[pos + len(START) :]
        self.state = "header"
        return True

    # ---- bodies

    def _function(self) -> str | None:
        """The function a message is addressed to, when it is a tool call."""
        if not self.parse_tools or not self.recipient.startswith("functions."):
            return None
        name = self.recipient[len("functions.") :]
        return name if self.names is None or name in self.names else None

    def _body(self, text: str, events: list[ChatEvent]) -> None:
        if not text:
            return
        name = self._function()
        if name is not None:
            self._call_text(name, text, events)
        elif self.channel == "analysis" and not self.recipient:
            self.reasoning.append(text)
            events.append(ChatEvent("reasoning", text))
        else:  # final, commentary, and messages to recipients it does not call (kept visible)
            self.content.append(text)
            events.append(ChatEvent("content", text))

    def _call_text(self, name: str, text: str, events: list[ChatEvent]) -> None:
        if self.call is None:
            self.call = {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            start = {**self.call, "function": dict(self.call["function"])}
            events.append(ChatEvent("tool_call_start", tool_call=start))
        self.arguments += text
        if text:
            events.append(ChatEvent("tool_call_args", text))

    def _end_message(self, events: list[ChatEvent]) -> None:
        name = self._function()
        if name is not None:
            if self.call is None:  # (an empty body: a call without arguments)
                self._call_text(name, "", events)
            if not self.arguments:  # (streamed too: the deltas join to the final arguments)
                self._call_text(name, "{}", events)
            call, self.call = self.call, None
            call["function"]["arguments"] = self.arguments or "{}"
            self.arguments = ""
            self.tool_calls.append(call)
            events.append(ChatEvent("tool_call", tool_call=call, streamed=True))
        self.channel = self.recipient = ""
