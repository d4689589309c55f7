"""One decode token's routed experts in two kernels, straight from the expert stacks.

`token_moe(x, ids, weights, gate_up, down, ...)` computes `sum_j weights[j] * expert[ids[j]](x)`
for one token: `gate_up [E, 2I, H]` and `down [E, H, I]` are stacks whose rows are contiguous
(a model's stacked experts, or views of the offload cache's slots, indexed by slot), so the
chosen experts' weights are read where they lie, never gathered into a copy. On CUDA two Triton
kernels (`expert_gemv_triton`) do it: the gate/up rows and the SwiGLU, then the down rows
weighted and summed into one fp32 row, with an optional fp32 row added (the offload split's CPU
experts' sum); experts under weight 0 are skipped (the split's CPU-assigned experts read no
slot). `token_moe_reference` is the plain-torch form, which tests compare it with.
`AGENTRT_EXPERT_GEMV=0` turns the kernels off (`available` then says no), for comparisons;
`AGENTRT_EXPERT_GEMV_TILES` sets their tiles (`tiles`).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING

import torch

from agentrt.env import setting, switched_off
from agentrt.errors import InvalidArgumentError

if TYPE_CHECKING:
    from agentrt.models.moe import SwiGLU

# each kernel's tile: output rows per program, columns per step, warps, pipeline stages. On an
# H100 at qwen3.5-35b-a3b's shapes (top-8), one token's experts took 21.1 us of GPU time at
# these against 39.2 at (16, 256, 4, 1) / (8, 256, 4, 1): more, smaller programs keep more
# loads in flight (`benchmarks/bench_expert_gemv.py`, which sweeps them)
GATE_UP_BLOCK = (4, 256, 8, 1)
DOWN_BLOCK = (4, 256, 4, 1)
PLAIN_LIMITS = dict(LIMIT=0.0, ALPHA=1.0)  # (the plain SwiGLU's)


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(x: torch.Tensor) -> bool:
    """Whether `token_moe` runs its kernels for activations `x` (CUDA with Triton, not turned
    off by `AGENTRT_EXPERT_GEMV=0`)."""
    return x.is_cuda and _has_triton() and not switched_off("EXPERT_GEMV")


def token_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    act: SwiGLU | None = None,
    add: torch.Tensor | None = None,
    bias_ids: torch.Tensor | None = None,
    blocks: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """x `[H]` (or `[1, H]`), ids/weights `[k]` -> the fp32 row `[H]` of the chosen experts'
    weighted sum (+ `add`, fp32 `[H]`); `biases`: `[E', 2I]` and `[E', H]` biases, at rows
    `bias_ids` (default `ids`); `act`: a `SwiGLU` (default the plain one); `blocks`: the two
    kernels' tiles (default `tiles()`)."""
    import triton

    from agentrt.models.expert_gemv_triton import down_kernel, gate_up_kernel

    experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    _check_stacks(gate_up, down)
    top_k = ids.shape[-1]
    # (the kernels read these with unit strides: no-ops for the callers' contiguous tensors)
    x, ids, weights = (t.reshape(-1).contiguous() for t in (x, ids, weights))
    bias_ids = ids if bias_ids is None else bias_ids.reshape(-1).contiguous()
    if biases is not None:
        biases = tuple(b.contiguous() for b in biases)
    if add is not None:
        add = add.contiguous()
    act_rows = torch.empty(top_k, inter, dtype=torch.float32, device=x.device)
    out = torch.empty(hidden, dtype=torch.float32, device=x.device)
    up_bias, down_bias = biases if biases is not None else (out, out)  # (unread without)
    limits = dict(LIMIT=float(act.limit), ALPHA=float(act.alpha)) if act else PLAIN_LIMITS
    (block_n, block_k, warps, stages), down_block = blocks or tiles()
    gate_up_kernel[(top_k, triton.cdiv(inter, block_n))](
        x, ids, weights, gate_up, bias_ids, up_bias, act_rows, gate_up.stride(0),
        H=hidden, INTER=inter, HAS_BIAS=biases is not None, **limits,
        BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(hidden)), num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    block_n, block_k, warps, stages = down_block
    down_kernel[(triton.cdiv(hidden, block_n),)](
        act_rows, ids, weights, down, bias_ids, down_bias, add if add is not None else out, out,
        down.stride(0), H=hidden, INTER=inter, TOP_K=top_k, HAS_BIAS=biases is not None,
        HAS_ADD=add is not None, BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(inter)), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@functools.cache
def _tiles_from(text: str | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not text:
        return GATE_UP_BLOCK, DOWN_BLOCK
    try:
        gate_up, down = (tuple(int(v) for v in part.split(",")) for part in text.split("/"))
    except ValueError:
        gate_up = down = ()
    shaped = len(gate_up) == len(down) == 4 and min(gate_up + down) > 0
    if not shaped or any(v & (v - 1) for v in gate_up[:3] + down[:3]):
        raise InvalidArgumentError(
            f"AGENTRT_EXPERT_GEMV_TILES must be rows,cols,warps,stages/rows,cols,warps,stages "
            f"(gate/up kernel, then down; rows, cols and warps powers of two), got {text!r}"
        )
    return gate_up, down


def tiles() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The kernels' tiles: `GATE_UP_BLOCK`, `DOWN_BLOCK`, or `AGENTRT_EXPERT_GEMV_TILES` (for
    benchmarks comparing tiles)."""
    return _tiles_from(setting("EXPERT_GEMV_TILES"))


def fits(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the kernels can read these stacks: `[E, 2I, H]` and `[E, H, I]` whose rows are
    contiguous (they index `expert * stride(0) + row * cols + col`)."""
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    hidden, inter = gate_up.shape[2], gate_up.shape[1] // 2
    if down.shape[1:] != (hidden, inter) or gate_up.shape[1] != 2 * inter:
        return False
    return all(s.stride(2) == 1 and s.stride(1) == s.shape[2] for s in (gate_up, down))


def _check_stacks(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    if not fits(gate_up, down):
        raise ValueError(
            f"expert stacks {tuple(gate_up.shape)} / {tuple(down.shape)} with strides "
            f"{gate_up.stride()} / {down.stride()}: not [E, 2I, H] and [E, H, I] with "
            "contiguous rows"
        )


def token_moe_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    act: SwiGLU | None = None,
    add: torch.Tensor | None = None,
    bias_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`token_moe` in plain torch, fp32 (experts under weight 0 skipped, as there)."""
    hidden, inter = gate_up.shape[2], gate_up.shape[1] // 2
    out = torch.zeros(hidden, dtype=torch.float32, device=x.device) if add is None else add.clone()
    x, ids = x.reshape(hidden).float(), ids.reshape(-1).tolist()
    bias_ids = ids if bias_ids is None else bias_ids.reshape(-1).tolist()
    for j, weight in enumerate(weights.reshape(-1).float().tolist()):
        if weight == 0:
            continue
        h = gate_up[ids[j]].float() @ x
        if biases is not None:
            h = h + biases[0][bias_ids[j]].float()
        if act is not None:
            a = act(h)
        else:
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
        y = down[ids[j]].float() @ a
        if biases is not None:
            y = y + biases[1][bias_ids[j]].float()
        out += weight * y
    return out
