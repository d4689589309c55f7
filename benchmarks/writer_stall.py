"""How long the state-cache writer's packing of one checkpoint stalls other Python threads (a
prefill's host side, request preparation) by holding the GIL: a background thread packs a
snapshot the size of qwen3.5-35b-a3b's (30 linear layers of conv and recurrent fp32 state,
~66 MB) as the writer does (`pack_parts` on a pool of WORKERS threads: 1 by default, so that
a 2-core machine is not oversubscribed; the state cache uses 4), while the main thread sleeps
0.2 ms at a time and records how late it wakes. Prints JSON: wake-ups later than 1 ms, their
total lateness and the longest, per packing; with glibc's malloc defaults, then with the state
cache's `keep_freed_buffers` (one JSON line each).

    python benchmarks/writer_stall.py [packings] [workers]     (default 10 1)
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from agentrt.host.cputhreads import keep_freed_buffers
from agentrt.statecache.codec import pack_parts


def snapshot() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    conv = [torch.randn(8192, 3, generator=g) for _ in range(30)]
    rec = [torch.randn(32, 128, 128, generator=g) * 0.1 for _ in range(30)]
    return conv + rec


def late_wakeups(done: Callable[[], bool]) -> list[float]:
    """Sleep 0.2 ms at a time until `done()`; the lateness of each wake-up over 1 ms."""
    gaps = []
    while not done():
        before = time.perf_counter()
        time.sleep(0.0002)
        late = time.perf_counter() - before - 0.0002
        if late > 1e-3:
            gaps.append(late)
    return gaps


def measure(tensors: list[torch.Tensor], packings: int, pool: ThreadPoolExecutor) -> dict:
    done = threading.Event()

    def writer() -> None:
        for _ in range(packings):
            pack_parts(tensors, 1, pool=pool)
        done.set()

    start = time.perf_counter()
    threading.Thread(target=writer).start()
    gaps = late_wakeups(done.is_set)
    return {
        "seconds": round(time.perf_counter() - start, 3),
        "gaps_over_1ms": len(gaps),
        "stalled_ms_per_packing": round(sum(gaps) * 1e3 / packings, 2),
        "longest_gap_ms": round(max(gaps, default=0) * 1e3, 2),
    }


def main() -> None:
    packings = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    tensors, pool = snapshot(), ThreadPoolExecutor(workers)
    raw = sum(t.numel() * t.element_size() for t in tensors)
    head = {"snapshot_mb": round(raw / 1e6, 1), "packings": packings, "workers": workers}
    # glibc's defaults first, then what the state cache sets (process-wide, so in this order)
    print(json.dumps(head | {"malloc": "default"} | measure(tensors, packings, pool)))
    tuned = "keep_freed_buffers" if keep_freed_buffers() else "default (not settable)"
    print(json.dumps(head | {"malloc": tuned} | measure(tensors, packings, pool)))


if __name__ == "__main__":
    main()
