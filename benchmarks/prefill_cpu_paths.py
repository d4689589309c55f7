"""Offloaded prefill's two CPU paths per rows per expert (qwen3.5-35b-a3b shapes: hidden 2048,
expert intermediate 512, bf16, 48 experts of one layer): the native kernel's rows call over all
48, and torch's `F.linear` on the OpenMP team one expert after another (`prefill_cpu._rows_of`);
then torch's path over 12 experts right after a native call of 8 rows each, after a 50 ms pause,
and with the team just used, and the native kernel right after torch's path. Milliseconds per
expert, the median of 5. Prints the OpenMP runtimes this process loaded first. Set the OpenMP
environment before running it to compare how idle workers wait, e.g.

    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=2000000 KMP_BLOCKTIME=200 \
        python benchmarks/prefill_cpu_paths.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
from bench_cpu_prefill import EXPERTS, expert_layer  # noqa: E402

from agentrt.offload.cpu_kernel import native_experts  # noqa: E402
from agentrt.offload.prefill_cpu import _begins, _rows_of  # noqa: E402
from agentrt.offload.store import ExpertStore  # noqa: E402

HIDDEN, INTER = 2048, 512


def _native(kernel, store: ExpertStore, rows: int, n: int = EXPERTS) -> float:
    """Seconds per expert of one native rows call over `n` experts of `rows` rows."""
    _, gate_up, down = store.expert_views(0)
    x = torch.randn(rows * n, HIDDEN).bfloat16()
    weights, out = torch.ones(rows * n), torch.empty(rows * n, HIDDEN)
    t0 = time.perf_counter()
    kernel.run_rows(gate_up[:n], down[:n], [rows] * n, x, weights, out)
    return (time.perf_counter() - t0) / n


def _torch(store: ExpertStore, rows: int, n: int = EXPERTS) -> float:
    """Seconds per expert of torch's path over `n` experts of `rows` rows."""
    x = torch.randn(rows * n, HIDDEN).bfloat16()
    out, scale = torch.empty_like(x), torch.ones(rows * n, dtype=torch.bfloat16)
    counts, experts = [rows] * n, list(range(n))
    t0 = time.perf_counter()
    _rows_of(store, 0, experts, _begins(experts, counts), counts, x, scale, out)
    return (time.perf_counter() - t0) / n


def _ms(fn, reps: int = 5) -> float:
    return round(statistics.median(fn() for _ in range(reps)) * 1e3, 3)


def _row(kernel, store: ExpertStore, rows: int) -> dict:
    _native(kernel, store, rows), _torch(store, rows)  # (first calls: shapes and pages)

    def after_native() -> float:
        _native(kernel, store, 8)
        return _torch(store, rows, 12)

    def after_pause() -> float:
        time.sleep(0.05)
        return _torch(store, rows, 12)

    def native_after_torch() -> float:
        _torch(store, 32, 4)
        return _native(kernel, store, rows, 12)

    return {
        "native": _ms(lambda: _native(kernel, store, rows)),
        "torch": _ms(lambda: _torch(store, rows)),
        "torch12_after_native": _ms(after_native),
        "torch12_after_pause": _ms(after_pause),
        "torch12_warm": _ms(lambda: _torch(store, rows, 12)),
        "native12_after_torch": _ms(native_after_torch),
    }


def main() -> None:
    torch.manual_seed(0)
    # (pinned where CUDA is, as the engine's store)
    store = expert_layer(HIDDEN, INTER, pin=torch.cuda.is_available())
    kernel = native_experts()
    if kernel is None:
        sys.exit("no native kernel here (no C compiler?): nothing to compare")
    with open("/proc/self/maps") as f:
        omp = sorted({line.split()[-1] for line in f if "omp" in line.split()[-1]})
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))}
    print(json.dumps({"omp_libs": omp, "threads": torch.get_num_threads(), "env": env}))
    for rows in (16, 24, 32, 48, 64, 96, 128, 192, 256):
        print(rows, json.dumps(_row(kernel, store, rows)), flush=True)


if __name__ == "__main__":
    main()
