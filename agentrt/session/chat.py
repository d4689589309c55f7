"""Chat formatting: message validation, rendering through the tokenizer's chat template, the
streaming output parser (reasoning `<think>…</think>`, tool calls `<tool_call>{json}</tool_call>`,
content), incremental detokenisation, and the result/event types of `Runtime.chat`.

The parser works on text, holding back any tail that could be the start of a marker, so the same
code serves streaming and non-streaming calls. Malformed tool-call JSON is returned as content,
unless the call was streamed already (see `toolstream.py`): then it stays a call.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrt.errors import ChatTemplateError, InvalidArgumentError
from agentrt.session.toolstream import LiveCall, new_call_id

ROLES = ("system", "user", "assistant", "tool", "developer")
REASONING_EFFORTS = ("low", "medium", "high")
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
    checkpoint: str | None = None  # kind of reused state: "live", a boundary kind, "block"
    restore_source: str | None = None  # where it came from: "live", "device", "ram", "lmdb"
    reuse_s: dict[str, float] | None = None  # restore_s, capture_s, ... (see engine.Timings)
    stop_sequence: str | None = None  # the stop string that ended the text, if one did

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
    """One streaming event: `reasoning`/`content` text deltas; `tool_call_start` (a call's id and
    name, its arguments empty) then `tool_call_args` deltas of its arguments text, for a call
    streamed as it is written (`toolstream.py`); a complete `tool_call` (`streamed`: its start
    and arguments went out already); or `done`."""

    type: str
    text: str = ""
    tool_call: dict[str, Any] | None = None
    result: ChatResult | None = None
    streamed: bool = False

    @property
    def usage(self) -> dict[str, int] | None:
        return self.result.usage if self.result else None

    @property
    def timings(self) -> dict[str, float] | None:
        return self.result.timings if self.result else None


# ------------------------------------------------------------------------- messages and rendering


def _text_of(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
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
            raise InvalidArgumentError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}"
            )
        clean = copy.deepcopy(msg)
        clean["role"] = "system" if role == "developer" else role
        # null content (an assistant message that only calls tools) renders as "": templates
        # such as Qwen3's test `'</think>' in content` and fail on None
        clean["content"] = _text_of(msg.get("content"), f"messages[{i}]") or ""
        if clean.get("tool_calls"):
            clean["tool_calls"] = [
                _normalize_call(c, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(clean["tool_calls"])
            ]
        out.append(clean)
    return out


def _normalize_call(call: Any, where: str) -> dict[str, Any]:
    """Check an OpenAI tool call; JSON-string arguments become a dict (templates iterate them)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidArgumentError(
            f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}"
        )
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return call


def render(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    generation_prompt: bool = True,
    today: datetime.date | None = None,
    reasoning_effort: str | None = None,
) -> str:
    """Render messages (+ tools) with the chat template (ending with the assistant header);
    `today`: the date a template that prints the date (`strftime_now`) sees;
    `reasoning_effort`: low, medium or high, for templates that take it (gpt-oss's)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "the tokenizer has no chat template: give one with --chat-template FILE "
            "(Runtime.open(chat_template=FILE))"
        )
    template = tokenizer.chat_template
    extra: dict[str, Any] = {}
    if reasoning_effort is not None:
        check_effort(reasoning_effort)
        extra["reasoning_effort"] = reasoning_effort
    if today is not None and isinstance(template, str) and "strftime_now" in template:
        extra["chat_template"] = dated_template(template, today)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **extra,
        )
    except Exception as exc:  # noqa: BLE001 - template errors are user input errors
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise ChatTemplateError("chat template did not render to text")
    return text


def check_effort(effort: str | None) -> None:
    """A reasoning effort chat templates take (low, medium, high), or None."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidArgumentError(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}"
        )


_STRFTIME = re.compile(r"strftime_now\(\s*(['\"])(.*?)\1\s*\)")


@functools.lru_cache(maxsize=8)
def dated_template(template: str, today: datetime.date) -> str:
    """`template` with each `strftime_now("FORMAT")` replaced by `today` in that format (the
    template then renders the same text all day long, and on any later day)."""
    return _STRFTIME.sub(lambda m: json.dumps(today.strftime(m[2])), template)


def forced_tool_text(tokenizer, tool_choice) -> str:
    """Text appended after the assistant header to force a tool call (`required` / named)."""
    if tool_choice in (None, "auto", "none"):
        return ""
    newline = "" if "<tool_output>" in tokenizer.get_vocab() else "\n"  # tiny vs Qwen/ChatML layout
    opener = CALL_OPEN + newline
    if isinstance(tool_choice, dict):
        return (
            opener + '{"name": ' + json.dumps(tool_choice["function"]["name"]) + ', "arguments": '
        )
    return opener


def opens_in_reasoning(generation_prompt: str) -> bool:
    """True when the assistant header the template appends leaves `<think>` open."""
    return generation_prompt.rfind(THINK_OPEN) > generation_prompt.rfind(THINK_CLOSE)


def generation_suffix(tokenizer, messages: list[dict[str, Any]], tools, prompt: str) -> str:
    """The part of `prompt` that the generation prompt added (the assistant header).

    Found from the last message alone when that render's suffix is not empty and the prompt ends
    with it and with the text before it (so it is not the tail of a longer suffix that depends
    on earlier messages): rendering a long transcript twice cost 7 ms of a request's
    preparation. Otherwise from the whole transcript."""
    if len(messages) > 1:
        try:
            base = render(tokenizer, messages[-1:], tools, generation_prompt=False)
            full = render(tokenizer, messages[-1:], tools)
        except ChatTemplateError:
            base = full = ""
        tail = len(full) - len(base) + min(len(base), 64)
        if full.startswith(base) and len(full) > len(base) and prompt.endswith(full[-tail:]):
            return full[len(base) :]
    base = render(tokenizer, messages, tools, generation_prompt=False)
    return prompt[len(base) :] if prompt.startswith(base) else ""


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
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if full.endswith("\ufffd") or len(full) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(done) :]

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character at the end decodes as U+FFFD)."""
        done = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
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


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _schema_types(tools: list[dict] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _xml_value(text: str, declared: Any) -> Any:
    value = text[1:] if text.startswith("\n") else text
    value = value[:-1] if value.endswith("\n") else value
    if declared == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _parse_body(body: str, tools: list[dict] | None) -> tuple[str, Any] | None:
    """(name, arguments) of a JSON body or an XML-style `<function=N><parameter=K>V...` body."""
    if body.startswith("<function="):
        match = _FUNCTION.fullmatch(body)
        if match is None:
            return None
        name = match[1].strip()
        types = _schema_types(tools, name)
        args = {
            k.strip(): _xml_value(v, types.get(k.strip())) for k, v in _PARAMETER.findall(match[2])
        }
        return name, args
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    return data["name"], data.get("arguments", {})


def parse_tool_call(body: str, tools: list[dict] | None = None) -> dict[str, Any] | None:
    """Tool-call body -> OpenAI tool call, or None when malformed."""
    parsed = _parse_body(body.strip(), tools)
    if parsed is None:
        return None
    name, args = parsed
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def tool_names(tools: list[dict[str, Any]] | None) -> set[str] | None:
    """The names of a request's tools (None: no tools listed, any name goes)."""
    if not tools:
        return None
    fns = (t.get("function", t) for t in tools if isinstance(t, dict))
    return {fn.get("name") for fn in fns if isinstance(fn, dict)}


@dataclass
class OutputParser:
    """Streaming splitter of generated text into reasoning, content and tool calls."""

    mode: str = "content"  # content | reasoning | tool_call
    pending: str = ""  # text not yet emitted (held back or a tool-call body)
    at_section_start: bool = True
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # schemas, to type XML-style parameters
    parse_tools: bool = True  # False (tool_choice "none"): tool-call markup stays content
    live: LiveCall | None = None  # the tool call being streamed
    names: set[str] | None = field(init=False, default=None)  # the tools' names (None: any)

    def __post_init__(self) -> None:
        self.names = tool_names(self.tools)

    @property
    def in_call(self) -> bool:
        """Whether a tool call is open (its close not read yet)."""
        return self.mode == "tool_call"

    def feed(self, text: str) -> list[ChatEvent]:
        self.pending += text
        events: list[ChatEvent] = []
        while self._step(events):
            pass
        return events

    def _markers(self) -> tuple[str, ...]:
        if self.mode == "content":
            return (THINK_OPEN, CALL_OPEN) if self.parse_tools else (THINK_OPEN,)
        return (THINK_CLOSE,) if self.mode == "reasoning" else (CALL_CLOSE,)

    def _step(self, events: list[ChatEvent]) -> bool:
        """Consume up to the next marker; return True if a marker was found."""
        hits = [(self.pending.find(m), m) for m in self._markers() if m in self.pending]
        if not hits and self.mode == "tool_call":
            self._stream_call(self.pending, events, _holdback(self.pending, (CALL_CLOSE,)))
        if not hits:
            if (
                self.mode != "tool_call"
            ):  # emit all but a possible marker start and trailing newlines
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
        kind = "reasoning" if self.mode == "reasoning" else "content"
        parts = self.reasoning if kind == "reasoning" else self.content
        if self.at_section_start and not parts:  # newlines after a marker start nothing new
            text = text.lstrip("\n")
        if not text:
            return
        self.at_section_start = False
        parts.append(text)
        events.append(ChatEvent(kind, text))

    def _stream_call(self, body: str, events: list[ChatEvent], hold: int = 0) -> None:
        """The open tool call's start, once `body` commits it, and its new arguments text (not
        the last `hold` characters)."""
        if self.live is None:
            self.live = LiveCall.commit(body, self.names)
            if self.live is None:
                return
            start = {**self.live.call, "function": dict(self.live.call["function"])}
            events.append(ChatEvent("tool_call_start", tool_call=start))
        delta = self.live.advance(body, hold)
        if delta:
            events.append(ChatEvent("tool_call_args", delta))

    def _close_live(self, body: str, events: list[ChatEvent]) -> None:
        """End the streamed call: its last arguments, the call, then any text after it."""
        live, self.live = self.live, None
        delta, rest = live.close(body)
        if delta:
            events.append(ChatEvent("tool_call_args", delta))
        self.tool_calls.append(live.call)
        events.append(ChatEvent("tool_call", tool_call=live.call, streamed=True))
        self.at_section_start = False
        self._emit(rest, events)

    def _finish_call(self, body: str, events: list[ChatEvent]) -> None:
        self._stream_call(body, events)  # (a whole body at once: the same events and call)
        if self.live is not None:
            self._close_live(body, events)
            return
        call = parse_tool_call(body, self.tools)
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
        if self.mode == "tool_call" and self.live is not None:  # cut off: it stays a call
            self._close_live(rest, events)
            self.mode, rest = "content", ""
        if self.mode == "tool_call":
            self.mode, self.at_section_start = "content", False
            rest = CALL_OPEN + rest
        self._emit(rest.rstrip("\n"), events)
        return events
