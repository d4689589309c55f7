"""Request validation for the chat-completions API: msgspec structs for the OpenAI shapes, then
the semantic checks msgspec cannot express. Every failure is a `BadRequest` with an OpenAI-style
message and the offending parameter, answered by `error`; nothing here touches the model."""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from starlette.responses import JSONResponse

from agentrt.session.chat import REASONING_EFFORTS

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def error(
    status: int, message: str, param: str | None = None, code: str | None = None, kind=None
) -> JSONResponse:
    """An OpenAI-shaped error answer."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class Message(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatRequest(msgspec.Struct):
    model: str
    messages: list[Message]
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    reasoning_effort: str | None = None  # low | medium | high (templates that take it)


_decoder = msgspec.json.Decoder(ChatRequest)


def _param_of(error: str) -> str | None:
    match = re.search(r"at `\$\.([^`]+)`", error)
    return match.group(1) if match else None


def parse(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """A request body through `decoder` (any API's request struct); every failure a
    `BadRequest` naming the offending parameter where msgspec says which."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}", _param_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


def decode(body: bytes) -> ChatRequest:
    """Parse and type-check a request body."""
    req = parse(_decoder, body)
    check(req)
    return req


def check(req: ChatRequest) -> None:
    if not req.messages:
        raise BadRequest("messages must not be empty", "messages")
    if req.n not in (None, 1):
        raise BadRequest("only n=1 is supported", "n")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise BadRequest("seed must fit in 64 bits", "seed")
    for name, value, lo, hi in (
        ("temperature", req.temperature, 0.0, 2.0),
        ("top_p", req.top_p, 0.0, 1.0),
    ):
        if value is not None and not lo <= value <= hi or (name == "top_p" and value == 0):
            raise BadRequest(
                f"{name} must be in [{lo}, {hi}]" + (" and > 0" if name == "top_p" else ""), name
            )
    limit = max_tokens(req)
    if limit is not None and limit < 1:
        raise BadRequest("max_tokens must be at least 1", "max_tokens")
    check_effort(req.reasoning_effort, "reasoning_effort")
    _check_messages(req.messages)
    names = _check_tools(req.tools or [])
    _check_tool_choice(req.tool_choice, names)


def check_effort(effort: Any, param: str) -> None:
    """A reasoning effort the chat templates take (or none)."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest(f"{param} must be one of {', '.join(REASONING_EFFORTS)}", param)


def max_tokens(req: ChatRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def _check_messages(messages: list[Message]) -> None:
    for i, msg in enumerate(messages):
        if isinstance(msg.content, list):
            for part in msg.content:
                if part.type != "text" or part.text is None:
                    raise BadRequest(
                        f"messages[{i}]: only text content parts are supported",
                        f"messages[{i}].content",
                    )
        if msg.role == "tool" and not msg.tool_call_id:
            raise BadRequest(
                f"messages[{i}]: a tool message needs tool_call_id", f"messages[{i}].tool_call_id"
            )
        if msg.tool_calls and msg.role != "assistant":
            raise BadRequest(
                f"messages[{i}]: only assistant messages carry tool_calls",
                f"messages[{i}].tool_calls",
            )


def _check_tools(tools: list[ToolDef]) -> set[str]:
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not NAME_RE.match(fn.name):
            raise BadRequest(
                f"tools[{i}]: function name must match [a-zA-Z0-9_-]{{1,64}}",
                f"tools[{i}].function.name",
            )
        if fn.name in names:
            raise BadRequest(
                f"tools[{i}]: duplicate function name {fn.name!r}", f"tools[{i}].function.name"
            )
        names.add(fn.name)
        params = fn.parameters
        if params is not None and (
            params.get("type", "object") != "object"
            or not isinstance(params.get("properties", {}), dict)
        ):
            raise BadRequest(
                f"tools[{i}]: parameters must be a JSON Schema object",
                f"tools[{i}].function.parameters",
            )
    return names


def _check_tool_choice(choice: str | dict | None, names: set[str]) -> None:
    if choice is None or choice in ("auto", "none"):
        return
    if choice == "required":
        if not names:
            raise BadRequest("tool_choice 'required' needs tools", "tool_choice")
        return
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") == "function" and isinstance(name, str) and name in names:
            return
    raise BadRequest(
        "tool_choice must be 'none', 'auto', 'required' or name one of the tools", "tool_choice"
    )


def to_plain(req: ChatRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools as plain OpenAI dicts for the runtime (a tool without a description
    gets an empty one, as on the other APIs: chat templates such as gpt-oss's read it)."""
    messages = msgspec.to_builtins(req.messages)
    tools = msgspec.to_builtins(req.tools) if req.tools else None
    for tool in tools or ():
        tool["function"].setdefault("description", "")
    return messages, tools
