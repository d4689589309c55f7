"""Linear-attention kernels: the chunked gated delta rule equals the token-by-token reference,
for any length, with grouped value heads, when split into segments; the states one pass yields
at given offsets equal those of passes stopped there; causal conv state carries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrt.models import kernels


def _inputs(seq_len: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, hk, dk, generator=g)
    k = torch.randn(seq_len, hk, dk, generator=g)
    v = torch.randn(seq_len, hv, dv, generator=g)
    decay = -torch.rand(seq_len, hv, generator=g) * 4
    beta = torch.rand(seq_len, hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("seq_len", [1, 5, 63, 64, 65, 200])
def test_chunk_matches_recurrent(seq_len):
    args = _inputs(seq_len)
    out_ref, state_ref = kernels.recurrent_gated_delta_rule(*args)
    out, state = kernels.chunk_gated_delta_rule(*args)
    assert torch.allclose(out, out_ref, atol=1e-5)
    assert torch.allclose(state, state_ref, atol=1e-5)


def test_segments_chain_to_one_pass():
    q, k, v, g, beta, s0 = _inputs(150, seed=1)
    full, final = kernels.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    outs, state = [], s0
    for a, b in [(0, 1), (1, 70), (70, 129), (129, 150)]:
        o, state = kernels.chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
        outs.append(o)
    assert torch.allclose(torch.cat(outs), full, atol=1e-5)
    assert torch.allclose(state, final, atol=1e-5)


@pytest.mark.parametrize("seq_len", [3, 64, 150])
def test_states_at_offsets_equal_stopped_passes(seq_len):
    q, k, v, g, beta, s0 = _inputs(seq_len, seed=4)
    offsets = sorted(
        {1, 2, 63, 64, 65, 128, 129, seq_len - 1, seq_len} & set(range(1, seq_len + 1))
    )
    ends = torch.tensor(offsets)
    out, final, states = kernels.gated_delta_rule_states(q, k, v, g, beta, s0, ends)
    full, full_final = kernels.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert torch.allclose(out, full, atol=1e-5) and torch.allclose(final, full_final, atol=1e-5)
    assert states.shape == (len(offsets), *s0.shape)
    for state, end in zip(states, offsets, strict=True):
        _, ref = kernels.recurrent_gated_delta_rule(
            q[:end], k[:end], v[:end], g[:end], beta[:end], s0
        )
        assert torch.allclose(state, ref, atol=1e-5), end
    windows = kernels.window_index(ends, seq_len)  # precomputed once for all layers of a pass
    assert torch.equal(kernels.gated_delta_rule_states(q, k, v, g, beta, s0, windows)[2], states)


def test_states_on_the_chunk_grid_are_the_chunk_starts():
    """Ends given as ints on the 64-token grid (`Engine.capture_grid`) take the chunk-start
    states of the pass, no window: the same states as the windows give there."""
    q, k, v, g, beta, s0 = _inputs(300, seed=7)
    grid = (64, 128, 256)
    _, _, states = kernels.gated_delta_rule_states(q, k, v, g, beta, s0, grid)
    _, _, windows = kernels.gated_delta_rule_states(q, k, v, g, beta, s0, torch.tensor(grid))
    for a, b in zip(states, windows, strict=True):
        assert a.dtype == torch.float32 and torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="multiples of 64"):
        kernels.gated_delta_rule_states(q, k, v, g, beta, s0, (64, 100))


def test_states_by_reruns_agree_with_one_pass():
    """The fallback for fla releases whose internals differ: one masked rerun per offset."""
    q, k, v, g, beta, s0 = _inputs(150, seed=5)
    ends = torch.tensor([1, 64, 100, 150])
    one_pass = kernels.gated_delta_rule_states(q, k, v, g, beta, s0, ends)
    reruns = kernels._states_by_reruns(q, k, v, g, beta, s0, ends, "torch")
    for a, b in zip(one_pass, reruns, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_grouped_value_heads_use_interleaved_key_heads():
    q, k, v, g, beta, s0 = _inputs(20, hk=2, hv=4, seed=2)
    out, _ = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    rep_q, rep_k = q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1)
    out_rep, _ = kernels.recurrent_gated_delta_rule(rep_q, rep_k, v, g, beta, s0)
    assert torch.allclose(out, out_rep)
    # value head 1 reads key head 0, value head 2 reads key head 1
    swapped, _ = kernels.recurrent_gated_delta_rule(q.flip(1), k.flip(1), v, g, beta, s0)
    assert not torch.allclose(out[:, 1], swapped[:, 1])


def test_causal_conv_carries_state():
    g = torch.Generator().manual_seed(3)
    channels, kernel = 6, 4
    x = torch.randn(channels, 30, generator=g)
    weight = torch.randn(channels, 1, kernel, generator=g)
    ref = F.silu(F.conv1d(F.pad(x, (kernel - 1, 0)).unsqueeze(0), weight, groups=channels)).squeeze(
        0
    )
    state = torch.zeros(channels, kernel - 1)
    out1, padded = kernels.causal_conv(x[:, :11].T, state, weight)  # time-major [T, C]
    out2, padded = kernels.causal_conv(x[:, 11:27].T, padded[-(kernel - 1) :].T, weight)
    steps = []  # then one token at a time (decode's form), with the taps kept by the caller
    for t in range(27, 30):
        taps = kernels.conv_taps(weight)
        out, padded = kernels.causal_conv(
            x[:, t : t + 1].T, padded[-(kernel - 1) :].T, weight, taps=taps
        )
        steps.append(out)
    assert torch.allclose(torch.cat([out1, out2, *steps]).T, ref, atol=1e-6)


def test_backend_resolution_on_cpu():
    assert kernels.resolve_backend("auto", "cpu") == "torch"
    assert kernels.resolve_backend("torch", "cpu") == "torch"
    from agentrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        kernels.resolve_backend("fla", "cpu")
