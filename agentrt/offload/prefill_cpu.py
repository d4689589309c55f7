"""The CPU side of offloaded prefill: missing experts of a few tokens each, computed on the host
while the copies run. Rows come grouped by expert, in `cpu_order`; each row's output is its
expert's output times its routing weight. Experts of at most `NATIVE_MAX_ROWS` rows run in the
native kernel where there is one (`cpu_kernel.NativeExperts.run_rows`: each weight row read
once and dotted with four of the expert's rows at a time), on its own thread pool while the
caller dispatches the device's work where it has one, the others through torch's `F.linear`.
Knows nothing of plans or copies."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from agentrt.offload.store import ExpertStore

# experts of more rows run through torch's F.linear: on the H200 machine's 16 cores the native
# kernel took 0.07-0.27 ms per expert of 1-24 rows (Qwen3.5-35B-A3B shapes) against torch's
# 0.24-0.35, and the same at 32 rows
NATIVE_MAX_ROWS = 24


def cpu_order(experts, counts: list[int]) -> list[int]:
    """The order a layer's CPU experts' rows are laid out in: fewest rows first (those the
    native kernel takes come first, as one run)."""
    return sorted(experts, key=lambda e: (counts[e], e))


class CPUExperts:
    """One layer's CPU experts (in `cpu_order`) over their rows of `x` (`counts[e]` consecutive
    rows each): `out[rows]` = each row's expert output times its routing weight. `post` starts
    the native kernel's share on the kernel's own thread pool and returns (the caller dispatches
    the device's work meanwhile); `finish` waits for it and runs the rest (experts of more than
    `NATIVE_MAX_ROWS` rows, or all of them where nothing was posted) on this thread. `kernel`:
    the native kernel, or None (torch's)."""

    def __init__(
        self, store: ExpertStore, kernel, layer: int, experts, counts, x, scale, out, ready=None
    ) -> None:
        self.store, self.kernel, self.layer = store, kernel, layer
        self.experts, self.counts = list(experts), counts
        self.x, self.scale, self.out = x, scale, out
        plain = kernel if store.plain and not store.packed else None  # (bias-free SwiGLU only)
        self.native = [
            e for e in self.experts if plain is not None and counts[e] <= NATIVE_MAX_ROWS
        ]
        self.rows = sum(counts[e] for e in self.native)
        self.result: torch.Tensor | None = None  # the posted share's fp32 output
        self.pool_seconds = 0.0  # the posted share's time on the pool's own clock
        self.here_seconds = 0.0  # what `finish` computed on this thread
        self.ready = ready  # the rows' arrival on the host (a CUDA event), if still awaited

    @classmethod
    def on_host(cls, store: ExpertStore, kernel, layer: int, experts, counts, x, scale):
        """For rows `x` / `scale` on a device: queued to pinned host memory on the current
        stream first (before the device's parts, so they arrive without waiting for the
        copies); the output is pinned too."""
        if x.device.type != "cuda":
            out = torch.empty_like(x)
            return cls(store, kernel, layer, experts, counts, x, scale, out)
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (x, scale, x)]
        pinned[0].copy_(x, non_blocking=True)
        pinned[1].copy_(scale, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))
        return cls(store, kernel, layer, experts, counts, *pinned, ready)

    def post(self) -> bool:
        """Start the native share on the kernel's pool (False: there is no pool or no share)."""
        if not self.native or not getattr(self.kernel, "pooled", False):
            return False
        if self.ready is not None:  # (queued just after the sort: the device is idle otherwise)
            self.ready.synchronize()
            self.ready = None
        self.result = torch.empty(self.x[: self.rows].shape, dtype=torch.float32)
        try:
            self.kernel.start_rows(*self._native_args(self.result))
        except OSError:  # (no pool after all: `finish` runs it here)
            self.result = None
            return False
        return True

    def finish(self) -> None:
        """Wait for the posted share (if any), then compute whatever is left."""
        kernel, rows = self.kernel, self.rows
        if self.ready is not None:
            self.ready.synchronize()
        if self.result is not None:
            self.pool_seconds = kernel.finish()
            self.out[:rows].copy_(self.result)
        t0 = time.perf_counter()
        self._compute_rest()
        self.here_seconds = time.perf_counter() - t0

    def _compute_rest(self) -> None:
        store, kernel, rows = self.store, self.kernel, self.rows
        if store.packed and kernel is not None:  # (packed rows: their own kernel, all at once)
            kernel.run_rows(self.layer, self.experts, self.counts, self.x, self.scale, self.out)
            return
        if self.native and self.result is None:
            result = torch.empty(self.x[:rows].shape, dtype=torch.float32)
            kernel.run_rows(*self._native_args(result))
            self.out[:rows].copy_(result)
        rest = self.experts[len(self.native) :]
        if rest:
            x, scale, out = self.x[rows:], self.scale[rows:], self.out[rows:]
            _torch_rows(store, self.layer, rest, self.counts, x, scale, out)

    def _native_args(self, result: torch.Tensor) -> tuple:
        _, gate_up, down = self.store.expert_views(self.layer)
        rows = self.rows
        gu, dn = [gate_up[e] for e in self.native], [down[e] for e in self.native]
        weights = self.scale[:rows].float().contiguous()
        counts = [self.counts[e] for e in self.native]
        return gu, dn, counts, self.x[:rows].contiguous(), weights, result


def _torch_rows(store, layer, experts, counts, x, scale, out) -> None:
    """Experts through torch's `F.linear`, one after another."""
    _, gate_up, down = store.expert_views(layer)
    begin = 0
    for expert in experts:
        end = begin + counts[expert]
        bias = store.expert_biases(layer, expert, "cpu")
        weight = scale[begin:end].unsqueeze(1)
        act = store.act(F.linear(x[begin:end], gate_up[expert], bias[0] if bias else None))
        out[begin:end] = F.linear(act * weight, down[expert])
        if bias:
            out[begin:end] += weight * bias[1]
        begin = end
