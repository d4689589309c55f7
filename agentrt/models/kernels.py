"""Linear-attention kernels (causal depthwise conv with carried state, the gated delta rule) for
the layers that use them (fla's fused norms: `fla_norms`).

One small interface, `gated_delta_rule(q, k, v, g, beta, state, backend)`, with two backends:
- `torch`: a pure-torch chunked (WY / UT-transform) implementation, always available, exact enough
  for fp32 parity; `recurrent_gated_delta_rule` is its token-by-token plain reference.
- `fla`: flash-linear-attention's Triton kernels, used on CUDA when `fla` imports.
All take an initial state and return the final state (fp32); `gated_delta_rule_states` also
returns the states after given offsets from the same pass (chunk-start states plus one short
masked window per offset), which is how capture positions cost no extra pass. Layouts are
unbatched: q, k `[T, Hk, dk]`, v `[T, Hv, dv]`, g (log decay, <= 0) and beta `[T, Hv]`, state
`[Hv, dk, dv]`. This module knows nothing about layers, caches or the engine.
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch
import torch.nn.functional as F

from agentrt.models.fla_norms import fla_l2norm, fla_l2norm_ops, on_device_of

CHUNK = 64


# ----------------------------------------------------------------------------- causal conv


def causal_conv(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    backend: str = "torch",
    taps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over `x [T, C]` continuing from `state [C, K-1]`.

    Time-major, as a sum of K shifted products accumulated in fp32 (no transposes, no conv
    kernel); with the `fla` backend on CUDA and from `FLA_CONV_MIN` tokens on, fla's fused
    causal conv kernel (one launch where the sum takes K+2 passes over fp32 copies). Returns
    (`[T, C]` output in x's dtype, the padded input `[K-1+T, C]` whose `K-1`-row windows are the
    conv states). `weight` is `[C, 1, K]` as in `nn.Conv1d(groups=C)`; `taps`: its
    `conv_taps`, where the caller keeps them (else computed here).
    """
    seq_len, width = x.shape[0], weight.shape[-1]
    padded = torch.cat([state.T.to(x.dtype), x], dim=0)
    if backend == "fla" and x.is_cuda and seq_len >= FLA_CONV_MIN:
        return fla_causal_conv(x, state, weight), padded
    taps = conv_taps(weight) if taps is None else taps
    if seq_len == 1:  # (a decode step: the window times the taps, summed, in two kernels)
        out = torch.mul(padded, taps.T).sum(0, keepdim=True)
        return F.silu(out).to(x.dtype), padded
    out = torch.mul(padded[:seq_len], taps[:, 0])  # (x's dtype times fp32: fp32)
    for j in range(1, width):
        out.addcmul_(padded[j : j + seq_len], taps[:, j])
    return F.silu(out).to(x.dtype), padded


def conv_taps(weight: torch.Tensor) -> torch.Tensor:
    """The depthwise conv's `[C, 1, K]` weight as fp32 taps `[C, K]`."""
    return weight[:, 0, :].float()


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


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_starts: bool = False):
    """Chunked form: inside each chunk of 64 tokens the delta-rule updates are folded into
    triangular solves (the UT transform), then one sequential pass carries the state across chunks.
    Zero padding (k = v = beta = g = 0) leaves the state unchanged, so any length works.
    With `chunk_starts`, also returns the state at the start of each chunk `[N, Hv, dk, dv]`."""
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
    starts = []
    for n in range(q.shape[1]):
        starts.append(s)
        v_new = u[:, n] - w[:, n] @ s
        out[:, n] = q_dec[:, n] @ s + attn[:, n] @ v_new
        s = s * chunk_dec[:, n] + k_dec[:, n].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :seq_len].transpose(0, 1)
    if chunk_starts:
        return out, s, torch.stack(starts)
    return out, s


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


# On the H200 (`benchmarks/bench_conv.py`, 8192 channels, bf16) fla's kernel took 0.23 ms of GPU
# time at 2048 and 4096 tokens where the torch sum took 0.50 and 0.96 ms; below 1024 tokens a call
# is bound by host time, 0.20-0.24 ms for fla's wrapper against 0.09-0.17 ms for the torch sum.
FLA_CONV_MIN = 1024


@functools.cache
def _fla_conv():
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d


def fla_causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fla's causal conv + SiLU; its state holds the last K inputs (the oldest one unused by the
    next output), ours the last K-1, so ours goes in with a zero column in front."""
    initial = F.pad(state.to(x.dtype), (1, 0)).unsqueeze(0)  # [1, C, K]
    out, _ = _fla_conv()(
        x.unsqueeze(0),
        weight[:, 0, :].to(x.dtype),
        initial_state=initial,
        output_final_state=False,
        activation="silu",
    )
    return out.squeeze(0)


FLA_RECURRENT_MAX = 64  # segments up to this many tokens take fla's fused recurrent kernel


def fla_gated_delta_rule(q, k, v, g, beta, state):
    """fla kernels on `[1, T, H, d]` inputs (fla maps value head j to key head j // (Hv/Hk),
    the same grouping as the torch path). Short segments (decode tokens, short suffixes, the
    pieces capture cuts leave) take the fused recurrent kernel: one launch where the chunked
    form has about ten, and prefill is bound by host time per launch. On the H200 a call took
    0.07-0.08 ms up to 64 tokens, 0.29 ms at 256, against the chunked form's 0.59-0.61 ms; equal
    at 512 (`benchmarks/fla_crossover.py`). 64 is the bound verified on the GPU end to end."""
    chunk, recurrent = fla_ops()
    short = q.shape[0] <= FLA_RECURRENT_MAX
    if not short:  # (fla's chunked rule would norm them by `l2norm_fwd`: the same kernel)
        q, k = fla_l2norm(q), fla_l2norm(k)
    out, final = (recurrent if short else chunk)(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.to(v.dtype).unsqueeze(0),
        initial_state=state.float().unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=short,
    )
    return out.squeeze(0), final.squeeze(0).float()


@functools.cache
def _fla_internals():
    """fla 0.6.0's internal forward steps of the chunked rule (the public function returns only
    the final state; these also give the state at each chunk start, which it computes anyway):
    the state step as its Triton kernel (`_fla_states_fp32` allocates the states)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    fla_l2norm_ops()  # (its imports checked with the others)
    return (
        chunk_local_cumsum,
        RCP_LN2,
        (
            chunk_gated_delta_rule_fwd_intra,
            chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
            chunk_fwd_o,
        ),
    )


def fla_chunk_starts(q, k, v, g, beta, state):
    """fla's chunked pass step by step (as `chunk_gated_delta_rule_fwd` runs it, without context
    parallelism), returning (output, final state fp32, chunk-start states `[N, Hv, dk, dv]`
    fp32). fla would keep the chunk-start states in k's dtype (bf16 for a bf16 model); here its
    state kernel stores them in fp32, the precision its recurrence runs at, so a checkpoint taken
    at a chunk start is the live state exactly; its output kernel reads them rounded to k's
    dtype, as fla's own pass does (the output is unchanged)."""
    with on_device_of(q):  # fla's public functions set the device; its internal ones do not
        return _fla_chunk_starts(q, k, v, g, beta, state)


def _fla_chunk_starts(q, k, v, g, beta, state):
    local_cumsum, rcp_ln2, (intra, state_kernel, fwd_o) = _fla_internals()
    q, k, v = (t.unsqueeze(0).contiguous() for t in (q, k, v))
    q, k = fla_l2norm(q), fla_l2norm(k)
    g = local_cumsum(g.float().unsqueeze(0).contiguous(), chunk_size=CHUNK, scale=rcp_ln2)
    beta = beta.to(v.dtype).unsqueeze(0).contiguous()
    w, u, _ = intra(k=k, v=v, g=g, beta=beta, chunk_size=CHUNK)
    initial = state.float().unsqueeze(0).contiguous()
    try:
        h, v_new, final = _fla_states_fp32(state_kernel, k, w, u, g, initial)
    except (TypeError, ValueError, RuntimeError) as exc:  # (another 0.6.x kernel signature)
        h, v_new, final = _fla_states_own(k, w, u, g, initial, exc)
    low = h.to(k.dtype)  # (what fla's own pass stores and its output kernel reads)
    out = fwd_o(q=q, k=k, v=v_new, h=low, g=g, scale=k.shape[-1] ** -0.5, chunk_size=CHUNK)
    return out.squeeze(0), final.squeeze(0), h.squeeze(0)


def _fla_states_fp32(kernel, k, w, u, g, initial):
    """fla 0.6's `chunk_gated_delta_rule_fwd_h` (sequences of equal length, states key-first)
    with the chunk-start states stored in fp32: its `kernel` casts to whatever it is given."""
    import triton

    batch, length, heads, key_dim = k.shape
    value_dim, value_heads = u.shape[-1], u.shape[2]
    chunks = triton.cdiv(length, CHUNK)
    h = k.new_empty(batch, chunks, value_heads, key_dim, value_dim, dtype=torch.float32)
    final = k.new_zeros(batch, value_heads, key_dim, value_dim, dtype=torch.float32)
    v_new = torch.empty_like(u)

    def grid(meta):
        return (triton.cdiv(value_dim, meta["BV"]) * batch * value_heads,)

    tensors = dict(k=k, v=u, w=w, v_new=v_new, g=g, gk=None, h=h, h0=initial, ht=final)
    sizes = dict(T=length, H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=CHUNK)
    kernel[grid](**tensors, cu_seqlens=None, chunk_offsets=None, **sizes, STATE_V_FIRST=False)
    return h, v_new, final


def _fla_states_own(k, w, u, g, initial, reason: Exception):
    """fla's own state step (chunk-start states in k's dtype), where `_fla_states_fp32` could
    not call its kernel; warns (once per place, as Python's warnings do)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    warnings.warn(
        f"fla's state kernel could not be called ({reason}); checkpoints inside a prefill "
        "piece keep fla's chunk-start states in the model's dtype",
        stacklevel=2,
    )
    return chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=g, initial_state=initial, output_final_state=True, chunk_size=CHUNK
    )


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


def gated_delta_rule_states(q, k, v, g, beta, state, ends, backend: str = "torch"):
    """`gated_delta_rule` in one pass that also yields the state after each of `ends` tokens
    (`[K]` int64 on q's device, values in [1, T]; device tensors, so CUDA graphs can vary them;
    or their `window_index`).

    The chunked pass gives the state at each 64-token chunk start; the state after `e` tokens is
    the start of the chunk holding token e-1, advanced over that chunk's rows before e (the later
    rows masked to identity updates: beta 0, no decay), all K windows in one batched call.
    `ends` may also be a tuple of ints that are all multiples of 64 (chunk starts, see
    `Engine.capture_grid`): those states are the chunk starts themselves, no window runs.

    Returns (output, final state fp32, states `[K, Hv, dk, dv]` fp32)."""
    use_fla = backend == "fla" and q.is_cuda
    on_grid = isinstance(ends, tuple) and all(isinstance(e, int) for e in ends)
    if on_grid and not all(e % CHUNK == 0 for e in ends):
        raise ValueError("integer ends must be chunk starts (multiples of 64)")
    if use_fla and q.shape[0] > FLA_RECURRENT_MAX and not fla_chunk_starts_usable():
        if on_grid:
            ends = torch.tensor(ends, dtype=torch.long, device=q.device)
        return _states_by_reruns(q, k, v, g, beta, state, ends, backend)
    if use_fla:
        if q.shape[0] <= FLA_RECURRENT_MAX:
            out, final = fla_gated_delta_rule(q, k, v, g, beta, state)
            starts = state.float().unsqueeze(0)
        else:
            out, final, starts = fla_chunk_starts(q, k, v, g, beta, state)
    else:
        out, final, starts = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_starts=True)
    if on_grid and all(e // CHUNK < starts.shape[0] for e in ends):
        # copies (fp32), not views: a view would keep the pass's every chunk state alive
        states = [starts[e // CHUNK].to(torch.float32, copy=True) for e in ends]
        return out.to(v.dtype), final, states
    if on_grid:  # past the starts the pass gave (a short fla segment)
        ends = torch.tensor(ends, dtype=torch.long, device=q.device)
    states = advance_windows(q, k, v, g, beta, starts, ends, use_fla, state)
    return out.to(v.dtype), final, states


@functools.cache
def fla_chunk_starts_usable() -> bool:
    """`fla_chunk_starts` follows fla 0.6's internal forward steps: other versions (which may
    move or change them) take `_states_by_reruns`, slower and right."""
    try:
        import fla

        _fla_internals()
        version = getattr(fla, "__version__", "")
    except Exception:  # noqa: BLE001 - any import problem: not usable
        return False
    if version.startswith("0.6."):
        return True
    print(
        f"agentrt: flash-linear-attention {version} is not 0.6.x; state captures inside a "
        "prefill chunk rerun the delta rule per capture",
        file=sys.stderr,
    )
    return False


def _states_by_reruns(q, k, v, g, beta, state, ends, backend):
    """The states after `ends` through one masked rerun of the rule each (public kernels only)."""
    ends = ends if isinstance(ends, torch.Tensor) else ends[0]
    out, final = gated_delta_rule(q, k, v, g, beta, state, backend)
    steps = torch.arange(q.shape[0], device=q.device)
    states = []
    for j in range(ends.shape[0]):
        keep = (steps < ends[j])[:, None]
        states.append(gated_delta_rule(q, k, v, g * keep, beta * keep, state, backend)[1])
    return out, final, torch.stack(states)


def window_index(ends: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
    """For `advance_windows`: (`ends`, the chunk holding each end's last row `[K]`, the rows of
    each window `[K, CHUNK]` (clamped into the pass), which of them count `[K, CHUNK]`). The same
    for every layer of a pass: callers with fixed offsets compute it once (`CutWindows`)."""
    first = torch.div(ends - 1, CHUNK, rounding_mode="floor")
    rows = first[:, None] * CHUNK + torch.arange(CHUNK, device=ends.device)
    keep = rows < ends[:, None]
    return ends, first, rows.clamp(max=seq_len - 1), keep


def advance_windows(
    q, k, v, g, beta, starts, ends, use_fla: bool, state: torch.Tensor | None = None
) -> torch.Tensor:
    """State after `ends[j]` tokens, from `starts` (the chunk-start states), one 64-row window
    per end. `ends`: the offsets `[K]`, or their `window_index`. `state` (the pass's fp32
    initial state) replaces `starts[0]` where fla rounded it to the model's dtype."""
    if isinstance(ends, torch.Tensor):
        ends = window_index(ends, q.shape[0])
    _, first, rows, keep = ends
    init = starts.index_select(0, first).float()
    if state is not None and starts.dtype != torch.float32:
        init = torch.where((first == 0)[:, None, None, None], state.float(), init)
    wq, wk, wv = q[rows], k[rows], v[rows]
    wg, wb = g[rows] * keep[..., None], beta[rows] * keep[..., None]
    if use_fla:
        _, recurrent = fla_ops()
        _, final = recurrent(
            wq,
            wk,
            wv,
            g=wg.float(),
            beta=wb.to(v.dtype),
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return final.float()
    return torch.stack(
        [
            chunk_gated_delta_rule(wq[j], wk[j], wv[j], wg[j], wb[j], init[j])[1]
            for j in range(len(init))
        ]
    )
