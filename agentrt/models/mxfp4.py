"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints store them: `blocks [..., G, 16]`
uint8, two E2M1 values per byte (low nibble first), and `scales [..., G]` uint8, one E8M0
power-of-two exponent (bias 127) per block of 32 values. `dequantize` expands them into a dense
tensor `[..., G * 32]`; `quantize` is its inverse for values on the FP4 grid (synthetic weights and
tests). Plain torch, any device.
"""

from __future__ import annotations

import math

import torch

from agentrt.errors import ModelFormatError

BLOCK = 32  # values per scale
# E2M1 code -> value (sign bit 3)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = FP4_VALUES + tuple(-v for v in FP4_VALUES)


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rows_per_step: int = 1 << 16
) -> torch.Tensor:
    """`[..., G, 16]` packed codes and `[..., G]` exponents -> `[..., G * 32]` in `dtype`
    (worked through in steps of `rows_per_step` blocks, so the temporaries stay small)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelFormatError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelFormatError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    *prefix, groups, half = blocks.shape
    flat_blocks = blocks.reshape(-1, half)
    flat_scales = scales.reshape(-1).to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(flat_blocks.shape[0], BLOCK, dtype=dtype, device=blocks.device)
    for begin in range(0, flat_blocks.shape[0], rows_per_step):
        end = begin + rows_per_step
        codes = flat_blocks[begin:end]
        values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)
        values = torch.ldexp(values.reshape(codes.shape[0], BLOCK), flat_scales[begin:end, None])
        out[begin:end] = values.to(dtype)
    return out.reshape(*prefix, groups * BLOCK)


def exponent_for(std: float) -> int:
    """The biased exponent that gives uniformly random codes a spread of about `std` (the
    synthetic models' MXFP4 experts)."""
    rms = math.sqrt(sum(v * v for v in FP4_VALUES) / len(FP4_VALUES))
    return 127 + round(math.log2(std / rms))


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., N]` (N a multiple of 32) -> (blocks `[..., N/32, 16]`, scales `[..., N/32]`): each
    block scaled by the power of two that brings its largest magnitude to at most 6, each value
    rounded to the nearest FP4 code. Exact for values that are FP4 codes times one power of two
    per block; otherwise the usual MXFP4 rounding."""
    if values.shape[-1] % BLOCK:
        raise ValueError(f"the last dimension ({values.shape[-1]}) must be a multiple of {BLOCK}")
    v = values.float().reshape(-1, BLOCK)
    peak = v.abs().amax(dim=1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = v / torch.exp2(exponent)[:, None]
    grid = torch.tensor(FP4_VALUES[:8], device=values.device)
    magnitude = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    shape = values.shape[:-1]
    groups = values.shape[-1] // BLOCK
    scales = (exponent + 127).to(torch.uint8).reshape(*shape, groups)
    return packed.reshape(*shape, groups, BLOCK // 2), scales
