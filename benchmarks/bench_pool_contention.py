"""The native CPU kernel's thread pool (graph decode's host steps) with helper threads
competing for the cores, as the state-cache writer's compression threads do while a turn's
response decodes: one decode token's CPU experts per call (qwen3.5-35b-a3b shapes by default,
4 experts, cycling through 32), with 0 to `BUSY` threads compressing 4 MiB payloads with zstd
(level 1, the writer's; on a `HelperPool`, as the writer's), each load with the pool's items
in fixed equal shares on every thread (`shares`: a preempted thread holds up the barrier for
the rest of its share), claimed in chunks on every thread (`claimed`), and claimed on one
thread fewer per busy helper (`yielding`, the default). Prints JSON: per load and mode, mean,
p90 and p99 milliseconds per call.

    python benchmarks/bench_pool_contention.py [--threads N] [--busy 4] [--hidden 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch
import zstandard

from agentrt.host.cputhreads import HelperPool, single_threaded, usable_cores
from agentrt.offload.cpu_kernel import native_experts

EXPERTS, PER_CALL = 32, 4


def compress_until(stop: threading.Event) -> None:
    """A writer-like helper: zstd level 1 over 4 MiB of random bytes, again and again."""
    single_threaded()
    compressor, data = zstandard.ZstdCompressor(level=1), os.urandom(4 << 20)
    while not stop.is_set():
        compressor.compress(data)


MODES = {"shares": (0, False), "claimed": (16, False), "yielding": (16, True)}


def call_times(kernel, gate_up, down, x, out, calls: int) -> dict[str, float]:
    """Milliseconds per pool call (post, then wait), mean and tail."""
    times = []
    for call in range(calls):
        ids = [(call * PER_CALL + j) % EXPERTS for j in range(PER_CALL)]
        t0 = time.perf_counter()
        kernel.start([gate_up[e] for e in ids], [down[e] for e in ids], [1.0] * PER_CALL, x, out)
        kernel.finish()
        times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    tail = {"p90_ms": times[int(0.9 * calls)], "p99_ms": times[int(0.99 * calls)]}
    return {"mean_ms": statistics.mean(times), **tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="pool size (0: cores - 1)")
    parser.add_argument("--busy", type=int, default=4, help="most compressing helpers")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    kernel = native_experts()
    if kernel is None:
        raise SystemExit("no native kernel (a C compiler is needed)")
    kernel.pool_threads = args.threads or max(1, usable_cores() - 1)
    torch.manual_seed(0)
    gate_up = list((torch.randn(EXPERTS, 2 * args.inter, args.hidden) * 0.02).bfloat16())
    down = list((torch.randn(EXPERTS, args.hidden, args.inter) * 0.02).bfloat16())
    x, out = torch.randn(args.hidden).bfloat16(), torch.zeros(args.hidden)
    report: dict = {"pool_threads": kernel.pool_threads, "cores": usable_cores()}
    default_active = kernel.active_threads
    every = kernel.pool_threads
    for busy in sorted({0, 1, args.busy}):
        stop = threading.Event()
        with HelperPool(max_workers=max(busy, 1)) as helpers:
            running = [helpers.submit(compress_until, stop) for _ in range(busy)]
            for name, (chunk, yielding) in MODES.items():
                kernel.schedule(chunk)
                kernel.active_threads = (lambda: every) if not yielding else default_active
                call_times(kernel, gate_up, down, x, out, args.calls // 4)  # (warm-up)
                row = call_times(kernel, gate_up, down, x, out, args.calls)
                report[f"busy{busy}_{name}"] = {k: round(v, 3) for k, v in row.items()}
            stop.set()
            for future in running:
                future.result()
    kernel.schedule(16)
    kernel.active_threads = default_active
    print(json.dumps(report))


if __name__ == "__main__":
    main()
