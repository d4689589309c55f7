"""`agentrt bench soak`: a bounded soak of the HTTP server.

Starts `agentrt serve` as a child process on a free loopback port (the given model, the semantic
state cache in a scratch state dir), then runs concurrent streaming clients for a duration. Each
client holds multi-turn conversations whose requests grow and share prefixes (one system prompt
for all, each turn the whole history again) and now and then disconnects mid-stream. Reports
requests served, answers by status, 5xx and in-stream errors, requests left unanswered, TTFT
p50/p99 (to the first generated text), the server's RSS growth after warm-up (total, and
anonymous memory apart: the LMDB map's file pages count in RSS too), and the state cache's
counters from `/metrics`. Knows the server only through HTTP and its process id (Linux /proc).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrt.env import snapshot
from agentrt.errors import AgentrtError

SYSTEM = (
    "You are a coding agent working in a Python repository. Read files before editing them, "
    "keep changes small, run the tests after every change and report what you did. "
) * 4
FOLLOW_UPS = (
    "Now read the file again and tell me what the main function returns.",
    "Here is the output of the tests:\n" + "test_main PASSED\ntest_io FAILED\n" * 6,
    "Explain the failure in one sentence.",
    "Apply the smallest fix and show the diff.",
    "Run the tests once more.",
)
STARTUP_S = 180.0  # the first start builds the embedded tiny model
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Tally:
    """What the clients saw, shared by their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, status: int | str, outcome: str, ttft: float | None, usage: dict | None) -> None:
        with self.lock:
            self.statuses[str(status)] += 1
            self.outcomes[outcome] += 1
            if ttft is not None:
                self.ttfts.append(ttft)
            if usage:
                self.prompt_tokens += usage.get("prompt_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                self.cached_tokens += details.get("cached_tokens", 0)

    def fail(self, text: str) -> None:
        with self.lock:
            self.failures.append(text[:300])


# ----------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`agentrt serve` in a child process, its stderr in a file."""

    def __init__(self, model: str, device: str, state_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.log = log
        cmd = [sys.executable, "-m", "agentrt.cli", "serve", "--model", model, "--device", device]
        cmd += ["--port", str(self.port), "--cache", "semantic", "--state-dir", str(state_dir)]
        env = {k: v for k, v in snapshot().items() if k != "AGENTRT_API_KEY"}  # clients send none
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)

    def wait_ready(self, timeout: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                last = (self.log_tail().strip().splitlines() or ["no output"])[-1]
                raise AgentrtError(f"the server exited at start: {last.removeprefix('error: ')}")
            try:
                if get(self.port, "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AgentrtError(f"the server did not start within {timeout:.0f} s")

    def memory(self) -> dict[str, int]:
        """VmRSS, VmHWM (peak) and RssAnon of the server, in bytes ({} off Linux)."""
        try:
            text = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return {}
        found = re.findall(r"^(VmRSS|VmHWM|RssAnon):\s+(\d+) kB", text, re.M)
        return {name: int(kib) * 1024 for name, kib in found}

    def log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> int:
        """Stop the server as Ctrl-C does (SIGINT: it flushes queued checkpoints), killing it
        after 30 s; its exit status (130 after SIGINT)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def state_cache_metrics(port: int) -> tuple[dict[str, float], int]:
    """The state cache's counters and its RAM tier's bytes, from the server's /metrics."""
    status, body = get(port, "/metrics")
    text = body.decode() if status == 200 else ""
    pattern = r'^agentrt_state_cache_stats_total\{stat="([^"]+)"\} (\S+)$'
    stats = {name: float(value) for name, value in re.findall(pattern, text, re.M)}
    ram = re.search(r"^agentrt_state_cache_ram_bytes (\d+)$", text, re.M)
    return stats, int(ram.group(1)) if ram else 0


# ----------------------------------------------------------------------------- one request


@dataclass
class Reply:
    status: int
    outcome: str  # "served", "disconnected", "rejected" (4xx), "stream_error", "incomplete"
    text: str = ""
    ttft: float | None = None
    usage: dict | None = None


def _read_stream(resp, leave_after: int | None, started: float) -> Reply:
    """Read SSE events until `[DONE]` (or leave after `leave_after` events)."""
    reply, events = Reply(resp.status, "incomplete"), 0
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            reply.outcome = "served" if reply.outcome == "incomplete" else reply.outcome
            return reply
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            reply.outcome = "stream_error"
            continue
        reply.usage = chunk.get("usage") or reply.usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            if (piece or delta.get("tool_calls")) and reply.ttft is None:
                reply.ttft = time.perf_counter() - started
            reply.text += piece
        events += 1
        if leave_after is not None and events >= leave_after:
            reply.outcome = "disconnected"
            return reply
    return reply


def chat(port: int, messages: list[dict], max_tokens: int, leave_after: int | None) -> Reply:
    """One streaming chat completion; the connection closes after `leave_after` events."""
    body = {
        "model": "soak",
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    started = time.perf_counter()
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return Reply(resp.status, "rejected" if resp.status < 500 else "server_error")
        return _read_stream(resp, leave_after, started)
    finally:
        conn.close()


# ----------------------------------------------------------------------------- clients


@dataclass(frozen=True)
class SoakConfig:
    model: str = "tiny"
    device: str = "auto"
    clients: int = 4
    seconds: float = 30.0
    max_tokens: int = 16
    disconnect: float = 0.2  # share of requests whose client leaves mid-stream
    turns: int = 6  # requests per conversation before a new one starts
    seed: int = 0


def _client(index: int, port: int, config: SoakConfig, deadline: float, tally: Tally) -> None:
    """Conversations of `config.turns` growing requests each, until `deadline`."""
    rng = random.Random(config.seed * 1000 + index)
    conversation = 0
    while time.monotonic() < deadline:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Client {index}, task {conversation}: fix main.py."},
        ]
        for _ in range(config.turns):
            if time.monotonic() >= deadline:
                return
            leave = rng.randint(1, 3) if rng.random() < config.disconnect else None
            reply = _one(port, messages, config.max_tokens, leave, tally)
            if reply is None:
                break
            messages.append({"role": "assistant", "content": reply.text})
            messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
        conversation += 1


def _one(port: int, messages: list[dict], max_tokens: int, leave, tally: Tally) -> Reply | None:
    """One request, tallied; None when it got no answer (the conversation then starts over)."""
    try:
        reply = chat(port, messages, max_tokens, leave)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        tally.add("none", "unanswered", None, None)
        tally.fail(f"{type(exc).__name__}: {exc}")
        return None
    tally.add(reply.status, reply.outcome, reply.ttft, reply.usage)
    if reply.outcome in ("stream_error", "incomplete", "server_error"):
        tally.fail(f"status {reply.status}: {reply.outcome}")
    return reply


class MemoryWatch:
    """Samples the server's memory every `every` seconds on a thread; keeps the peaks. The
    state cache's RAM tier (recent checkpoints kept decoded, up to its cap) is reported apart:
    anonymous memory beyond its growth is what a leak would show as."""

    def __init__(self, server: ServerProcess, every: float = 0.25) -> None:
        self.server, self.every = server, every
        self.start = server.memory()
        self.ram_start = state_cache_metrics(server.port)[1]
        self.peak_anon = self.start.get("RssAnon", 0)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.every):
            self.peak_anon = max(self.peak_anon, self.server.memory().get("RssAnon", 0))

    def report(self) -> dict[str, float | None]:
        self.stopped.set()
        self.thread.join()
        end = self.server.memory()
        if not end:
            return {"available": False}
        mib = 2**20
        ram_growth = state_cache_metrics(self.server.port)[1] - self.ram_start
        anon_growth = self.peak_anon - self.start["RssAnon"]
        return {
            "start_mib": self.start["VmRSS"] / mib,
            "end_mib": end["VmRSS"] / mib,
            "peak_mib": end["VmHWM"] / mib,
            "growth_mib": (end["VmHWM"] - self.start["VmRSS"]) / mib,
            "anon_start_mib": self.start["RssAnon"] / mib,
            "anon_peak_mib": self.peak_anon / mib,
            "anon_growth_mib": anon_growth / mib,
            "ram_tier_growth_mib": ram_growth / mib,
            "anon_growth_beyond_ram_tier_mib": (anon_growth - ram_growth) / mib,
        }


# ----------------------------------------------------------------------------- the run


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None without values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _warm_up(port: int, config: SoakConfig) -> None:
    """Two turns before the clock starts, so one-time work (first allocations, the state
    cache's files) is not counted as growth."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "warm up"}]
    for _ in range(2):
        reply = chat(port, messages, config.max_tokens, None)
        if reply.outcome != "served":
            raise AgentrtError(f"the warm-up request failed: status {reply.status}")
        messages += [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": "go"},
        ]


def _drive(port: int, config: SoakConfig, note: Callable[[str], None]) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + config.seconds
    threads = [
        threading.Thread(target=_client, args=(i, port, config, deadline, tally), daemon=True)
        for i in range(config.clients)
    ]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(timeout=10 / len(threads))
        served = tally.outcomes["served"]
        note(f"soak: {config.seconds - max(deadline - time.monotonic(), 0):.0f} s, {served} served")
    return tally


def _summary(tally: Tally, memory: dict, cache: dict[str, float], config: SoakConfig) -> dict:
    five = sum(n for status, n in tally.statuses.items() if status.startswith("5"))
    dropped = sum(v for k, v in cache.items() if k.startswith(("dropped_", "deferred_dropped")))
    return {
        "config": dataclasses.asdict(config),
        "requests": {
            "sent": sum(tally.outcomes.values()),
            "served": tally.outcomes["served"],
            "disconnected": tally.outcomes["disconnected"],
            "rejected_4xx": tally.outcomes["rejected"],
            "stream_errors": tally.outcomes["stream_error"],
            "unanswered": tally.outcomes["unanswered"] + tally.outcomes["incomplete"],
            "by_status": dict(tally.statuses),
            "5xx": five,
            "cached_token_share": tally.cached_tokens / max(tally.prompt_tokens, 1),
        },
        "ttft_s": {
            "p50": _percentile(tally.ttfts, 50),
            "p99": _percentile(tally.ttfts, 99),
            "max": max(tally.ttfts, default=None),
            "count": len(tally.ttfts),
        },
        "rss": memory,
        "state_cache": {
            "saved": cache.get("write_written", 0),
            "dropped": dropped,
            "stats": cache,
        },
        "failures": tally.failures[:10],
    }


def soak(config: SoakConfig, note: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Run the soak (see the module docstring) and return its report."""
    scratch = Path(tempfile.mkdtemp(prefix="agentrt-soak-"))
    server = ServerProcess(config.model, config.device, scratch / "state", scratch / "server.log")
    try:
        server.wait_ready()
        _warm_up(server.port, config)
        watch = MemoryWatch(server)
        started = time.monotonic()
        tally = _drive(server.port, config, note)
        memory = watch.report()
        report = _summary(tally, memory, state_cache_metrics(server.port)[0], config)
        report["wall_s"] = time.monotonic() - started
        report["server_alive"] = get(server.port, "/health")[0] == 200
    finally:
        status = server.stop()
        log = server.log_tail(100_000)
        shutil.rmtree(scratch, ignore_errors=True)
    report["server_exit_status"] = status
    report["server_tracebacks"] = log.count("Traceback (most recent call last)")
    return report
