"""Fewer kernels per decode step: linears that read the same input run as one matmul over one
weight whose row blocks the separate linears' weights become (views: no extra memory, and the
loader's names still address them), and what modules derive from their weights (fp32 casts,
exponentials) is computed once. A one-token decode step launches some 70 small kernels per
layer, so each launch saved counts; prefill runs the same fused forms.

`fuse(model)` runs once the model is loaded and placed (the engine does it). A fused module
fuses again after a move (`.to`, which gives each parameter its own storage), and a weight
written in place stays consistent (the views share the fused storage); a module never fused
runs its plain forms, which the tests compare the fused ones with.
"""

from __future__ import annotations

import torch
from torch import nn


class Fusable(nn.Module):
    """A module with a `fuse()` pass; `fused_now` tells whether it ran (and is kept through
    moves)."""

    fused_now = False

    def fuse(self) -> None:
        """Build the fused weights and derived constants (idempotent)."""
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if self.fused_now:
            _fuse_one(self)  # (the move gave each parameter its own storage: views again)
        return out


def fuse(model: nn.Module) -> None:
    """Fuse every `Fusable` module of `model` (see the module docstring)."""
    for module in model.modules():
        if isinstance(module, Fusable):
            _fuse_one(module)


def _fuse_one(module: Fusable) -> None:
    with torch.no_grad(), torch.inference_mode(False):
        module.fuse()
    module.fused_now = True


def row_blocks(linears: list[nn.Linear], current: torch.Tensor | None) -> torch.Tensor:
    """One `[sum of out_features, in_features]` weight whose consecutive row blocks the
    `linears`' weights are (made views of it here unless they already are: then `current` is
    returned as it is)."""
    if current is not None and _views_of(linears, current):
        return current
    weight = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        start += rows
    return weight


def _views_of(linears: list[nn.Linear], weight: torch.Tensor) -> bool:
    """Whether the linears' weights are the consecutive row blocks of `weight`, in order."""
    ptr, step = weight.data_ptr(), weight.stride(0) * weight.element_size()
    if weight.device != linears[0].weight.device:
        return False
    for m in linears:
        if m.weight.data_ptr() != ptr:
            return False
        ptr += m.weight.shape[0] * step
    return ptr == weight.data_ptr() + weight.shape[0] * step
