"""The Anthropic Messages API's requests: msgspec structs for its shapes, the checks they cannot
express (every failure a `BadRequest`), and their translation into the OpenAI-shaped messages
and tools the runtime renders, so that a conversation reaches the same token ids, and the same
checkpoints, whichever API sends it."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from agentrt.server.schema import NAME_RE, BadRequest, parse


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: Any = None


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    data: str


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class Message(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent; server tools (bash_...) are not run
    cache_control: dict[str, Any] | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(msgspec.Struct):
    model: str
    messages: list[Message]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountRequest(msgspec.Struct):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


_decoders = {
    MessagesRequest: msgspec.json.Decoder(MessagesRequest),
    CountRequest: msgspec.json.Decoder(CountRequest),
}


def decode(body: bytes, kind: type = MessagesRequest):
    """Parse, type-check and check a request body (`MessagesRequest` or `CountRequest`)."""
    req = parse(_decoders[kind], body)
    if isinstance(req, MessagesRequest):
        _check_sampling(req)
    _check_conversation(req.messages)
    names = _check_tools(req.tools or [])
    _check_tool_choice(req.tool_choice, names)
    return req


def _check_sampling(req: MessagesRequest) -> None:
    if req.max_tokens < 1:
        raise BadRequest("max_tokens: must be at least 1")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise BadRequest("temperature: must be in [0, 1]")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise BadRequest("top_p: must be in (0, 1]")
    if req.top_k is not None:
        raise BadRequest("top_k: not supported by this server (use temperature or top_p)")
    if req.stop_sequences is not None and any(not s for s in req.stop_sequences):
        raise BadRequest("stop_sequences: must not contain empty strings")


def _check_conversation(messages: list[Message]) -> None:
    """Block types per role, tool results that answer an earlier tool use, no media."""
    if not messages:
        raise BadRequest("messages: at least one message is required")
    open_ids: set[str] = set()
    for i, msg in enumerate(messages):
        blocks = [] if isinstance(msg.content, str) else msg.content
        for j, block in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            if isinstance(block, ImageBlock | DocumentBlock):
                raise BadRequest(f"{where}: image and document blocks are not supported")
            if msg.role == "user" and isinstance(
                block, ToolUseBlock | ThinkingBlock | RedactedThinkingBlock
            ):
                raise BadRequest(f"{where}: a user message cannot hold a {_tag(block)} block")
            if msg.role == "assistant" and isinstance(block, ToolResultBlock):
                raise BadRequest(f"{where}: tool_result blocks belong in user messages")
            if isinstance(block, ToolUseBlock):
                if not NAME_RE.match(block.name):
                    raise BadRequest(f"{where}: tool name must match [a-zA-Z0-9_-]{{1,64}}")
                open_ids.add(block.id)
            if isinstance(block, ToolResultBlock):
                if block.tool_use_id not in open_ids:
                    raise BadRequest(
                        f"{where}: tool_result for unknown tool_use_id {block.tool_use_id!r}"
                    )
                if not isinstance(block.content, str | None) and any(
                    not isinstance(part, TextBlock) for part in block.content
                ):
                    raise BadRequest(f"{where}: only text content in tool results is supported")


def _tag(block) -> str:
    return type(block).__struct_config__.tag


def _check_tools(tools: list[Tool]) -> set[str]:
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise BadRequest(f"tools.{i}: server tool {tool.type!r} is not supported")
        if not NAME_RE.match(tool.name):
            raise BadRequest(f"tools.{i}.name: must match [a-zA-Z0-9_-]{{1,64}}")
        if tool.name in names:
            raise BadRequest(f"tools.{i}.name: duplicate tool name {tool.name!r}")
        schema = tool.input_schema
        if schema is None:
            raise BadRequest(f"tools.{i}.input_schema: required")
        if schema.get("type", "object") != "object" or not isinstance(
            schema.get("properties", {}), dict
        ):
            raise BadRequest(f"tools.{i}.input_schema: must be a JSON Schema object")
        names.add(tool.name)
    return names


def _check_tool_choice(choice: ToolChoice | None, names: set[str]) -> None:
    if choice is None or choice.type in ("auto", "none"):
        return
    if not names:
        raise BadRequest(f"tool_choice: {choice.type!r} needs tools")
    if choice.type == "tool" and choice.name not in names:
        raise BadRequest("tool_choice.name: must name one of the tools")


# ----------------------------------------------------------------------------- translation


def to_plain(req) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, Any]:
    """(messages, tools, tool_choice) in the OpenAI shapes `Runtime.prepare` takes."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _joined(req.system, "\n\n")
        messages.append({"role": "system", "content": system})
    for msg in req.messages:
        if isinstance(msg.content, str):
            messages.append({"role": msg.role, "content": msg.content})
        elif msg.role == "user":
            messages += _user_messages(msg.content)
        else:
            messages.append(_assistant_message(msg.content))
    tools = None
    if req.tools:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    return messages, tools, _tool_choice(req.tool_choice)


def _joined(blocks: list[TextBlock], sep: str) -> str:
    return sep.join(b.text for b in blocks)


def _user_messages(blocks: list) -> list[dict[str, Any]]:
    """A user turn's blocks in order: each tool result becomes a tool message, each run of
    text blocks one user message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
            texts.clear()

    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            flush()
            content = block.content
            text = content if isinstance(content, str) else _joined(content or [], "\n")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
    flush()
    if not out:  # (an empty content list)
        out.append({"role": "user", "content": ""})
    return out


def _assistant_message(blocks: list) -> dict[str, Any]:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
        }
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if thinking:
        msg["reasoning_content"] = thinking
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def sampling(req: MessagesRequest) -> dict[str, Any]:
    """`Runtime.chat_prepared` keyword arguments of a request (Anthropic's default
    temperature is 1; no seed: the server draws one)."""
    return {
        "max_tokens": req.max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "stop": req.stop_sequences or None,
        "seed": None,
    }
