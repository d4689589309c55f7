"""The OpenAI Responses API (`POST /v1/responses`, stateless): its route (on the chat server's
worker, API-key check and metrics), the response object (reasoning, message and function-call
output items, usage with cached tokens) and its server-sent event sequence. Requests:
`responses_schema.py`. Nothing is stored: a response cannot be fetched or continued by id."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentrt.server import responses_schema as requests
from agentrt.server.worker import Job
from agentrt.session.chat import ChatEvent


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(result) -> dict[str, Any]:
    u = result.usage
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def call_item(item_id: str, call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


class Shell:
    """The fields of a response object that do not depend on the generation."""

    def __init__(self, req: requests.ResponsesRequest, model: str) -> None:
        self.id, self.created = _id("resp"), int(time.time())
        self.fields = {
            "object": "response",
            "model": model,
            "instructions": req.instructions,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None,
            "reasoning": req.reasoning or {},
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "metadata": req.metadata or {},
        }

    def body(self, status: str, output: list, result=None) -> dict[str, Any]:
        body = {"id": self.id, "created_at": self.created, "status": status, **self.fields}
        body |= {"output": output, "error": None, "incomplete_details": None, "usage": None}
        if result is not None:
            body["usage"] = usage(result)
            if result.finish_reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body


def status_of(result) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def output_items(result) -> list[dict[str, Any]]:
    """The finished generation's output items: reasoning, message, function calls."""
    items = []
    if result.reasoning_content:
        items.append(reasoning_item(_id("rs"), result.reasoning_content))
    if result.content:
        items.append(message_item(_id("msg"), result.content))
    items += [call_item(_id("fc"), call) for call in result.tool_calls]
    return items


class EventStream:
    """Chat events to the Responses API's event sequence: `response.created` and
    `response.in_progress`; per output item `response.output_item.added`, its part and deltas
    (`response.reasoning_text.delta`, `response.output_text.delta`,
    `response.function_call_arguments.delta`: a streamed function call's arguments text as it
    is written, one not streamed as one delta),
    their `.done` events and `response.output_item.done`; then `response.completed` (or
    `response.incomplete` at the token limit). Every event carries a `sequence_number`."""

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed and its text
        self.text = ""
        self.call: tuple[str, dict[str, Any]] | None = None  # (item id, call) of a call

    def _event(self, kind: str, **data) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> str:
        body = self.shell.body("in_progress", [])
        return self._event("response.created", response=body) + self._event(
            "response.in_progress", response=body
        )

    def _begin(self, item: dict[str, Any], part: dict[str, Any] | None) -> str:
        out = self._close()
        self.open, self.text = item, ""
        index = len(self.items)
        out += self._event("response.output_item.added", output_index=index, item=item)
        if part is not None:
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        return out

    def _close(self) -> str:
        item, self.open = self.open, None
        if item is None:
            return ""
        index, where = len(self.items), {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "reasoning":
            item = reasoning_item(item["id"], self.text)
            part = {"type": "reasoning_text", "text": self.text}
            out = self._event(
                "response.reasoning_text.done", **where, content_index=0, text=self.text
            )
        else:
            item = message_item(item["id"], self.text)
            part = text_part(self.text)
            out = self._event(
                "response.output_text.done", **where, content_index=0, text=self.text, logprobs=[]
            )
        out += self._event("response.content_part.done", **where, content_index=0, part=part)
        self.items.append(item)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _text(self, reasoning: bool, text: str) -> Iterator[str]:
        """A reasoning or output text delta, opening its item first when another is open."""
        kind = "reasoning" if reasoning else "message"
        if self.open is None or self.open["type"] != kind:
            if reasoning:
                part = {"type": "reasoning_text", "text": ""}
                yield self._begin(reasoning_item(_id("rs"), "", "in_progress"), part)
            else:
                yield self._begin(message_item(_id("msg"), None, "in_progress"), text_part(""))
        self.text += text
        where = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        if reasoning:
            yield self._event("response.reasoning_text.delta", **where, delta=text)
        else:
            yield self._event("response.output_text.delta", **where, delta=text, logprobs=[])

    def event(self, event) -> Iterator[str]:
        """SSE text for one chat event (`reasoning`, `content`, `tool_call_start`,
        `tool_call_args`, `tool_call`, `done`)."""
        if event.type in ("reasoning", "content"):
            yield from self._text(event.type == "reasoning", event.text)
        elif event.type == "tool_call_start":
            yield self._close()
            self.call = (_id("fc"), event.tool_call)
            added = call_item(self.call[0], event.tool_call, arguments="")
            index = len(self.items)  # (a call's item is added to `items` when it is done)
            yield self._event("response.output_item.added", output_index=index, item=added)
        elif event.type == "tool_call_args":
            where = {"item_id": self.call[0], "output_index": len(self.items)}
            yield self._event("response.function_call_arguments.delta", **where, delta=event.text)
        elif event.type == "tool_call":
            if not event.streamed:
                yield from self.event(ChatEvent("tool_call_start", tool_call=event.tool_call))
                args = event.tool_call["function"]["arguments"]
                yield from self.event(ChatEvent("tool_call_args", args))
            done = call_item(self.call[0], event.tool_call)
            index = len(self.items)
            where = {"item_id": self.call[0], "output_index": index}
            yield self._event(
                "response.function_call_arguments.done",
                **where,
                name=done["name"],
                arguments=done["arguments"],
            )
            self.items.append(done)
            yield self._event("response.output_item.done", output_index=index, item=done)
        elif event.type == "done":
            yield self._close()
            status = status_of(event.result)
            body = self.shell.body(status, self.items, event.result)
            yield self._event(f"response.{status}", response=body)

    def failure(self, message: str) -> str:
        return self._event("error", code="server_error", message=message, param=None)


# ----------------------------------------------------------------------------- route


def _decode(body: bytes) -> tuple[requests.ResponsesRequest, tuple, dict[str, Any]]:
    req = requests.decode(body)
    return req, requests.to_plain(req), requests.sampling(req)


async def create(server, request: Request) -> Response:
    """`POST /v1/responses` on `server` (an `app.ChatServer`)."""
    admitted = await server.admit(request, _decode)
    if isinstance(admitted, Response):
        return admitted
    req, job = admitted
    shell = Shell(req, server.model_name)
    if req.stream:
        return StreamingResponse(_events(server, job, shell), media_type="text/event-stream")
    result = await server.outcome(request, job)
    if isinstance(result, Response):
        return result
    return JSONResponse(shell.body(status_of(result), output_items(result), result))


def _events(server, job: Job, shell: Shell):
    stream = EventStream(shell)
    return server.relay(job, stream.start(), stream.event, stream.failure, ": keep-alive\n\n")
