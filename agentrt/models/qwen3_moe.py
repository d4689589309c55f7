"""Qwen3-MoE: attention-only decoder (q/k RMSNorm, full rotary), routed experts with top-k softmax
routing (optionally renormalised), no shared expert; `mlp_only_layers` / `decoder_sparse_step`
layers use a dense SwiGLU MLP. Weight names match `Qwen3MoeForCausalLM` (prefix `model.`).
"""

from __future__ import annotations

from agentrt.models.config import ModelConfig
from agentrt.models.layers import Attention, CausalLM, DecoderLayer, build_mlp
from agentrt.models.moe import RoutedExperts


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
