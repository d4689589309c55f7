"""Shared fixtures: tiny random HF checkpoints written by transformers' `save_pretrained` (the
oracle), an isolated AGENTRT_HOME, and helpers. Everything runs on CPU in fp32."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def agentrt_home(tmp_path_factory):
    """Build the embedded tiny model into a fresh per-session home (never the user's cache)."""
    home = tmp_path_factory.mktemp("agentrt-home")
    os.environ["AGENTRT_HOME"] = str(home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield home


def _q35_text_kwargs() -> dict:
    return dict(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=4096,
    )


def _save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_qwen35(tmp_path_factory) -> Path:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(1)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_q35_text_kwargs()))
    return _save(model, tmp_path_factory.mktemp("hf-qwen35"))


@pytest.fixture(scope="session")
def hf_qwen3(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=4096,
    )
    return _save(Qwen3MoeForCausalLM(cfg), tmp_path_factory.mktemp("hf-qwen3"))


@pytest.fixture(scope="session")
def hf_qwen3_tied(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(4)
    cfg = Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    )
    return _save(Qwen3MoeForCausalLM(cfg), tmp_path_factory.mktemp("hf-qwen3-tied"))


@pytest.fixture(scope="session")
def hf_qwen35_multimodal(tmp_path_factory) -> Path:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(3)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    cfg = Qwen3_5MoeConfig(text_config=_q35_text_kwargs(), vision_config=vision)
    return _save(Qwen3_5MoeForConditionalGeneration(cfg), tmp_path_factory.mktemp("hf-qwen35-mm"))


@pytest.fixture(scope="session")
def hf_gpt_oss(tmp_path_factory) -> Path:
    """gpt-oss in miniature: sinks, sliding (window 16) and full layers, YaRN, biased experts
    with the clamped SwiGLU; dims multiples of 32 (MXFP4 blocks)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(5)
    cfg = GptOssConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    )
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():  # visible sinks and biases (their initial values are zeros)
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                param.normal_(0.0, 0.5)
    return _save(model, tmp_path_factory.mktemp("hf-gpt-oss"))


@pytest.fixture(scope="session")
def hf_checkpoints(
    hf_qwen35, hf_qwen3, hf_qwen35_multimodal, hf_qwen3_tied, hf_gpt_oss
) -> dict[str, Path]:
    return {
        "qwen3_5_moe": hf_qwen35,
        "qwen3_moe": hf_qwen3,
        "qwen3_5_moe_multimodal": hf_qwen35_multimodal,
        "qwen3_moe_tied": hf_qwen3_tied,
        "gpt_oss": hf_gpt_oss,
    }


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """The attention-only tiny model (`tiny-qwen3-moe`) with the tiny tokenizer and template."""
    from agentrt.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-qwen3") / "model", "tiny-qwen3-moe")


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> Path:
    """`tiny-gpt-oss` (sinks, sliding window, biased clamped experts) with the tiny tokenizer."""
    from agentrt.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-gpt-oss") / "model", "tiny-gpt-oss")
