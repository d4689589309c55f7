"""Expert compute over packed MXFP4 rows (device slots or a staging buffer; layout
`mxfp4_rows.RowLayout`), for an `ExpertStore` kept packed: a decode token's experts and a
prefill part's, with the store's biases and activation, as the unpacked paths compute them
(gate/up, activation in the activations' dtype, down; products accumulated in fp32). Triton
kernels on CUDA; elsewhere the plain-torch references (dequantize, then multiply). On CUDA a
decode token's activation is fused into the down product's reads, which round its inputs and
output to the activations' dtype once (fp32 between) where torch's ops round after each op:
within about one step of that dtype of the other paths."""

from __future__ import annotations

import torch

from agentrt.models.moe import unsort
from agentrt.offload.mxfp4_rows import (
    Part,
    grouped,
    grouped_reference,
    matvec,
    matvec_reference,
)
from agentrt.offload.pairs import bincount
from agentrt.offload.store import ExpertStore


def _matvec(
    rows, slots: torch.Tensor, part: Part, x: torch.Tensor, bias=None, act=None, scale=None
):
    if rows.is_cuda:
        return matvec(rows, slots, part, x, bias, act, scale=scale)
    return matvec_reference(rows, slots, part, x, bias, act, scale)


def _grouped(rows: torch.Tensor, counts: list[int], part: Part, x: torch.Tensor, tiles=None):
    slots = list(range(len(counts)))
    if not rows.is_cuda:
        return grouped_reference(rows, slots, counts, part, x)
    return grouped(rows, slots, counts, part, x, tiles=tiles)


def token_experts(
    store: ExpertStore, layer: int, rows: torch.Tensor, slots: torch.Tensor, x, ids, weights=None
) -> torch.Tensor:
    """One token's experts: `x [1, H]` through the experts in `rows[slots]` (`slots [k]`, on the
    device; `ids [k]` their expert ids, for the biases) -> `[k, H]` in x's dtype, unweighted;
    with `weights [k]` (fp32), each output in x's dtype times its weight, as fp32 (0 under a
    weight of 0: `mxfp4_rows.weighted`), in the down product's kernel on CUDA."""
    layout, biases = store.layout, store.biases(layer, x.device)
    up_bias, down_bias = ((b, ids) for b in biases) if biases is not None else (None, None)
    h = _matvec(rows, slots, layout.gate_up, x[0], up_bias)  # [k, 2I] fp32
    # (the activation in x's dtype, fused into the down product's reads)
    act = (store.act, x.dtype)
    if weights is not None:
        return _matvec(rows, slots, layout.down, h, down_bias, act, (weights, x.dtype))
    y = _matvec(rows, slots, layout.down, h, down_bias, act)  # [k, H] fp32
    return y.to(x.dtype)


def part_ffn(
    store: ExpertStore, buf: torch.Tensor, counts: list[int], x, scale, biases=None, tables=None
) -> torch.Tensor:
    """A prefill part's experts, `buf[i]` with `counts[i]` consecutive rows of `x [T, H]` each:
    gate/up (+ biases), the activation times the routing weights `scale [T, 1]`, down (+
    biases, scaled) -> `[T, H]` in x's dtype (as `pairs.grouped_ffn` computes unpacked).
    `tables`: the part's `uploads.PartTables` (on the device already), or None."""
    layout = store.layout
    tiles = tables.tiles if tables is not None else None
    h = _grouped(buf, counts, layout.gate_up, x, tiles)  # [T, 2I] fp32
    if biases is not None:  # (each row's expert from the host's counts: no device sync)
        owner = _owners(counts, x.device, tables)
        up_bias, down_bias = (b.index_select(0, owner) for b in biases)
        h = h + up_bias
    hidden = store.act(h.to(x.dtype)) * scale
    y = _grouped(buf, counts, layout.down, hidden, tiles)  # [T, H] fp32
    if biases is not None:
        y = y + down_bias * scale
    return y.to(x.dtype)


def _owners(counts: list[int], device: torch.device, tables=None) -> torch.Tensor:
    """Each row's position in the part (`counts[i]` rows of each), on `device` (from the
    tables' rows per expert where given: no transfer)."""
    if tables is not None:
        index = torch.arange(len(counts), device=device)
        return torch.repeat_interleave(index, tables.counts, output_size=sum(counts))
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    if device.type == "cuda":
        owner = owner.pin_memory().to(device, non_blocking=True)
    return owner


def resident_ffn(store: ExpertStore, layer: int, block: torch.Tensor, x, ids, weights):
    """A layer whose experts all sit in `block` (in expert order, the baselines' resident
    layers) over a chunk: `x [T, H]`, `ids`/`weights` `[T, k]` -> `[T, H]` (one sync: the
    tokens per expert)."""
    top_k, flat = ids.shape[1], ids.reshape(-1)
    counts = bincount(flat, store.num_experts).tolist()
    order = torch.argsort(flat, stable=True)
    scale = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
    biases = store.biases(layer, x.device)
    ys = part_ffn(store, block, counts, x.index_select(0, order // top_k), scale, biases)
    return unsort(ys, order, top_k).sum(1)
