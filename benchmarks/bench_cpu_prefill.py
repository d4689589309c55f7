"""Offloaded prefill's CPU experts of many rows each (qwen3.5-35b-a3b shapes by default: hidden
2048, expert intermediate 512, bf16), over 48 experts of one layer (300 MB: far beyond the
caches), through `offload/prefill_cpu.run_cpu_experts`, two ways: one expert after another on
the process's OpenMP team (what it runs for experts of more than `NATIVE_MAX_ROWS` rows), and
the experts spread over `RowWorkers` (`AGENTRT_PREFILL_CPU_WORKERS=1`). Beside each, what the
prefill planner's cost model charges per expert (`planner.Costs.cpu_s` at `prefill.CPU_FLOPS`
and the given weight-read bandwidth), which sizes the CPU's share of a chunk; and, for at most
32 rows, the native kernel's rows call over all 48 at once (what `prefill_cpu` runs for experts
of at most `NATIVE_MAX_ROWS` rows). Prints JSON: per rows per expert, milliseconds per expert
each way (the median of `--passes` passes over the 48, each after a pass over 4), the speed-up
of the workers and the model's milliseconds.

    python benchmarks/bench_cpu_prefill.py [--rows 8,16,24,32,64,128,256] [--cpu-gb-s 44] \
        [--passes 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from agentrt.offload.cpu_kernel import native_experts
from agentrt.offload.planner import Costs
from agentrt.offload.prefill import CPU_FLOPS
from agentrt.offload.prefill_cpu import RowWorkers, run_cpu_experts
from agentrt.offload.store import ExpertStore

EXPERTS = 48


def expert_layer(hidden: int, inter: int, pin: bool = False) -> ExpertStore:
    """One layer of `EXPERTS` bf16 experts with random weights (in pinned memory with `pin`)."""
    store = ExpertStore(range(1), EXPERTS, hidden, inter, dtype=torch.bfloat16, pin=pin)
    store.flat[0].copy_(torch.randn(store.flat[0].shape) * 0.02)
    return store


def _torch_rows(store: ExpertStore, rows: int, workers: RowWorkers | None) -> float:
    """Seconds per expert, each of `rows` rows, through torch (on the team, or the workers)."""
    x = torch.randn(EXPERTS * rows, store.hidden).to(torch.bfloat16)
    out, scale = torch.empty_like(x), torch.ones(EXPERTS * rows, dtype=torch.bfloat16)

    def run(n: int) -> None:
        counts = [rows] * n + [0] * (EXPERTS - n)
        args = (x[: n * rows], scale[: n * rows], out[: n * rows], workers)
        with torch.inference_mode():
            run_cpu_experts(store, None, 0, list(range(n)), counts, *args)

    run(4)
    t0 = time.perf_counter()
    run(EXPERTS)
    return (time.perf_counter() - t0) / EXPERTS


def _native(store: ExpertStore, rows: int) -> float | None:
    """Seconds per expert, all of them in one rows call of the native kernel (None: no kernel)."""
    kernel = native_experts()
    if kernel is None:
        return None
    xs = torch.randn(rows * EXPERTS, store.hidden).to(torch.bfloat16)
    weights = torch.ones(rows * EXPERTS)
    out = torch.empty(xs.shape, dtype=torch.float32)
    _, gu, dn = store.expert_views(0)
    kernel.run_rows(gu[:4], dn[:4], [rows] * 4, xs[: 4 * rows], weights[: 4 * rows], out)
    t0 = time.perf_counter()
    kernel.run_rows(gu, dn, [rows] * EXPERTS, xs, weights, out)
    return (time.perf_counter() - t0) / EXPERTS


def _median(passes: int, fn, *args) -> float | None:
    """The median of `passes` calls of `fn` (None where it gives None)."""
    times = [fn(*args) for _ in range(max(1, passes))]
    return None if None in times else statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,16,24,32,64,128,256")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--cpu-gb-s", type=float, default=44.0, help="the model's read rate")
    parser.add_argument("--passes", type=int, default=3, help="passes per figure (the median)")
    args = parser.parse_args()
    torch.manual_seed(0)
    h, i = args.hidden, args.inter
    store = expert_layer(h, i)
    costs = Costs(store.expert_bytes, 1.0, args.cpu_gb_s * 1e9, CPU_FLOPS, 6.0 * i * h)
    workers = RowWorkers()
    result = {"threads": torch.get_num_threads(), "workers": workers.threads, "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        one = _median(args.passes, _torch_rows, store, rows, None)
        spread = _median(args.passes, _torch_rows, store, rows, workers)
        result["rows"][rows] = {
            "one_call_ms": round(one * 1e3, 3),
            "workers_ms": round(spread * 1e3, 3),
            "workers_speedup": round(one / spread, 2),
            "one_call_tflops": round(6 * i * h * rows / one / 1e12, 3),
            "model_ms": round(costs.cpu_s(rows) * 1e3, 3),
        }
        native = _median(args.passes, _native, store, rows) if rows <= 32 else None
        if native is not None:
            result["rows"][rows]["native_ms"] = round(native * 1e3, 3)
    workers.close()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
