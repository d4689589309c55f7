"""A MoE layer's (token, expert) pairs laid out by expert for grouped GEMMs: the
routing counted per expert without a device sync, the sorted inputs and outputs, the grouped
GEMMs over them and the reference loop over experts, with expert biases where a model has them
(the inverse permutation is `models.moe.unsort`, shared with the resident path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrt.models.moe import PLAIN


@dataclass
class Sorted:
    x_sorted: torch.Tensor  # [Tk, H] inputs of the pairs, sorted by position
    scale: torch.Tensor  # [Tk] their routing weights
    out: torch.Tensor  # [Tk, H] their weighted outputs


def looped_ffn(x, gate_up, down, rows: list[int], scale, biases=None, act=PLAIN) -> torch.Tensor:
    """Reference path: each expert over its rows (`biases`: the experts' (gate_up `[n, 2I]`,
    down `[n, H]`) biases, in the same order, or None)."""
    out, begin = torch.empty_like(x), 0
    for i, count in enumerate(rows):
        end = begin + count
        if count:
            up_bias = biases[0][i] if biases is not None else None
            h = act(F.linear(x[begin:end], gate_up[i], up_bias)) * scale[begin:end]
            out[begin:end] = F.linear(h, down[i])
            if biases is not None:
                out[begin:end] += scale[begin:end] * biases[1][i]
        begin = end
    return out


def grouped_ffn(grouped, x, gate_up, down, offs, scale, act=PLAIN, biases=None):
    """Two grouped GEMMs (`grouped`: torch's) over rows sorted by expert (`offs`: their
    cumulative rows, on the device): gate/up (+ the experts' `biases`, repeated over their
    rows), the activation scaled by the routing weights, down (+ biases, scaled)."""
    h = grouped(x, gate_up.transpose(1, 2), offs=offs)
    if biases is None:
        gate, up = h.chunk(2, dim=-1)
        hidden = F.silu(gate).mul_(up) if act == PLAIN else act(h)
        return grouped(hidden.mul_(scale), down.transpose(1, 2), offs=offs)
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()  # (no host round trip)
    up_bias, down_bias = (
        b.repeat_interleave(counts, dim=0, output_size=x.shape[0]) for b in biases
    )
    hidden = act(h + up_bias).mul_(scale)
    return grouped(hidden, down.transpose(1, 2), offs=offs) + down_bias * scale


def part_biases(store, layer: int, index: torch.Tensor):
    """The biases of the experts `index` (on the device) of `layer`, in that order (None: no
    biases)."""
    both = store.biases(layer, index.device)
    if both is None:
        return None
    return both[0].index_select(0, index), both[1].index_select(0, index)


def bincount(ids: torch.Tensor, num: int) -> torch.Tensor:
    """Pairs per expert, without the device sync of `torch.bincount` (which reads the largest
    id back to size its output): the layer's one sync stays where it is counted."""
    counts = torch.zeros(num, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))
