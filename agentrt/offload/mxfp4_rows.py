"""Packed MXFP4 expert rows: the layout one expert takes when its weights stay MXFP4 (17/32 of a
byte per weight against 2 in bf16), the rows' plain-torch dequantization (the reference), and a
Triton matvec over selected rows (a decode token's experts, `mxfp4_triton`) checked against
it.

One expert with gate_up `[2I, H]` and down `[H, I]` is one uint8 row: gate_up's codes
`[2I, H/2]`, its exponents `[2I, H/32]`, down's codes `[H, I/2]`, its exponents `[H, I/32]`
(codes and exponents as `agentrt.models.mxfp4` reads them from gpt-oss checkpoints). Nothing in
the engine keeps experts packed yet: the host store, the expert cache and the kernels that read
them still take bf16 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.models.mxfp4 import BLOCK, dequantize, quantize


@dataclass(frozen=True)
class Part:
    """One matrix `[rows, cols]` of a packed expert row: its codes at byte `codes`, its
    exponents at byte `scales`."""

    rows: int
    cols: int
    codes: int
    scales: int

    @property
    def groups(self) -> int:
        return self.cols // BLOCK

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols // 2 + self.rows * self.groups


@dataclass(frozen=True)
class RowLayout:
    """Where gate_up and down sit in a packed expert row of `hidden` H and `inter` I."""

    hidden: int
    inter: int

    def __post_init__(self) -> None:
        if self.hidden % BLOCK or self.inter % BLOCK:
            raise ValueError(f"MXFP4 rows need H and I multiples of {BLOCK}")

    @property
    def gate_up(self) -> Part:
        rows, cols = 2 * self.inter, self.hidden
        return Part(rows, cols, 0, rows * cols // 2)

    @property
    def down(self) -> Part:
        start = self.gate_up.nbytes
        rows, cols = self.hidden, self.inter
        return Part(rows, cols, start, start + rows * cols // 2)

    @property
    def row_bytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def pack_row(layout: RowLayout, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's `[2I, H]` and `[H, I]` weights as a packed row (MXFP4 rounding)."""
    out = torch.empty(layout.row_bytes, dtype=torch.uint8, device=gate_up.device)
    for part, weight in ((layout.gate_up, gate_up), (layout.down, down)):
        codes, scales = quantize(weight)
        out[part.codes : part.scales] = codes.reshape(-1)
        out[part.scales : part.scales + part.rows * part.groups] = scales.reshape(-1)
    return out


def unpack(rows: torch.Tensor, part: Part, dtype: torch.dtype) -> torch.Tensor:
    """`[n, row_bytes]` packed rows -> that matrix of each, `[n, rows, cols]` in `dtype`."""
    n = rows.shape[0]
    codes = rows[:, part.codes : part.scales].reshape(n, part.rows, part.groups, BLOCK // 2)
    scales = rows[:, part.scales : part.scales + part.rows * part.groups]
    return dequantize(codes, scales.reshape(n, part.rows, part.groups), dtype)


def matvec_reference(
    rows: torch.Tensor, slots: torch.Tensor, part: Part, x: torch.Tensor
) -> torch.Tensor:
    """`out[i] = W(rows[slots[i]]) @ x[i]` in fp32 (`x [k, cols]`, or `[cols]` for all)."""
    weights = unpack(rows.index_select(0, slots), part, torch.float32)
    x = x.float().expand(slots.shape[0], part.cols)
    return torch.bmm(weights, x.unsqueeze(2)).squeeze(2)


def matvec(rows: torch.Tensor, slots: torch.Tensor, part: Part, x: torch.Tensor) -> torch.Tensor:
    """`matvec_reference` through the Triton kernel (CUDA, or Triton's interpreter): each
    program decodes a tile of codes and exponents of one selected row straight from the packed
    bytes and dots it with x; fp32 accumulation."""
    import triton

    from agentrt.offload.mxfp4_triton import matvec_kernel

    k = slots.shape[0]
    x = x.float().expand(k, part.cols).contiguous()
    out = torch.empty(k, part.rows, dtype=torch.float32, device=rows.device)
    block_n, block_b = 32, 64  # output rows, code bytes (128 weights, 4 exponents) per step
    grid = (k, triton.cdiv(part.rows, block_n))
    matvec_kernel[grid](
        rows,
        slots,
        x,
        out,
        rows.stride(0),
        part.codes,
        part.scales,
        part.rows,
        part.cols // 2,
        part.groups,
        BLOCK_N=block_n,
        BLOCK_B=block_b,
    )
    return out
