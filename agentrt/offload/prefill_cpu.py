"""The CPU side of offloaded prefill: missing experts of a few tokens each, computed on the host
while the copies run. Rows come grouped by expert, in `cpu_order`; each row's output is its
expert's output times its routing weight. Experts of at most `NATIVE_MAX_ROWS` rows run in the
native kernel where there is one (`cpu_kernel.NativeExperts.run_rows`: each weight row read
once and dotted with four of the expert's rows at a time), the others through torch's
`F.linear`: one after another on torch's OpenMP team, or, with `RowWorkers`
(`AGENTRT_PREFILL_CPU_WORKERS=1`), spread over single-threaded worker threads, one expert each
at a time. Knows nothing of devices, plans or copies."""

from __future__ import annotations

import functools
import heapq
import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import torch.nn.functional as F

from agentrt.env import setting
from agentrt.host.cputhreads import single_threaded, usable_cores
from agentrt.offload.cpu_kernel import expert_weights
from agentrt.offload.store import ExpertStore

# experts of more rows run through torch's F.linear: on the H200 machine's 16 cores the native
# kernel took 0.07-0.27 ms per expert of 1-24 rows (Qwen3.5-35B-A3B shapes) against torch's
# 0.24-0.35, and the same at 32 rows
NATIVE_MAX_ROWS = 24


def cpu_order(experts, counts: list[int]) -> list[int]:
    """The order a layer's CPU experts' rows are laid out in: fewest rows first (those the
    native kernel takes come first, as one run)."""
    return sorted(experts, key=lambda e: (counts[e], e))


def cpu_inputs(ys, rows: tuple[int, int], on_cuda: bool):
    """The CPU rows' hidden states and routing weights (`ys`: the layer's sorted pairs), on
    their way to pinned host memory (queued before any part, so they arrive without waiting
    for the copies), and their event (None off CUDA: the tensors themselves)."""
    x, scale = ys.x_sorted[rows[0] : rows[1]], ys.scale[rows[0] : rows[1]]
    if not on_cuda:
        return x, scale, None
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (x, scale)]
    pinned[0].copy_(x, non_blocking=True)
    pinned[1].copy_(scale, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(x.device))
    return pinned[0], pinned[1], event


class RowWorkers:
    """Single-threaded worker threads that share a layer's many-row CPU experts: one expert of a
    few hundred rows on the whole OpenMP team scales poorly with cores (on an H100 host's 16,
    1.2-3.1 TFLOP/s against 0.5-1.3 on 2 cores; on 2 cores these workers ran experts of 64-256
    rows 1.13-1.30x as fast as the team)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or usable_cores()
        self._pool = ThreadPoolExecutor(
            self.threads, thread_name_prefix="agentrt-cpu-rows", initializer=single_threaded
        )

    def run(self, store: ExpertStore, layer: int, experts, counts, x, scale, out) -> None:
        """`_rows_of` for `experts` (their rows laid out in their order), spread over the
        workers by rows (the most rows first, each to the least loaded worker)."""
        begins = _begins(experts, counts)
        groups = _balanced(experts, counts, self.threads)
        jobs = [
            self._pool.submit(_rows_of, store, layer, group, begins, counts, x, scale, out)
            for group in groups
            if group
        ]
        wait(jobs)  # (all of them done before one's error is raised: none writes `out` after)
        for job in jobs:
            job.result()

    def close(self) -> None:
        self._pool.shutdown()


def row_workers() -> RowWorkers | None:
    """The process's workers for prefill's many-row CPU experts where
    `AGENTRT_PREFILL_CPU_WORKERS=1` asks for them, else None: torch's team (on an H100 host's
    16 cores the workers were 1.10-1.22x as fast as the team for 128-256 rows, 0.72-0.75x for
    24-32, and the prefill bench with them inconclusive)."""
    return _shared_workers() if setting("PREFILL_CPU_WORKERS") == "1" else None


@functools.cache
def _shared_workers() -> RowWorkers:
    return RowWorkers()


def _balanced(experts, counts, groups: int) -> list[list[int]]:
    """`experts` in `groups` groups of about equal rows (the most rows first, each to the
    group with the fewest so far)."""
    heap = [(0, g) for g in range(groups)]
    out: list[list[int]] = [[] for _ in range(groups)]
    for expert in sorted(experts, key=lambda e: -counts[e]):
        rows, g = heapq.heappop(heap)
        out[g].append(expert)
        heapq.heappush(heap, (rows + counts[expert], g))
    return out


def _begins(experts, counts) -> dict[int, int]:
    """Where each of `experts` starts in rows laid out in their order, `counts[e]` each."""
    begins, at = {}, 0
    for expert in experts:
        begins[expert], at = at, at + counts[expert]
    return begins


def _rows_of(store, layer, experts, begins, counts, x, scale, out) -> None:
    """Each of `experts` over its rows (from `begins`), through torch's `F.linear` on this
    thread (a worker's, or the caller's on torch's team)."""
    with torch.inference_mode():
        for expert in experts:
            rows = slice(begins[expert], begins[expert] + counts[expert])
            _expert_rows(store, layer, expert, x[rows], scale[rows], out[rows])


def run_cpu_experts(
    store: ExpertStore,
    kernel,
    layer: int,
    experts,
    counts,
    x,
    scale,
    out,
    workers=None,
    totals=None,
):
    """`out[rows]` = weighted outputs of `experts` (of `layer`, in `cpu_order`) over their rows
    of `x` (`counts[e]` consecutive rows each); `kernel`: the native kernel, or None (torch's);
    `workers`: `RowWorkers` for the experts torch computes, or None (torch's team); `totals`
    (`stats.PrefillTotals`, or None) counts each path's seconds and rows."""
    t0 = time.perf_counter()
    if store.packed and kernel is not None:  # (packed rows: their own kernel)
        kernel.run_rows(layer, experts, counts, x, scale, out)
        _count(totals, "native", t0, sum(counts[e] for e in experts))
        return
    kernel = kernel if store.plain else None  # (it computes bias-free SwiGLU experts only)
    native = [e for e in experts if kernel is not None and counts[e] <= NATIVE_MAX_ROWS]
    split = sum(counts[e] for e in native)
    if native:
        result = torch.empty(x[:split].shape, dtype=torch.float32)
        gu, dn = expert_weights(store, layer, native)
        weights = scale[:split].float().contiguous()
        kernel.run_rows(
            gu, dn, [counts[e] for e in native], x[:split].contiguous(), weights, result
        )
        out[:split].copy_(result)
        _count(totals, "native", t0, split)
    rest, t1 = list(experts[len(native) :]), time.perf_counter()
    if len(rest) > 1 and workers is not None:
        workers.run(store, layer, rest, counts, x[split:], scale[split:], out[split:])
    elif rest:
        begins = _begins(rest, counts)
        _rows_of(store, layer, rest, begins, counts, x[split:], scale[split:], out[split:])
    if rest:
        _count(totals, "torch", t1, sum(counts[e] for e in rest))


def _count(totals, path: str, since: float, rows: int) -> None:
    """Add a path's seconds since `since` and its rows to `totals` (None: nothing)."""
    if totals is not None:
        totals.add_cpu_path(path, time.perf_counter() - since, rows)


def _expert_rows(store, layer: int, expert: int, x, scale, out) -> None:
    """`out` = one expert's weighted output over its rows `x` (torch's `F.linear`)."""
    _, gate_up, down = store.expert_views(layer)
    bias = store.expert_biases(layer, expert, "cpu")
    weight = scale.unsqueeze(1)
    act = store.act(F.linear(x, gate_up[expert], bias[0] if bias else None))
    out[:] = F.linear(act * weight, down[expert])
    if bias:
        out += weight * bias[1]
