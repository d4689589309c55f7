"""The engine worker: one thread that runs chat jobs in arrival order on the `Runtime`, with a
bounded queue (full -> the caller answers 429) and per-job cancellation (a client that goes away
stops its generation at the next token). Events are handed to the asyncio side thread-safely.
When its queue is empty after a job, the worker prepares the engine for the next turn
(`prepare_ahead`)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

from agentrt.errors import AgentrtError

DONE = object()


class QueueFull(Exception):
    pass


class ShuttingDown(RuntimeError):
    """What a job's client hears when the server stops before or while the job runs."""

    def __init__(self) -> None:
        super().__init__("server shutting down")


@dataclass
class Job:
    prepared: Any  # a `PreparedChat`
    kwargs: dict[str, Any]  # sampling settings for `Runtime.chat_prepared`
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finished: bool = False

    def emit(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # (the loop closed: nobody is listening)
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    def end(self) -> None:
        """End a job that will not run (the server stops)."""
        self.cancelled = self.finished = True
        self.emit(ShuttingDown())
        self.emit(DONE)


class EngineWorker:
    def __init__(self, runtime, queue_size: int) -> None:
        self.runtime = runtime
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._loop, name="agentrt-engine", daemon=True)
        self.busy = False
        self.closing = False
        self.running: Job | None = None
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.closing:
            job.end()
            return
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None

    def depth(self) -> int:
        return self.jobs.qsize() + int(self.busy)

    def end_all(self) -> None:
        """A stop has begun: waiting jobs, later ones and the running one end with
        `ShuttingDown` (the running one stops at its next token)."""
        self.closing = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.end()
        running = self.running
        if running is not None and not running.cancelled and not running.finished:
            running.emit(ShuttingDown())
            running.cancelled = True

    def stop(self) -> None:
        """End every job (`end_all`), then the thread."""
        self.end_all()
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled:  # (its client went away while it waited: it still ends)
                job.finished = True
                job.emit(DONE)
                continue
            self.busy, self.running = True, job
            try:
                self._run(job)
                if self.jobs.empty():  # idle: what the next turn would pay for, now
                    self.running = None
                    self.runtime.prepare_ahead()
            finally:
                self.busy, self.running = False, None

    def _run(self, job: Job) -> None:
        try:
            events = self.runtime.chat_prepared(
                job.prepared, stream=True, should_stop=lambda: job.cancelled, **job.kwargs
            )
            for event in events:
                if job.cancelled and event.type != "done":
                    continue  # keep draining: the generator stops at the next token
                job.emit(event)
        except AgentrtError as exc:
            job.emit(exc)
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            traceback.print_exc()
            job.emit(RuntimeError(f"internal error: {type(exc).__name__}: {exc}"))
        job.finished = True
        job.emit(DONE)
