"""The OpenAI Responses API's requests (the stateless subset): a msgspec struct for the request,
checks of its input items, and their translation into the chat-completions messages and tools
the runtime renders, so that a conversation reaches the same token ids, and the same
checkpoints, whichever API sends it. Stored responses (`previous_response_id`, `conversation`,
`background`), built-in tools and structured output formats are refused with a `BadRequest`."""

from __future__ import annotations

from typing import Any

import msgspec

from agentrt.server.schema import NAME_RE, BadRequest, check_effort, parse


class ResponsesRequest(msgspec.Struct):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None


_decoder = msgspec.json.Decoder(ResponsesRequest)

# (field, why) refused when set: this server keeps no responses and runs no built-in tools
_UNSUPPORTED = (
    ("previous_response_id", "stored responses are not kept; send the whole input"),
    ("conversation", "stored conversations are not kept; send the whole input"),
    ("background", "background responses are not supported"),
    ("prompt", "stored prompt templates are not supported"),
)


def decode(body: bytes) -> ResponsesRequest:
    """Parse, type-check and check a request body."""
    req = parse(_decoder, body)
    for name, why in _UNSUPPORTED:
        if getattr(req, name) not in (None, False):
            raise BadRequest(f"{name}: {why}", name)
    _check_sampling(req)
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") != "text":
        raise BadRequest("text.format: only plain text output is supported", "text.format")
    names = _check_tools(req.tools or [])
    _check_tool_choice(req.tool_choice, names)
    to_messages(req)  # (the input items' checks)
    return req


def _check_sampling(req: ResponsesRequest) -> None:
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise BadRequest("max_output_tokens must be at least 1", "max_output_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise BadRequest("temperature must be in [0, 2]", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise BadRequest("top_p must be in (0, 1]", "top_p")
    if req.truncation not in (None, "disabled"):
        raise BadRequest("truncation: only 'disabled' is supported", "truncation")


def _check_tools(tools: list[dict[str, Any]]) -> set[str]:
    names: set[str] = set()
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise BadRequest(f"tools[{i}]: tool type {kind!r} is not supported", f"tools[{i}]")
        name = tool.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise BadRequest(
                f"tools[{i}]: name must match [a-zA-Z0-9_-]{{1,64}}", f"tools[{i}].name"
            )
        if name in names:
            raise BadRequest(f"tools[{i}]: duplicate tool name {name!r}", f"tools[{i}].name")
        params = tool.get("parameters")
        if params is not None and (
            not isinstance(params, dict)
            or params.get("type", "object") != "object"
            or not isinstance(params.get("properties", {}), dict)
        ):
            raise BadRequest(
                f"tools[{i}]: parameters must be a JSON Schema object", f"tools[{i}].parameters"
            )
        names.add(name)
    return names


def _check_tool_choice(choice, names: set[str]) -> None:
    if choice is None or choice in ("auto", "none"):
        return
    if choice == "required" and names:
        return
    if isinstance(choice, dict) and choice.get("type") == "function":
        if isinstance(choice.get("name"), str) and choice["name"] in names:
            return
    raise BadRequest(
        "tool_choice must be 'none', 'auto', 'required' (with tools) or name one of the "
        "function tools",
        "tool_choice",
    )


# ----------------------------------------------------------------------------- translation


def to_plain(req: ResponsesRequest) -> tuple[list[dict[str, Any]], Any, Any, str | None]:
    """(messages, tools, tool_choice, reasoning effort) in the shapes `Runtime.prepare` takes."""
    tools = None
    if req.tools:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": t.get("parameters") or {"type": "object", "properties": {}},
                },
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return to_messages(req), tools, choice, effort(req)


def effort(req: ResponsesRequest) -> str | None:
    """`reasoning.effort`, checked (low, medium or high; or none)."""
    if req.reasoning is None:
        return None
    if not isinstance(req.reasoning, dict):
        raise BadRequest("reasoning must be an object", "reasoning")
    value = req.reasoning.get("effort")
    check_effort(value, "reasoning.effort")
    return value


def to_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages: `instructions` first as the system message; a run of
    reasoning, assistant message and function-call items becomes one assistant message; each
    function-call output a tool message."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise BadRequest("input must not be empty", "input")
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    turn: dict[str, Any] | None = None  # the assistant message being gathered
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind in ("reasoning", "function_call") or (
            kind == "message" and item.get("role") == "assistant"
        ):
            turn = turn or {"role": "assistant", "content": None}
            _gather(turn, item, kind, where, calls)
            continue
        if turn is not None:
            out.append(turn)
            turn = None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise BadRequest(f"{where}: unknown role {role!r}", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise BadRequest(f"{where}: output for unknown call_id {call_id!r}", where)
            output = _text(item.get("output"), where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise BadRequest(f"{where}: input item type {kind!r} is not supported", where)
    if turn is not None:
        out.append(turn)
    return out


def _gather(turn: dict[str, Any], item: dict[str, Any], kind: str, where: str, calls) -> None:
    """Add a reasoning, assistant message or function-call item to the assistant `turn`."""
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        if not isinstance(parts, list):
            raise BadRequest(f"{where}: a reasoning item's content must be a list", where)
        text = "".join(_text(p.get("text", ""), where) for p in parts if isinstance(p, dict))
        turn["reasoning_content"] = turn.get("reasoning_content", "") + text
    elif kind == "message":
        text = _text(item.get("content"), where)
        turn["content"] = (turn["content"] or "") + text
    else:
        name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
        if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
            raise BadRequest(f"{where}: a function_call needs name, arguments and call_id", where)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        turn.setdefault("tool_calls", []).append(call)
        calls.add(call_id)


def _text(content, where: str) -> str:
    """A string, or the text of a list of text parts (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of text parts", where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise BadRequest(f"{where}: content part {kind!r} is not supported", where)
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise BadRequest(f"{where}: a text part needs text", where)
        texts.append(text)
    return "".join(texts)


def sampling(req: ResponsesRequest) -> dict[str, Any]:
    """`Runtime.chat_prepared` keyword arguments of a request (no seed: the server draws
    one)."""
    kwargs: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "seed": None,
    }
    if req.max_output_tokens is not None:
        kwargs["max_tokens"] = req.max_output_tokens
    return kwargs
