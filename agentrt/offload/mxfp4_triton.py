"""Triton kernels over packed MXFP4 expert rows (layout: `mxfp4_rows`); imported only where
Triton is (CUDA, or Triton's interpreter)."""

import triton
import triton.language as tl


@triton.jit
def fp4_twice(code):
    """E2M1 code (sign in bit 3) -> twice its value, in integer steps (no exp2): 0, 1, 2, 3, 4,
    6, 8, 12 for 0, 0.5, 1, 1.5, 2, 3, 4, 6, and their negatives; fp32."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = (2 + mantissa) << tl.maximum(exponent - 1, 0)
    twice = tl.where(exponent == 0, mantissa, normal)
    return tl.where((code & 8) != 0, -twice, twice).to(tl.float32)


@triton.jit
def half_power(scale):
    """An E8M0 exponent byte -> 2^(scale - 128) (half its power of two; 0 for scale 0, whose
    2^-128 fp32 cannot hold as a normal number), built from the float's exponent bits."""
    bits = tl.maximum(scale.to(tl.int32) - 1, 0) << 23
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rounded(v, ROUND: tl.constexpr):
    """fp32 `v` rounded to bf16 (ROUND 1) or fp16 (2) and back, or as is (0): the values an
    activation in that dtype would hold."""
    if ROUND == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def swiglu(gate, up, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """`moe.SwiGLU` on fp32 halves: silu(gate) * up (LIMIT 0), or gpt-oss's clamped form."""
    if LIMIT == 0:
        out = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        out = (up + 1) * (gate * tl.sigmoid(gate * ALPHA))
    return out


@triton.jit
def decoded_tile(
    row,
    codes_at,
    scales_at,
    n,
    b0,
    n_rows,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    n_bytes: tl.constexpr,
    n_groups: tl.constexpr,
):
    """Output rows `n`, bytes b0 .. b0 + BLOCK_B (b0 a multiple of BLOCK_B, itself of 16) as
    weights `[BLOCK_N, 2 * BLOCK_B]` in element order (each byte's low nibble first), fp32,
    zero past the row's end: each exponent is decoded once per group of 32 weights."""
    b = b0 + tl.arange(0, BLOCK_B)
    g = b0 // 16 + tl.arange(0, BLOCK_B // 16)
    rows_in = n[:, None] < n_rows
    code_at = row + codes_at + n[:, None] * n_bytes + b[None, :]
    code = tl.load(code_at, mask=rows_in & (b[None, :] < n_bytes), other=0).to(tl.int32)
    scale_at = row + scales_at + n[:, None] * n_groups + g[None, :]
    scale = tl.load(scale_at, mask=rows_in & (g[None, :] < n_groups), other=127)
    weights = tl.join(fp4_twice(code & 15), fp4_twice(code >> 4))  # [N, B, 2]
    weights = tl.reshape(weights, (BLOCK_N, BLOCK_B // 16, 32))
    weights = weights * half_power(scale)[:, :, None]
    return tl.reshape(weights, (BLOCK_N, 2 * BLOCK_B))


@triton.jit
def matvec_kernel(
    rows_ptr,
    slots_ptr,
    x_ptr,
    out_ptr,
    bias_ptr,
    ids_ptr,
    scale_ptr,
    row_stride,
    x_stride,
    codes_at,
    scales_at,
    n_rows: tl.constexpr,  # (the model's shapes: one compilation per matrix)
    n_bytes: tl.constexpr,
    n_groups: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
    ROUND: tl.constexpr,
    REDUCE: tl.constexpr,
    SCALE: tl.constexpr,
    OUT_ROUND: tl.constexpr,
):
    """`out[i, n] = W(rows[slots[i]])[n] . x[i]` (+ `bias[ids[i], n]` with HAS_BIAS) for
    BLOCK_N output rows n: the codes read as `[BLOCK_N, BLOCK_B]` byte tiles (each exponent
    decoded once per 32 weights, `decoded_tile`), products summed per lane in fp32 and reduced
    once at the end (REDUCE: each step, into BLOCK_N sums: fewer registers). `x_stride` 0: one
    x for all; x is read in its dtype. With SCALE, each output row is rounded (OUT_ROUND, as
    `rounded`) and then times `scale[i]`, 0 where that weight is 0 (a slot read under weight 0
    may hold inf: inf * 0 would be nan). With ACT, x[i] is an expert's gate and up
    halves (fp32, each as wide as a row): x = swiglu(gate, up), its inputs and output rounded
    to the model's dtype (`rounded`) and fp32 between, where torch's activation in that dtype
    rounds after each op (within bf16's precision of it)."""
    i = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = rows_ptr + tl.load(slots_ptr + i).to(tl.int64) * row_stride
    x_row = x_ptr + i * x_stride
    if REDUCE:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, 2 * BLOCK_B), dtype=tl.float32)
    for b0 in range(0, n_bytes, BLOCK_B):
        w = decoded_tile(
            row, codes_at, scales_at, n, b0, n_rows, BLOCK_N, BLOCK_B, n_bytes, n_groups
        )
        k = 2 * b0 + tl.arange(0, 2 * BLOCK_B)
        inside = k < 2 * n_bytes
        if ACT:
            gate = tl.load(x_row + k, mask=inside, other=0.0).to(tl.float32)
            up = tl.load(x_row + 2 * n_bytes + k, mask=inside, other=0.0).to(tl.float32)
            gate, up = rounded(gate, ROUND), rounded(up, ROUND)
            x = rounded(swiglu(gate, up, LIMIT, ALPHA), ROUND)
        else:
            x = tl.load(x_row + k, mask=inside, other=0.0).to(tl.float32)
        if REDUCE:
            acc += tl.sum(w * x[None, :], axis=1)
        else:
            acc += w * x[None, :]
    if REDUCE:
        out = acc
    else:
        out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        expert = tl.load(ids_ptr + i).to(tl.int64)
        out += tl.load(bias_ptr + expert * n_rows + n, mask=n < n_rows, other=0.0).to(tl.float32)
    if SCALE:
        weight = tl.load(scale_ptr + i)
        out = tl.where(weight != 0, rounded(out, OUT_ROUND) * weight, 0.0)
    tl.store(out_ptr + i * n_rows + n, out, mask=n < n_rows)


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
    """One tile of BLOCK_M tokens of one expert against BLOCK_N of its output rows: per step,
    BLOCK_B bytes of codes (2 * BLOCK_B weights) decoded into x's dtype and one dot with the
    tokens' contiguous inputs, fp32 accumulation."""
    t = tl.program_id(0)
    slot = tl.load(tiles_ptr + t)
    start = tl.load(tiles_ptr + n_tiles + t)
    end = tl.load(tiles_ptr + 2 * n_tiles + t)
    m = start + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, 2 * BLOCK_B)
    row = rows_ptr + slot * row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tokens_in = m[:, None] < end
    for b0 in range(0, n_bytes, BLOCK_B):
        w = decoded_tile(
            row, codes_at, scales_at, n, b0, n_rows, BLOCK_N, BLOCK_B, n_bytes, n_groups
        )
        x_at = x_ptr + m[:, None] * 2 * n_bytes + 2 * b0 + k[None, :]
        x = tl.load(x_at, mask=tokens_in & (2 * b0 + k[None, :] < 2 * n_bytes), other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    out_at = out_ptr + m[:, None] * n_rows + n[None, :]
    tl.store(out_at, acc, mask=tokens_in & (n[None, :] < n_rows))
