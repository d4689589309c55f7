"""Packed MXFP4 expert rows: the layout one expert takes when its weights stay MXFP4 (17/32 of a
byte per weight against 2 in bf16), the rows' plain-torch dequantization and products (the
references), and the same products through Triton kernels (`mxfp4_triton`): a matvec over
selected rows (a decode token's experts) and a grouped matmul over runs of tokens per expert (a
prefill chunk's).

One expert with gate_up `[2I, H]` and down `[H, I]` is one uint8 row: gate_up's codes
`[2I, H/2]`, its exponents `[2I, H/32]`, down's codes `[H, I/2]`, its exponents `[H, I/32]`
(codes and exponents as `agentrt.models.mxfp4` reads them from gpt-oss checkpoints). A packed
`ExpertStore` holds its experts as such rows; `packed.py` computes them in the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrt.env import setting
from agentrt.errors import InvalidArgumentError
from agentrt.models.mxfp4 import BLOCK, dequantize, exponent_for, quantize


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
            raise InvalidArgumentError(
                f"MXFP4-packed experts need hidden and expert sizes that are multiples of "
                f"{BLOCK}; this model has {self.hidden} and {self.inter}"
            )

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
    out = torch.empty(1, layout.row_bytes, dtype=torch.uint8, device=gate_up.device)
    for part, weight in ((layout.gate_up, gate_up), (layout.down, down)):
        write_part(out, part, *quantize(weight))
    return out[0]


def write_part(rows: torch.Tensor, part: Part, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Matrix `part` of each of `rows [n, row_bytes]` from its codes (`[n, rows, G, 16]` or the
    same bytes in any shape) and exponents (`[n, rows, G]`)."""
    n = rows.shape[0]
    rows[:, part.codes : part.scales] = codes.reshape(n, -1)
    rows[:, part.scales : part.scales + part.rows * part.groups] = scales.reshape(n, -1)


def read_part(rows: torch.Tensor, part: Part) -> tuple[torch.Tensor, torch.Tensor]:
    """Matrix `part` of each of `rows [n, row_bytes]`: its codes `[n, rows, G, 16]` and
    exponents `[n, rows, G]` (views; `write_part`'s inverse)."""
    n = rows.shape[0]
    codes = rows[:, part.codes : part.scales].reshape(n, part.rows, part.groups, BLOCK // 2)
    scales = rows[:, part.scales : part.scales + part.rows * part.groups]
    return codes, scales.reshape(n, part.rows, part.groups)


def unpack(rows: torch.Tensor, part: Part, dtype: torch.dtype) -> torch.Tensor:
    """`[n, row_bytes]` packed rows -> that matrix of each, `[n, rows, cols]` in `dtype`."""
    return dequantize(*read_part(rows, part), dtype)


def synthetic_rows(
    layout: RowLayout, experts: int, layer: int, seed: int, std: float, device
) -> torch.Tensor:
    """A synthetic model's `layer` as packed rows `[experts, row_bytes]` drawn on `device`:
    uniformly random FP4 codes (seeded per layer) under one exponent that gives the weights
    about `std` (the same values wherever a generator on that kind of device draws them)."""
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + layer) & (2**64 - 1))
    shape = (experts, layout.row_bytes)
    rows = torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)
    exponent = exponent_for(std)
    for part in (layout.gate_up, layout.down):
        rows[:, part.scales : part.scales + part.rows * part.groups] = exponent
    return rows


def matvec_reference(
    rows: torch.Tensor,
    slots: torch.Tensor,
    part: Part,
    x: torch.Tensor,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    act: tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype] | None = None,
    scale: tuple[torch.Tensor, torch.dtype] | None = None,
) -> torch.Tensor:
    """`out[i] = W(rows[slots[i]]) @ x[i]` in fp32 (`x [k, cols]`, or `[cols]` for all), plus
    `bias[0][bias[1][i]]` where `bias` (a `[E, rows]` table, the experts' ids `[k]`) is given.
    `act` (an expert's activation, a dtype): x holds `[k, 2 cols]` gate and up halves, and the
    product reads `activation(x in dtype)`. `scale` (fp32 weights `[k]`, a dtype): each
    `out[i]` rounded to that dtype, then times its weight (fp32; 0 where the weight is 0)."""
    if act is not None:
        x = act[0](x.to(act[1]))
    weights = unpack(rows.index_select(0, slots), part, torch.float32)
    x = x.float().expand(slots.shape[0], part.cols)
    out = torch.bmm(weights, x.unsqueeze(2)).squeeze(2)
    if bias is not None:
        out = out + bias[0].index_select(0, bias[1])
    return out if scale is None else weighted(out.to(scale[1]), scale[0])


def weighted(ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`ys [k, n]` times their `weights [k]` (fp32), 0 under a weight of 0: a slot read under
    weight 0 may hold inf (fp16), and inf * 0 is nan."""
    w = weights.float().unsqueeze(1)
    return torch.where(w != 0, ys * w, 0.0)


# how the matvec kernel rounds a fused activation's inputs and output (`mxfp4_triton.rounded`)
ROUNDING = {torch.bfloat16: 1, torch.float16: 2}
# the matvec kernel's tile: output rows, code bytes per step (2x weights), warps (the fastest
# of `benchmarks/bench_mxfp4_matvec.py`'s sweep on an H100, 124 us a gpt-oss-120b layer)
MATVEC_TILE = (8, 128, 4)


def matvec(
    rows: torch.Tensor,
    slots: torch.Tensor,
    part: Part,
    x: torch.Tensor,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    act: tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype] | None = None,
    tile: tuple[int, ...] = MATVEC_TILE,
    scale: tuple[torch.Tensor, torch.dtype] | None = None,
) -> torch.Tensor:
    """`matvec_reference` through the Triton kernel (CUDA, or Triton's interpreter): each
    program decodes tiles of codes and exponents of one selected row straight from the packed
    bytes and dots them with x, fp32 accumulation, and adds its bias row; an `act` (a
    `moe.SwiGLU`: its `limit` and `alpha` are read) is applied to x as it is read. `tile`:
    (output rows, code bytes per step, warps), powers of two, bytes a multiple of 16, and
    optionally a fourth value, 1: products reduced each step (fewer registers a program).
    `scale`: as `matvec_reference`'s, in the kernel."""
    import triton

    from agentrt.offload.mxfp4_triton import matvec_kernel

    limit, alpha = (act[0].limit, act[0].alpha) if act is not None else (0.0, 1.0)
    k = slots.shape[0]
    block_n, block_b, warps, *reduce = tile
    if len(reduce) > 1 or reduce not in ([], [0], [1]):
        raise ValueError(f"matvec: tile {tile} is (rows, bytes, warps[, 0 or 1])")
    width = 2 * part.cols if act is not None else part.cols
    if x.shape[-1] != width or (x.dim() > 1 and x.shape[0] != k) or block_b % 16:
        raise ValueError(f"matvec: x {tuple(x.shape)} for {k} rows of {width}, tile {tile}")
    x = x.contiguous()  # ([cols]: one x, read by every row, in its dtype)
    out = torch.empty(k, part.rows, dtype=torch.float32, device=rows.device)
    grid = (k, triton.cdiv(part.rows, block_n))
    matvec_kernel[grid](
        rows,
        slots,
        x,
        out,
        bias[0].contiguous() if bias is not None else out,
        bias[1].contiguous() if bias is not None else slots,
        scale[0].float().contiguous() if scale is not None else out,
        rows.stride(0),
        x.shape[-1] if x.dim() > 1 else 0,
        part.codes,
        part.scales,
        part.rows,
        part.cols // 2,
        part.groups,
        BLOCK_N=block_n,
        BLOCK_B=block_b,
        HAS_BIAS=bias is not None,
        ACT=act is not None,
        LIMIT=float(limit),
        ALPHA=float(alpha),
        ROUND=ROUNDING.get(act[1], 0) if act is not None else 0,
        REDUCE=reduce == [1],
        SCALE=scale is not None,
        OUT_ROUND=ROUNDING.get(scale[1], 0) if scale is not None else 0,
        num_warps=warps,
    )
    return out


def grouped_reference(
    rows: torch.Tensor, slots: list[int], counts: list[int], part: Part, x: torch.Tensor
) -> torch.Tensor:
    """A prefill chunk's experts: `x [T, cols]` holds the tokens of expert `slots[g]` in
    consecutive runs of `counts[g]` rows; `out [T, rows]` (fp32) = each run times its expert's
    weights, dequantized to x's dtype (as the grouped kernel rounds them)."""
    out, begin = torch.empty(x.shape[0], part.rows, dtype=torch.float32, device=x.device), 0
    for slot, count in zip(slots, counts, strict=True):
        weight = unpack(rows[slot : slot + 1], part, x.dtype)[0]
        out[begin : begin + count] = (x[begin : begin + count] @ weight.T).float()
        begin += count
    return out


# the grouped kernel's tile: tokens, output rows, code bytes per step (2x weights), warps. On
# the H200, gpt-oss-120b experts, an 8K-token chunk's runs: 13.3 ms for gate_up and down against
# 22.8 ms at (64, 128, 64, 8) and 30.4 at (32, 128, 64, 4) (benchmarks/bench_mxfp4_grouped.py)
GROUPED_TILE = (128, 256, 64, 8)
# fp32 activations take twice the shared memory per step: 256 KiB at GROUPED_TILE, over sm_90's
# 227 KiB (Triton refuses to launch it); half the bytes per step take 128 KiB
GROUPED_TILE_FP32 = (128, 256, 32, 8)


def grouped_tile(dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int]:
    """The tile for activations of `dtype` (`GROUPED_TILE`; `GROUPED_TILE_FP32` for 4-byte ones),
    or `AGENTRT_MXFP4_TILE` ("M,N,B,warps", for benchmarks comparing tiles)."""
    text = setting("MXFP4_TILE")
    if not text:
        return GROUPED_TILE_FP32 if dtype.itemsize > 2 else GROUPED_TILE
    try:
        m, n, b, warps = (int(v) for v in text.split(","))
    except ValueError:
        raise InvalidArgumentError(
            f"AGENTRT_MXFP4_TILE must be M,N,B,warps, got {text!r}"
        ) from None
    if min(m, n) < 16 or b < 16 or b % 16 or any(v & (v - 1) for v in (m, n, b, warps)):
        raise InvalidArgumentError(f"AGENTRT_MXFP4_TILE {text!r}: powers of two, M, N, B >= 16")
    return m, n, b, warps


def tile_table(slots: list[int], counts: list[int], block_m: int) -> list[int]:
    """The grouped kernel's tiles for runs of `counts` rows (in order) of the experts in
    `slots`: each tile's slot, first row and its run's end row, as one list (slots, then
    starts, then ends)."""
    tile_slot, tile_start, tile_end, begin = [], [], [], 0
    for slot, count in zip(slots, counts, strict=True):
        for start in range(begin, begin + count, block_m):
            tile_slot.append(slot)
            tile_start.append(start)
            tile_end.append(begin + count)
        begin += count
    return tile_slot + tile_start + tile_end


def grouped(
    rows: torch.Tensor,
    slots: list[int],
    counts: list[int],
    part: Part,
    x: torch.Tensor,
    tile: tuple[int, int, int, int] | None = None,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """`grouped_reference` through the Triton kernel: one program per tile of M tokens of one
    expert and N outputs; it decodes the expert's codes B bytes at a time into x's dtype and
    multiplies with fp32 accumulation (`counts` come from the host: a prefill's plan has them;
    `tile`: (M, N, B, warps), default `grouped_tile(x.dtype)`; `tiles`: their `tile_table` as
    `[3, n]` on the device already, else it is built and copied here)."""
    import triton

    from agentrt.offload.mxfp4_triton import grouped_kernel

    block_m, block_n, block_b, warps = tile or grouped_tile(x.dtype)
    out = torch.empty(x.shape[0], part.rows, dtype=torch.float32, device=x.device)
    if tiles is None:
        table = tile_table(slots, counts, block_m)
        tiles = torch.tensor(table, dtype=torch.int64).view(3, -1)
        if x.is_cuda:  # (from pinned memory: the copy does not hold the host up)
            tiles = tiles.pin_memory().to(x.device, non_blocking=True)
    n_tiles = tiles.shape[1]
    if not n_tiles:
        return out
    grid = (n_tiles, triton.cdiv(part.rows, block_n))
    grouped_kernel[grid](
        rows,
        tiles,
        x.contiguous(),
        out,
        rows.stride(0),
        part.codes,
        part.scales,
        n_tiles,
        part.rows,
        part.cols // 2,
        part.groups,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_B=block_b,
        # (fp32 activations: full fp32 products, not TF32 - the reference's precision)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps,
    )
    return out
