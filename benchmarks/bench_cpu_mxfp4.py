"""A decode token's packed MXFP4 CPU experts, gpt-oss-120b shapes (hidden 2880, expert
intermediate 2880, biases, clamped SwiGLU; 12.6 MiB per expert): agentrt's native kernel
(`agentrt/offload/cpu_mxfp4.py`) against dequantize-then-torch (what runs without it), cycling
through 16 experts (202 MiB: beyond the caches), and prefill's rows call for 1, 4 and 16 rows of
one expert. Also one expert posted to the pool after the pool has been idle for 0 to 50 ms
(its threads spin `AGENTRT_POOL_SPIN_MS`, 20 by default, then sleep: what a sparse CPU share
in decode pays to wake them), by the pool's own clock. Prints JSON: ms per expert and GB/s of
packed rows read per path, with the thread
count (`OMP_NUM_THREADS` sets the native kernel's; its pool, graph decode's, has one fewer),
and the native kernel's largest difference from fp32 math on the dequantized weights (relative
to the output's largest value).

    python benchmarks/bench_cpu_mxfp4.py
"""

from __future__ import annotations

import json
import os
import time

import torch

from agentrt.models.moe import SwiGLU, expert_ffn
from agentrt.offload.calibrate import SPIN_SETTLE_S
from agentrt.offload.cpu_mxfp4 import mxfp4_kernel
from agentrt.offload.store import ExpertStore

EXPERTS, SIZE, CALLS = 16, 2880, 32


def _store() -> ExpertStore:
    store = ExpertStore(range(1), EXPERTS, SIZE, SIZE, torch.bfloat16, pin=False, bias=True,
                        act=SwiGLU(7.0, 1.702), packed=True)  # fmt: skip
    rows = store.flat[0]
    rows.random_(0, 256, generator=torch.Generator().manual_seed(0))
    for part in (store.layout.gate_up, store.layout.down):
        rows[:, part.scales : part.scales + part.rows * part.groups] = 120
    return store


def _time(fn, calls: int) -> float:
    fn(0)  # warm-up
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls


def _rows_call(kernel, rows: int) -> float:
    """Seconds of prefill's call for `rows` rows of one expert."""
    xs, scale, out = torch.randn(rows, SIZE), torch.rand(rows), torch.empty(rows, SIZE)
    counts = [rows if e == 0 else 0 for e in range(EXPERTS)]
    return _time(lambda _i: kernel.run_rows(0, [0], counts, xs, scale, out), 8)


def _after_idle(kernel, x: torch.Tensor, out: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per idle gap (ms before each call): the pool's seconds for one expert, median and
    largest of 16 calls, in ms."""
    report = {}
    for gap_ms in (0, 5, 10, 20, 50):
        took = []
        for i in range(16):
            time.sleep(gap_ms / 1e3)
            kernel.start_experts(0, [i % EXPERTS], [1.0], x, out)
            took.append(kernel.finish() * 1e3)
        took.sort()
        report[f"gap_{gap_ms}"] = {"median": round(took[8], 3), "max": round(took[-1], 3)}
    return report


def main() -> None:
    store = _store()
    kernel = mxfp4_kernel(store)
    x, out = torch.randn(SIZE).to(torch.bfloat16), torch.zeros(SIZE)
    report = {"threads": os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()}
    report["expert_mib"] = round(store.expert_bytes / 2**20, 2)
    if kernel is not None:
        s = _time(lambda i: kernel.run_experts(0, [i % EXPERTS], [1.0], x, out), CALLS)
        report["native"] = {"ms": round(s * 1e3, 2), "gb_s": round(store.expert_bytes / s / 1e9, 2)}

        def pooled(i: int) -> None:
            kernel.start_experts(0, [i % EXPERTS], [1.0], x, out)
            kernel.finish()

        time.sleep(SPIN_SETTLE_S)  # (the OpenMP team's workers spin on the same cores a while)
        s = _time(pooled, CALLS)
        report["native_pool"] = {
            "threads": kernel.pool_threads,
            "ms": round(s * 1e3, 2),
            "gb_s": round(store.expert_bytes / s / 1e9, 2),
        }
        report["native_pool_after_idle_ms"] = _after_idle(kernel, x, out)
        for rows in (1, 4, 16):
            report[f"native_rows_{rows}"] = {"ms": round(_rows_call(kernel, rows) * 1e3, 2)}
    _, gate_up, down = store.expert_views(0)

    def torch_path(i: int) -> None:
        e = i % EXPERTS
        expert_ffn(x[None], gate_up[e], down[e], *store.expert_biases(0, e, "cpu"), act=store.act)

    if kernel is not None:  # against fp32 math on the dequantized weights, relative to its max
        want = expert_ffn(
            x.float()[None], gate_up[1].float(), down[1].float(),
            *(b.float() for b in store.expert_biases(0, 1, "cpu")), act=store.act,
        )[0]  # fmt: skip
        kernel.run_experts(0, [1], [1.0], x, out)
        report["native_error"] = float(f"{((out - want).abs().max() / want.abs().max()):.2e}")
    s = _time(torch_path, 4)
    report["dequantize_then_torch"] = {
        "ms": round(s * 1e3, 2),
        "gb_s": round(store.expert_bytes / s / 1e9, 3),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
