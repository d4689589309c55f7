"""The engine worker: one thread that runs chat jobs in arrival order on the `Runtime`, with a
bounded queue (full -> the caller answers 429) and per-job cancellation (a client that goes away
stops its generation at the next token). Events are handed to the asyncio side thread-safely."""

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
    kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineWorker:
    def __init__(self, runtime, queue_size: int) -> None:
        self.runtime = runtime
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._loop, name="agentrt-engine", daemon=True)
        self.busy = False
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None

    def depth(self) -> int:
        return self.jobs.qsize() + int(self.busy)

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled:
                continue
            self.busy = True
            try:
                self._run(job)
            finally:
                self.busy = False

    def _run(self, job: Job) -> None:
        try:
            for event in self.runtime.chat(stream=True, **job.kwargs):
                if job.cancelled:
                    break
                job.emit(event)
        except AgentrtError as exc:
            job.emit(exc)
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            traceback.print_exc()
            job.emit(RuntimeError(f"internal error: {type(exc).__name__}: {exc}"))
        job.emit(DONE)
