"""Causal conv of a Gated DeltaNet layer (qwen3.5-35b-a3b: 8192 channels, kernel 4, bf16) on the
GPU: the torch sum of shifted products against fla's fused kernel, per length. Prints JSON lines
with host time per call (launch cost, what an eager prefill pays) and GPU time per call (CUDA
events over 50 back-to-back calls).

    python benchmarks/bench_conv.py
"""

from __future__ import annotations

import json
import time

import torch

from agentrt.models import kernels


def per_call(fn, reps: int = 50) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return host * 1e3, start.elapsed_time(end) / reps


def main() -> None:
    channels, width = 8192, 4
    weight = torch.randn(channels, 1, width, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(channels, width - 1, device="cuda", dtype=torch.bfloat16)
    for length in (1, 64, 512, 2048, 4096):
        x = torch.randn(length, channels, device="cuda", dtype=torch.bfloat16)
        row = {"tokens": length}
        for backend in ("torch", "fla"):
            host, gpu = per_call(lambda b=backend, x=x: kernels.causal_conv(x, state, weight, b))
            row[f"{backend}_host_ms"], row[f"{backend}_gpu_ms"] = round(host, 4), round(gpu, 4)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
