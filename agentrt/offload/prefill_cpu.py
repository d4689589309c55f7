"""The CPU side of offloaded prefill: missing experts of a few tokens each, computed on the host
while the copies run. Rows come grouped by expert, in the order of the experts given; each row's
output is its expert's output times its routing weight. Experts of at most `NATIVE_MAX_ROWS`
rows run in the native kernel where there is one (`cpu_kernel.NativeExperts.run_rows`: each
weight row read once for all of the expert's rows), the others through torch's `F.linear`.
Knows nothing of devices, plans or copies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentrt.offload.store import ExpertStore

# on the 2-core dev machine the native kernel took 0.20-0.26 ms per expert of 1-4 rows against
# torch's 0.45-0.53, the same at 8, and more above (bound by memory for few rows, by arithmetic
# for many)
NATIVE_MAX_ROWS = 8


def run_cpu_experts(store: ExpertStore, kernel, layer: int, experts, counts, x, scale, out):
    """`out[rows]` = weighted outputs of `experts` (of `layer`) over their rows of `x`
    (`counts[e]` consecutive rows each); `kernel`: the native kernel, or None (torch's)."""
    begin = 0
    for group, native in _groups(kernel, experts, counts):
        end = begin + sum(counts[e] for e in group)
        run = _native_rows if native else _torch_rows
        run(store, kernel, layer, group, counts, x[begin:end], scale[begin:end], out[begin:end])
        begin = end


def _groups(kernel, experts, counts) -> list[tuple[list[int], bool]]:
    """Runs of consecutive experts for one kernel each: native for few rows, else torch's."""
    groups: list[tuple[list[int], bool]] = []
    for expert in experts:
        native = kernel is not None and counts[expert] <= NATIVE_MAX_ROWS
        if groups and groups[-1][1] == native:
            groups[-1][0].append(expert)
        else:
            groups.append(([expert], native))
    return groups


def _native_rows(store, kernel, layer, experts, counts, x, scale, out) -> None:
    """Experts of few rows each through the native kernel, in one call."""
    _, gate_up, down = store.expert_views(layer)
    result = torch.empty(x.shape, dtype=torch.float32)
    rows = [counts[e] for e in experts]
    gu, dn = [gate_up[e] for e in experts], [down[e] for e in experts]
    kernel.run_rows(gu, dn, rows, x.contiguous(), scale.float().contiguous(), result)
    out.copy_(result)


def _torch_rows(store, kernel, layer, experts, counts, x, scale, out) -> None:
    """Experts through torch's `F.linear`, one after another."""
    _, gate_up, down = store.expert_views(layer)
    begin = 0
    for expert in experts:
        end = begin + counts[expert]
        gate, up = F.linear(x[begin:end], gate_up[expert]).chunk(2, dim=-1)
        act = F.silu(gate) * up * scale[begin:end].unsqueeze(1)
        out[begin:end] = F.linear(act, down[expert])
        begin = end
