"""Decode fusions (`models.fusion`): fused forms against the plain ones on a tiny random
Qwen3.5-MoE checkpoint (fp32, CPU), weights kept as views of the fused blocks through moves and
in-place writes, and the top-k softmax of the router."""

from __future__ import annotations

import torch
from util import random_ids

from agentrt.models.ffn import MLP, MoEBlock, Router
from agentrt.models.fusion import derive
from agentrt.models.layers import Attention
from agentrt.models.loader import load_model
from agentrt.models.qwen3_5_moe import GatedDeltaNet


def _logits(model, ids: list[int]) -> torch.Tensor:
    from agentrt.engine import Engine
    from agentrt.engine.config import EngineConfig

    engine = Engine(model, EngineConfig(device="cpu", dtype="float32"))
    state = engine.new_state()
    prefill = engine.prefill(state, ids[:-3], all_logits=True)
    return torch.cat([prefill, torch.stack([engine.decode_step(state, t) for t in ids[-3:]])])


def _plain_then_fused(path, ids: list[int], monkeypatch):
    """The checkpoint at `path` loaded without its fusions, then with them (fp32, CPU): both
    models, after the fused one's logits are checked against the plain one's."""
    import agentrt.engine.engine as engine_module
    import agentrt.models as models

    monkeypatch.setattr(engine_module, "derive", lambda model: None)
    monkeypatch.setattr(models, "fuse_rows", lambda model: None)
    plain_model = load_model(path, "cpu", torch.float32)
    plain = _logits(plain_model, ids)
    monkeypatch.undo()
    model = load_model(path, "cpu", torch.float32)
    torch.testing.assert_close(_logits(model, ids), plain, rtol=1e-4, atol=1e-4)
    return plain_model, model


def test_fused_forward_equals_the_plain_one(hf_qwen35, monkeypatch):
    """Prefill and decode logits with the fusions match the plain forms (fp32, CPU), and each
    fused module's weights are row views of its block (no extra memory)."""
    plain_model, model = _plain_then_fused(hf_qwen35, random_ids(60, seed=3), monkeypatch)
    assert next(m for m in plain_model.modules() if isinstance(m, GatedDeltaNet))._in_proj is None
    gdn = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    moe = next(m for m in model.modules() if isinstance(m, MoEBlock))
    assert gdn.in_proj_qkv.weight.data_ptr() == gdn._in_proj.data_ptr()
    assert gdn.in_proj_a.weight.data_ptr() == gdn._in_proj[-gdn.num_v_heads :].data_ptr()
    assert gdn._neg_a is not None and gdn._taps is not None
    assert moe.shared_expert.gate_proj.weight.data_ptr() == moe._shared_in.data_ptr()
    assert moe.shared_expert._gate_up is None  # (the block fuses its shared expert)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    rows = attn.q_proj.out_features + attn.k_proj.out_features
    assert attn.v_proj.weight.data_ptr() == attn._qkv[rows:].data_ptr()


def test_fused_gpt_oss_attention_equals_the_plain_one(tiny_gpt_oss, monkeypatch):
    """gpt-oss's q, k and v projections as one matmul, weights and biases row views of the
    fused blocks: the same prefill and decode logits as the three projections (fp32, CPU)."""
    from agentrt.models.gpt_oss import SinkAttention

    plain_model, model = _plain_then_fused(tiny_gpt_oss, random_ids(60, seed=5), monkeypatch)
    assert next(m for m in plain_model.modules() if isinstance(m, SinkAttention))._qkv is None
    attn = next(m for m in model.modules() if isinstance(m, SinkAttention))
    rows = attn.q_proj.out_features
    assert attn.k_proj.weight.data_ptr() == attn._qkv[rows:].data_ptr()
    assert attn.k_proj.bias.data_ptr() == attn._qkv_bias[rows:].data_ptr()
    assert attn.q_proj.bias.abs().sum() > 0  # (the biases the fused matmul adds are real)


def test_fused_weights_follow_moves_and_in_place_writes():
    """After a move (`.to`) the weights are views of a fused block again, and a weight written
    in place (as the loader writes) is what the fused matmul reads."""
    torch.manual_seed(0)
    mlp = MLP(8, 6)
    derive(mlp)
    x = torch.randn(3, 8)
    mlp = mlp.to(torch.float64)
    assert mlp._gate_up.dtype == torch.float64
    assert mlp.up_proj.weight.data_ptr() == mlp._gate_up[6:].data_ptr()
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2.0)
    x = x.double()
    want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), want)


def test_derived_constants_follow_weights_written_in_place_when_derived_again(hf_qwen35):
    """`derive(model)` after an in-place weight write computes the constants again, into the
    same tensors (a captured graph reads them there)."""
    model = load_model(hf_qwen35, "cpu", torch.float32)
    derive(model)
    gdn = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    neg_a, taps = gdn._neg_a.data_ptr(), gdn._taps.data_ptr()
    weight = gdn.conv1d.weight
    assert not (weight.data_ptr() <= taps < weight.data_ptr() + weight.nbytes)  # its own
    with torch.no_grad():
        gdn.A_log.add_(0.5)
        gdn.conv1d.weight.mul_(2.0)
    derive(model)
    assert (gdn._neg_a.data_ptr(), gdn._taps.data_ptr()) == (neg_a, taps)
    torch.testing.assert_close(gdn._neg_a, -gdn.A_log.detach().float().exp())
    from agentrt.models import kernels

    torch.testing.assert_close(gdn._taps, kernels.conv_taps(gdn.conv1d.weight.detach()))


def test_router_softmax_over_the_top_k_equals_renormalised_probabilities():
    """With renormalisation, a softmax over the k largest logits gives the renormalised top-k
    probabilities of the full softmax, for the same experts."""
    from types import SimpleNamespace

    torch.manual_seed(1)
    cfg = SimpleNamespace(num_experts_per_tok=4, norm_topk_prob=True, num_experts=16, hidden_size=8)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(5, 8)
    ids, weights = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    top, want_ids = torch.topk(probs, 4, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
