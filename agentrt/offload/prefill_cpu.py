"""The CPU side of offloaded prefill: missing experts of a few tokens each, computed on the host
while the copies run. Rows come grouped by expert, in `cpu_order`; each row's output is its
expert's output times its routing weight. Experts of at most `NATIVE_MAX_ROWS` rows run in the
native kernel where there is one (`cpu_kernel.NativeExperts.run_rows`: each weight row read
once and dotted with four of the expert's rows at a time), the others through torch's
`F.linear`. Knows nothing of devices, plans or copies."""

from __future__ import annotations

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


def run_cpu_experts(store: ExpertStore, kernel, layer: int, experts, counts, x, scale, out):
    """`out[rows]` = weighted outputs of `experts` (of `layer`, in `cpu_order`) over their rows
    of `x` (`counts[e]` consecutive rows each); `kernel`: the native kernel, or None (torch's)."""
    if store.packed and kernel is not None:  # (packed rows: their own kernel)
        kernel.run_rows(layer, experts, counts, x, scale, out)
        return
    kernel = kernel if store.plain else None  # (it computes bias-free SwiGLU experts only)
    native = [e for e in experts if kernel is not None and counts[e] <= NATIVE_MAX_ROWS]
    split = sum(counts[e] for e in native)
    if native:
        _, gate_up, down = store.expert_views(layer)
        result = torch.empty(x[:split].shape, dtype=torch.float32)
        gu, dn = [gate_up[e] for e in native], [down[e] for e in native]
        weights = scale[:split].float().contiguous()
        kernel.run_rows(
            gu, dn, [counts[e] for e in native], x[:split].contiguous(), weights, result
        )
        out[:split].copy_(result)
    rest = list(experts[len(native) :])
    if rest:
        _torch_rows(store, layer, rest, counts, x[split:], scale[split:], out[split:])


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
