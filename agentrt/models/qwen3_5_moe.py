"""Qwen3.5-MoE (text part): hybrid Gated DeltaNet linear attention + gated full attention, routed
experts with top-k softmax routing plus a sigmoid-gated shared expert, zero-centred RMSNorms.

The Gated DeltaNet layer runs its causal conv and its recurrence over the whole chunk at once,
recording (conv, recurrent) state at each capture offset from the same pass.
Weight names match `Qwen3_5MoeForCausalLM` (prefix `model.`) and the text part of
`Qwen3_5MoeForConditionalGeneration` (prefix `model.language_model.`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.models import kernels
from agentrt.models.config import FULL, LINEAR, ModelConfig
from agentrt.models.fusion import Fusable, block_linears, row_blocks
from agentrt.models.kv import LinearCache
from agentrt.models.layers import (
    Attention,
    CausalLM,
    DecoderLayer,
    GatedRMSNorm,
    Position,
    Span,
    build_mlp,
    is_full_attention,
)
from agentrt.models.moe import RoutedExperts


class GatedDeltaNet(Fusable):
    """Linear attention: conv1d(q,k,v) -> gated delta rule -> gated RMSNorm -> out_proj."""

    backend = "torch"  # set per model by `set_linear_backend`
    _in_proj: torch.Tensor | None = None  # (fused: the four input projections' rows)
    _neg_a: torch.Tensor | None = None  # (derived: -exp(A_log), the conv's fp32 taps)
    _taps: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.dk, self.num_v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)

    def fuse_rows(self) -> None:
        """The four input projections as one matmul (see `fusion`)."""
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        self._in_proj = row_blocks(parts, self._in_proj)

    def derive(self) -> None:
        self._keep("_neg_a", -self.A_log.detach().float().exp())
        self._keep("_taps", kernels.conv_taps(self.conv1d.weight.detach()))

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """g = -exp(A_log) * softplus(a + dt_bias), fp32 (A_log and dt_bias are fp32)."""
        if self._neg_a is None:
            return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return self._neg_a * F.softplus(a + self.dt_bias)  # (a's dtype + fp32 adds in fp32)

    def forward(
        self, x: torch.Tensor, cache: LinearCache, start: Position, captures: Sequence[int]
    ) -> torch.Tensor:
        seq_len = x.shape[0]
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        qkv, z, b, a = block_linears(x, parts, self._in_proj)
        conv_out, padded = kernels.causal_conv(
            qkv.contiguous(), cache.conv, self.conv1d.weight, self.backend, self._taps
        )  # [T, C] (`contiguous`: a no-op for one token; fla's conv reads rows of C)
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(seq_len, self.num_k_heads, self.dk)
        k = k.reshape(seq_len, self.num_k_heads, self.dk)
        v = v.reshape(seq_len, self.num_v_heads, self.dv)
        beta = torch.sigmoid(b)  # [T, Hv]
        g = self._decay(a)
        if isinstance(start, Span):
            out = self._masked_recurrence(q, k, v, g, beta, cache, padded, start)
        else:
            out = self._recurrence(q, k, v, g, beta, cache, padded, start, captures)
        z = z.reshape(seq_len, self.num_v_heads, self.dv)
        out = self.norm(out, z).reshape(seq_len, self.value_dim)
        return self.out_proj(out)

    def _recurrence(
        self, q, k, v, g, beta, cache: LinearCache, padded, start: int, captures
    ) -> torch.Tensor:
        """One pass of the delta rule; the states at the capture offsets inside the chunk come
        from the same pass (`kernels.gated_delta_rule_states`), the one at its end is the final."""
        seq_len, width = q.shape[0], self.kernel - 1
        cuts = sorted({int(c) for c in captures if 0 < c < seq_len})
        if cuts:
            # cuts on the 64-token chunk grid (`Engine.capture_grid`) are chunk starts the pass
            # computes anyway; others advance a window from the chunk start before them
            aligned = all(c % kernels.CHUNK == 0 for c in cuts)
            ends = tuple(cuts) if aligned else _cut_windows(tuple(cuts), seq_len, q.device)
            out, state, states = kernels.gated_delta_rule_states(
                q, k, v, g, beta, cache.recurrent, ends, self.backend
            )
            for end, snapshot in zip(cuts, states, strict=True):
                cache.captured[start + end] = (padded[end : end + width].T.clone(), snapshot)
        else:
            out, state = kernels.gated_delta_rule(q, k, v, g, beta, cache.recurrent, self.backend)
        if seq_len in captures:
            cache.captured[start + seq_len] = (
                padded[seq_len : seq_len + width].T.clone(),
                state.clone(),
            )
        cache.conv.copy_(padded[seq_len : seq_len + width].T)
        cache.recurrent.copy_(state)
        return out

    def _masked_recurrence(self, q, k, v, g, beta, cache: LinearCache, padded, span: Span):
        """Static pass: padding rows (from `span.valid` on) become identity updates (beta 0, no
        decay), so the final state is the one after the real tokens; the conv state is the
        window of inputs ending there. The states after `span.cuts` come from the same pass
        into `cache.slots`."""
        steps = torch.arange(q.shape[0], device=q.device)
        keep = (steps < span.valid)[:, None]
        g, beta = g * keep, beta * keep
        if span.cuts is None:
            out, state = kernels.gated_delta_rule(q, k, v, g, beta, cache.recurrent, self.backend)
        else:
            out, state, states = kernels.gated_delta_rule_states(
                q, k, v, g, beta, cache.recurrent, span.cuts, self.backend
            )
            conv = self._conv_windows(padded, span.cuts)
            cache.slots = _into_slot_buffers(cache, conv, states)
        cache.conv.copy_(self._conv_windows(padded, span.valid)[0])
        cache.recurrent.copy_(state)
        return out

    def _conv_windows(self, padded: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The conv states after `ends` (`[K]` device tensor) tokens of the pass: the inputs
        ending there, `[K, conv_dim, kernel-1]`."""
        rows = ends[:, None] + torch.arange(self.kernel - 1, device=padded.device)
        return padded[rows].transpose(1, 2)


def _into_slot_buffers(
    cache: LinearCache, conv: torch.Tensor, rec: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut states, copied into the buffers every static pass shares (allocated at first
    use: the eager warm-up that precedes any capture, so outside the graphs' pool)."""
    buffers = cache.slot_buffers
    if buffers is None or buffers[0].shape != conv.shape or buffers[1].shape != rec.shape:
        if conv.is_cuda and torch.cuda.is_current_stream_capturing():
            return conv, rec  # a shape first met inside a capture: that graph's own tensors
        buffers = cache.slot_buffers = (torch.empty_like(conv), torch.empty_like(rec))
    buffers[0].copy_(conv)
    buffers[1].copy_(rec)
    return buffers


@functools.lru_cache(maxsize=4)
def _cut_windows(cuts: tuple[int, ...], seq_len: int, device: torch.device) -> tuple:
    """The capture offsets of an eager chunk on the device and their `kernels.window_index`,
    computed once for all the chunk's linear layers (read only, so they can share it)."""
    return kernels.window_index(_on_device(list(cuts), device), seq_len)


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor on `device` without a host sync: a copy from pageable memory waits
    for the stream (made once per linear layer, before `_cut_windows`, it cost +40% on a prefill
    with captures), one from pinned memory (PyTorch's caching host allocator) does not."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


# config.json `model_type`s read as this architecture (the text part of multimodal checkpoints)
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
ZERO_CENTERED_NORMS = True  # RMSNorm weights stored as offsets from 1 (a synthetic model's: 0)


def config_fields(text: dict, num_layers: int) -> dict:
    """This architecture's `ModelConfig` fields from the text section of its config.json: the
    layer types (`layer_types`, or every `full_attention_interval`-th layer full attention),
    routing weights renormalised over the top-k unless the config says otherwise."""
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    return {"layer_types": tuple(types), "norm_topk_prob": bool(text.get("norm_topk_prob", True))}


def build(cfg: ModelConfig, experts: RoutedExperts) -> CausalLM:
    layers = []
    for i in range(cfg.num_layers):
        if is_full_attention(cfg, i):
            name, mixer = "self_attn", Attention(cfg, output_gate=True, zero_centered=True)
        else:
            name, mixer = "linear_attn", GatedDeltaNet(cfg)
        layers.append(DecoderLayer(name, mixer, build_mlp(cfg, i, experts), cfg, zc=True))
    return CausalLM(cfg, layers, experts, zc=True)
