"""The q* rule (docs/architecture.md §5): of m missing experts, copy q over PCIe and compute m - q
on the CPU so both finish together: q* ~ m * B_P / (B_P + B_H'), rounded to the integer that
minimises max(q * S / B_P, (m - q) * S / B_H')."""

from __future__ import annotations

import math


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
    candidates = {max(0, min(misses, math.floor(ideal))), max(0, min(misses, math.ceil(ideal)))}
    return min(
        sorted(candidates),
        key=lambda q: (max((queued + q) / b_copy, (misses - q) / b_cpu), -q),
    )


def split_time(misses: int, q: int, expert_bytes: int, b_copy: float, b_cpu: float) -> float:
    """Seconds for the slower of the two sides."""
    copy = q * expert_bytes / b_copy if q else 0.0
    cpu = (misses - q) * expert_bytes / b_cpu if misses - q else 0.0
    return max(copy, cpu)
