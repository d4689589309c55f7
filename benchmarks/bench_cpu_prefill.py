"""Offloaded prefill's CPU experts of many rows each (qwen3.5-35b-a3b shapes by default: hidden
2048, expert intermediate 512, bf16), cycling through 48 experts (300 MB: far beyond the
caches), two ways: one expert after another, each through torch's `F.linear` on the process's
OpenMP team (what `offload/prefill_cpu.py` runs for experts of more than `NATIVE_MAX_ROWS`
rows), and the experts spread over single-threaded worker threads, one expert each at a time.
Beside each, what the prefill planner's cost model charges per expert (`planner.Costs.cpu_s`
at `prefill.CPU_FLOPS` and the given weight-read bandwidth), which sizes the CPU's share of a
chunk; and, for at most 32 rows, the native kernel's rows call over all 48 at once (what
`prefill_cpu` runs for experts of at most `NATIVE_MAX_ROWS` rows). Prints JSON: per rows per
expert, milliseconds per expert each way (the median of `--passes` passes over the 48), the
speed-up of the workers and the model's milliseconds.

    python benchmarks/bench_cpu_prefill.py [--rows 8,16,24,32,64,128,256] [--cpu-gb-s 44] \
        [--passes 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from agentrt.host.cputhreads import single_threaded, usable_cores
from agentrt.offload.cpu_kernel import native_experts
from agentrt.offload.planner import Costs
from agentrt.offload.prefill import CPU_FLOPS

EXPERTS = 48


def _expert(x, gate_up, down):
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def _one_call(x, gate_up, down) -> float:
    """Seconds per expert, one after another on torch's team."""
    with torch.inference_mode():
        for e in range(4):
            _expert(x, gate_up[e], down[e])
        t0 = time.perf_counter()
        for e in range(EXPERTS):
            _expert(x, gate_up[e], down[e])
    return (time.perf_counter() - t0) / EXPERTS


def _workers(x, gate_up, down, pool: ThreadPoolExecutor, workers: int) -> float:
    """Seconds per expert, spread over `workers` single-threaded threads."""

    def run(experts):
        with torch.inference_mode():
            for e in experts:
                _expert(x, gate_up[e], down[e])

    list(pool.map(run, [[w % EXPERTS] for w in range(workers)]))
    t0 = time.perf_counter()
    list(pool.map(run, [range(w, EXPERTS, workers) for w in range(workers)]))
    return (time.perf_counter() - t0) / EXPERTS


def _native(x, gate_up, down) -> float | None:
    """Seconds per expert, all of them in one rows call of the native kernel (None: no kernel)."""
    kernel = native_experts()
    if kernel is None:
        return None
    rows = x.shape[0]
    xs = x.repeat(EXPERTS, 1).contiguous()
    weights = torch.ones(rows * EXPERTS)
    out = torch.empty(xs.shape, dtype=torch.float32)
    gu, dn = list(gate_up.unbind(0)), list(down.unbind(0))
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
    gate_up = (torch.randn(EXPERTS, 2 * i, h) * 0.02).to(torch.bfloat16)
    down = (torch.randn(EXPERTS, h, i) * 0.02).to(torch.bfloat16)
    expert_bytes = 3 * i * h * 2
    costs = Costs(expert_bytes, 1.0, args.cpu_gb_s * 1e9, CPU_FLOPS, 6.0 * i * h)
    workers = usable_cores()
    pool = ThreadPoolExecutor(workers, initializer=single_threaded)
    result = {"threads": torch.get_num_threads(), "workers": workers, "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, h).to(torch.bfloat16)
        one = _median(args.passes, _one_call, x, gate_up, down)
        spread = _median(args.passes, _workers, x, gate_up, down, pool, workers)
        result["rows"][rows] = {
            "one_call_ms": round(one * 1e3, 3),
            "workers_ms": round(spread * 1e3, 3),
            "workers_speedup": round(one / spread, 2),
            "one_call_tflops": round(6 * i * h * rows / one / 1e12, 3),
            "model_ms": round(costs.cpu_s(rows) * 1e3, 3),
        }
        native = _median(args.passes, _native, x, gate_up, down) if rows <= 32 else None
        if native is not None:
            result["rows"][rows]["native_ms"] = round(native * 1e3, 3)
    pool.shutdown()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
