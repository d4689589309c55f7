"""Parity with the transformers oracle (fp32, CPU) on tiny random save_pretrained checkpoints."""

from __future__ import annotations

import pytest
import torch
from util import open_engine, random_ids

from agentrt import Runtime

ARCHS = ["qwen3_5_moe", "qwen3_moe", "qwen3_5_moe_multimodal", "qwen3_moe_tied", "gpt_oss"]


def _hf_model(path):
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    if "mm" in path.name:
        return Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(hf_checkpoints, arch):
    path = hf_checkpoints[arch]
    ids = random_ids(150, seed=5)
    with torch.no_grad():
        ref = _hf_model(path)(torch.tensor([ids])).logits[0]
    engine = open_engine(path)
    ours = engine.prefill(engine.new_state(), ids, all_logits=True)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_transformers(hf_checkpoints, arch):
    path = hf_checkpoints[arch]
    ids = random_ids(40, seed=6)
    with torch.no_grad():
        out = _hf_model(path).generate(
            torch.tensor([ids]),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )
    expected = out[0, len(ids) :].tolist()
    rt = Runtime.open(model=str(path), device="cpu")
    assert rt.generate(ids, max_tokens=32, temperature=0.0) == expected


def test_bf16_error_is_no_worse_than_transformers(hf_qwen35):
    """bf16 vs fp32 (CPU): our engine's logits error stays within 1.5x transformers' own."""
    ids = random_ids(120, seed=8)
    with torch.no_grad():
        hf32 = _hf_model(hf_qwen35)(torch.tensor([ids])).logits[0]
        from transformers import AutoModelForCausalLM

        hf16 = AutoModelForCausalLM.from_pretrained(hf_qwen35, dtype=torch.bfloat16).eval()
        hf_err = (hf16(torch.tensor([ids])).logits[0].float() - hf32).abs().mean().item()
    from agentrt.engine import Engine
    from agentrt.engine.config import EngineConfig
    from agentrt.models.loader import load_model

    eng = Engine(load_model(hf_qwen35, "cpu", torch.bfloat16), EngineConfig(dtype="bfloat16"))
    ours = eng.prefill(eng.new_state(), ids, all_logits=True)
    our_err = (ours - hf32).abs().mean().item()
    assert our_err < 1.5 * hf_err, (our_err, hf_err)
