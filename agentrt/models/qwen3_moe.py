"""Qwen3-MoE: attention-only decoder (q/k RMSNorm, full rotary), routed experts with top-k softmax
routing (optionally renormalised), no shared expert; `mlp_only_layers` / `decoder_sparse_step`
layers use a dense SwiGLU MLP. Weight names match `Qwen3MoeForCausalLM` (prefix `model.`).
"""

from __future__ import annotations

from agentrt.models.config import FULL, ModelConfig
from agentrt.models.layers import Attention, CausalLM, DecoderLayer, build_mlp
from agentrt.models.moe import RoutedExperts

MODEL_TYPES = ("qwen3_moe",)  # config.json `model_type`s read as this architecture
ZERO_CENTERED_NORMS = False  # RMSNorm weights stored as they scale (a synthetic model's: 1)


def config_fields(text: dict, num_layers: int) -> dict:
    """This architecture's `ModelConfig` fields: every layer full attention; the layers listed
    in `mlp_only_layers` or off the `decoder_sparse_step` grid dense."""
    only = set(text.get("mlp_only_layers") or [])
    step = int(text.get("decoder_sparse_step", 1) or 1)
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
    return {
        "layer_types": (FULL,) * num_layers,
        "dense_layers": dense,
        "norm_topk_prob": bool(text.get("norm_topk_prob", False)),
    }


def build(cfg: ModelConfig, experts: RoutedExperts) -> CausalLM:
    layers = [
        DecoderLayer(
            "self_attn",
            Attention(cfg, output_gate=False, zero_centered=False),
            build_mlp(cfg, i, experts),
            cfg,
            zc=False,
        )
        for i in range(cfg.num_layers)
    ]
    return CausalLM(cfg, layers, experts, zc=False)
