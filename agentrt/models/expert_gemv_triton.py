"""Triton kernels of one decode token's routed experts (`expert_gemv`); imported only where
Triton is (CUDA, or Triton's interpreter)."""

import triton
import triton.language as tl


@triton.jit
def swiglu(gate, up, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """`SwiGLU(LIMIT, ALPHA)` on fp32 gate and up halves (LIMIT 0: silu(gate) * up)."""
    if LIMIT == 0:
        out = gate * tl.sigmoid(gate) * up
    else:
        # (NaN kept, as torch's clamp keeps it)
        gate = tl.minimum(gate, LIMIT, propagate_nan=tl.PropagateNan.ALL)
        up = tl.maximum(up, -LIMIT, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(up, LIMIT, propagate_nan=tl.PropagateNan.ALL)
        out = (up + 1) * (gate * tl.sigmoid(gate * ALPHA))
    return out


@triton.jit
def gate_up_kernel(
    x_ptr,
    ids_ptr,
    weights_ptr,
    gate_up_ptr,
    bias_ids_ptr,
    bias_ptr,
    act_ptr,
    expert_stride,
    H: tl.constexpr,
    INTER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (j, b): the activations `act[j, n]` of chosen expert j for its intermediate rows
    n in block b: its gate rows n and up rows INTER + n dotted with x, fp32 accumulation, then
    the SwiGLU (biases at row `bias_ids[j]`). An expert under weight 0 is skipped (its row of
    `act` is left as it was)."""
    j = tl.program_id(0)
    if tl.load(weights_ptr + j) != 0:
        expert = tl.load(ids_ptr + j).to(tl.int64)
        base = gate_up_ptr + expert * expert_stride
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_in = n[:, None] < INTER
        gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask = rows_in & (k[None, :] < H)
            x = tl.load(x_ptr + k, mask=k < H, other=0.0).to(tl.float32)[None, :]
            at = base + n[:, None] * H + k[None, :]
            gate += tl.load(at, mask=mask, other=0.0).to(tl.float32) * x
            up += tl.load(at + INTER * H, mask=mask, other=0.0).to(tl.float32) * x
        g, u = tl.sum(gate, axis=1), tl.sum(up, axis=1)
        if HAS_BIAS:
            bias = bias_ptr + tl.load(bias_ids_ptr + j).to(tl.int64) * 2 * INTER + n
            g += tl.load(bias, mask=n < INTER, other=0.0).to(tl.float32)
            u += tl.load(bias + INTER, mask=n < INTER, other=0.0).to(tl.float32)
        tl.store(act_ptr + j * INTER + n, swiglu(g, u, LIMIT, ALPHA), mask=n < INTER)


@triton.jit
def down_kernel(
    act_ptr,
    ids_ptr,
    weights_ptr,
    down_ptr,
    bias_ids_ptr,
    bias_ptr,
    add_ptr,
    out_ptr,
    expert_stride,
    H: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program b: output rows n of block b, `out[n] = sum_j w_j * (down[ids[j]][n] . act[j] +
    bias) (+ add[n])` in fp32 over the experts of nonzero weight (a skipped expert's `act` row
    is never read: a zero weight cannot turn a stale inf into nan)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = n[:, None] < H
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, TOP_K):
        weight = tl.load(weights_ptr + j).to(tl.float32)
        if weight != 0:
            expert = tl.load(ids_ptr + j).to(tl.int64)
            base = down_ptr + expert * expert_stride
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(act_ptr + j * INTER + k, mask=k < INTER, other=0.0)
                at = base + n[:, None] * INTER + k[None, :]
                w = tl.load(at, mask=rows_in & (k[None, :] < INTER), other=0.0)
                acc += w.to(tl.float32) * a[None, :]
            y = tl.sum(acc, axis=1)
            if HAS_BIAS:
                bias = bias_ptr + tl.load(bias_ids_ptr + j).to(tl.int64) * H + n
                y += tl.load(bias, mask=n < H, other=0.0).to(tl.float32)
            total += weight * y
    if HAS_ADD:
        total += tl.load(add_ptr + n, mask=n < H, other=0.0)
    tl.store(out_ptr + n, total, mask=n < H)
