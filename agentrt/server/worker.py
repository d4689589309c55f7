"""The engine worker: one thread that runs chat jobs in arrival order on the `Runtime`, with a
bounded queue (full -> the caller answers 429) and per-job cancellation (a client that goes away
stops its generation at the next token). Events are handed to the asyncio side thread-safely.
When its queue is empty after a job, the worker prepares the engine for the next turn
(`prepare_ahead`)."""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

from agentrt.errors import AgentrtError

DONE = object()


class QueueFull(Exception):
    pass


@dataclass
class Job:
    prepared: Any  # a `PreparedChat`
    kwargs: dict[str, Any]  # sampling settings for `Runtime.chat_prepared`
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finished: bool = False

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineWorker:
    def __init__(self, runtime, queue_size: int) -> None:
        self.runtime = runtime
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._loop, name="agentrt-engine", daemon=True)
        self.busy = False
        self.running: Job | None = None
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None

    def depth(self) -> int:
        return self.jobs.qsize() + int(self.busy)

    def stop(self) -> None:
        """Cancel waiting jobs and the running one, then end the thread."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled = job.finished = True
                job.emit(RuntimeError("server shutting down"))
                job.emit(DONE)
        self.current_cancel()
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def current_cancel(self) -> None:
        job = self.running
        if job is not None:
            job.cancelled = True

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
