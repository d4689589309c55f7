"""A MoE layer's (token, expert) pairs laid out by expert for grouped GEMMs: the
routing counted per expert without a device sync, the sorted inputs and outputs, the reference
loop over experts (the inverse permutation is `models.moe.unsort`, shared with the resident
path)."""

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


def bincount(ids: torch.Tensor, num: int) -> torch.Tensor:
    """Pairs per expert, without the device sync of `torch.bincount` (which reads the largest
    id back to size its output): the layer's one sync stays where it is counted."""
    counts = torch.zeros(num, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))
