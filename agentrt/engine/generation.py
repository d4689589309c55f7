"""What one request's run reports: `Generation` (its tokens, why it stopped, the state it
reused) with its `Timings`, and `Cancelled`, raised when its caller asks to stop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field


class Cancelled(Exception):
    """The caller asked to stop (e.g. the HTTP client went away)."""


@dataclass
class Timings:
    """Seconds. `prefill_s` runs from the start of state reuse to logits ready; `restore_s` is
    its first part (finding + loading a checkpoint); `capture_s` is the host time spent queueing
    new checkpoints after the prefill's kernels were launched (it overlaps their execution),
    `capture_gpu_s` the device time of their device->host copies after the prefill's last
    kernel (CUDA events; 0 on the CPU, where the copies are part of `capture_s`).
    `prepare_s` runs from the request's start to the start of state reuse (rendering and
    tokenizing; in the server, also the wait in its queue); `restore_wait_s` is the part of
    `restore_s` spent waiting for the device."""

    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    restore_s: float = 0.0
    capture_s: float = 0.0
    capture_gpu_s: float = 0.0
    prepare_s: float = 0.0
    restore_wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """The public `timings` of a result (docs/architecture.md §2: exactly these three)."""
        return {"ttft_s": self.ttft_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s}

    def parts(self) -> dict[str, float]:
        """The other fields: where the time to the first token went (reuse, capture, ...)."""
        public = self.as_dict()
        return {k: v for k, v in asdict(self).items() if k not in public}


@dataclass
class Generation:
    """Outcome of one generation: new tokens, why it stopped, state reuse, timings."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose state was reused, not recomputed
    started_at: float | None = None  # perf_counter of the request's start (TTFT origin)
    should_stop: Callable[[], bool] | None = None  # polled between prefill chunks and tokens
    checkpoint: str | None = None  # kind of the reused state ("live", a boundary kind, "block")
    restore_source: str | None = None  # where it came from: "live", "device", "ram", "lmdb"
    timings: Timings = field(default_factory=Timings)
