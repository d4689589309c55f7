"""The next layer's likely CPU experts read into the CPU's caches during a graph piece: the
native pools' warm-ups (`NativeExperts.warm` for bf16 experts, `PackedCPUExperts.warm` for
packed MXFP4 ones), and the host step that posts them and the plan that puts the warmed
experts on the CPU side."""

from __future__ import annotations

import pytest
import torch
from test_offload import (
    _assert_host_step_is_dense,
    _graph_host_steps,
    _native_or_skip,
    _packed_kernel_or_skip,
    _packed_store,
    _random_bf16_store,
)

from agentrt.offload.experts import Bandwidths, OffloadedExperts
from agentrt.offload.slots import ExpertCache
from agentrt.offload.store import ExpertStore


def _warm(kernel, store, layer: int, experts: list[int]) -> bool:
    _, gate_up, down = store.expert_views(layer)
    return kernel.warm([gate_up[e] for e in experts], [down[e] for e in experts])


def test_a_call_after_a_warm_up_gives_the_same_bits(monkeypatch):
    """A posted warm-up only reads: the pool's next call waits for it and computes the same
    bits as a call without one, whichever experts it read; with the pool off nothing is
    posted. Each thread's own share first, then the others': every item is computed once."""
    kernel = _native_or_skip()
    store = _random_bf16_store()
    _, gate_up, down = store.expert_views(0)
    x = torch.randn(store.hidden).to(torch.bfloat16)
    plain, warmed = (torch.zeros(store.hidden) for _ in range(2))
    kernel.run([gate_up[1], gate_up[5]], [down[1], down[5]], [0.4, 0.6], x, plain)
    monkeypatch.setattr(kernel, "pooled", False)
    assert not _warm(kernel, store, 0, [1, 5])
    monkeypatch.setattr(kernel, "pooled", True)
    for experts in ([1, 5], [5], [0, 1, 5, 7], []):
        assert _warm(kernel, store, 0, experts) == bool(experts)
        kernel.start([gate_up[1], gate_up[5]], [down[1], down[5]], [0.4, 0.6], x, warmed)
        kernel.finish()
        assert torch.equal(warmed, plain)
    assert _warm(kernel, store, 0, [2])
    kernel.settle()
    kernel.settle()  # (nothing posted: returns at once)
    again = torch.zeros(store.hidden)
    kernel.run([gate_up[1], gate_up[5]], [down[1], down[5]], [0.4, 0.6], x, again)
    assert torch.equal(again, plain)


def test_a_call_cuts_a_long_warm_up_short_and_still_computes_all_of_itself(monkeypatch):
    """A call posted while a long warm-up still reads (tens of MB) cuts the warm-up short
    rather than waiting for all of it (`agentrt_pool_cancel`), and the cut never reaches the
    call itself: every item is computed, the same bits as without a warm-up, call after call."""
    kernel = _native_or_skip()
    monkeypatch.setattr(kernel, "pooled", True)
    store = ExpertStore(range(1), 24, hidden=1024, inter=1024, dtype=torch.bfloat16, pin=False)
    store.flat[0].normal_(0.0, 0.05)  # (24 experts of 6 MiB)
    _, gate_up, down = store.expert_views(0)
    x = torch.randn(store.hidden).to(torch.bfloat16)
    plain = torch.zeros(store.hidden)
    kernel.run([gate_up[3], gate_up[9]], [down[3], down[9]], [0.3, 0.7], x, plain)
    cancels = []
    real = kernel._cancel
    monkeypatch.setattr(kernel, "_cancel", lambda: (cancels.append(1), real())[1])
    for _ in range(5):
        assert _warm(kernel, store, 0, list(range(24)))
        out = torch.full((store.hidden,), float("nan"))
        kernel.start([gate_up[3], gate_up[9]], [down[3], down[9]], [0.3, 0.7], x, out)
        kernel.finish()
        assert torch.equal(out, plain)
    assert len(cancels) == 5 and kernel._guard.warming is None


def test_host_steps_warm_the_next_layers_likely_cpu_experts(monkeypatch):
    """With the pool and prefetch, a host step reads the predicted experts the next layer lacks
    and did not get copied into the CPU's caches; the steps stay equal to the dense sum, and
    `warm_cpu=False` (`OffloadConfig.cpu_warm`) turns the reads off."""
    kernel = _native_or_skip()
    monkeypatch.setattr(kernel, "pooled", True)
    for warm in (True, False):
        store = _random_bf16_store()
        experts, cache, steps = _graph_host_steps(store, kernel, prefetch=True)
        experts.warm_cpu = warm
        monkeypatch.setattr(experts, "_prefetch_cap", lambda own=0: 1)
        for step in steps:
            _assert_host_step_is_dense(store, cache, *step)
        kernel.settle()
        assert (experts.totals.warmed > 0) == warm
        assert 0 < experts.totals.warm_used <= experts.totals.warmed or not warm


def test_the_plan_puts_warmed_misses_on_the_cpu_side():
    """Of a layer's misses, those read into the CPU's caches for it go to the CPU side first:
    here the two the policy would copy (q* = 2 of 4 at equal bandwidths) run on the CPU, and
    the other two are copied."""
    store = _random_bf16_store()
    cache = ExpertCache(store, 6, "cpu", "lru")
    experts = OffloadedExperts(store, cache, Bandwidths(1.0, 1.0))
    misses = [0, 3, 5, 6]
    ranked = [e for _, e in cache.policy.rank((1, e) for e in misses)]
    experts._warmed[1] = set(ranked[:2])
    gpu, cpu = experts._plan_decode(1, {e: [row] for row, e in enumerate(misses)}, True)
    assert sorted(cpu) == sorted(ranked[:2]) and sorted(gpu) == sorted(ranked[2:])
    assert experts.totals.warm_used == 2 and 1 not in experts._warmed


def test_close_waits_for_a_posted_warm_up(monkeypatch):
    """`OffloadedExperts.close` waits for a warm-up still posted over its store (which may be
    freed next) and releases what it held."""
    kernel = _native_or_skip()
    monkeypatch.setattr(kernel, "pooled", True)
    store = _random_bf16_store()
    cache = ExpertCache(store, 3, "cpu", "lru")
    experts = OffloadedExperts(store, cache, Bandwidths(1.0, 1.0), cpu_kernel=kernel)
    assert _warm(kernel, store, 1, [0, 2, 4]) and kernel._guard.warming is not None
    experts.close()
    assert kernel._guard.warming is None


@pytest.mark.parametrize("biased", [False, True])
def test_a_packed_call_after_a_warm_up_gives_the_same_bits(monkeypatch, biased):
    """The packed MXFP4 kernel's warm-up only reads too: its pool's next call computes the same
    bits as the OpenMP call, whichever experts were read; with the pool off nothing is
    posted."""
    _, store = _packed_store(biased)
    kernel = _packed_kernel_or_skip(store)
    x, ids, w = torch.randn(store.hidden), [1, 4], [0.4, 0.6]
    plain, warmed = (torch.zeros(store.hidden) for _ in range(2))
    kernel.run_experts(1, ids, w, x, plain)
    monkeypatch.setattr(kernel, "pooled", False)
    assert not kernel.warm(1, ids)
    monkeypatch.setattr(kernel, "pooled", True)
    for read in ([1, 4], [4], [0, 1, 4, 5], []):
        assert kernel.warm(1, read) == bool(read)
        kernel.start_experts(1, ids, w, x, warmed)
        kernel.finish()
        assert torch.equal(warmed, plain)
    assert kernel.warm(0, [2]) and kernel._guard.warming is not None
    kernel.settle()
    assert kernel._guard.warming is None


def test_packed_host_steps_warm_the_next_layers_likely_cpu_experts(monkeypatch):
    """Graph host steps over packed MXFP4 experts post the warm-up through the packed kernel
    and stay equal to the dense sum; `close` waits for the last one."""
    _, store = _packed_store(False)
    kernel = _packed_kernel_or_skip(store)
    monkeypatch.setattr(kernel, "pooled", True)
    experts, cache, steps = _graph_host_steps(store, kernel, prefetch=True)
    assert experts.warm_cpu and experts.packed_cpu is kernel
    monkeypatch.setattr(experts, "_prefetch_cap", lambda own=0: 1)
    for step in steps:
        _assert_host_step_is_dense(store, cache, *step)
    assert experts.totals.warmed > 0
    experts.close()
    assert kernel._guard.warming is None


def test_the_warm_up_is_on_for_bf16_experts_and_off_for_packed_ones_by_default():
    """`OffloadConfig.cpu_warm=None` (the default) warms for bf16 stores and not for packed
    MXFP4 ones; True or False decides for both. The installed experts follow it, and `bench
    decode` spells the store's choice out in its settings (and labels)."""
    from agentrt.bench.offload import _resolved, label, load_offloadable
    from agentrt.engine.placement import install
    from agentrt.offload.config import OffloadConfig

    base = dict(mode="auto", expert_cache_slots=4, copy_bandwidth=1.0, cpu_bandwidth=1.0)
    for packed in (False, True):
        model, store, _ = load_offloadable("synthetic:tiny", "cpu", "bfloat16", 0, packed)
        for warm, want in ((None, not packed), (True, True), (False, False)):
            assert OffloadConfig(cpu_warm=warm).warms(packed) == want
            experts = install(model, store, "cpu", OffloadConfig(**base, cpu_warm=warm))
            if experts.layer_cpu is None:  # (no C compiler: nothing to warm)
                pytest.skip("no C compiler (or the native kernel did not build)")
            assert experts.warm_cpu == want
            experts.close()
        setting = _resolved(
            {"offload": "auto", "split": True, "policy": "lfu", "cpu_warm": None}, packed
        )
        assert setting["cpu_warm"] == (not packed)
        assert label(setting).endswith("/no-warm") == packed
    assert _resolved({"offload": "static"}, True) == {"offload": "static"}


def test_install_converts_a_packed_stores_biases_before_any_call():
    """A packed store with biases (gpt-oss): `install` has the MXFP4 kernel convert every
    layer's biases to fp32 at once, so no layer's first decode call converts them on a
    request's path."""
    from agentrt.bench.offload import load_offloadable
    from agentrt.engine.placement import install
    from agentrt.offload.config import OffloadConfig

    model, store, _ = load_offloadable("synthetic:tiny-gpt-oss", "cpu", "bfloat16", 0, True)
    base = dict(mode="auto", expert_cache_slots=4, copy_bandwidth=1.0, cpu_bandwidth=1.0)
    experts = install(model, store, "cpu", OffloadConfig(**base))
    kernel = experts.packed_cpu
    if kernel is None:
        pytest.skip("no C compiler (or the MXFP4 kernel did not build)")
    assert store.bias is not None and sorted(kernel._biases) == store.layers
    for layer in store.layers:
        assert torch.equal(kernel._biases[layer][0], store.bias[layer][0].float())
    experts.close()
