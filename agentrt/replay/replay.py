"""Replay traces on the local runtime or against an OpenAI-compatible endpoint, and build the replay
report of docs/architecture.md §2 (plus a terminal table and an optional PNG plot). TTFT: over HTTP,
at the first content / reasoning / tool-call delta of the stream; locally, at the first sampled
token (counted from the request's arrival, rendering included), which a tool-call-only reply would
otherwise hide until its call is complete.

Replay sends each request exactly as recorded; it never feeds its own generations back.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agentrt.errors import AgentrtError, InvalidArgumentError
from agentrt.replay.trace import Request, Trace


@dataclass
class Row:
    index: int
    trace: str
    id: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    completion_tokens: int
    decode_s: float
    checkpoint: str | None
    output_token_ids: list[int] | None = None
    timings: dict[str, Any] | None = None  # local runs: where the TTFT went (see `local_target`)

    def as_dict(self) -> dict[str, Any]:
        out = {
            "index": self.index,
            "trace": self.trace,
            "id": self.id,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": self.ttft_s,
            "completion_tokens": self.completion_tokens,
            "decode_s": self.decode_s,  # from the first token to the last
            "checkpoint": self.checkpoint,
        }
        if self.output_token_ids is not None:
            out["output_token_ids"] = self.output_token_ids
        if self.timings is not None:
            out["timings"] = self.timings
        return out


@dataclass
class Target:
    """Where requests go; `send` returns one report row (minus index/trace)."""

    name: str
    cache: str
    device: str
    send: Callable[[Request, int], dict[str, Any]] = field(repr=False)


# ----------------------------------------------------------------------------- local runtime


def local_target(rt) -> Target:
    """Replay on an open `Runtime`; checkpoints are reported by their boundary text."""

    def send(req: Request, max_tokens: int) -> dict[str, Any]:
        result, watch = None, _Watch(rt)
        for ev in rt.chat(req.messages, tools=req.tools, max_tokens=max_tokens, stream=True):
            if ev.type == "done":
                result = ev.result
        ttft = result.timings["ttft_s"]  # first sampled token, from the request's arrival
        seen = watch.seen()
        t0 = time.perf_counter()  # (what an idle server does between turns: not in any TTFT)
        prepared = rt.prepare_ahead()
        ahead_s = time.perf_counter() - t0
        return {
            "prompt_tokens": result.usage["prompt_tokens"],
            "cached_tokens": result.usage["cached_tokens"],
            "ttft_s": ttft,
            "completion_tokens": result.usage["completion_tokens"],
            "decode_s": result.timings["decode_s"],
            "checkpoint": rt.checkpoint_label(result.checkpoint),
            "output_token_ids": result.token_ids,
            "timings": {  # the parts of the TTFT, and where reused state came from
                **result.reuse_s,  # restore_s, capture_s, ... (see engine.Timings)
                "prefill_s": result.timings["prefill_s"],
                "restore_source": result.restore_source,
                # after the request: KV grown and graphs captured for the next turn (seconds)
                "ahead_s": ahead_s if prepared else 0.0,
                **seen,
            },
        }

    return Target(rt.model_name, rt.cache, str(rt.engine.device), send)


class _Watch:
    """What ran beside a request on a local runtime: the checkpoint writes queued when it
    arrived and the writer's seconds until its response was out (it competes for the host),
    with offloaded experts what its prefill copied and ran on the CPU, and the decode steps it
    ran without a CUDA graph or paid a graph capture for (one-time work on its path)."""

    def __init__(self, rt) -> None:
        self.engine = rt.engine
        self.decode = _decode_counts(rt.engine)
        self.steps = getattr(rt.engine.offload, "totals", None)  # (offloaded decode's counters)
        self.before_steps = None if self.steps is None else self.steps.as_dict()
        streamer = getattr(rt.engine.offload, "prefill", None)  # (offloaded experts only)
        self.totals = None if streamer is None else streamer.totals
        self.prefill = None if self.totals is None else self.totals.as_dict()
        self.cache = getattr(rt.reuse, "cache", None)
        self.pending = 0 if self.cache is None else self.cache.writes_pending
        self.written = 0.0 if self.cache is None else self.cache.stats["write_seconds"]

    def seen(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.cache is not None:
            out["writes_pending"] = self.pending
            out["writer_s"] = self.cache.stats["write_seconds"] - self.written
        if self.totals is not None:
            out["offload"] = self.totals.since(self.prefill)
        now = _decode_counts(self.engine)
        out.update((k, now[k] - self.decode[k]) for k in now)
        if self.steps is not None:
            out["decode_offload"] = self.steps.since(self.before_steps)
        return out


def _decode_counts(engine) -> dict[str, float]:
    """The engine's decode steps run eagerly, its decode-graph captures and their seconds, and
    with offloaded experts the expert cache's resizes and the experts copied back after them."""
    graph, cache = engine.decode_graph, getattr(engine.offload, "cache", None)
    counts = {
        "eager_decode_steps": engine.eager_decode_steps,
        "decode_captures": 0 if graph is None else graph.captures,
        "decode_capture_s": 0.0 if graph is None else graph.capture_seconds,
    }
    if cache is not None:
        counts.update(cache_resizes=cache.resizes, experts_refilled=cache.refilled)
    return counts


# ----------------------------------------------------------------------------- HTTP endpoint


def _sse_events(response) -> Iterator[dict[str, Any]]:
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            continue


def _has_delta(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        # (`reasoning`: the name vLLM and OpenRouter stream reasoning under)
        if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
            return True
    return False


def endpoint_target(
    url: str, model: str, api_key: str | None = None, timeout: float = 3600
) -> Target:
    """Replay against `url` (an OpenAI-compatible server), streaming."""
    try:
        parts = urllib.parse.urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        valid = False
    if not valid:
        raise InvalidArgumentError(f"--endpoint must be an http(s) URL, not {url!r}")
    base = url.rstrip("/")
    endpoint = (
        base
        if base.endswith("/chat/completions")
        else f"{base.removesuffix('/v1')}/v1/chat/completions"
    )

    def send(req: Request, max_tokens: int) -> dict[str, Any]:
        body = {
            "model": model,
            "messages": req.messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.tools:
            body["tools"] = req.tools
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        http_req = urllib.request.Request(endpoint, json.dumps(body).encode(), headers)
        t0 = time.perf_counter()
        ttft, t_last, usage = None, None, {}
        try:
            with urllib.request.urlopen(http_req, timeout=timeout) as response:
                for chunk in _sse_events(response):
                    if chunk.get("error"):
                        raise AgentrtError(f"{endpoint}: error during the stream: {chunk['error']}")
                    if _has_delta(chunk):
                        t_last = time.perf_counter()
                        ttft = ttft if ttft is not None else t_last - t0
                    usage = chunk.get("usage") or usage
        except urllib.error.HTTPError as exc:
            raise AgentrtError(
                f"{endpoint}: HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise AgentrtError(f"{endpoint}: {exc}") from None
        end = time.perf_counter()
        ttft = ttft if ttft is not None else end - t0
        details = usage.get("prompt_tokens_details") or {}
        return {
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": details.get("cached_tokens") or 0,
            "ttft_s": ttft,
            "completion_tokens": usage.get("completion_tokens", 0),
            "decode_s": (t_last or end) - (t0 + ttft),
            "checkpoint": None,
        }

    return Target(f"{model} @ {base}", "unknown", "remote", send)


# ----------------------------------------------------------------------------- replay + report


class ReplayStopped(AgentrtError):
    """A request could not be replayed (e.g. longer than the model's context); `rows` holds the
    requests replayed before it."""

    def __init__(self, message: str, rows: list[Row]) -> None:
        super().__init__(message)
        self.rows = rows


def replay(traces: list[Trace], target: Target, max_tokens: int, progress=None) -> list[Row]:
    """Send every request of `traces` in order; its report rows. A request that fails with a
    user error stops the replay (`ReplayStopped`, with the rows before it)."""
    rows: list[Row] = []
    for trace in traces:
        for req in trace.requests:
            limit = min(req.max_tokens, max_tokens) if req.max_tokens else max_tokens
            try:
                row = target.send(req, limit)
            except AgentrtError as exc:
                raise ReplayStopped(f"request {req.id} of {trace.name}: {exc}", rows) from None
            rows.append(Row(index=len(rows), trace=trace.name, id=req.id, **row))
            if progress is not None:
                progress(rows[-1])
    return rows


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ttft_summary(ttft: list[float], prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Requests, TTFT percentiles and max, prompt / cached / prefilled tokens."""
    return {
        "requests": len(ttft),
        "ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)}
        | {"max": max(ttft, default=0.0)},
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "prefilled_tokens": prompt_tokens - cached_tokens,
    }


def report(rows: list[Row], target: Target) -> dict[str, Any]:
    decode_s = sum(r.decode_s for r in rows)
    decoded = sum(max(r.completion_tokens - 1, 0) for r in rows)
    prompt = sum(r.prompt_tokens for r in rows)
    summary = ttft_summary([r.ttft_s for r in rows], prompt, sum(r.cached_tokens for r in rows))
    summary.update(
        decode_tok_s=decoded / decode_s if decode_s > 0 else 0.0,
        model=target.name,
        cache=target.cache,
        device=target.device,
    )
    return {"summary": summary, "requests": [r.as_dict() for r in rows]}


_COLUMNS = (("cache", 10), ("requests", 9), ("p50 s", 9), ("p90 s", 9), ("p99 s", 9), ("max s", 9),
            ("cached tok", 12), ("prefilled", 11))  # fmt: skip


def summary_table(reports: list[dict[str, Any]]) -> str:
    """A terminal table of TTFT percentiles and token counts, one line per report."""
    head = "".join(
        f"{name:<{w}}" if i == 0 else f"{name:>{w}}" for i, (name, w) in enumerate(_COLUMNS)
    )
    lines = [head, "-" * len(head)]
    for rep in reports:
        s, t = rep["summary"], rep["summary"]["ttft_s"]
        cells = [s["cache"], s["requests"], t["p50"], t["p90"], t["p99"], t["max"]]
        cells += [s["cached_tokens"], s["prefilled_tokens"]]
        line = ""
        for i, (value, (_, w)) in enumerate(zip(cells, _COLUMNS, strict=True)):
            text = f"{value:.3f}" if isinstance(value, float) else str(value)
            line += f"{text:<{w}}" if i == 0 else f"{text:>{w}}"
        lines.append(line)
    return "\n".join(lines)


def plot(reports: list[dict[str, Any]], path: str, title: str = "TTFT per request") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AgentrtError("--plot needs matplotlib: pip install 'agentrt[plot]'") from None
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for rep in reports:
        xs = [r["index"] for r in rep["requests"]]
        ax.plot(
            xs,
            [r["ttft_s"] for r in rep["requests"]],
            marker=".",
            label=f"cache={rep['summary']['cache']}",
        )
    ax.set_xlabel("request")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise AgentrtError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)
