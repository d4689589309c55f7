"""A decode token's CPU experts on the native kernel's pool, cold against warm: whether reading
an expert's weights into the CPU's caches ahead of its use (while the GPU runs the layer's graph
piece) would shorten a host step. Per trial, `--experts` experts drawn from a pinned store larger
than the last-level cache (qwen3.5-35b-a3b shapes by default): `cold` computes them straight
from DRAM; `warm` computes them once (the warm-up), waits `--gap-us` (the piece's time), then
computes them again, timed; `touched` reads them with the pool's warm-up (`NativeExperts.warm`:
each thread the rows it will compute) instead, waits, and computes them. With `--copies` (CUDA),
host->device copies from another pinned buffer keep the link busy through every trial, as
prefetches do; `--fixed`: the pool's threads take fixed equal shares (no claims from others').
Prints JSON: per mode, the median and p90 milliseconds of the timed call and its read rate.

    python benchmarks/bench_cpu_warm.py [--experts 3] [--store-gib 3] [--gap-us 250] [--copies]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from agentrt.offload.cpu_kernel import native_experts


def spin(seconds: float) -> None:
    """Wait without sleeping (a sleep's wake-up is longer than a piece)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class LinkLoad:
    """Host->device copies on a side stream that keep the link busy (CUDA only)."""

    def __init__(self, enabled: bool, chunk_mib: int = 64, chunks: int = 8) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        if not self.enabled:
            return
        self.src = torch.empty(chunks, chunk_mib << 20, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty_like(self.src, device="cuda")
        self.stream = torch.cuda.Stream()

    def top_up(self) -> None:
        """Queue another round of copies (about 10 ms of link time at 50 GB/s)."""
        if not self.enabled:
            return
        with torch.cuda.stream(self.stream):
            for i in range(self.src.shape[0]):
                self.dst[i].copy_(self.src[i], non_blocking=True)

    def drain(self) -> None:
        if self.enabled:
            self.stream.synchronize()


def timed_call(kernel, gate_up, down, ids, x, out) -> float:
    t0 = time.perf_counter()
    kernel.start([gate_up[e] for e in ids], [down[e] for e in ids], [1.0] * len(ids), x, out)
    kernel.finish()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=3, help="CPU experts per call")
    parser.add_argument("--store-gib", type=float, default=3.0, help="pinned store size")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--gap-us", type=float, default=250.0, help="warm-up to use")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--copies", action="store_true", help="keep the link busy (CUDA)")
    parser.add_argument("--fixed", action="store_true", help="fixed equal shares per thread")
    args = parser.parse_args()
    kernel = native_experts()
    if kernel is None or not kernel.pooled:
        raise SystemExit("the native kernel's pool is not available here")
    expert_bytes = 3 * args.hidden * args.inter * 2
    num = max(4 * args.experts, int(args.store_gib * 2**30 / expert_bytes))
    pin = torch.cuda.is_available()
    gate_up = torch.empty(num, 2 * args.inter, args.hidden, dtype=torch.bfloat16, pin_memory=pin)
    down = torch.empty(num, args.hidden, args.inter, dtype=torch.bfloat16, pin_memory=pin)
    for t in (gate_up, down):
        t.view(torch.int16).random_(-(2**14), 2**14)  # (finite bf16 values, pages touched)
    x = torch.randn(args.hidden).to(torch.bfloat16)
    out = torch.zeros(args.hidden, dtype=torch.float32, pin_memory=pin)
    load, rng = LinkLoad(args.copies), random.Random(0)
    if args.fixed:
        kernel.schedule(0)
    times: dict[str, list[float]] = {"cold": [], "warm": [], "warm_up": [], "touched": []}
    for _ in range(args.trials):
        load.top_up()
        ids = rng.sample(range(num), args.experts)
        times["cold"].append(timed_call(kernel, gate_up, down, ids, x, out))
        ids = rng.sample(range(num), args.experts)
        times["warm_up"].append(timed_call(kernel, gate_up, down, ids, x, out))
        spin(args.gap_us * 1e-6)
        times["warm"].append(timed_call(kernel, gate_up, down, ids, x, out))
        ids = rng.sample(range(num), args.experts)
        kernel.warm([gate_up[e] for e in ids], [down[e] for e in ids])
        spin(args.gap_us * 1e-6)
        times["touched"].append(timed_call(kernel, gate_up, down, ids, x, out))
        load.drain()
    report = {"experts": args.experts, "expert_mib": expert_bytes / 2**20, "store_experts": num}
    report.update(gap_us=args.gap_us, copies=load.enabled, threads=kernel.pool_threads)
    report.update(fixed_shares=args.fixed)
    for mode, values in times.items():
        values.sort()
        median = statistics.median(values)
        report[mode] = {
            "median_ms": round(1e3 * median, 4),
            "p90_ms": round(1e3 * values[int(0.9 * len(values))], 4),
            "gb_s": round(args.experts * expert_bytes / median / 1e9, 1),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
