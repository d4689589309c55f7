"""Linear-attention kernels: causal depthwise conv with carried state, and the gated delta rule.

One small interface, `gated_delta_rule(q, k, v, g, beta, state, backend)`, with two backends:
- `torch`: a pure-torch chunked (WY / UT-transform) implementation, always available, exact enough
  for fp32 parity; `recurrent_gated_delta_rule` is its token-by-token plain reference.
- `fla`: flash-linear-attention's Triton kernels, used on CUDA when `fla` imports.
All take an initial state and return the final state (fp32). Layouts are unbatched:
q, k `[T, Hk, dk]`, v `[T, Hv, dv]`, g (log decay, <= 0) and beta `[T, Hv]`, state `[Hv, dk, dv]`.
This module knows nothing about layers, caches or the engine.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CHUNK = 64


# ----------------------------------------------------------------------------- causal conv


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over `x [T, C]` continuing from `state [C, K-1]`.

    Time-major, as a sum of K shifted products accumulated in fp32 (no transposes, no conv
    kernel). Returns (`[T, C]` output in x's dtype, the padded input `[K-1+T, C]` whose
    `K-1`-row windows are the conv states). `weight` is `[C, 1, K]` as in `nn.Conv1d(groups=C)`.
    """
    seq_len, width = x.shape[0], weight.shape[-1]
    padded = torch.cat([state.T.to(x.dtype), x], dim=0)
    taps = weight[:, 0, :].float()  # [C, K]
    out = padded[:seq_len].float() * taps[:, 0]
    for j in range(1, width):
        out.addcmul_(padded[j : j + seq_len], taps[:, j])
    return F.silu(out).to(x.dtype), padded


# ----------------------------------------------------------------------------- gated delta rule


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """fp32, heads-first, q/k L2-normalised, q scaled, k heads repeated to the value heads."""
    rep = v.shape[1] // k.shape[1]
    q, k = (_l2norm(t.float()).repeat_interleave(rep, dim=1) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    # [T, H, d] -> [H, T, d]; [T, H] -> [H, T]
    return (t.transpose(0, 1).float() for t in (q, k, v, g, beta))


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token-by-token reference: S <- S*exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float().clone()  # [H, dk, dv]
    out = torch.empty_like(v)  # [H, T, dv]
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[:, t], s)
        delta = (v[:, t] - pred) * beta[:, t, None]
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hk,hkv->hv", q[:, t], s)
    return out.transpose(0, 1), s


def _pad_chunks(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) by `pad` and split it into `[H, N, CHUNK, ...]`."""
    if pad:
        widths = [0, 0] * (x.dim() - 2) + [0, pad]
        x = F.pad(x, widths)
    return x.reshape(x.shape[0], -1, CHUNK, *x.shape[2:])


def chunk_gated_delta_rule(q, k, v, g, beta, state):
    """Chunked form: inside each chunk of 64 tokens the delta-rule updates are folded into
    triangular solves (the UT transform), then one sequential pass carries the state across chunks.
    Zero padding (k = v = beta = g = 0) leaves the state unchanged, so any length works."""
    seq_len = q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (-seq_len) % CHUNK
    q, k, v, g, beta = (_pad_chunks(t, pad) for t in (q, k, v, g, beta))
    decay = g.cumsum(-1)  # [H, N, C] log decay from chunk start to each position (inclusive)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    rel = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    # (I + L) with L_ij = beta_i k_i.k_j exp(decay_i - decay_j), i > j; diagonal treated as 1.
    system = (kb @ k.transpose(-1, -2)) * rel
    solve = functools.partial(
        torch.linalg.solve_triangular, system, upper=False, unitriangular=True
    )
    u = solve(v * beta[..., None])  # pseudo-values  [H, N, C, dv]
    w = solve(kb * decay.exp()[..., None])  # decayed keys reading the carried state
    attn = (q @ k.transpose(-1, -2)) * rel  # intra-chunk scores incl. diagonal
    q_dec = q * decay.exp()[..., None]
    k_dec = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_dec = decay[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    s = state.float().clone()
    out = torch.empty_like(v)
    for n in range(q.shape[1]):
        v_new = u[:, n] - w[:, n] @ s
        out[:, n] = q_dec[:, n] @ s + attn[:, n] @ v_new
        s = s * chunk_dec[:, n] + k_dec[:, n].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :seq_len]
    return out.transpose(0, 1), s


# ----------------------------------------------------------------------------- fla backend


@functools.cache
def fla_ops():
    """Return fla's (chunk, fused_recurrent) gated-delta-rule functions, or None if unavailable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return chunk, recurrent


FLA_RECURRENT_MAX = 64  # segments up to this many tokens take fla's fused recurrent kernel


def fla_gated_delta_rule(q, k, v, g, beta, state):
    """fla kernels on `[1, T, H, d]` inputs (fla maps value head j to key head j // (Hv/Hk),
    the same grouping as the torch path). Short segments (decode tokens, short suffixes, the
    pieces capture cuts leave) take the fused recurrent kernel: one launch where the chunked
    form has about ten, and prefill is bound by host time per launch. On the H200 a call took
    0.07-0.08 ms up to 64 tokens, 0.29 ms at 256, against the chunked form's 0.59-0.61 ms; equal
    at 512 (`scripts/fla_crossover.py`). 64 is the bound verified on the GPU end to end."""
    chunk, recurrent = fla_ops()
    fn = recurrent if q.shape[0] <= FLA_RECURRENT_MAX else chunk
    out, final = fn(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.to(v.dtype).unsqueeze(0),
        initial_state=state.float().unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out.squeeze(0), final.squeeze(0).float()


# ----------------------------------------------------------------------------- dispatch


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """Map `auto|torch|fla` to the backend that will run on `device`."""
    on_cuda = torch.device(device).type == "cuda"
    if requested == "fla":
        if not (on_cuda and fla_ops() is not None):
            from agentrt.errors import InvalidArgumentError

            raise InvalidArgumentError(
                "linear_attn='fla' needs CUDA and the flash-linear-attention package"
            )
        return "fla"
    if requested == "auto" and on_cuda and fla_ops() is not None:
        return "fla"
    return "torch"


def gated_delta_rule(q, k, v, g, beta, state, backend: str = "torch"):
    """Run the gated delta rule from `state`.

    Returns (output `[T, Hv, dv]` in v's dtype, final state `[Hv, dk, dv]` fp32)."""
    if backend == "fla" and q.is_cuda:  # layers kept on the CPU use the torch path
        out, final = fla_gated_delta_rule(q, k, v, g, beta, state)
    elif q.shape[0] == 1:
        out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    else:
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    return out.to(v.dtype), final
