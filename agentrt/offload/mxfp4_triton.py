"""Triton kernels over packed MXFP4 expert rows (layout: `mxfp4_rows`); imported only where
Triton is (CUDA, or Triton's interpreter)."""

import triton
import triton.language as tl


@triton.jit
def fp4(code):
    """E2M1 code (sign in bit 3) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32))
    value = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def decoded(row, codes_at, scales_at, n, b, n_rows, n_bytes, n_groups):
    """The weights of bytes `b` of output rows `n` (fp32, scaled): (low nibbles, high nibbles)."""
    mask = (n[:, None] < n_rows) & (b[None, :] < n_bytes)
    code = tl.load(row + codes_at + n[:, None] * n_bytes + b[None, :], mask=mask, other=0)
    code = code.to(tl.int32)
    scale = tl.load(
        row + scales_at + n[:, None] * n_groups + b[None, :] // 16, mask=mask, other=127
    )
    power = tl.exp2(scale.to(tl.float32) - 127.0)
    return fp4(code & 15) * power, fp4(code >> 4) * power


@triton.jit
def matvec_kernel(
    rows_ptr,
    slots_ptr,
    x_ptr,
    out_ptr,
    row_stride,
    codes_at,
    scales_at,
    n_rows: tl.constexpr,  # (the model's shapes: one compilation per matrix)
    n_bytes: tl.constexpr,
    n_groups: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    i = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = rows_ptr + tl.load(slots_ptr + i).to(tl.int64) * row_stride
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for b0 in range(0, n_bytes, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        w_lo, w_hi = decoded(row, codes_at, scales_at, n, b, n_rows, n_bytes, n_groups)
        x_lo = tl.load(x_ptr + i * 2 * n_bytes + 2 * b, mask=b < n_bytes, other=0.0)
        x_hi = tl.load(x_ptr + i * 2 * n_bytes + 2 * b + 1, mask=b < n_bytes, other=0.0)
        acc += tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], axis=1)
    tl.store(out_ptr + i * n_rows + n, acc, mask=n < n_rows)


@triton.jit
def grouped_kernel(
    rows_ptr,
    tiles_ptr,
    x_ptr,
    out_ptr,
    row_stride,
    codes_at,
    scales_at,
    n_tiles,
    n_rows: tl.constexpr,
    n_bytes: tl.constexpr,
    n_groups: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(tiles_ptr + t)
    start = tl.load(tiles_ptr + n_tiles + t)
    end = tl.load(tiles_ptr + 2 * n_tiles + t)
    m = start + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = rows_ptr + slot * row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, n_bytes, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        w_lo, w_hi = decoded(row, codes_at, scales_at, n, b, n_rows, n_bytes, n_groups)
        x_mask = (m[:, None] < end) & (b[None, :] < n_bytes)
        x_at = x_ptr + m[:, None] * 2 * n_bytes + 2 * b[None, :]
        x_lo = tl.load(x_at, mask=x_mask, other=0.0)
        x_hi = tl.load(x_at + 1, mask=x_mask, other=0.0)
        acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), input_precision=PRECISION)
        acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), input_precision=PRECISION)
    out_at = out_ptr + m[:, None] * n_rows + n[None, :]
    tl.store(out_at, acc, mask=(m[:, None] < end) & (n[None, :] < n_rows))
