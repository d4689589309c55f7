"""The q* rule (docs/architecture.md §5): of m missing experts, copy q over PCIe and compute m - q
on the CPU so both finish together: q* ~ m * B_P / (B_P + B_H'), rounded to the integer that
minimises max(q * S / B_P, (m - q) * S / B_H'), and the bandwidths it is fed (`Bandwidths`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Bandwidths:
    """Bytes/s: `copy` = host->device expert copies, `cpu` = CPU expert compute while copying.

    They start from the calibration profile and follow what decode steps measure in the engine's
    real arrangement, so q* adapts when, say, the CPU is slower next to running copies than the
    calibration saw. Each `window` observations of a side give one rate (bytes over seconds,
    summed), which moves the estimate by `alpha`; an estimate never falls below `floor` times
    its starting value. Both guard against a trap: a few slow steps (right after a long
    prefill, the CPU is still busy) would otherwise settle the CPU side near zero, after which
    it only runs single-expert probes on a sleeping thread pool, which measure slow again.
    The other way, a window at least `jump` times the estimate moves it by `alpha_up`, so an
    estimate far below what the CPU's real work measures rises within a few windows. (Probes
    alone measure slow, so a saved profile taken while the host was busy is caught at start-up
    instead: `calibrate.understates_cpu`.)"""

    copy: float
    cpu: float
    alpha: float = 0.1  # weight of each window's rate
    window: int = 16  # observations per update
    floor: float = 0.5  # the lowest estimate, as a fraction of the starting value
    jump: float = 2.0  # a window's rate this many times the estimate ...
    alpha_up: float = 0.5  # ... moves it this far
    _start: dict = field(init=False, repr=False)
    _sums: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._start = {"copy": self.copy, "cpu": self.cpu}
        self._sums = {"copy": [0, 0.0, 0], "cpu": [0, 0.0, 0]}

    def observe(self, side: str, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        sums = self._sums[side]
        sums[0], sums[1], sums[2] = sums[0] + num_bytes, sums[1] + seconds, sums[2] + 1
        if sums[2] < self.window:
            return
        rate = sums[0] / sums[1]
        self._sums[side] = [0, 0.0, 0]
        now = getattr(self, side)
        alpha = self.alpha_up if rate >= self.jump * now else self.alpha
        moved = (1 - alpha) * now + alpha * rate
        setattr(self, side, max(moved, self.floor * self._start[side]))


def q_star(misses: int, b_copy: float, b_cpu: float, queued: float = 0.0) -> int:
    """How many of `misses` experts to copy, given copy and CPU-compute bandwidths (bytes/s) and
    `queued` experts' worth of copies already ahead of them on the copy engine (prefetches):
    the integer minimising max((queued + q) / B_P, (m - q) / B_H')."""
    if misses <= 0:
        return 0
    if b_cpu <= 0:
        return misses
    if b_copy <= 0:
        return 0
    ideal = (misses * b_copy - queued * b_cpu) / (b_copy + b_cpu)
    low = max(0, min(misses, math.floor(ideal)))
    high = max(0, min(misses, math.ceil(ideal)))
    if low == high:
        return low
    # (a host step asks once per MoE layer: two candidates compared inline, ties to more copies)
    t_low = max((queued + low) / b_copy, (misses - low) / b_cpu)
    t_high = max((queued + high) / b_copy, (misses - high) / b_cpu)
    return high if t_high <= t_low else low


def split_time(misses: int, q: int, expert_bytes: int, b_copy: float, b_cpu: float) -> float:
    """Seconds for the slower of the two sides."""
    copy = q * expert_bytes / b_copy if q else 0.0
    cpu = (misses - q) * expert_bytes / b_cpu if misses - q else 0.0
    return max(copy, cpu)
