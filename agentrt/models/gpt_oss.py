"""gpt-oss: an attention-only decoder with learned attention sinks (one logit per head that joins
every softmax and takes no value), every other layer attending to the last `sliding_window`
(128) positions only, YaRN rotary, biased q/k/v/o projections; routed experts chosen as the top 4
router logits (the router has a bias) weighted by a softmax over those 4, each expert with biases
and the clamped SwiGLU (`moe.SwiGLU`). Weight names match `GptOssForCausalLM` (prefix `model.`);
experts come in bf16 (`[E, in, out]`, gate and up columns interleaved) or MXFP4 (`_blocks` and
`_scales`, dequantized by the loader). Sliding-window layers keep the whole KV (the window is a
mask); the state cache stores only their last window (`statecache.codec.Layout.windowed`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.models import per_pass
from agentrt.models.config import FULL, ModelConfig
from agentrt.models.ffn import MoEBlock
from agentrt.models.fusion import Fusable, block_linears, row_blocks
from agentrt.models.kv import KVCache
from agentrt.models.layers import (
    CausalLM,
    DecoderLayer,
    Position,
    Span,
    _checked_once,
    first_position,
    flash_varlen,
)
from agentrt.models.moe import RoutedExperts
from agentrt.models.rotary import Rotary

MODEL_TYPES = ("gpt_oss",)  # config.json `model_type`s read as this architecture
ZERO_CENTERED_NORMS = False  # RMSNorm weights stored as they scale
DEFAULT_ROPE_THETA = 150000.0
# what transformers assumes for a config.json that names no rotary scaling
DEFAULT_ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# prefill graphs are off by default (not measured yet; where the flash path is unusable, a static
# pass's plain-torch attention computes over the whole KV capacity)
PREFILL_GRAPHS = False
SCORE_BYTES = 1 << 28  # attention scores held at once (fp32), bounding the query rows per step


def config_fields(text: dict, num_layers: int) -> dict:
    """Every layer attention with a KV cache; `layer_types` (default: even layers sliding) says
    which see only the last `sliding_window` positions; the experts' size is
    `intermediate_size`; biased experts with the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`)."""
    types = text.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    return {
        "layer_types": (FULL,) * num_layers,
        "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        "sliding_window": int(text.get("sliding_window") or 0),
        "norm_topk_prob": True,
        "moe_intermediate_size": int(text.get("intermediate_size") or 0),
        "intermediate_size": 0,
        "expert_bias": True,
        "swiglu_limit": float(text.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(text.get("swiglu_alpha", 1.702)),
    }


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    scale: float,
    key_start: int = 0,
) -> torch.Tensor:
    """Causal attention with a sink logit per head: q `[H, T, D]` at positions `q_pos` `[T]`, k/v
    `[Hkv, L, D]` at positions key_start..key_start+L-1 (query head h reads kv head
    h // (H / Hkv)); a key is seen when at or before the query and, with `window`, within its
    last `window` positions. Scores and softmax in fp32, in steps of query rows."""
    heads, length, dim = q.shape
    kv_heads, keys = k.shape[0], k.shape[1]
    group = heads // kv_heads
    key_pos = torch.arange(key_start, key_start + keys, device=q.device)
    sink = sinks.float().view(kv_heads, group, 1, 1)
    step = max(1, SCORE_BYTES // (4 * heads * max(keys, 1)))
    out = torch.empty_like(q)
    for begin in range(0, length, step):
        rows = slice(begin, begin + step)
        qs = q[:, rows].reshape(kv_heads, group, -1, dim)
        count = qs.shape[2]
        scores = torch.matmul(qs.reshape(kv_heads, -1, dim), k.transpose(1, 2)).float() * scale
        scores = scores.view(kv_heads, group, count, keys)
        seen = key_pos[None, :] <= q_pos[rows, None]
        if window:
            seen = seen & (key_pos[None, :] > q_pos[rows, None] - window)
        scores = scores.masked_fill(~seen, float("-inf"))
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        weights = torch.exp(scores - top)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
        mixed = torch.matmul(weights.to(v.dtype).view(kv_heads, -1, keys), v)
        out[:, rows] = mixed.view(heads, count, dim)
    return out


def flash_sink_attention(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    used: int | torch.Tensor,
    sinks: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """`sink_attention` on CUDA through flash attention's varlen kernel: q `[H, T, D]` at the
    last T of the first `used` (an int, or a `[1]` device tensor) positions of `[Hkv, capacity,
    D]` keys (only those read; the window, if any, in the kernel). A sink only adds exp(sink) to
    each softmax denominator, so the output is flash attention's scaled by
    sigmoid(logsumexp - sink)."""
    if isinstance(used, int):
        used = torch.full((1,), used, dtype=torch.int32, device=q.device)
    out, lse = flash_varlen(q, k_all, v_all, used, window, with_lse=True)
    # (fp32 lse and keep promote sinks and out to fp32 inside the kernels: no copies made)
    keep = torch.sigmoid(lse - sinks[:, None])  # [H, T]
    return (out * keep[..., None]).to(q.dtype)


def flash_sinks_usable(q: torch.Tensor, k: torch.Tensor, window: int) -> bool:
    """Whether `flash_sink_attention` runs and agrees with `sink_attention` for these shapes on
    this device (checked once per shape family; a failure falls back to the plain path)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    key = (q.device, q.dtype, q.shape[0], k.shape[0], q.shape[-1], window)
    return _checked_once(_probe_flash_sinks, *key)


def _probe_flash_sinks(device, dtype, heads: int, kv_heads: int, dim: int, window: int) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    capacity, start = 300, 211

    def rand(*shape) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    k, v, sinks = rand(kv_heads, capacity, dim), rand(kv_heads, capacity, dim), rand(heads)
    try:
        for q_len in (1, 37):
            q = rand(heads, q_len, dim)
            used = torch.full((1,), start + q_len, dtype=torch.long, device=device)
            got = flash_sink_attention(q, k, v, used, sinks, window).float()
            pos = start + torch.arange(q_len, device=device)
            keys = slice(0, start + q_len)
            want = sink_attention(q, k[:, keys], v[:, keys], pos, sinks, window, dim**-0.5)
            if not torch.allclose(got, want.float(), atol=2e-2, rtol=2e-2):
                raise ValueError(f"differs by {(got - want.float()).abs().max():.3g}")
    except Exception as exc:  # noqa: BLE001 - any failure: the plain path is always correct
        print(f"agentrt: flash sink attention unusable ({exc}); using plain torch", file=sys.stderr)
        return False
    return True


class SinkAttention(Fusable):
    """gpt-oss attention: biased projections, YaRN rotary, sinks, an optional sliding window.
    Fused: the q, k and v projections (weights and biases) as one matmul."""

    _qkv: torch.Tensor | None = None
    _qkv_bias: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=True)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=True)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=True)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))
        self.window = cfg.sliding_window if layer in cfg.sliding_layers else 0
        self.rotary = Rotary.of(cfg)

    def fuse_rows(self) -> None:
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self._qkv = row_blocks(parts, self._qkv)
        self._qkv_bias = row_blocks(parts, self._qkv_bias, "bias")

    def forward(
        self, x: torch.Tensor, cache: KVCache, start: Position, captures: Sequence[int] = ()
    ) -> torch.Tensor:
        seq_len = x.shape[0]
        parts = [self.q_proj, self.k_proj, self.v_proj]
        q, k, v = block_linears(x, parts, self._qkv, self._qkv_bias)
        q = q.reshape(seq_len, self.num_heads, self.head_dim)
        k = k.reshape(seq_len, self.num_kv_heads, self.head_dim)
        v = v.reshape(seq_len, self.num_kv_heads, self.head_dim)
        q, k = self.rotary.rotate(q, k, first_position(start))
        q = q.transpose(0, 1)  # [H, T, D]
        if isinstance(start, (Span, torch.Tensor)):  # static pass: the whole buffers, masked
            begin = start.start if isinstance(start, Span) else start
            cache.write_at(begin, k.transpose(0, 1), v.transpose(0, 1))
        else:
            begin = start
            cache.write(start, k.transpose(0, 1), v.transpose(0, 1))
        if flash_sinks_usable(q, cache.k, self.window):  # (reads only the used keys)
            used = per_pass.end_int32(begin, seq_len, q.device)
            out = flash_sink_attention(q, cache.k, cache.v, used, self.sinks, self.window)
        else:
            out = self._plain(q, cache, begin, seq_len)
        return self.o_proj(out.transpose(0, 1).reshape(seq_len, -1))

    def _plain(self, q: torch.Tensor, cache: KVCache, begin, seq_len: int) -> torch.Tensor:
        """`sink_attention` over the keys the pass can see: eagerly (an int `begin`) those
        written, from the window's start on; in a static pass the whole buffers, masked."""
        q_pos = begin + torch.arange(seq_len, device=q.device)
        first, end = 0, cache.k.shape[1]
        if not isinstance(begin, torch.Tensor):
            end = begin + seq_len
            first = max(0, begin - self.window + 1) if self.window else 0
        keys = slice(first, end)
        scale = self.head_dim**-0.5
        return sink_attention(
            q, cache.k[:, keys], cache.v[:, keys], q_pos, self.sinks, self.window, scale, first
        )


class TopKSoftmaxRouter(nn.Module):
    """The top-k router logits (weights and bias), weighted by a softmax over those k."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1, dtype=torch.float).to(x.dtype)  # (no copy)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Alternating gate/up rows (dim 1) -> all gate rows, then all up rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def expert_layout(kind: str, tensor: torch.Tensor, packed: bool) -> torch.Tensor:
    """A checkpoint's fused expert tensor in `RoutedExperts`' layout: bf16 weights are stored
    `[E, in, out]` (MXFP4 ones dequantize to `[E, out, in]`), gate and up interleaved."""
    if kind == "down_proj_bias":
        return tensor
    if kind == "gate_up_proj_bias":
        return _deinterleave(tensor)
    if not packed:
        tensor = tensor.transpose(1, 2)
    return _deinterleave(tensor) if kind == "gate_up_proj" else tensor


def checkpoint_layout(kind: str, tensor: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """The inverse of `expert_layout`: what `GptOssForCausalLM` saves (bf16 weights), or with
    `packed` an MXFP4 pair's `_blocks` / `_scales` from rows in the store's order."""
    if kind == "down_proj_bias":
        return tensor
    if kind == "gate_up_proj_bias":
        return _interleave(tensor)
    tensor = _interleave(tensor) if kind == "gate_up_proj" else tensor
    return tensor if packed else tensor.transpose(1, 2)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """All gate rows, then all up rows (dim 1) -> alternating gate/up rows."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def build(cfg: ModelConfig, experts: RoutedExperts) -> CausalLM:
    if cfg.dense_layers:
        raise ValueError("gpt-oss has no dense MLP layers")
    layers = [
        DecoderLayer(
            "self_attn",
            SinkAttention(cfg, i),
            MoEBlock(cfg, i, experts, TopKSoftmaxRouter(cfg), "router"),
            cfg,
            zc=False,
        )
        for i in range(cfg.num_layers)
    ]
    return CausalLM(cfg, layers, experts, zc=False)
