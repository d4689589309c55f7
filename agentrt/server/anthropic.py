"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): its routes (on
the chat server's worker, API-key check and metrics), its response shapes (a message, its
server-sent event sequence, usage) and its errors. Requests: `anthropic_schema.py`."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentrt.errors import AgentrtError
from agentrt.server import anthropic_schema as requests
from agentrt.server.schema import BadRequest
from agentrt.server.worker import Job

# error types by status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "api_error",
}


def error(status: int, message: str) -> JSONResponse:
    """An Anthropic-shaped error answer."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status)


# ----------------------------------------------------------------------------- response shapes


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage(result) -> dict[str, int]:
    """Anthropic usage: input tokens not read from the state cache, those that were, output."""
    u = result.usage
    return {
        "input_tokens": u["prompt_tokens"] - u["cached_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u["cached_tokens"],
        "output_tokens": u["completion_tokens"],
    }


def stop_reason(result) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    if result.tool_calls and result.finish_reason == "tool_calls":
        return "tool_use", None
    if result.stop_sequence is not None:  # (one that cut a tool call short too)
        return "stop_sequence", result.stop_sequence
    if result.tool_calls and result.finish_reason == "stop":
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    args = fn.get("arguments") or "{}"
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        value = {}
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": value}


def message_body(result, model: str, msg_id: str) -> dict[str, Any]:
    """The non-streamed reply."""
    content: list[dict[str, Any]] = []
    if result.reasoning_content:
        content.append({"type": "thinking", "thinking": result.reasoning_content, "signature": ""})
    if result.content:
        content.append({"type": "text", "text": result.content})
    content += [_tool_use(call) for call in result.tool_calls]
    reason, sequence = stop_reason(result)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(result),
    }


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessageStream:
    """Chat events to the Messages API's event sequence: `message_start`, then per content
    block `content_block_start`, its deltas and `content_block_stop`, then `message_delta`
    (stop reason, usage) and `message_stop`. A streamed tool call opens its `tool_use` block
    at its start and sends its arguments text as `input_json_delta`s as they are written; one
    not streamed arrives complete, as one delta."""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.model, self.prompt_tokens = model, prompt_tokens
        self.index = -1
        self.open: str | None = None  # type of the block being streamed

    def start(self) -> str:
        message = {
            "id": message_id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return sse("message_start", {"type": "message_start", "message": message})

    def _begin(self, block: dict[str, Any]) -> str:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + sse("content_block_start", start)

    def _close(self) -> str:
        if self.open is None:
            return ""
        out = ""
        if self.open == "thinking":  # (no signature: the client sends the block back as is)
            delta = {"type": "signature_delta", "signature": ""}
            out = self._delta(delta)
        self.open = None
        return out + sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse("content_block_delta", body)

    def event(self, event) -> Iterator[str]:
        """SSE text for one chat event (`reasoning`, `content`, `tool_call_start`,
        `tool_call_args`, `tool_call`, `done`)."""
        if event.type == "reasoning":
            if self.open != "thinking":
                yield self._begin({"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": event.text})
        elif event.type == "content":
            if self.open != "text":
                yield self._begin({"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": event.text})
        elif event.type == "tool_call_start":
            call = event.tool_call
            block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"]}
            yield self._begin({**block, "input": {}})
        elif event.type == "tool_call_args":
            yield self._delta({"type": "input_json_delta", "partial_json": event.text})
        elif event.type == "tool_call" and not event.streamed:
            block = _tool_use(event.tool_call)
            yield self._begin({**block, "input": {}})
            partial = json.dumps(block["input"], ensure_ascii=False)
            yield self._delta({"type": "input_json_delta", "partial_json": partial})
        elif event.type == "done":
            yield self._close()
            reason, sequence = stop_reason(event.result)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            body = {"type": "message_delta", "delta": delta, "usage": usage(event.result)}
            yield sse("message_delta", body)
            yield sse("message_stop", {"type": "message_stop"})

    @staticmethod
    def failure(message: str) -> str:
        return sse("error", {"type": "error", "error": {"type": "api_error", "message": message}})

    @staticmethod
    def ping() -> str:
        return sse("ping", {"type": "ping"})


# ----------------------------------------------------------------------------- routes


def _answer(status: int, message: str, param=None, code=None) -> JSONResponse:
    return error(status, message)


def _decode(body: bytes) -> tuple[requests.MessagesRequest, tuple, dict[str, Any]]:
    req = requests.decode(body)
    return req, requests.to_plain(req), requests.sampling(req)


async def messages(server, request: Request) -> Response:
    """`POST /v1/messages` on `server` (an `app.ChatServer`): the conversation in OpenAI shape,
    through the same renderer, worker and state cache as chat completions."""
    admitted = await server.admit(request, _decode, _answer)
    if isinstance(admitted, Response):
        return admitted
    req, job = admitted
    if req.stream:
        events = _events(server, job, len(job.prepared.prompt_ids))
        return StreamingResponse(events, media_type="text/event-stream")
    result = await server.outcome(request, job, _answer)
    if isinstance(result, Response):
        return result
    return JSONResponse(message_body(result, server.model_name, message_id()))


def _events(server, job: Job, prompt_tokens: int):
    stream = MessageStream(server.model_name, prompt_tokens)
    return server.relay(job, stream.start(), stream.event, stream.failure, stream.ping())


async def count_tokens(server, request: Request) -> Response:
    """`POST /v1/messages/count_tokens`: the prompt's length as this server renders it."""
    if not server._authorized(request):
        return error(401, "invalid or missing API key")
    try:
        req = requests.decode(await server._body(request), requests.CountRequest)
        count = partial(server.runtime.prepare, check_fits=False)  # (a client counts to compact)
        prepared = await asyncio.to_thread(count, *requests.to_plain(req))
    except BadRequest as exc:
        return error(exc.status, exc.message)
    except AgentrtError as exc:
        return error(400, str(exc))
    return JSONResponse({"input_tokens": len(prepared.prompt_ids)})
