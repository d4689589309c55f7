"""Shared building blocks of the model files: norms, rotary embedding, attention over a `KVCache`,
and the decoder stack (its feed-forward blocks, dense or MoE, are in `ffn.py`).

Parameter names follow Hugging Face checkpoints (minus the `model.` prefix) so the loader can map
them one to one. Everything is unbatched: hidden states are `[T, hidden]` for one sequence.
This module knows nothing about the engine, sessions, or where expert weights live.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from agentrt.models import fla_norms, per_pass
from agentrt.models.config import FULL, ModelConfig
from agentrt.models.ffn import MLP, MoEBlock
from agentrt.models.fusion import Fusable, block_linears, row_blocks
from agentrt.models.kv import KVCache, LayerCache
from agentrt.models.moe import ExpertBackend, RoutedExperts
from agentrt.models.rotary import Rotary

# A position is a Python int (eager), a `[1]` long tensor on the device (static decode: the same
# kernels and shapes every step, so the step can be captured in a CUDA graph), or a `Span`.


@dataclass(frozen=True)
class Span:
    """Positions of a fixed-shape multi-token pass (CUDA-graph safe): the pass holds B tokens at
    positions `start`.. of which the first `valid` are real, the rest padding whose effects on
    the state are masked out (their KV lands beyond the valid length, their linear-attention
    updates are identities). Both are `[1]` long device tensors."""

    start: torch.Tensor
    valid: torch.Tensor
    cuts: torch.Tensor | None = None  # `[K]` offsets in (0, valid]: linear layers record the
    # state after token cut-1 in their `slots` (capture positions inside one pass)


Position = int | torch.Tensor | Span


def first_position(start: Position) -> int | torch.Tensor:
    """The position of a pass's first token (a `Span`'s start tensor)."""
    return start.start if isinstance(start, Span) else start


class NormBase(nn.Module):
    """Shared by the norms: the `backend` (`torch`, or `fla` for its fused kernels on CUDA, set
    with the linear-attention backend) and the fp32 scale the fused kernels multiply by."""

    backend = "torch"

    def __init__(self, weight: torch.Tensor, eps: float, zero_centered: bool) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(weight)
        self._scale_cache: tuple[tuple[int, int], torch.Tensor] | None = None

    def fused(self, x: torch.Tensor) -> bool:
        return self.backend == "fla" and x.is_cuda and fla_norms_usable(x.device, x.dtype)

    def clear_scale(self) -> None:
        """Forget the cached scale (`set_linear_backend` does, after weights are loaded: writes
        through `.data` do not count as a change of the weight's version)."""
        self._scale_cache = None

    def scale(self) -> torch.Tensor:
        """fp32 (1 + weight) when zero-centred, else weight; recomputed only when the weight
        changes, so graph replays read one tensor."""
        try:
            version = self.weight._version
        except RuntimeError:  # a weight created under inference mode has no version counter
            version = -1
        key = (self.weight.data_ptr(), version)
        if self._scale_cache is not None and self._scale_cache[0] == key:
            return self._scale_cache[1]
        w = self.weight.detach().float()
        scale = 1.0 + w if self.zero_centered else w
        if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._scale_cache = (key, scale)  # (never memory of a graph's pool)
        return scale


_PROBED: dict[tuple, bool] = {}  # (probe, its arguments) -> the fast path is right there


def _checked_once(probe, *key) -> bool:
    """`probe(*key)`, run once per key and remembered; never inside a CUDA-graph capture (a
    capture meeting an unchecked key takes the plain path)."""
    if (probe, *key) not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _PROBED[(probe, *key)] = probe(*key)
    return _PROBED[(probe, *key)]


def fla_norms_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fla's fused norms run and agree with the torch formulas on this device and
    dtype (checked once)."""
    return _checked_once(_probe_fla_norms, device, dtype)


def _probe_fla_norms(device, dtype) -> bool:
    """Both fla kernels of each norm: a tile of rows up to 512 channels (head-sized norms), a
    row per program above (hidden-sized)."""
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        for dim in (128, 2048):
            x, gate = (
                torch.randn(5, dim, device=device, generator=gen).to(dtype) for _ in range(2)
            )
            scale = torch.rand(dim, device=device, generator=gen) + 0.5
            plain = F.rms_norm(x.float(), (dim,), None, 1e-6) * scale
            for got, want in (
                (fla_norms.fla_rms_norm(x, scale, 1e-6), plain),
                (fla_norms.fla_rms_norm(x, scale, 1e-6, gate), plain * F.silu(gate.float())),
            ):
                if not torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2):
                    raise ValueError(f"differs by {(got.float() - want).abs().max():.3g}")
    except Exception as exc:  # noqa: BLE001 - any failure: the torch formulas are always right
        print(f"agentrt: fla's fused norms unusable ({exc}); norms use torch", file=sys.stderr)
        return False
    return True


class RMSNorm(NormBase):
    """RMSNorm computed in fp32; `zero_centered` scales by (1 + weight) as Qwen3.5 does."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__(torch.zeros(dim) if zero_centered else torch.ones(dim), eps, zero_centered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused(x):  # one kernel where the lines below take five
            return fla_norms.fla_rms_norm(x, self.scale(), self.eps)
        # F.rms_norm: one fused kernel on CUDA (eager prefill of short suffixes is launch-bound);
        # on the CPU the same arithmetic in the same order as the explicit formula
        dims = (x.shape[-1],)
        if self.zero_centered:
            return F.rms_norm(x.float(), dims, 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return self.weight * F.rms_norm(x.float(), dims, None, self.eps).to(x.dtype)


class GatedRMSNorm(NormBase):
    """weight * rmsnorm(x) * silu(gate), norm in fp32 (the Gated DeltaNet output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(torch.ones(dim), eps, zero_centered=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fused(x):  # one kernel where the lines below take eight
            return fla_norms.fla_rms_norm(x, self.scale(), self.eps, gate)
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal: bool = False
) -> torch.Tensor:
    """SDPA on `[H, T, D]` queries and `[Hkv, L, D]` keys/values; query head h reads kv head h // G.

    Grouped heads are handled without `enable_gqa`: a single query position folds the G heads
    of a group into the position axis (no copy); longer queries repeat the kv heads and run as
    one 4-D batch, since torch's fused CUDA kernels (flash, memory-efficient) take only 4-D
    inputs: with 3-D ones every prefill ran the math path (fp32 scores, 49 of 120 ms of GPU time
    in an 8K-token profile of an 8-layer cut of qwen3.5-35b-a3b). On CUDA the 4-D call may not
    use cuDNN: it builds an execution plan for every new shape (40-80 ms of host time per call
    on an H200, over a second on the first), and prefill shapes are nearly all new.
    """
    num_heads, q_len, head_dim = q.shape
    group = num_heads // k.shape[0]
    if group > 1 and q_len == 1:
        out = F.scaled_dot_product_attention(
            q.view(k.shape[0], group, head_dim), k, v, attn_mask=mask
        )
        return out.view(num_heads, 1, head_dim)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    with sdpa_kernel(_PREFILL_BACKENDS) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=causal
        )
    return out[0]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q `[H, T, D]` at positions start.., k/v `[Hkv, start+T, D]` -> `[H, T, D]`."""
    q_len, kv_len = q.shape[1], k.shape[1]
    if q_len == 1:
        return _sdpa(q, k, v)
    if start == 0:
        return _sdpa(q, k, v, causal=True)
    if q.is_cuda:  # flash / memory-efficient kernels with the diagonal offset, no mask tensor
        # (imported here: the module loads torch._dynamo, 2 s of every start on a CPU; on CUDA
        # the engine's warm-up reaches this line before any request)
        from torch.nn.attention.bias import causal_lower_right

        return _sdpa(q, k, v, mask=causal_lower_right(q_len, kv_len))
    rows = torch.arange(start, start + q_len, device=q.device)[:, None]
    mask = torch.arange(kv_len, device=q.device)[None, :] <= rows
    return _sdpa(q, k, v, mask=mask)


def static_attention(
    q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """Causal attention of a static pass: q `[H, T, D]` at positions start.. (a `[1]` device
    tensor) over the whole KV buffers `[Hkv, capacity, D]`, of which the first start + T are
    written. On CUDA, flash attention's varlen kernel with the used length in a device tensor
    (`seqused_k`) reads only those positions and the grouped kv heads as they are; elsewhere a
    `[T, capacity]` mask over the whole capacity."""
    if flash_varlen_usable(q, k_all):
        return flash_varlen(q, k_all, v_all, per_pass.end_int32(start, q.shape[1], q.device))
    rows = per_pass.positions(start, q.shape[1])
    mask = torch.arange(k_all.shape[1], device=q.device)[None, :] <= rows[:, None]
    return _sdpa(q, k_all, v_all, mask=mask)


def flash_varlen(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    used: torch.Tensor,
    window: int = 0,
    with_lse: bool = False,
):
    """q `[H, T, D]` against the first `used` (`[1]` device tensor) of `[Hkv, capacity, D]`
    keys, causal aligned to the end (query i sees keys up to used - T + i; with `window`, only
    its last `window` of them): one sequence in flash attention's varlen form, nothing copied,
    no host sync. `with_lse`: also each head's and query's softmax logsumexp `[H, T]`."""
    num_heads, q_len, _ = q.shape
    capacity = k_all.shape[1]
    cu_q = per_pass.sequence_bounds(q_len, q.device)  # [0, T]
    cu_k = per_pass.sequence_bounds(capacity, q.device)
    sliding = dict(window_size_left=window - 1, window_size_right=0) if window else {}
    out, lse = torch.ops.aten._flash_attention_forward(
        q.transpose(0, 1),
        k_all.transpose(0, 1),
        v_all.transpose(0, 1),
        cu_q,
        cu_k,
        q_len,
        capacity,
        0.0,
        q_len > 1,
        False,
        seqused_k=used.to(torch.int32),
        **sliding,
    )[:2]
    out = out.transpose(0, 1)  # [H, T, D]
    return (out, lse.view(num_heads, q_len)) if with_lse else out


def flash_varlen_usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `flash_varlen` runs and agrees with masked SDPA for these shapes on this device
    (checked once per shape family)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return _checked_once(
        _probe_flash_varlen, q.device, q.dtype, q.shape[0], k.shape[0], q.shape[-1]
    )


def _probe_flash_varlen(device, dtype, heads: int, kv_heads: int, dim: int) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    capacity, start = 80, 37
    k = torch.randn(kv_heads, capacity, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(kv_heads, capacity, dim, device=device, dtype=dtype, generator=gen)
    try:
        for q_len in (1, 5):
            q = torch.randn(heads, q_len, dim, device=device, dtype=dtype, generator=gen)
            used = torch.full((1,), start + q_len, dtype=torch.long, device=device)
            got = flash_varlen(q, k, v, used).float()
            want = causal_attention(q, k[:, : start + q_len], v[:, : start + q_len], start)
            if not torch.allclose(got, want.float(), atol=2e-2, rtol=2e-2):
                raise ValueError(f"differs from SDPA by {(got - want.float()).abs().max():.3g}")
    except Exception as exc:  # noqa: BLE001 - any failure: the masked path is always correct
        print(
            f"agentrt: flash varlen attention unusable ({exc}); static passes use a mask",
            file=sys.stderr,
        )
        return False
    return True


class Attention(Fusable):
    """Causal attention with q/k RMSNorm; `output_gate`: Qwen3.5's sigmoid gate from q_proj.
    Fused: the q, k and v projections as one matmul."""

    _qkv: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, output_gate: bool, zero_centered: bool) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.output_gate = output_gate
        self.q_proj = nn.Linear(h, cfg.num_heads * d * (2 if output_gate else 1), bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centered)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centered)
        self.rotary = Rotary.of(cfg)

    def fuse_rows(self) -> None:
        self._qkv = row_blocks([self.q_proj, self.k_proj, self.v_proj], self._qkv)

    def forward(
        self, x: torch.Tensor, cache: KVCache, start: Position, captures: Sequence[int] = ()
    ) -> torch.Tensor:
        seq_len = x.shape[0]
        q, k, v = block_linears(x, [self.q_proj, self.k_proj, self.v_proj], self._qkv)
        q = q.view(seq_len, self.num_heads, -1)  # [T, H, D or 2D]
        gate = None
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(seq_len, -1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(seq_len, self.num_kv_heads, self.head_dim))
        v = v.view(seq_len, self.num_kv_heads, self.head_dim)
        q, k = self.rotary.rotate(q, k, first_position(start))
        if isinstance(start, (Span, torch.Tensor)):  # static pass: fixed shapes (CUDA graphs)
            begin = start.start if isinstance(start, Span) else start
            cache.write_at(begin, k.transpose(0, 1), v.transpose(0, 1))
            out = static_attention(q.transpose(0, 1), cache.k, cache.v, begin)
        else:
            k_all, v_all = cache.write(start, k.transpose(0, 1), v.transpose(0, 1))
            out = causal_attention(q.transpose(0, 1), k_all, v_all, start)  # [H, T, D]
        out = out.transpose(0, 1).reshape(seq_len, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (attention or linear attention), then MLP/MoE."""

    def __init__(
        self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, cfg: ModelConfig, zc: bool
    ) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)

    def forward(
        self, x: torch.Tensor, cache: LayerCache, start: Position, captures: Sequence[int]
    ) -> torch.Tensor:
        mixer = getattr(self, self.mixer_name)
        x = x + mixer(self.input_layernorm(x), cache, start, captures)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; the model files supply the layers."""

    def __init__(
        self, cfg: ModelConfig, layers: list[DecoderLayer], experts: RoutedExperts, zc: bool
    ) -> None:
        super().__init__()
        self.config = cfg
        self.experts = experts
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def set_experts(self, experts: ExpertBackend) -> None:
        """Swap the routed-expert implementation (e.g. for the offload engine)."""
        self.experts = experts
        for module in self.modules():
            if isinstance(module, MoEBlock):
                module._experts[0] = experts

    def forward(
        self,
        ids: torch.Tensor,
        caches: Sequence[LayerCache],
        start: Position,
        captures: Sequence[int] = (),
    ) -> torch.Tensor:
        """ids `[T]` at positions start..start+T-1 -> final hidden `[T, hidden]`.

        `captures`: offsets r in (0, T] where linear layers record their state after token r-1.
        """
        x = self.embed_tokens(ids)
        with per_pass.one_pass():  # (its attention layers share what they derive from start)
            for layer, cache in zip(self.layers, caches, strict=True):
                x = layer(x, cache, start, captures)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def is_full_attention(cfg: ModelConfig, layer: int) -> bool:
    return cfg.layer_types[layer] == FULL


def build_mlp(cfg: ModelConfig, layer: int, experts: RoutedExperts) -> nn.Module:
    if layer in cfg.dense_layers:
        return MLP(cfg.hidden_size, cfg.intermediate_size)
    return MoEBlock(cfg, layer, experts)
