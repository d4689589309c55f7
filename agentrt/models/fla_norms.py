"""fla's fused norm kernels for the layers that use the `fla` backend: RMS norm (gated or not)
and the L2 norm of q and k, each in one kernel. Head-sized rows go to fla's tile kernels
directly, with two size classes where fla's wrappers pass a new autotuning key for nearly
every prompt length (each one a compilation and tuning inside the first request that long).
"""

from __future__ import annotations

import contextlib
import functools

import torch


def on_device_of(x: torch.Tensor):
    """The CUDA device of `x` made current (nothing for CPU tensors: Triton's interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@functools.cache
def _fla_norms():
    """fla's norm wrappers (row kernels, above 512 channels) and tile kernels (up to 512)."""
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd, layer_norm_gated_fwd_kernel
    from fla.modules.norm.layernorm import layer_norm_fwd, layer_norm_fwd_kernel

    return layer_norm_fwd, layer_norm_gated_fwd, layer_norm_fwd_kernel, layer_norm_gated_fwd_kernel


def _size_class(rows: int, per_class: int) -> int:
    """The `NB` argument of fla's tile norm kernels. Its wrappers pass cdiv(rows, per_class),
    which the kernels do not use except as an autotuning key: every new value meant a new
    compilation and tuning of nine configurations, i.e. one for nearly every new prompt length
    (a q norm has 16 rows per token, 2048 rows per value). Two classes instead."""
    return 1 if rows <= per_class else 2


def _fla_tile_norm(kernel, rows, gates, scale, eps: float, per_class: int) -> torch.Tensor:
    """One of fla's tile norm kernels (rows of up to 512 channels) on `[T, D]` rows."""
    args = dict(w=scale, b=None, mean=None, eps=eps, IS_RMS_NORM=True)
    if gates is None:
        args |= dict(res=None, res_out=None, G=1, HAS_RESIDUAL=False, STORE_RESIDUAL_OUT=False)
        args |= dict(HAS_WEIGHT=True, HAS_BIAS=False)
    else:  # (this kernel derives the HAS_* flags from the arguments)
        args |= dict(g=gates, residual=None, residual_out=None, ACTIVATION="swish")
    return _launch_tile(kernel, rows, per_class, **args)


def _launch_tile(kernel, rows: torch.Tensor, per_class: int, **args) -> torch.Tensor:
    """A row-tile kernel of fla's norms on `[T, D]` rows (one program per `BT` rows) with its
    size class from `_size_class`; returns the output rows (the per-row statistics, which
    only fla's backward pass reads, are dropped)."""
    import triton

    count, dim = rows.shape
    y, rstd = torch.empty_like(rows), torch.empty(count, dtype=torch.float, device=rows.device)
    kernel[lambda meta: (triton.cdiv(count, meta["BT"]),)](
        x=rows,
        y=y,
        rstd=rstd,
        T=count,
        D=dim,
        BD=triton.next_power_of_2(dim),
        NB=_size_class(count, per_class),
        **args,
    )
    return y


def fla_rms_norm(
    x: torch.Tensor, scale: torch.Tensor, eps: float, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """`rmsnorm(x) * scale` (times `silu(gate)` when given) in one fla kernel (fp32 inside, one
    rounding to x's dtype), where the torch path takes five to eight; `scale` is fp32."""
    plain, gated, plain_tile, gated_tile = _fla_norms()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    gates = None if gate is None else gate.reshape(-1, gate.shape[-1]).contiguous()
    with on_device_of(x):
        if rows.shape[1] <= 512:  # fla's own classes: 2048 rows, 2048 * 32 gated
            tile, per_class = (plain_tile, 2048) if gate is None else (gated_tile, 65536)
            return _fla_tile_norm(tile, rows, gates, scale, eps, per_class).view(x.shape)
        if gate is None:
            y, _, _, _ = plain(rows, scale, None, eps=eps, is_rms_norm=True)
        else:
            y, _, _, _ = gated(rows, gates, scale, None, "swish", eps=eps, is_rms_norm=True)
    return y.view(x.shape)


def fla_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's L2 norm of `x`'s last dimension, as its `l2norm_fwd` computes it (the kernel fla's
    chunked rule runs on q and k), with the size class capped at two: the wrapper passes
    cdiv(rows, 65536), a compile-time argument and autotuning key the kernel does not otherwise
    use, so every 4096 tokens of a 16-head prompt meant a new compilation and tuning (10 s on
    an H200) inside the first request that long. Rows over 512 wide go to fla's wrapper."""
    l2norm_fwd, kernel = fla_l2norm_ops()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    with on_device_of(x):
        if rows.shape[1] > 512:
            return l2norm_fwd(x, eps)[0]
        return _launch_tile(kernel, rows, 65536, eps=eps).view(x.shape)


@functools.cache
def fla_l2norm_ops():
    from fla.modules.norm.l2norm import l2norm_fwd, l2norm_fwd_kernel

    return l2norm_fwd, l2norm_fwd_kernel
