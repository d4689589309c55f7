"""Fewer kernels per decode step: linears that read the same input run as one matmul over one
weight whose row blocks the separate linears' weights are (views: no extra memory, and the
loader's names still address them), and what modules derive from their weights (fp32 casts,
exponentials) is computed once. A one-token decode step launches some 70 small kernels per
layer, so each launch saved counts; prefill runs the same fused forms.

`fuse_rows(model)` lays the weights out as row blocks when the model is allocated, before any
weight is loaded (`models.build_empty`: the separate blocks are freed before anything else
takes memory); `derive(model)` computes the constants once the weights are loaded (the engine
does both; the first is then a no-op). A module moved (`.to`, which gives each parameter its own
storage) lays its weights out and derives again; a weight written in place stays consistent
(the views share the fused storage), and the constants derived from it are computed again by
calling `derive(model)` again, which rewrites them in place (so that captured CUDA graphs read
the new values). A module whose weights are not laid out runs its plain forms, which the tests
compare the fused ones with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Fusable(nn.Module):
    """A module with fused forms: `fuse_rows` (idempotent) and `derive`."""

    rows_fused = False
    derived = False

    def fuse_rows(self) -> None:
        """Make the weights of the linears that share an input row blocks of one weight."""

    def derive(self) -> None:
        """Compute the constants the forward derives from weights (after they are loaded), each
        through `_keep`."""

    def _keep(self, name: str, value: torch.Tensor) -> None:
        """Set the derived constant `name`: written into the one there where it has the same
        layout (graphs captured on it read the new values), else set to a tensor of its own
        (never a view of a weight, which the write would change)."""
        current = getattr(self, name, None)
        same = isinstance(current, torch.Tensor) and current.shape == value.shape
        if same and current.dtype == value.dtype and current.device == value.device:
            current.copy_(value)
        else:
            setattr(self, name, value.clone())

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if self.rows_fused:  # (the move gave each parameter its own storage: views again)
            _fuse_one(self, self.derived)
        return out


def fuse_rows(model: nn.Module) -> None:
    """Lay out the row blocks of every `Fusable` module of `model`."""
    for module in model.modules():
        if isinstance(module, Fusable):
            _fuse_one(module, derive=False)


def derive(model: nn.Module) -> None:
    """Lay out the row blocks (where not yet done) and compute the derived constants of every
    `Fusable` module of `model` (after its weights are loaded)."""
    for module in model.modules():
        if isinstance(module, Fusable):
            _fuse_one(module, derive=True)


def _fuse_one(module: Fusable, derive: bool) -> None:
    with torch.no_grad(), torch.inference_mode(False):
        module.fuse_rows()
        module.rows_fused = True
        if derive:
            module.derive()
            module.derived = True


def row_blocks(
    linears: list[nn.Linear], current: torch.Tensor | None, name: str = "weight"
) -> torch.Tensor:
    """One `[sum of out_features, in_features]` weight whose consecutive row blocks the
    `linears`' weights are (made views of it here unless they already are: then `current` is
    returned as it is); `name="bias"`: the same for their biases (`[sum of out_features]`)."""
    if current is not None and _views_of(linears, current, name):
        return current
    weight = torch.cat([getattr(m, name).detach() for m in linears])
    start = 0
    for m in linears:
        rows = getattr(m, name).shape[0]
        setattr(m, name, nn.Parameter(weight[start : start + rows], requires_grad=False))
        start += rows
    return weight


def block_linears(
    x: torch.Tensor,
    linears: list[nn.Linear],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Each of `linears` applied to `x`: one matmul over their fused `weight` (and `bias`) from
    `row_blocks`, split back into their outputs, or each on its own where not laid out (None)."""
    if weight is None:
        return tuple(m(x) for m in linears)
    return F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1)


def _views_of(linears: list[nn.Linear], weight: torch.Tensor, name: str = "weight") -> bool:
    """Whether the linears' weights (or biases) are the consecutive row blocks of `weight`."""
    ptr, step = weight.data_ptr(), weight.stride(0) * weight.element_size()
    if weight.device != getattr(linears[0], name).device:
        return False
    for m in linears:
        if getattr(m, name).data_ptr() != ptr:
            return False
        ptr += getattr(m, name).shape[0] * step
    return ptr == weight.data_ptr() + weight.shape[0] * step
