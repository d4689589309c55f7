"""The Starlette application: routes, API-key check, body size limit, OpenAI-style errors, chat
completions, Anthropic messages and OpenAI responses (JSON or server-sent events; the latter two's
shapes in `anthropic.py` and `responses.py`), models, health and Prometheus metrics. Bad input
always becomes a 4xx answer; the process keeps serving.

Safe by default: `check_exposure` refuses a non-loopback bind without an API key (unless
`insecure_no_auth`), keys are compared in constant time and never logged, and no CORS headers
are sent unless `cors_origins` names the browser origins allowed to call the API."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from agentrt.errors import AgentrtError, InvalidArgumentError, PromptTooLongError
from agentrt.server import anthropic, responses, schema
from agentrt.server.schema import error
from agentrt.server.worker import DONE, EngineWorker, Job, QueueFull, ShuttingDown

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
KEEPALIVE_S = 5.0  # an SSE comment goes out when nothing else has for this long


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    max_request_bytes: int = 32 * 2**20
    queue_size: int = 16
    insecure_no_auth: bool = False  # allow a non-loopback bind without an API key
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API; none: no CORS


def is_loopback(host: str) -> bool:
    """Whether `host` is `localhost`, an address in 127.0.0.0/8 or ::1 (names are not resolved)."""
    name = host.strip().strip("[]").rstrip(".").lower()
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_exposure(config: ServerConfig) -> bool:
    """Raise when `config` serves beyond this machine with no API key and `insecure_no_auth`
    is not set; return whether it serves beyond this machine with no key (allowed)."""
    if config.api_key or is_loopback(config.host):
        return False
    if not config.insecure_no_auth:
        raise InvalidArgumentError(
            f"refusing to serve on {config.host} without --api-key (anyone who can reach it "
            "could use the model); pass --api-key KEY, bind 127.0.0.1, or --insecure-no-auth"
        )
    return True


def key_matches(given: str, expected: str) -> bool:
    """Constant-time comparison of a presented key with the configured one. Header values come
    as latin-1 text (their raw bytes), the configured key as UTF-8 text."""
    return hmac.compare_digest(given.encode("latin-1"), expected.encode("utf-8", "surrogateescape"))


def _number(value: float) -> str:
    """Prometheus sample value without precision loss (integers stay integers)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass
class Metrics:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counters: dict[str, float] = field(default_factory=dict)
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0

    def add(self, name: str, value: float = 1) -> None:
        with self.lock:
            self.counters[name] = self.counters.get(name, 0) + value

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            index = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
            self.ttft_counts[index] += 1
            self.ttft_sum += seconds

    def render(self, queue_depth: int) -> str:
        with self.lock:
            lines, typed = [], set()
            for name, value in sorted(self.counters.items()):
                metric, _, label = name.partition("|")
                if metric not in typed:
                    typed.add(metric)
                    lines.append(f"# TYPE agentrt_{metric} counter")
                lines.append(
                    f"agentrt_{metric}{'{' + label + '}' if label else ''} {_number(value)}"
                )
            lines.append("# TYPE agentrt_ttft_seconds histogram")
            running = 0
            for bound, count in zip([*TTFT_BUCKETS, "+Inf"], self.ttft_counts, strict=True):
                running += count
                lines.append(f'agentrt_ttft_seconds_bucket{{le="{bound}"}} {running}')
            lines.append(f"agentrt_ttft_seconds_sum {_number(self.ttft_sum)}")
            lines.append(f"agentrt_ttft_seconds_count {running}")
            lines.append("# TYPE agentrt_queue_depth gauge")
            lines.append(f"agentrt_queue_depth {queue_depth}")
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- response shapes


def _usage(result) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u["prompt_tokens"],
        "completion_tokens": u["completion_tokens"],
        "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
    }


def _delta(event, call_index: int) -> dict[str, Any] | None:
    """The chunk delta of a chat event: a streamed call's id and name first, then its arguments
    text; a call not streamed arrives whole (None: nothing more to send)."""
    if event.type == "reasoning":
        return {"reasoning_content": event.text}
    if event.type == "content":
        return {"content": event.text}
    if event.type == "tool_call_args":
        return {"tool_calls": [{"index": call_index, "function": {"arguments": event.text}}]}
    if event.type == "tool_call" and event.streamed:
        return None
    return {"tool_calls": [{"index": call_index, **event.tool_call}]}


class ChatServer:
    def __init__(self, runtime, config: ServerConfig) -> None:
        self.runtime = runtime
        self.config = config
        self.worker = EngineWorker(runtime, config.queue_size)
        self.metrics = Metrics()
        self.model_name = runtime.model_name
        self.created = int(time.time())
        # seeds of requests that name none: one drawn per authorized request as it arrives,
        # from the runtime's seed (`--seed`), so a server restarted with the same seed answers
        # the same requests, arriving in the same order, the same way; each request still
        # samples its own way
        self.seeds = random.Random(runtime.seed)

    # ------------------------------------------------------------------ plumbing

    def _authorized(self, request: Request) -> bool:
        """No key configured, or the request presents it: `Authorization: Bearer KEY` (OpenAI)
        or `x-api-key: KEY` (Anthropic)."""
        if not self.config.api_key:
            return True
        given = request.headers.get("x-api-key")
        if given is not None:
            return key_matches(given.strip(), self.config.api_key)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and key_matches(given.strip(), self.config.api_key)

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.config.max_request_bytes:
            raise schema.BadRequest("request body too large", status=413, code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.config.max_request_bytes:
                raise schema.BadRequest(
                    "request body too large", status=413, code="request_too_large"
                )
        return bytes(body)

    def _kwargs(self, req: schema.ChatRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "stop": req.stop,
            "seed": req.seed,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
        }
        limit = schema.max_tokens(req)
        if limit is not None:
            kwargs["max_tokens"] = limit
        return kwargs

    # ------------------------------------------------------------------ routes

    async def admit(self, request: Request, decode, answer=error) -> tuple[Any, Job] | Response:
        """The front of every generation route: the API key, the body (`decode`: bytes ->
        (request, (messages, tools, tool_choice) for `Runtime.prepare`, sampling keywords)),
        rendering, and a place in the queue. Returns (request, queued job), or the answer to
        give instead, shaped by `answer(status, message, param=None, code=None)`."""
        if not self._authorized(request):
            return answer(401, "invalid or missing API key", None, "invalid_api_key")
        seed = self.seeds.getrandbits(31)  # (drawn on arrival, used where the request has none)
        try:
            req, plain, kwargs = decode(await self._body(request))
            prepared = await asyncio.to_thread(self.runtime.prepare, *plain)
        except schema.BadRequest as exc:
            self.metrics.add('requests_total|status="rejected"')
            return answer(exc.status, exc.message, exc.param, exc.code)
        except AgentrtError as exc:
            return self._failed(exc, answer)
        # (no limit given: as OpenAI's APIs, up to the context's end, where generation stops)
        kwargs.setdefault("max_tokens", self.runtime.engine.max_context)
        if kwargs.get("seed") is None:
            kwargs["seed"] = seed
        job = Job(prepared, kwargs, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull:
            self.metrics.add('requests_total|status="queue_full"')
            busy = "server busy: request queue is full, retry later"
            return answer(429, busy, None, "rate_limit_exceeded")
        return req, job

    async def outcome(self, request: Request, job: Job, answer=error) -> Any:
        """The finished generation of a job answered in one piece (its metrics counted), or
        the answer to give instead (a failure; 499 when the client went away)."""
        watcher = asyncio.create_task(self._watch(request, job))
        try:
            result, failure = await self._result(job)
        finally:
            watcher.cancel()
        if failure is not None:
            return self._failed(failure, answer)
        if job.cancelled:
            return Response(status_code=499)
        self._finish(result)
        return result

    def _chat_request(self, body: bytes) -> tuple[Any, tuple, dict[str, Any]]:
        req = schema.decode(body)
        messages, tools = schema.to_plain(req)
        plain = (messages, tools, req.tool_choice, req.reasoning_effort)
        return req, plain, self._kwargs(req)

    async def chat_completions(self, request: Request) -> Response:
        admitted = await self.admit(request, self._chat_request)
        if isinstance(admitted, Response):
            return admitted
        req, job = admitted
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._sse(job, include_usage), media_type="text/event-stream")
        result = await self.outcome(request, job)
        if isinstance(result, Response):
            return result
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "usage": _usage(result),
            "choices": [
                {"index": 0, "message": result.message(), "finish_reason": result.finish_reason}
            ],
        }
        return JSONResponse(body)

    async def _watch(self, request: Request, job: Job) -> None:
        """Cancel the job when the (non-streaming) client goes away."""
        while not job.finished:
            if await request.is_disconnected():
                job.cancelled = True
                return
            await asyncio.sleep(0.25)

    def _failed(self, exc: Exception, answer=error) -> JSONResponse:
        self.metrics.add('requests_total|status="error"')
        if isinstance(exc, PromptTooLongError):
            return answer(400, str(exc), "messages", "context_length_exceeded")
        if isinstance(exc, AgentrtError):
            return answer(400, str(exc))
        return answer(503 if isinstance(exc, ShuttingDown) else 500, str(exc))

    def _finish(self, result) -> None:
        self.metrics.add('requests_total|status="ok"')
        self.metrics.observe_ttft(result.timings["ttft_s"])
        self.metrics.add("prompt_tokens_total", result.usage["prompt_tokens"])
        self.metrics.add("cached_tokens_total", result.usage["cached_tokens"])
        prefilled = result.usage["prompt_tokens"] - result.usage["cached_tokens"]
        self.metrics.add("prefilled_tokens_total", prefilled)
        self.metrics.add("completion_tokens_total", result.usage["completion_tokens"])

    async def _result(self, job: Job) -> tuple[Any, Exception | None]:
        """(the finished generation, None), or (None, what went wrong)."""
        result, failure = None, None
        while (item := await job.events.get()) is not DONE:
            if isinstance(item, Exception):
                failure = failure or item
            elif item.type == "done":
                result = item.result
        if failure is None and result is None and job.cancelled:
            return None, None  # (its client went away before it ran)
        if failure is not None or result is None:
            return None, failure or RuntimeError("generation ended without a result")
        return result, None

    async def _next(self, job: Job):
        """The next event, or None after `KEEPALIVE_S` without one (to keep the stream alive)."""
        try:
            return await asyncio.wait_for(job.events.get(), timeout=KEEPALIVE_S)
        except asyncio.TimeoutError:
            return None

    async def _sse(self, job: Job, include_usage: bool):
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict | None, finish=None, usage=None) -> str:
            body: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
            }
            body["choices"] = (
                [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            )
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        calls = 0

        def render(event) -> list[str]:
            nonlocal calls
            if event.type == "done":
                out = [chunk({}, event.result.finish_reason)]
                return out + ([chunk(None, usage=_usage(event.result))] if include_usage else [])
            delta = _delta(event, calls)
            calls += event.type == "tool_call"
            return [] if delta is None else [chunk(delta)]

        def failure(message: str) -> str:
            return (
                f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
            )

        first = chunk({"role": "assistant", "content": ""})
        async for text in self.relay(job, first, render, failure, ": keep-alive\n\n"):
            yield text
        yield "data: [DONE]\n\n"

    async def relay(self, job: Job, first: str, render, failure, keep_alive: str):
        """A job's server-sent events, in any API's shape: `first` at once (headers and a first
        byte go out now), then `render(event)`'s texts for each chat event (the finished
        generation's metrics counted), `failure(message)` for an error, and `keep_alive` after
        `KEEPALIVE_S` without an event. The job is cancelled when the stream ends or the client
        goes away."""
        try:
            yield first
            while (item := await self._next(job)) is not DONE:
                if item is None:
                    yield keep_alive
                elif isinstance(item, Exception):
                    self.metrics.add('requests_total|status="error"')
                    yield failure(str(item))
                    return  # (nothing follows an error)
                else:
                    if item.type == "done":
                        self._finish(item.result)
                    for text in render(item):
                        yield text
        finally:
            job.cancelled = True  # client gone or stream finished: stop generating

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return error(401, "invalid or missing API key", code="invalid_api_key")
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "agentrt",
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_name, "cache": self.runtime.cache})

    def _offload_lines(self) -> str:
        """Expert-cache hit rate and bytes moved, when experts are offloaded."""
        experts = getattr(self.runtime.engine, "offload", None)
        if experts is None:
            return ""
        lines = [
            "# TYPE agentrt_expert_cache_hit_rate gauge",
            f"agentrt_expert_cache_hit_rate {_number(experts.cache.hit_rate())}",
            "# TYPE agentrt_expert_bytes_copied_total counter",
            f"agentrt_expert_bytes_copied_total {experts.totals.bytes_copied}",
        ]
        return "\n".join(lines) + "\n"

    def _state_cache_lines(self) -> str:
        """The semantic state cache's counters (`StateCache.stats`: checkpoints written and
        dropped, hits, misses, corrupt records deleted, bytes written) and the bytes its RAM
        tier holds, when it is on."""
        cache = getattr(self.runtime.reuse, "cache", None)
        if cache is None:
            return ""
        stats = dict(cache.stats)  # (one atomic copy: the writer thread adds keys)
        lines = ["# TYPE agentrt_state_cache_stats_total counter"]
        for name, value in sorted(stats.items()):
            lines.append(f'agentrt_state_cache_stats_total{{stat="{name}"}} {_number(value)}')
        lines.append("# TYPE agentrt_state_cache_ram_bytes gauge")
        lines.append(f"agentrt_state_cache_ram_bytes {cache.ram.bytes}")
        return "\n".join(lines) + "\n"

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(
            self.metrics.render(self.worker.depth())
            + self._offload_lines()
            + self._state_cache_lines(),
            media_type="text/plain; version=0.0.4",
        )


def _shaped(request: Request, status: int, message: str, code: str) -> Response:
    """An error in the shape of the API the path belongs to (Anthropic's under /v1/messages)."""
    if request.url.path.startswith("/v1/messages"):
        return anthropic.error(status, message)
    return error(status, message, code=code)


async def _not_found(request: Request, exc) -> Response:
    return _shaped(request, 404, f"no route {request.method} {request.url.path}", "not_found")


async def _not_allowed(request: Request, exc) -> Response:
    message = f"method {request.method} not allowed on {request.url.path}"
    return _shaped(request, 405, message, "method_not_allowed")


async def _crashed(request: Request, exc) -> Response:
    return _shaped(request, 500, f"internal error: {type(exc).__name__}", "internal_error")


def build_app(runtime, config: ServerConfig) -> tuple[Starlette, ChatServer]:
    server = ChatServer(runtime, config)
    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/messages", partial(anthropic.messages, server), methods=["POST"]),
        Route("/v1/responses", partial(responses.create, server), methods=["POST"]),
        Route(
            "/v1/messages/count_tokens", partial(anthropic.count_tokens, server), methods=["POST"]
        ),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
    ]
    handlers = {404: _not_found, 405: _not_allowed, 500: _crashed, Exception: _crashed}
    app = Starlette(routes=routes, exception_handlers=handlers, middleware=_cors(config))
    return app, server


def _cors(config: ServerConfig) -> list[Middleware]:
    """CORS for the named origins only (preflight included); none named, no CORS headers."""
    if not config.cors_origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    ]
