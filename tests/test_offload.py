"""Expert offloading on the CPU (the cache is a pool of CPU slots, copies are memcpy): outputs
equal the non-offloaded model for copy-only, CPU-only and split misses, prefill streaming and the
static baseline; the q* rule; cache and policy invariants; budget sizing; calibration."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from agentrt import Runtime
from agentrt.models.registry import config_of
from agentrt.offload.config import OffloadConfig
from agentrt.offload.policy import LFU, LRU
from agentrt.offload.slots import ExpertCache
from agentrt.offload.split import q_star, split_time
from agentrt.offload.store import ExpertStore

PROMPT = "The quick brown fox reads main.py and runs the tests again. " * 12


@pytest.fixture(scope="module", params=["tiny", "attention-only", "gpt-oss"])
def model_spec(request, tiny_qwen3, tiny_gpt_oss):
    """The hybrid tiny model, an attention-only one, and gpt-oss (expert biases, the clamped
    SwiGLU: the native CPU kernel does not take them, torch's kernels do)."""
    specs = {"tiny": "tiny", "attention-only": tiny_qwen3, "gpt-oss": tiny_gpt_oss}
    return str(specs[request.param])


@pytest.fixture(scope="module")
def reference(model_spec):
    rt = Runtime.open(model_spec, cache="off")
    ids = rt.tokenizer.encode(PROMPT)
    logits = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    return ids, rt.generate(ids, max_tokens=20), logits


CONFIGS = {
    "split": OffloadConfig(
        mode="auto", expert_cache_slots=10, copy_bandwidth=1.0, cpu_bandwidth=1.0
    ),
    "copy-only": OffloadConfig(
        mode="auto", expert_cache_slots=10, split=False, copy_bandwidth=1.0, cpu_bandwidth=1.0
    ),
    "cpu-only": OffloadConfig(
        mode="auto", expert_cache_slots=10, copy_bandwidth=1e-12, cpu_bandwidth=1.0
    ),
    "lfu": OffloadConfig(
        mode="auto", expert_cache_slots=24, policy="lfu", copy_bandwidth=2.0, cpu_bandwidth=1.0
    ),
    "no-prefetch": OffloadConfig(
        mode="auto", expert_cache_slots=10, prefetch=False, copy_bandwidth=2.0, cpu_bandwidth=1.0
    ),
    "static": OffloadConfig(mode="static", cpu_moe_layers=2),
    "layer": OffloadConfig(mode="layer", cpu_layers=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_offloaded_equals_dense(model_spec, reference, name):
    ids, want_tokens, want_logits = reference
    rt = Runtime.open(model_spec, cache="off", offload=CONFIGS[name])
    experts = rt.engine.offload
    logits = rt.engine.prefill(
        rt.engine.new_state(), ids, all_logits=True
    )  # prefill: streamed misses
    assert (logits - want_logits).abs().max().item() < 1e-4
    assert rt.generate(ids, max_tokens=20) == want_tokens  # decode: copies and/or CPU misses
    experts.cache.check()
    t = experts.totals
    if name == "copy-only":
        assert t.copied > 0 and t.cpu == 0
    elif name == "cpu-only":
        assert t.cpu > 0 and t.copied == 0
    elif name == "split":
        assert t.copied > 0 and t.cpu > 0
    elif name in ("static", "layer"):
        assert t.cpu > 0 and t.copied == 0 and t.streamed == 0
    if name == "layer":
        hosted = [type(layer).__name__ == "HostLayer" for layer in rt.engine.model.layers]
        assert hosted[:2] == [True, True] and not any(hosted[2:])
    if name not in ("static", "layer"):  # the long prompt went through the prefill path
        assert experts.prefill.totals.layers > 0
        assert (t.streamed > 0) == (name != "cpu-only")
    # decode copied ahead the experts the next layer's router predicted (not for the baselines)
    assert (t.prefetched > 0) == (name not in ("static", "layer", "no-prefetch"))
    assert 0 <= t.prefetch_hits <= t.prefetched


@pytest.mark.parametrize("name", ["split", "cpu-only", "copy-only"])
def test_short_prefill_shares_few_token_experts_with_the_cpu(model_spec, reference, name):
    """A short prefill (a suffix: most experts get a few tokens) with the split runs some missing
    experts on the CPU and streams the rest; copy-only streams them all. Logits equal dense."""
    ids, _, _ = reference
    prompt = ids[:24]  # 96 (token, expert) pairs: the prefill path, a few tokens per expert
    dense = Runtime.open(model_spec, cache="off")
    want = dense.engine.prefill(dense.engine.new_state(), prompt, all_logits=True)
    rt = Runtime.open(model_spec, cache="off", offload=CONFIGS[name])
    got = rt.engine.prefill(rt.engine.new_state(), prompt, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    t = rt.engine.offload.totals
    assert t.copied == 0  # prefill admits nothing
    if name == "copy-only":
        assert t.cpu == 0 and t.streamed > 0
    elif name == "cpu-only":
        assert t.cpu > 0
    else:
        assert t.cpu > 0 and t.streamed > 0


def test_q_star_counts_copies_already_queued():
    """Prefetches still on the copy engine make the copy side start late: fewer copies."""
    assert q_star(6, 2.0, 1.0) == 4 and q_star(6, 2.0, 1.0, queued=0.0) == 4
    assert q_star(6, 2.0, 1.0, queued=3.0) == 3  # max((3+3)/2, 3/1) = 3
    assert q_star(6, 2.0, 1.0, queued=20.0) == 0  # everything on the CPU
    assert q_star(6, 1.0, 0.0, queued=5.0) == 6  # no CPU side: copies regardless


def test_q_star_rounding():
    assert q_star(0, 1, 1) == 0
    assert q_star(8, 1, 1) == 4
    assert q_star(8, 3, 1) == 6  # copies three times faster: 6 copied, 2 on the CPU
    assert q_star(7, 1, 1) in (3, 4)
    assert q_star(5, 1, 0) == 5 and q_star(5, 0, 1) == 0
    for m in range(0, 20):
        for bp, bh in [(55, 21), (55, 42), (10, 40), (1, 1)]:
            q = q_star(m, bp, bh)
            best = min(range(m + 1), key=lambda k: split_time(m, k, 1, bp, bh))
            assert split_time(m, q, 1, bp, bh) == pytest.approx(split_time(m, best, 1, bp, bh))


def test_q_star_is_the_fastest_split_ties_to_more_copies():
    """Against every q: the least max(copy side, CPU side) with copies queued ahead, and of
    equal times the most copies."""
    rng = random.Random(4)
    for _ in range(2000):
        m, queued = rng.randrange(0, 24), rng.choice([0.0, rng.uniform(0, 12)])
        bp, bh = rng.choice([1.0, 2.0, 55.0, rng.uniform(0.1, 80)]), rng.uniform(0.1, 80)
        cost = [max((queued + q) / bp, (m - q) / bh) for q in range(m + 1)]
        want = max(q for q in range(m + 1) if cost[q] == min(cost))
        assert cost[q_star(m, bp, bh, queued)] == pytest.approx(cost[want]), (m, queued, bp, bh)
    assert q_star(7, 1.0, 1.0) == 4  # 3 or 4 copies both take 4: the copies


def _store(layers=3, experts=8) -> ExpertStore:
    store = ExpertStore(range(layers), experts, hidden=4, inter=2, dtype=torch.float32, pin=False)
    for layer in store.layers:
        store.flat[layer].copy_(
            torch.arange(store.flat[layer].numel(), dtype=torch.float32).view_as(store.flat[layer])
        )
    return store


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cache_invariants_under_random_use(policy):
    store = _store()
    cache = ExpertCache(store, 5, "cpu", policy)
    rng = random.Random(0)
    for _ in range(500):
        layer = rng.randrange(3)
        wanted = {(layer, rng.randrange(8)) for _ in range(3)}
        for key in wanted:
            cache.policy.touch(key)
            if cache.lookup(*key) < 0:
                slot = cache.admit(*key, exclude=wanted)
                assert slot is not None
        cache.check()
        for key in wanted:  # what a step needs is resident at the end of the step
            assert cache.lookup(*key) >= 0


def test_lru_and_lfu_choose_different_victims():
    lru, lfu = LRU(), LFU()
    for policy in (lru, lfu):
        for key in [(0, 1), (0, 2)]:
            policy.insert(key)
        for _ in range(5):
            policy.touch((0, 1))  # a favourite, used long ago
        policy.touch((0, 2))  # used once, recently
    assert lru.victim(set()) == (0, 1)  # least recently used
    assert lfu.victim(set()) == (0, 2)  # least frequently used
    assert lfu.rank([(0, 2), (0, 1)])[0] == (0, 1)


def test_lfu_heap_victim_is_the_least_frequent_resident():
    """The lazily invalidated heap picks what a full scan would: min (count, last use)."""
    lfu, rng = LFU(half_life=97), random.Random(1)
    for step in range(3000):
        key = (rng.randrange(4), rng.randrange(16))
        lfu.touch(key)
        if key not in lfu.order:
            if len(lfu.order) >= 20:
                exclude = {(rng.randrange(4), rng.randrange(16)) for _ in range(3)}
                resident = [k for k in lfu.order if k not in exclude]
                want = min(resident, key=lambda k: (lfu.count.get(k, 0.0), lfu.last_use[k]))
                assert lfu.victim(exclude) == want, step
                lfu.remove(want)
            lfu.insert(key)


def test_lfu_victim_stays_exact_through_rescales_and_victims_kept():
    """Counts scaled down before they overflow keep the order; a victim its caller keeps
    resident after all is still found the next time."""
    lfu, rng = LFU(half_life=31), random.Random(2)
    lfu.RESCALE_AT = 1e3  # (a rescale every few hundred uses)
    rescales = 0
    for step in range(4000):
        key = (rng.randrange(4), rng.randrange(16))
        weight = lfu.weight
        lfu.touch(key)
        rescales += lfu.weight < weight
        if key in lfu.order:
            continue
        if len(lfu.order) >= 20:
            resident = list(lfu.order)
            want = min(resident, key=lambda k: (lfu.count.get(k, 0.0), lfu.last_use[k]))
            assert lfu.victim(set()) == want, step
            if rng.random() < 0.2:  # kept: asked again, the same answer
                assert lfu.victim(set()) == want, step
            lfu.remove(want)
        lfu.insert(key)
    assert rescales > 5


def test_lfu_victim_is_exact_in_the_engines_order_of_calls():
    """As the engine calls it: a layer's misses admitted in place of victims outside the
    layer's experts (inserted keys get their entry later), then every routed expert touched;
    now and then a key dropped without being a victim, or dropped and admitted again."""
    lfu, rng = LFU(half_life=53), random.Random(3)
    for step in range(3000):
        layer = rng.randrange(4)
        keys = {(layer, e) for e in rng.sample(range(16), 4)}
        for key in sorted(keys - set(lfu.order)):
            if len(lfu.order) >= 24:
                resident = [k for k in lfu.order if k not in keys]
                want = min(resident, key=lambda k: (lfu.count.get(k, 0.0), lfu.last_use[k]))
                assert lfu.victim(keys) == want, step
                lfu.remove(want)
            lfu.insert(key)
        for key in keys:
            lfu.touch(key)
        if rng.random() < 0.1:  # (a copy that could not be issued; then perhaps again)
            dropped = rng.choice(list(lfu.order))
            lfu.remove(dropped)
            if rng.random() < 0.5:
                lfu.insert(dropped)


def test_bench_decode_replays_the_timed_steps_routing_only(tmp_path, monkeypatch):
    """`lru_hit_rate` replays the timed steps' routing (after the warm-up's), not the steps
    profiled after them."""
    from agentrt.bench import offload as bench_offload

    replayed = []

    def recording(log, slots, count_from=0):
        replayed.append((len(log) - count_from, len({layer for layer, _ in log})))
        return 0.5

    monkeypatch.setattr(bench_offload, "lru_replay", recording)
    runs = bench_offload.settings(["auto"], [True], ["lfu"])
    report = bench_offload.offload_decode(
        "tiny", "cpu", None, None, runs, 8, 4, 0, False, py_profile=str(tmp_path / "p.txt")
    )
    ((counted, layers),) = replayed
    assert counted == 4 * layers and report["runs"][0]["lru_hit_rate"] == 0.5


def test_decode_settings_vary_the_overlap_and_the_pace_of_auto_only():
    from agentrt.bench import offload as bench_offload

    runs = bench_offload.settings(["static", "auto"], [True], ["lfu"], overlaps=(True, False))
    default = bench_offload.label(runs[1 - OffloadConfig.overlap])
    other = bench_offload.label(runs[OffloadConfig.overlap])
    assert default == "auto/split/lfu" and runs[2]["offload"] == "static"
    assert other == "auto/split/lfu/" + ("no-overlap" if OffloadConfig.overlap else "overlap")
    runs = bench_offload.settings(["auto"], [True], ["lfu"], paces=(True, False))
    names = [bench_offload.label(r) for r in runs]
    assert names == ["auto/split/lfu/paced", "auto/split/lfu/unpaced"]
    assert [r["pace"] for r in runs] == [True, False]


def test_native_pool_waits_for_a_call_its_thread_left():
    """A call posted to the native kernel's pool and never waited for (a captured decode step
    that failed between its host step's halves) is waited for by the thread's next call, which
    then runs (the library's lock would otherwise stop it for good)."""
    kernel = _native_or_skip()
    torch.manual_seed(0)
    gate_up = (torch.randn(2, 16, 32) * 0.1).to(torch.bfloat16)
    down = (torch.randn(2, 32, 8) * 0.1).to(torch.bfloat16)
    x, left, out = torch.randn(32).to(torch.bfloat16), torch.zeros(32), torch.zeros(32)
    kernel.start([gate_up[0]], [down[0]], [1.0], x, left)
    kernel.run([gate_up[1]], [down[1]], [1.0], x, out)
    assert not kernel.posted and left.abs().sum() > 0 and out.abs().sum() > 0
    kernel.start([gate_up[0]], [down[0]], [1.0], x, left)
    kernel.start([gate_up[1]], [down[1]], [1.0], x, out)  # (a post after a post: the same)
    assert kernel.finish() > 0 and not kernel.posted


def test_lru_replay_counts_a_plain_lru_over_the_timed_steps():
    from agentrt.bench.offload_figures import lru_replay

    log = [(0, [1, 2]), (1, [1]), (0, [1, 3]), (0, [2, 1])]
    # 3 slots. warm: (0,1) (0,2) (1,1); step 2: (0,1) hit, (0,3) miss evicts (0,2);
    # step 3: (0,2) miss evicts (1,1), (0,1) hit
    assert lru_replay(log, slots=3, count_from=2) == 0.5
    assert lru_replay(log, slots=3) == 2 / 7
    assert lru_replay([], slots=3) is None


@pytest.mark.parametrize("name", ["lru", "lfu"])
def test_policy_step_admits_misses_in_place_of_victims_outside_the_layer(name):
    from agentrt.bench.offload_figures import policy_step
    from agentrt.offload.policy import POLICIES

    policy, resident = POLICIES[name](), set()
    assert policy_step(policy, resident, 0, [1, 2], slots=2) == 0
    assert policy_step(policy, resident, 0, [1, 3], slots=2) == 1  # (0, 2) evicted
    assert resident == {(0, 1), (0, 3)} == set(policy.order)
    assert policy_step(policy, resident, 1, [1, 2, 3], slots=2) == 0  # (room for two)
    assert policy_step(policy, resident, 1, [4, 5, 6], slots=2) == 0
    assert len(resident) == 2


def test_lfu_counts_fade_with_their_half_life():
    lfu = LFU(half_life=100)
    for key in [(0, 1), (0, 2)]:
        lfu.insert(key)
    for _ in range(3):
        lfu.touch((0, 1))  # three uses, then 200 uses elsewhere: worth 3/4 of a use now
    for _ in range(200):
        lfu.touch((1, 0))
    lfu.touch((0, 2))  # one use, now
    assert lfu.victim(set()) == (0, 1)
    assert 0.7 < lfu.count[(0, 1)] / lfu.count[(0, 2)] < 0.8


@pytest.mark.slow
def test_slots_follow_the_vram_budget():
    from agentrt.engine.placement import (
        dense_bytes,
        kv_bytes_per_token,
        slots_for_budget,
        staging_bytes,
    )

    rt = Runtime.open(cache="off", offload="auto", vram_budget="2GiB", expert_policy="lru")
    model, store = rt.engine.model, rt.engine.offload.store
    config = OffloadConfig(
        mode="auto", vram_budget=64 * 2**20, kv_reserve_tokens=1024, workspace_bytes=2**20
    )
    staging = staging_bytes(store, config)
    assert staging > 0  # the prefill staging ring comes out of the budget
    expected = (
        64 * 2**20 - dense_bytes(model) - 1024 * kv_bytes_per_token(model) - 2**20 - staging
    ) // store.expert_bytes
    assert slots_for_budget(model, store, config) == expected
    from agentrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="no room for experts"):
        slots_for_budget(model, store, OffloadConfig(mode="auto", vram_budget=2**20))


def _elastic_config(model_spec, reserve: int, slots: int) -> tuple[OffloadConfig, int]:
    """An auto config whose budget holds the model's dense weights, KV for `reserve` tokens,
    the prefill staging and `slots` experts (no workspace); and the staging's bytes."""
    from agentrt.engine.placement import dense_bytes, kv_bytes_per_token, staging_bytes

    probe = Runtime.open(model_spec, cache="off", offload=CONFIGS["split"])
    model, store = probe.engine.model, probe.engine.offload.store
    staging = staging_bytes(store, OffloadConfig(mode="auto"))
    budget = (
        dense_bytes(model)
        + reserve * kv_bytes_per_token(model)
        + slots * store.expert_bytes
        + staging
    )
    config = OffloadConfig(
        mode="auto",
        vram_budget=budget,
        kv_reserve_tokens=reserve,
        workspace_bytes=0,
        copy_bandwidth=1.0,
        cpu_bandwidth=1.0,
    )
    return config, staging


def test_growing_kv_takes_room_from_the_expert_cache(model_spec, reference):
    """Elastic (docs/architecture.md §5): under a VRAM budget, KV that outgrows its reservation
    shrinks the expert cache by what it takes, and outputs still equal the dense model's; a prompt
    whose KV would leave no room for one token's experts is refused before anything changes."""
    from agentrt.engine.placement import dense_bytes
    from agentrt.errors import PromptTooLongError

    ids, want_tokens, want_logits = reference
    reserve, slots = 64, 40  # KV for 64 tokens, then 40 slots (and the prefill staging)
    config, staging = _elastic_config(model_spec, reserve, slots)
    budget = config.vram_budget
    rt = Runtime.open(model_spec, cache="off", offload=config)
    model, store = rt.engine.model, rt.engine.offload.store
    cache = rt.engine.offload.cache
    assert cache.num_slots == slots
    logits = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (logits - want_logits).abs().max().item() < 1e-4
    assert rt.generate(ids, max_tokens=20) == want_tokens
    state = rt.engine.new_state()
    rt.engine.prefill(state, ids)
    kv = sum(c.bytes_at(c.capacity) for c in state.kv_caches())
    assert cache.resizes >= 1 and cache.num_slots < slots
    assert cache.num_slots == (budget - dense_bytes(model) - kv - staging) // store.expert_bytes
    cache.check()
    # a warm cache that shrinks keeps its most valuable experts: they come back at the next
    # decode step (after the request's first token), from the host store
    grow = 1024  # (KV grows in steps of this many tokens)
    roomy = OffloadConfig(
        **{**config.__dict__, "kv_reserve_tokens": grow, "vram_budget": budget + grow * 4096}
    )
    warm = Runtime.open(model_spec, cache="off", offload=roomy)
    warm.generate(ids[:8], max_tokens=8)  # within the KV reservation: decode fills the cache
    cache = warm.engine.offload.cache
    ranked = cache.ranked()
    state = warm.engine.new_state()
    warm.engine.prefill(state, (ids * (grow // len(ids) + 1))[: grow + 16])
    assert 0 < len(cache.pending) <= cache.num_slots
    assert cache.pending == ranked[: len(cache.pending)]
    kept = list(cache.pending)
    warm.engine.decode_step(state, ids[0])
    assert not cache.pending
    for layer, expert in kept[:4]:
        slot = cache.lookup(layer, expert)
        assert slot >= 0 and torch.equal(cache.slots[slot], store.flat[layer][expert])
    cache.check()
    tight = OffloadConfig(**{**config.__dict__, "vram_budget": budget - 36 * store.expert_bytes})
    small = Runtime.open(model_spec, cache="off", offload=tight)
    state = small.engine.new_state()
    with pytest.raises(PromptTooLongError, match="VRAM budget"):
        small.engine.prefill(state, ids)
    assert state.num_tokens == 0 and small.engine.offload.cache.num_slots == 4


def test_calibration_profile_round_trip(tmp_path):
    from agentrt.offload.calibrate import calibrate, load_profile, profile_path, save_profile

    store = _store(layers=1, experts=4)
    profile = calibrate(store, torch.device("cpu"), count=8)
    assert profile.copy > 0 and profile.cpu > 0 and profile.cpu_overlapped > 0
    path = profile_path(tmp_path, torch.device("cpu"), store.dtype, store.expert_bytes)
    save_profile(profile, path)
    assert load_profile(path) == profile


@pytest.mark.parametrize("placement", [{}, {"expert_cache_slots": 8}, {"vram_budget": "1100MiB"}])
def test_close_releases_the_model(placement):
    """After `close` nothing keeps the model (no reference cycle holds it: under a budget the
    experts object keeps the model's sizes, not the model), so its memory goes back, on a GPU
    to the allocator; with the collector off, as between its passes."""
    import gc
    import weakref

    rt = Runtime.open("tiny", cache="off", **placement)
    rt.generate([1, 2, 3], max_tokens=2)
    model = weakref.ref(rt.engine.model)
    gc.disable()
    try:
        rt.close()
        assert model() is None
    finally:
        gc.enable()


def test_collector_clock_counts_passes_by_generation():
    import gc

    from agentrt.host.heap import CollectorClock

    with CollectorClock() as clock:
        gc.collect(0)
        gc.collect()
    assert clock.passes[0] >= 1 and clock.passes[2] >= 1 and clock.seconds > 0
    assert clock._callback not in gc.callbacks


def test_metrics_report_the_expert_cache():
    from agentrt.server.app import ChatServer, ServerConfig

    rt = Runtime.open("tiny", cache="off", expert_cache_slots=8)
    rt.generate(list(range(20, 60)), max_tokens=4)
    server = ChatServer(rt, ServerConfig())
    text = server._offload_lines()
    server.worker.stop()
    sample = next(
        line for line in text.splitlines() if line.startswith("agentrt_expert_cache_hit_rate ")
    )
    rate = float(sample.split()[1])
    assert 0.0 <= rate <= 1.0 and "agentrt_expert_bytes_copied_total" in text


def test_baselines_take_the_fewest_cpu_layers_that_fit_the_budget():
    """static / layer without an explicit N: the rest must fit the budget, one layer fewer not."""
    from agentrt.engine.placement import _layers_for_budget, _static_layers_for_budget

    rt = Runtime.open(cache="off", offload="static", cpu_moe_layers=0)
    model, store = rt.engine.model, rt.engine.offload.store
    per_layer = store.num_experts * store.expert_bytes
    base = OffloadConfig(mode="static", kv_reserve_tokens=0, workspace_bytes=0)
    from agentrt.engine.placement import dense_bytes

    for keep in range(len(store.layers) + 1):
        budget = dense_bytes(model) + keep * per_layer + per_layer // 2
        config = OffloadConfig(**{**base.__dict__, "vram_budget": budget})
        assert _static_layers_for_budget(model, store, config) == len(store.layers) - keep
    config = OffloadConfig(
        mode="layer", vram_budget=dense_bytes(model), workspace_bytes=0, kv_reserve_tokens=0
    )
    n = _layers_for_budget(model, store, config)
    assert 0 < n < len(model.layers)  # the experts alone do not fit: some layers go to the CPU
    assert _layers_for_budget(model, store, OffloadConfig(mode="layer")) == 0  # no budget


@pytest.mark.slow
def test_layer_placement_moves_a_layer_to_the_host_once():
    """A second `layer` placement of the same model (a benchmark's next prompt length) leaves
    the layers the first one moved as they are, not wrapped twice."""
    from agentrt.engine.placement import _cpu_expert_layers
    from agentrt.offload.host_layer import HostLayer

    rt = Runtime.open(cache="off", offload="static", cpu_moe_layers=0)
    model, store = rt.engine.model, rt.engine.offload.store
    config = OffloadConfig(mode="layer", cpu_layers=2)
    for _ in range(2):
        assert _cpu_expert_layers(model, store, config) == frozenset(
            layer for layer in store.layers if layer < 2
        )
    moved = [layer for layer in model.layers if isinstance(layer, HostLayer)]
    assert len(moved) == 2 and not any(isinstance(m.inner, HostLayer) for m in moved)


@pytest.mark.slow
def test_bench_decode_compares_placements_in_one_run(tmp_path):
    """`bench decode --offload ...` runs every combination once and reports the per-token
    figures, the decode bound and ratios (values are not asserted: this is no timing test)."""
    import json

    from util import invoke_cli

    out = tmp_path / "decode.json"
    args = ["bench", "decode", "--model", "tiny", "--device", "cpu", "--prompt-len", "32"]
    args += ["--tokens", "4", "--offload", "layer,auto,none,static", "--split", "on,off"]
    args += ["--prefetch", "on,off", "--repeat", "2", "--vram-budget", "1066MiB"]
    args += ["--json", str(out), "--py-profile", str(tmp_path / "prof.txt")]
    result = invoke_cli(*args)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["runs"]]
    profiles = (tmp_path / "prof.txt").read_text()
    assert profiles.count("=== auto/split/lfu: 16 decode steps") == 2  # one per round
    assert "decode_step" in profiles and "_py_profile" not in report["runs"][0]
    autos = ["auto/split/lfu", "auto/copy-only/lfu"]
    assert labels == ["none", *autos, *(a + "/no-prefetch" for a in autos), "static", "layer"]
    split, static, alone = report["runs"][1], report["runs"][5], report["runs"][3]
    assert split["copied_per_token"] > 0 and split["cpu_experts_per_token"] > 0
    assert 0 <= split["hit_rate"] < 1 and split["bound_tok_s"] > 0
    assert 0 < split["expert_residency"] < 1 and report["runs"][0]["expert_residency"] is None
    assert 0 <= split["cache_hit_rate"] <= split["hit_rate"]
    assert 0 <= split["lru_hit_rate"] <= 1 and static["lru_hit_rate"] == static["cache_hit_rate"]
    assert split["prefetched_per_token"] > 0 and alone["prefetched_per_token"] == 0
    moved = split["copied_per_token"] + split["prefetched_per_token"]
    assert split["pcie_bytes_per_token"] == moved * report["expert_bytes"]
    assert static["cpu_layers"] and static["hit_rate"] < 1
    top_k = config_of("tiny").num_experts_per_tok  # each timed token: top_k experts per CPU layer
    assert static["cpu_experts_per_token"] == len(static["cpu_layers"]) * top_k
    assert len(split["tok_s_rounds"]) == 2 and len(report["runs"][-1]["tok_s_rounds"]) == 1
    assert split["tok_s"] == sorted(split["tok_s_rounds"])[1]  # the median round's figures
    assert split["host_steps_per_token"] == 0  # no CUDA graph on the CPU: no host steps
    assert split["host_cpu_experts_ms_per_token"] > 0  # CPU experts are timed either way
    assert "auto/split/lfu_vs_static" in report["ratios"]
    assert "auto/split/lfu_vs_copy-only" in report["ratios"]
    assert "auto/split/lfu_vs_no-prefetch" in report["ratios"]
    assert "setting" in result.stderr  # the summary table
    # the host-memory ceiling: the experts missing when their layer came, read once from DRAM
    dram = report["dram_read_gb_s"] * 1e9
    assert dram == max(report["dram_read_sources_gb_s"].values()) * 1e9 > 0
    missing = split["misses_per_token"] + split["prefetch_hits_per_token"]
    assert split["host_read_bytes_per_token"] == missing * report["expert_bytes"]
    assert split["host_memory_ceiling_tok_s"] == pytest.approx(
        dram / split["host_read_bytes_per_token"]
    )
    assert split["ceiling_vs_static"] == pytest.approx(
        split["host_memory_ceiling_tok_s"] / static["tok_s"]
    )
    assert static["host_read_bytes_per_token"] == static["cpu_expert_bytes_per_token"]
    assert "host_memory_ceiling_tok_s" not in report["runs"][0]  # none reads no experts
    assert "host-memory ceiling" in result.stderr


@pytest.mark.slow
def test_bench_decode_after_several_prompt_lengths(tmp_path):
    """With several prompt lengths every setting decodes after each (labels `@LENGTH`, ratios
    per length) and `after_prompt` compares each length's tok/s and hit rate with the first's;
    a list without --offload is a usage error."""
    import json

    from util import invoke_cli

    out = tmp_path / "decode.json"
    args = ["bench", "decode", "--model", "tiny", "--device", "cpu", "--prompt-len", "8,40"]
    args += ["--tokens", "3", "--offload", "auto,static", "--vram-budget", "1066MiB"]
    result = invoke_cli(*args, "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["prompt_tokens"] == [8, 40]
    labels = [r["label"] for r in report["runs"]]
    assert labels == ["auto/split/lfu@8", "static@8", "auto/split/lfu@40", "static@40"]
    assert [r["prompt_tokens"] for r in report["runs"]] == [8, 8, 40, 40]
    assert {"auto/split/lfu_vs_static@8", "auto/split/lfu_vs_static@40"} <= set(report["ratios"])
    after = report["after_prompt"]["auto/split/lfu@40"]
    long, short = report["runs"][2], report["runs"][0]
    assert after["tok_s_ratio"] == pytest.approx(long["tok_s"] / short["tok_s"])
    if short["hit_rate"]:
        assert after["hit_rate_ratio"] == pytest.approx(long["hit_rate"] / short["hit_rate"])
    assert after["versus_prompt_tokens"] == 8 and "static@40" in report["after_prompt"]
    assert "auto/split/lfu after 40 tokens" in result.stderr
    bad = invoke_cli(
        "bench", "decode", "--model", "tiny", "--device", "cpu", "--prompt-len", "8,40"
    )
    assert bad.returncode == 2 and "only with --offload" in bad.stderr


def test_measured_bandwidths_keep_probing_the_cpu_side():
    """With bandwidths that follow measurements, a slow CPU estimate sends every miss over the
    copy path, but every PROBE_EVERY-th such decision still runs one miss on the CPU, so the
    estimate can recover; with fixed bandwidths the decisions stay as configured."""
    from agentrt.offload.experts import PROBE_EVERY, Bandwidths, OffloadedExperts

    store = _store(layers=1, experts=16)
    runs = {}
    for adaptive in (False, True):
        cache = ExpertCache(store, 6, "cpu", "lru")  # room for every copy: no forced CPU work
        experts = OffloadedExperts(store, cache, Bandwidths(copy=1e9, cpu=1.0))
        experts.adaptive = adaptive  # on the CPU it is off by default (reproducible decisions)
        rng = random.Random(0)
        for _ in range(4 * PROBE_EVERY):
            pairs = {e: [i] for i, e in enumerate(rng.sample(range(16), 4))}
            gpu, cpu = experts._plan_decode(0, pairs)
            assert sorted(gpu + cpu) == sorted(pairs)
        cache.check()
        runs[adaptive] = cache.stats[0].cpu
    assert runs[False] == 0 and 1 <= runs[True] <= 4


def test_measured_bandwidths_move_by_window_and_keep_a_floor():
    """A window of observations moves an estimate a tenth of the way to its summed rate; one
    slow call no longer resets it, and a run of slow ones stops at half the starting value."""
    from agentrt.offload.split import Bandwidths

    bw = Bandwidths(copy=100.0, cpu=100.0)
    for _ in range(bw.window - 1):
        bw.observe("cpu", 100, 1.0)
    assert bw.cpu == 100.0  # (a window is not complete yet)
    bw.observe("cpu", 100, 1.0)
    assert bw.cpu == pytest.approx(100.0)
    bw.observe("copy", 0, 1.0)  # (nothing moved: ignored)
    for _ in range(bw.window):
        bw.observe("cpu", 100, 0.8)
    assert bw.cpu == pytest.approx(0.9 * 100 + 0.1 * 125)
    bw.cpu = 100.0
    for _ in range(100 * bw.window):
        bw.observe("cpu", 1, 1.0)
    assert bw.cpu == pytest.approx(50.0) and bw.copy == 100.0


def test_an_estimate_far_below_what_steps_measure_recovers_in_a_few_windows():
    """A calibration taken while the host was busy (the CPU side at 1/80 of its rate): a window
    at twice the estimate or more moves it half way, so one window brings it to half the
    measured rate and the q* rule sends misses to the CPU again; from there the usual tenth."""
    from agentrt.offload.split import Bandwidths, q_star

    bw = Bandwidths(copy=50e9, cpu=0.8e9)
    assert q_star(8, bw.copy, bw.cpu) == 8  # (every miss copied)
    for _ in range(bw.window):
        bw.observe("cpu", 6_000_000, 6_000_000 / 60e9)
    assert bw.cpu == pytest.approx(0.5 * 0.8e9 + 0.5 * 60e9)
    assert q_star(8, bw.copy, bw.cpu) == 5
    for _ in range(bw.window):  # (below twice the estimate: the usual tenth)
        bw.observe("cpu", 6_000_000, 6_000_000 / 60e9)
    assert bw.cpu == pytest.approx(0.9 * 30.4e9 + 0.1 * 60e9)


def test_calibration_keeps_each_figure_best_of_its_rounds(monkeypatch):
    """One round slowed by something else on the host does not become the saved profile."""
    from agentrt.offload import calibrate as cal

    rounds = iter([(50e9, 0.8e9, 40e9, 0.8e9), (52e9, 61e9, 51e9, 55e9), (49e9, 58e9, 52e9, 50e9)])
    monkeypatch.setattr(cal, "_round", lambda *args: next(rounds))
    monkeypatch.setattr(cal, "SPIN_SETTLE_S", 0.0)
    profile = cal.calibrate(_store(layers=1, experts=4), torch.device("cpu"), count=8)
    assert (profile.copy, profile.cpu, profile.copy_overlapped, profile.cpu_overlapped) == (
        52e9,
        61e9,
        52e9,
        55e9,
    )


def test_a_saved_profile_that_understates_the_cpu_is_measured_again(tmp_path, monkeypatch):
    """A profile saved while the host was busy (its CPU figure far below what the CPU does) is
    measured again at the next start and replaced; a plausible one is kept as saved."""
    from agentrt.engine import placement
    from agentrt.engine.placement import profile_for
    from agentrt.offload.calibrate import Profile, load_profile, profile_path, save_profile

    monkeypatch.setenv("AGENTRT_HOME", str(tmp_path))
    store, cpu = _store(layers=1, experts=4), torch.device("cpu")
    path = profile_path(tmp_path / "profiles", cpu, store.dtype, store.expert_bytes)
    busy = Profile(1e9, 1.0, 1e9, 1.0, store.expert_bytes, "cpu", "x", 1)  # (1 byte/s)
    save_profile(busy, path)
    measured = profile_for(store, cpu)
    assert measured.cpu > 1e3 and load_profile(path) == measured
    fast = Profile(1e9, 1e15, 1e9, 1e15, store.expert_bytes, "cpu", "x", 1)  # (no CPU doubles it)
    save_profile(fast, path)
    placement._CHECKED.clear()  # (as at a new process's start: checked again)
    assert profile_for(store, cpu) == fast and load_profile(path) == fast


@pytest.mark.parametrize("split,biased", [(True, False), (False, False), (True, True)])
def test_graph_host_step_fills_what_the_next_piece_needs(split, biased):
    """The host step between captured decode pieces (run here on CPU slots): slot indices and
    weights for the experts on the device plus the CPU experts' weighted sum give exactly the
    token's weighted expert sum, step after step, with the cache consistent throughout (also
    for experts with biases and gpt-oss's clamped SwiGLU)."""
    from agentrt.models.moe import PLAIN, SwiGLU, expert_ffn
    from agentrt.offload.experts import Bandwidths, OffloadedExperts
    from agentrt.offload.host_step import LayerIO

    torch.manual_seed(0)
    act = SwiGLU(7.0, 1.702) if biased else PLAIN
    store = ExpertStore(range(2), 8, 4, 2, torch.float32, pin=False, bias=biased, act=act)
    for layer in store.layers:
        store.flat[layer].normal_()
        for bias in store.bias[layer] if biased else ():
            bias.normal_()

    def ffn(x, gate_up, down, layer, expert):
        bias = store.expert_biases(layer, expert, "cpu")
        return expert_ffn(x, gate_up, down, *bias, act=store.act)[0]

    cache = ExpertCache(store, 5, "cpu", "lru")
    experts = OffloadedExperts(store, cache, Bandwidths(copy=1.0, cpu=1.0), split=split)
    io = LayerIO(top_k=4, hidden=4, dtype=torch.float32, device="cpu")
    rng = random.Random(0)
    for step in range(30):
        layer, ids = step % 2, rng.sample(range(8), 4)
        w, x = torch.rand(4), torch.randn(1, 4)
        io.ids_h.copy_(torch.tensor(ids))
        io.w_h.copy_(w)
        io.x_h.copy_(x[0])
        experts._host_step(layer, io)()  # (with the work it leaves for the next piece's run)
        on_device = sum(
            io.gw_h[j] * ffn(x, cache.gate_up(int(s)), cache.down(int(s)), layer, ids[j])
            for j, s in enumerate(io.slot_h.tolist())
        )
        gate_up, down = store.gate_up(layer), store.down(layer)
        dense = sum(w[j] * ffn(x, gate_up[e], down[e], layer, e) for j, e in enumerate(ids))
        torch.testing.assert_close(on_device + io.cpu_h, dense)
        cache.check()
    stats = [cache.stats[layer] for layer in store.layers]
    assert experts.totals.host_steps == 30
    assert sum(s.copied for s in stats) > 0
    assert (sum(s.cpu for s in stats) > 0) == split


@pytest.mark.parametrize("name", ["tiny", "gpt-oss"])
def test_a_static_placements_resident_layers_run_captured_without_a_host_step(name, tiny_gpt_oss):
    """A static placement's resident layers keep every expert in a fixed slot: the captured
    form of such a layer looks the slots up from the device table (`fix_slots`) and never cuts
    the capture, and its weighted sum equals the dense one (also with gpt-oss's biases and
    clamped SwiGLU); a CPU layer still cuts. Auto placements fix nothing (their slots move)."""
    from agentrt.models.moe import expert_ffn
    from agentrt.offload.host_step import LayerIO

    class Recorder:
        cuts = 0

        def cut(self, host, sync=True):
            self.cuts += 1

    torch.manual_seed(0)
    config = OffloadConfig(mode="static", cpu_moe_layers=1)
    rt = Runtime.open("tiny" if name == "tiny" else str(tiny_gpt_oss), cache="off", offload=config)
    experts, model = rt.engine.offload, rt.engine.model
    store, top_k = experts.store, model.config.num_experts_per_tok
    resident = store.layers[1:]
    assert sorted(experts.fixed_slots) == resident
    for layer, table in experts.fixed_slots.items():
        assert table.tolist() == experts.cache.slot_of[layer]
    rng = random.Random(0)
    for step in range(6):
        layer = resident[step % len(resident)]
        ids = torch.tensor([rng.sample(range(store.num_experts), top_k)])
        w, x = torch.rand(1, top_k), torch.randn(1, store.hidden)
        experts._io.setdefault(layer, LayerIO(top_k, store.hidden, torch.float32, "cpu"))
        experts.recorder = Recorder()
        got = experts._captured(layer, x, ids, w)
        assert experts.recorder.cuts == 0
        gate_up, down = store.gate_up(layer), store.down(layer)
        dense = sum(
            w[0, j] * expert_ffn(x, gate_up[e], down[e], *store.expert_biases(layer, e, "cpu"),
                                 act=store.act)[0]
            for j, e in enumerate(ids[0].tolist())
        )  # fmt: skip
        torch.testing.assert_close(got[0], dense)
    first = store.layers[0]
    experts._io[first] = LayerIO(top_k, store.hidden, torch.float32, "cpu")
    ids = torch.tensor([list(range(top_k))])
    experts._captured(first, torch.randn(1, store.hidden), ids, torch.rand(1, top_k))
    assert experts.recorder.cuts == 1  # (the CPU layer's host step)
    rt.close()
    auto = OffloadConfig(mode="auto", expert_cache_slots=10, copy_bandwidth=1.0, cpu_bandwidth=1.0)
    rt = Runtime.open("tiny", cache="off", offload=auto)
    assert rt.engine.offload.fixed_slots == {}
    rt.close()


def test_host_step_prefetches_the_next_layers_predicted_experts():
    """A graph host step copies ahead, into free or victim slots, the experts predicted for the
    next MoE layer (never evicting this layer's experts or the prediction); the next layer's step
    finds them as hits, counts how many it used, and its output still equals the dense sum."""
    from agentrt.models.moe import expert_ffn
    from agentrt.offload.experts import Bandwidths, OffloadedExperts
    from agentrt.offload.host_step import LayerIO

    torch.manual_seed(0)
    store = _store(layers=2, experts=8)
    for layer in store.layers:
        store.flat[layer].normal_()
    cache = ExpertCache(store, 6, "cpu", "lru")
    routers = {layer: torch.randn(8, 4) for layer in store.layers}
    experts = OffloadedExperts(store, cache, Bandwidths(1.0, 1.0), split=False, routers=routers)
    ios = {layer: LayerIO(top_k=4, hidden=4, dtype=torch.float32, device="cpu") for layer in (0, 1)}
    x, w = torch.randn(1, 4), torch.rand(4)
    for layer, ids, predicted in ((0, [0, 1, 2, 3], [4, 5, 6, 7]), (1, [5, 4, 0, 1], [0, 1, 2, 3])):
        io = ios[layer]
        io.ids_h.copy_(torch.tensor(ids))
        io.pred_h.copy_(torch.tensor(predicted))
        io.w_h.copy_(w)
        io.x_h.copy_(x[0])
        later = experts._host_step(layer, io)
        # the bookkeeping and the prefetch wait for the returned work (run while the next
        # piece runs): the inputs that piece reads are complete without them
        assert cache.stats[layer].misses == 0 and experts.totals.prefetched == 2 * layer
        gate_up, down = store.gate_up(layer), store.down(layer)
        dense = sum(w[j] * expert_ffn(x, gate_up[e], down[e])[0] for j, e in enumerate(ids))
        on_device = sum(
            io.gw_h[j] * expert_ffn(x, cache.gate_up(int(s)), cache.down(int(s)))[0]
            for j, s in enumerate(io.slot_h.tolist())
        )
        torch.testing.assert_close(on_device + io.cpu_h, dense)
        later()
        cache.check()
        if layer == 0:  # 4 slots hold layer 0's copies: 2 free ones take the best predictions
            assert [cache.slot_of[1][e] >= 0 for e in predicted] == [True, True, False, False]
            assert all(cache.slot_of[0][e] >= 0 for e in ids)
    assert cache.stats[1].prefetched == 2 and cache.stats[1].prefetch_hits == 2
    assert cache.stats[1].hits == 2 and experts.totals.prefetched == 2
    assert 1 not in experts.next_layer and not experts._prefetched.get(0)  # last layer: none


def test_host_step_starts_the_cpu_experts_before_issuing_its_copies():
    """With the native kernel's pool, a graph host step posts its CPU experts as soon as the
    plan names them, before it chooses victims for its copies, waits for the layer's prefetches
    and issues the copies (the CPU side is the longer one); the experts posted are those the
    plan left on the CPU, and the step counts the time to the post."""
    from agentrt.offload.experts import Bandwidths, OffloadedExperts
    from agentrt.offload.host_step import LayerIO

    events = []

    class Pool:  # records the post; the sum it leaves is not checked here
        pooled, posted = True, False

        def start(self, gate_up, down, weights, x, out):
            events.append(("cpu", len(gate_up)))
            self.posted = True

        def finish(self) -> float:
            self.posted = False
            return 1e-6

    store = ExpertStore(range(1), 8, hidden=4, inter=2, dtype=torch.bfloat16, pin=False)
    cache = ExpertCache(store, 4, "cpu", "lru")
    experts = OffloadedExperts(store, cache, Bandwidths(1.0, 1.0), cpu_kernel=Pool())
    issue, wait, admit = experts._issue, experts._await_prefetch, cache.admit
    experts._issue = lambda *a: (events.append(("copy", len(a[4]))), issue(*a))
    cache.admit = lambda *a: (events.append(("admit", a[1])), admit(*a))[1]
    experts._await_prefetch = lambda layer, *a: (events.append(("await", layer)), wait(layer, *a))
    io = LayerIO(top_k=4, hidden=4, dtype=torch.bfloat16, device="cpu")
    io.ids_h.copy_(torch.tensor([0, 1, 2, 3]))
    io.w_h.fill_(0.25)
    experts._host_step(0, io)()
    # q* = 2 of 4 misses at equal bandwidths; the prefetches into the layer are awaited after
    # the post, before the copies (which may refill a prefetched slot)
    assert [e[0] for e in events] == ["cpu", "admit", "admit", "await", "copy"]
    assert events[0] == ("cpu", 2) and events[-1] == ("copy", 2)
    assert sum(s.cpu for s in cache.stats.values()) == 2 and experts.totals.cpu_start_seconds > 0
    cache.check()


def test_prefetch_count_fills_pcie_over_a_layers_time():
    """Per layer, as many experts as the copy bandwidth moves in the measured period between
    host steps, less the layer's own copies, at least one (with the split and copy-only)."""
    from agentrt.offload.experts import Bandwidths, OffloadedExperts

    store = _store(layers=2, experts=8)
    experts = OffloadedExperts(store, ExpertCache(store, 4, "cpu", "lru"), Bandwidths(1.0, 1.0))
    assert experts._prefetch_cap() == 8  # on the CPU, before any period: every prediction
    experts._measure_period(0, 10.0)
    experts._measure_period(1, 10.002)
    experts.bw.copy = 5.5 * store.expert_bytes / 0.002
    assert experts._prefetch_cap() == 5 and experts._prefetch_cap(own=2) == 3
    experts._measure_period(0, 11.0)  # a new token (no period from layer 1 to layer 0)
    experts._measure_period(1, 11.0)  # the average moves a tenth of the way
    assert experts._period == pytest.approx(0.0018) and experts._prefetch_cap() == 4
    assert experts._prefetch_cap(own=9) == 1
    assert experts._queued() == 0  # (no copy engine on the CPU)
    experts.split = False  # copy-only: the same window (the copy engine idles otherwise)
    assert experts._prefetch_cap() == 4 and experts._prefetch_cap(own=2) == 2


def test_prefetch_pace_shrinks_the_prefetches_when_they_arrive_late(monkeypatch):
    """With pacing on, a graph host step checks whether the prefetches it awaited are done
    before the next piece is launched: late ones cut the share of the layer's time they may
    fill (so the cap), timely ones raise it back, within [LOW, 1]; off (the default), nothing
    is checked and the cap is the layer's whole time."""
    from agentrt.offload.experts import Bandwidths, OffloadedExperts
    from agentrt.offload.prefetch import PrefetchPace

    store = _store(layers=2, experts=8)
    cache = ExpertCache(store, 4, "cpu", "lru")
    stream = _Stream()

    routers = {layer: torch.randn(8, store.hidden) for layer in store.layers}

    def paced(on: bool) -> OffloadedExperts:
        monkeypatch.setenv("AGENTRT_PREFETCH_PACE", "1" if on else "")
        experts = OffloadedExperts(store, cache, Bandwidths(1.0, 1.0), routers=routers)
        experts._period, experts.bw.copy = 0.002, 8 * store.expert_bytes / 0.002
        monkeypatch.setattr(experts, "_current", lambda: stream)  # (what a CUDA stream offers)
        assert experts.pace.on == on and experts._prefetch_cap() == 8
        return experts

    def step(done: bool) -> None:  # a host step: await layer 1's prefetches, then check
        experts._pending[1] = _Event(done)
        experts._await_prefetch(1, check=True)
        experts._pace_prefetch()

    experts = paced(on=False)
    step(False)
    assert experts.pace.checks == 0 and experts._prefetch_cap() == 8
    experts = paced(on=True)
    step(False)
    assert experts.pace.share == pytest.approx(PrefetchPace.DOWN)
    assert experts._prefetch_cap() == int(8 * PrefetchPace.DOWN)
    for _ in range(20):
        step(False)
    assert experts.pace.share == PrefetchPace.LOW and experts._prefetch_cap() == 1
    step(True)
    assert experts.pace.share == pytest.approx(PrefetchPace.LOW + PrefetchPace.UP)
    for _ in range(200):
        step(True)
    assert experts.pace.share == 1.0 and (experts.pace.checks, experts.pace.late) == (222, 21)
    experts._pending[1] = _Event(False)
    experts._await_prefetch(1)  # (eager decode: no check)
    experts._pace_prefetch()
    assert experts.pace.checks == 222
    for given in (False, True):  # (the config's setting, as `bench decode --prefetch-pace`)
        monkeypatch.setenv("AGENTRT_PREFETCH_PACE", "" if given else "1")
        experts = OffloadedExperts(
            store, cache, Bandwidths(1.0, 1.0), routers=routers, prefetch_pace=given
        )
        assert experts.pace.on == given


def test_the_offload_config_sets_the_prefetch_pace(model_spec, monkeypatch):
    """`OffloadConfig.prefetch_pace` reaches the installed experts over the environment's
    choice (None leaves it to `AGENTRT_PREFETCH_PACE`); a static placement, which prefetches
    nothing, is never paced."""
    monkeypatch.delenv("AGENTRT_PREFETCH_PACE", raising=False)
    base = dict(mode="auto", expert_cache_slots=10, copy_bandwidth=1.0, cpu_bandwidth=1.0)
    rt = Runtime.open(model_spec, cache="off", offload=OffloadConfig(**base, prefetch_pace=True))
    assert rt.engine.offload.pace.on
    monkeypatch.setenv("AGENTRT_PREFETCH_PACE", "1")
    rt = Runtime.open(model_spec, cache="off", offload=OffloadConfig(**base))
    assert rt.engine.offload.pace.on
    rt = Runtime.open(model_spec, cache="off", offload=OffloadConfig(**base, prefetch_pace=False))
    assert not rt.engine.offload.pace.on
    rt = Runtime.open(model_spec, cache="off", offload=CONFIGS["static"])
    assert not rt.engine.offload.pace.on


@pytest.mark.parametrize("overlap", [False, True])
def test_a_graph_host_step_checks_its_prefetches_before_the_launch(monkeypatch, overlap):
    """The check comes where the piece that reads the prefetched slots is launched next: at the
    end of the whole host step, or after its first half with overlap (that piece runs the
    device experts beside the CPU's), and before the step's deferred work either way."""
    from agentrt.offload.experts import Bandwidths, OffloadedExperts
    from agentrt.offload.host_step import LayerIO

    order: list[str] = []
    monkeypatch.setenv("AGENTRT_PREFETCH_PACE", "1")
    store = _random_bf16_store()
    cache = ExpertCache(store, 3, "cpu", "lru")
    routers = {layer: torch.randn(8, store.hidden) for layer in store.layers}  # (1 is the last)
    experts = OffloadedExperts(store, cache, Bandwidths(1.0, 1.0), routers=routers)
    stream = _Stream()
    monkeypatch.setattr(experts, "_current", lambda: stream)
    finish, after = experts._host_finish, experts._after_step
    monkeypatch.setattr(experts, "_host_finish", lambda *a: (order.append("finish"), finish(*a))[1])
    monkeypatch.setattr(experts, "_after_step", lambda *a: (order.append("after"), after(*a))[1])
    io = LayerIO(top_k=4, hidden=store.hidden, dtype=store.dtype, device="cpu")
    io.ids_h.copy_(torch.tensor([0, 2, 5, 7]))
    io.w_h.fill_(0.25)
    experts._awaited = _Event(False, order)  # (left by a step that failed: never checked)
    for prefetched in (False, True):  # a step that awaits no prefetch, then one that does
        if prefetched:
            experts._pending[1] = _Event(False, order)
        if overlap:
            experts._host_plan(1, io, paced=True)
            later = experts._host_finish(1, io)
        else:
            later = experts._host_step(1, io)
        later()
    checked = ["query", "finish", "after"] if overlap else ["finish", "query", "after"]
    assert order == ["finish", "after", *checked]
    assert (experts.pace.checks, experts.pace.late) == (1, 1)


def test_an_event_query_through_the_runtime_clears_not_ready():
    """`CudaCalls.done`: True when the event's work is done, False when it is not ready (and
    the runtime's last error, which that answer sets, cleared), an error raised otherwise."""
    from agentrt.offload.copies import CudaCalls

    class Lib:
        cudaMemcpyAsync = None  # noqa: N815 (bound by `CudaCalls`, not called here)

        def __init__(self, answer: int) -> None:
            self.answer, self.cleared = answer, 0

        def cudaEventQuery(self, event: int) -> int:  # noqa: N802 (the runtime's name)
            return self.answer

        def cudaGetLastError(self) -> int:  # noqa: N802
            self.cleared += 1
            return 0

    ready, busy, broken = Lib(0), Lib(600), Lib(700)
    assert CudaCalls(ready).done(1) and ready.cleared == 0
    assert not CudaCalls(busy).done(1) and busy.cleared == 1
    with pytest.raises(RuntimeError):
        CudaCalls(broken).done(1)
    assert broken.cleared == 1


class _Event:
    """A CUDA event's stand-in: `query()` answers `done`, logged into `log` where given."""

    def __init__(self, done: bool, log: list[str] | None = None) -> None:
        self.done, self.log = done, log

    def query(self) -> bool:
        if self.log is not None:
            self.log.append("query")
        return self.done


class _Stream:
    """A CUDA stream's stand-in for `OffloadedExperts._current` (waits do nothing)."""

    def wait_event(self, event) -> None:
        pass


def test_a_copy_that_fails_leaves_no_expert_listed_as_resident(monkeypatch):
    """Slots are admitted before the copies are issued: if issuing fails, the experts must not
    stay listed as resident (later tokens would compute with another expert's weights)."""
    from agentrt.offload.experts import Bandwidths, OffloadedExperts

    store = _store(layers=1, experts=8)
    cache = ExpertCache(store, 4, "cpu", "lru")
    experts = OffloadedExperts(store, cache, Bandwidths(1.0, 1.0), split=False)
    experts._plan_decode(0, {e: [i] for i, e in enumerate([0, 1, 2, 3])})  # fills the slots

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(torch, "_foreach_copy_", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        experts._plan_decode(0, {4: [0], 5: [1]})
    cache.check()
    assert all(cache.slot_of[0][e] < 0 for e in (4, 5)) and len(cache.free) == 2
    assert cache.stats[0].evictions == 2  # the victims (0 and 1) were replaced, not 4 and 5


def _native_or_skip():
    from agentrt.offload.cpu_kernel import native_experts

    kernel = native_experts()
    if kernel is None:
        pytest.skip("no C compiler (or the native kernel did not build)")
    return kernel


def _packed_kernel_or_skip(store):
    """The packed MXFP4 CPU kernel bound to `store`, or a skip where it cannot be built."""
    from agentrt.offload.cpu_mxfp4 import mxfp4_kernel

    kernel = mxfp4_kernel(store)
    if kernel is None:
        pytest.skip("no C compiler (or the MXFP4 kernel did not build)")
    return kernel


def test_native_cpu_kernel_matches_the_fp32_experts():
    """The native bf16 kernel's weighted expert sum against fp32 math on the same bf16 values
    (odd sizes exercise the tail loops), fresh and accumulated into the output."""
    kernel = _native_or_skip()
    torch.manual_seed(0)
    hidden, inter = 200, 72
    gate_up = (torch.randn(3, 2 * inter, hidden) * 0.1).to(torch.bfloat16)
    down = (torch.randn(3, hidden, inter) * 0.1).to(torch.bfloat16)
    x = torch.randn(hidden).to(torch.bfloat16)

    def expert(e):
        g, u = (gate_up[e].float() @ x.float()).chunk(2)
        return down[e].float() @ (torch.nn.functional.silu(g) * u)

    want = 0.5 * expert(0) + 0.3 * expert(2) + 0.2 * expert(1)
    out = torch.full((hidden,), float("nan"))
    kernel.run(
        [gate_up[0], gate_up[2], gate_up[1]], [down[0], down[2], down[1]], [0.5, 0.3, 0.2], x, out
    )
    torch.testing.assert_close(out, want, rtol=0, atol=2e-2 * want.abs().max().item())
    kernel.run([gate_up[1]], [down[1]], [1.0], x, out, accumulate=True)
    torch.testing.assert_close(out, want + expert(1), rtol=0, atol=2e-2 * want.abs().max().item())
    # the same call on the kernel's own thread (start, then finish) gives the same bits
    again = torch.full((hidden,), float("nan"))
    kernel.start([gate_up[2], gate_up[0]], [down[2], down[0]], [0.3, 0.5], x, again)
    assert kernel.finish() > 0
    kernel.run([gate_up[2], gate_up[0]], [down[2], down[0]], [0.3, 0.5], x, out)
    assert torch.equal(again, out)


def _graph_host_steps(store, kernel, prefetch: bool):
    """`OffloadedExperts` over `store` with 3 CPU slots and `kernel`, its cache, and twelve graph
    host steps of 4 random experts a token, alternating layers (prefetching with routers), each
    yielding (layer, ids, weights, x, its LayerIO) once run."""
    from agentrt.offload.experts import Bandwidths, OffloadedExperts
    from agentrt.offload.host_step import LayerIO

    n, hidden = store.num_experts, store.hidden
    cache = ExpertCache(store, 3, "cpu", "lru")
    routers = {layer: torch.randn(n, hidden) for layer in store.layers} if prefetch else None
    experts = OffloadedExperts(
        store, cache, Bandwidths(1.0, 1.0), cpu_kernel=kernel, routers=routers
    )
    io = LayerIO(top_k=4, hidden=hidden, dtype=store.dtype, device="cpu")

    def steps():
        rng = random.Random(0)
        for step in range(12):
            layer, ids = step % 2, rng.sample(range(n), 4)
            w, x = torch.rand(4), torch.randn(hidden).to(store.dtype)
            io.pred_h.copy_(torch.tensor(rng.sample(range(n), 4)))
            io.ids_h.copy_(torch.tensor(ids))
            io.w_h.copy_(w)
            io.x_h.copy_(x)
            experts._host_step(layer, io)()
            yield layer, ids, w, x, io

    return experts, cache, steps()


def _random_bf16_store() -> ExpertStore:
    """Two layers of 8 bf16 experts (64 x 32) with random weights."""
    torch.manual_seed(0)
    store = ExpertStore(range(2), 8, hidden=64, inter=32, dtype=torch.bfloat16, pin=False)
    for layer in store.layers:
        store.flat[layer].copy_(torch.randn_like(store.flat[layer], dtype=torch.float32) * 0.2)
    return store


def _assert_host_step_is_dense(store, cache, layer, ids, w, x, io) -> None:
    """The device slots the step filled in, plus its CPU sum, give the token's dense sum."""
    from agentrt.models.moe import expert_ffn

    x = x[None].float()
    on_device = sum(
        io.gw_h[j] * expert_ffn(x, cache.gate_up(s).float(), cache.down(s).float())[0]
        for j, s in enumerate(io.slot_h.tolist())
    )
    gate_up, down = store.gate_up(layer).float(), store.down(layer).float()
    dense = sum(w[j] * expert_ffn(x, gate_up[e], down[e])[0] for j, e in enumerate(ids))
    torch.testing.assert_close(
        on_device + io.cpu_h, dense, rtol=0, atol=3e-2 * dense.abs().max().item()
    )


@pytest.mark.parametrize("prefetch,pooled", [(False, False), (True, False), (True, True)])
def test_host_step_with_the_native_kernel_equals_the_dense_sum(prefetch, pooled, monkeypatch):
    """A graph host step whose CPU experts go through the native kernel (bf16 store): device
    slots plus the kernel's sum give the token's weighted expert sum. `pooled`: the kernel runs
    on its thread pool while the host step prefetches into other slots and fills the inputs."""
    kernel = _native_or_skip()
    monkeypatch.setattr(kernel, "pooled", pooled)
    store = _random_bf16_store()
    experts, cache, steps = _graph_host_steps(store, kernel, prefetch)
    for step in steps:
        _assert_host_step_is_dense(store, cache, *step)
    assert experts.totals.cpu > 0  # (3 slots for 4 experts a token: some always run on the CPU)
    assert (experts.totals.prefetched > 0) == prefetch


def test_host_step_runs_a_copy_that_found_no_slot_after_the_pooled_experts(monkeypatch):
    """A graph host step posts its CPU experts before admitting its copies; a copy that then
    finds no slot runs on the CPU after the pool's experts, added to their sum."""
    kernel = _native_or_skip()
    monkeypatch.setattr(kernel, "pooled", True)
    store = _random_bf16_store()
    experts, cache, steps = _graph_host_steps(store, kernel, prefetch=False)
    admit, refused = cache.admit, []

    def every_other(layer, expert, exclude):  # every other admission fails
        if len(refused) % 2:
            refused.append(None)
            return None
        refused.append((layer, expert))
        return admit(layer, expert, exclude)

    monkeypatch.setattr(cache, "admit", every_other)
    for step in steps:
        refused.clear()
        _assert_host_step_is_dense(store, cache, *step)
        cache.check()
    assert experts.totals.cpu > 0


def test_row_pointers_are_the_rows_data_pointers():
    from agentrt.offload.cpu_kernel import row_pointers

    flat = torch.zeros(6, 40, dtype=torch.uint8)
    for stack in (flat, flat[:, 8:], torch.zeros(5, 3, 4)[:, 1], torch.zeros(4, 9)[::2]):
        ids = [3, 0, 1] if len(stack) > 3 else [1, 0]
        assert row_pointers(stack, ids) == [stack[e].data_ptr() for e in ids]


POOL_CHECK = """
import torch
from agentrt.offload.cpu_kernel import native_experts
k = native_experts()
k.pool_threads = 3  # (the pool's size, fixed by its first call; may exceed the cores here)
torch.manual_seed(0)
for hidden, inter, n in ((200, 72, 3), (64, 32, 1), (130, 7, 5)):
    gu = list((torch.randn(n, 2 * inter, hidden) * 0.1).to(torch.bfloat16))
    dn = list((torch.randn(n, hidden, inter) * 0.1).to(torch.bfloat16))
    x, w = torch.randn(hidden).to(torch.bfloat16), [0.5, 0.3, 0.2, 0.7, 0.1][:n]
    want, out = torch.zeros(hidden), torch.zeros(hidden)
    k.run(gu, dn, w, x, want)
    twice = want.clone()
    k.run(gu, dn, w, x, twice, accumulate=True)
    for call in range(21):
        k.schedule((16, 1, 0)[call % 3])  # claimed chunks of 16 or 1 items, fixed shares
        k.active_threads = lambda: 1 + call % 4  # (all 3, or fewer: helpers busy)
        out.fill_(float("nan"))
        k.start(gu, dn, w, x, out)
        assert k.finish() > 0 and torch.equal(out, want)
        k.start(gu, dn, w, x, out, accumulate=True)
        k.finish()
        assert torch.equal(out, twice)
    k.schedule(16)
    print("ok")
# many short calls on 1-3 threads: a thread that sat calls out must rejoin their barriers
import random
rng, gu, dn = random.Random(0), gu[:2], dn[:2]
want = torch.zeros(hidden)
k.run(gu, dn, [0.5, 0.3], x, want)
for call in range(400):
    k.active_threads = lambda: rng.randint(1, 3)
    k.start(gu, dn, [0.5, 0.3], x, out)
    k.finish()
    assert torch.equal(out, want), call
from agentrt.offload.store import ExpertStore
store = ExpertStore(range(1), 4, hidden=64, inter=32, dtype=torch.bfloat16, pin=False)
POST = "start"
"""
# (after a pool check: `k` a kernel, `store` its experts, POST the name of its posting method)
POOL_CALIBRATION = """
from agentrt.offload import calibrate as cal
k.pooled = True  # calibration overlaps copies with the pool, as graph decode's host steps do
cal._time_threaded_overlap = None  # (the helper-thread arrangement must not run)
posts, start = [], getattr(k, POST)
setattr(k, POST, lambda *args: posts.append(1) or start(*args))
p = cal.calibrate(store, torch.device("cpu"), count=8, kernel=k)
assert p.copy_overlapped > 0 and p.cpu_overlapped > 0 and p.cpu > 0
assert len(posts) == 4 + cal.ROUNDS * (8 + 8)  # warm-up, then B_H and B_H' per round, on the pool
assert cal.profile_kernel(k) == "native-pool" and not k.posted
print("ok")
"""


@pytest.mark.slow
def test_native_kernel_pool_computes_the_same_bits_as_its_openmp_path():
    """The kernel's thread pool (graph decode's host steps: `start`, then `finish`) computes
    what its OpenMP path (`run`) does, bit for bit: shapes split unevenly over 3 threads or
    fewer of them (items claimed in chunks of 16 or 1, or fixed shares), fresh and accumulated,
    call after call (in a
    subprocess: the first call fixes the pool's size); calibration then measures the overlapped
    bandwidths through the pool."""
    import subprocess
    import sys

    _native_or_skip()
    proc = subprocess.run(
        [sys.executable, "-c", POOL_CHECK + POOL_CALIBRATION],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"] * 4


def test_native_kernel_pool_whose_threads_sleep_at_once_computes_the_same_bits(monkeypatch):
    """With no spin (`AGENTRT_POOL_SPIN_MS=0`) every wait of the pool, its threads' and the
    caller's, goes through the condition variable: the same bits as the OpenMP path, call
    after call. `rest` (a prefill begins) sends the threads to sleep until the next posted call
    makes them spin again. The setting reads milliseconds; a bad value keeps the default, with a
    warning."""
    import os
    import subprocess
    import sys

    from agentrt.offload.cpu_kernel import SPIN_S, pool_spin_s

    _native_or_skip()
    env = {**os.environ, "AGENTRT_POOL_SPIN_MS": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", POOL_CHECK], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"] * 3
    rest = (
        "from agentrt.offload.cpu_kernel import native_experts\n"
        "import torch\n"
        "k = native_experts()\n"
        "k.pool_threads = 2\n"
        "b = torch.bfloat16\n"
        "gu, dn = [torch.zeros(8, 4, dtype=b)], [torch.zeros(4, 4, dtype=b)]\n"
        "x, out = torch.zeros(4, dtype=b), torch.zeros(4)\n"
        "print(k._spin(0.005))\n"  # (the setting then: 5 ms, from the environment)
        "k.rest()\n"
        "k.rest()\n"
        "print(k._spin(0.0))\n"  # (resting: 0)
        "k.start(gu, dn, [1.0], x, out)\n"
        "k.finish()\n"
        "print(k._spin(0.0), k._guard.resting)\n"  # (a posted call: 5 ms again)
    )
    env["AGENTRT_POOL_SPIN_MS"] = "5"
    proc = subprocess.run(
        [sys.executable, "-c", rest], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0.005", "0.0", "0.005", "False"]
    monkeypatch.setenv("AGENTRT_POOL_SPIN_MS", "5")
    assert pool_spin_s() == 0.005
    for bad in ("-1", "soon", "1e9"):
        monkeypatch.setenv("AGENTRT_POOL_SPIN_MS", bad)
        assert pool_spin_s() == SPIN_S
    monkeypatch.delenv("AGENTRT_POOL_SPIN_MS")
    assert pool_spin_s() == SPIN_S


def test_a_refill_keeps_the_ranking_a_later_resize_goes_by():
    """Experts a resize brought back (`refill`) rank as they did before it, so a second resize
    before decode touches them keeps the most valuable ones, with either policy; a rebuild
    counts as one resize."""
    from agentrt.offload.slots import ExpertCache
    from agentrt.offload.store import ExpertStore

    for policy in ("lru", "lfu"):
        store = ExpertStore(range(1), 8, hidden=4, inter=2, dtype=torch.float32, pin=False)
        cache = ExpertCache(store, 8, "cpu", policy)
        for e in range(8):
            cache.admit(0, e, exclude=set())
        for e in range(8):
            cache.policy.touch((0, e))  # (expert 7 the most recent)
        cache.rebuild(6, lambda: None)
        assert cache.resizes == 1
        assert cache.refill() == 6 and cache.refilled == 6  # (all six dropped by the resize)
        assert [e for _, e in cache.ranked()] == [7, 6, 5, 4, 3, 2]
        cache.rebuild(3, lambda: None)
        assert [e for _, e in cache.pending] == [7, 6, 5]
        cache.check()


def test_a_kv_growth_that_fails_leaves_the_cache_the_room_it_had(model_spec):
    """KV growth that fails inside the pool's rebuild (out of memory, say) leaves the KV as it
    was, and the new pool as large as the budget allows beside it, not the smaller pool the
    growth was to leave."""
    from agentrt.engine.elastic import make_kv_room
    from agentrt.models.kv import KVCache

    config, _ = _elastic_config(model_spec, 64, 40)  # (40 slots: room for KV to grow into)
    rt = Runtime.open(model_spec, cache="off", offload=config)
    experts, state = rt.engine.offload, rt.engine.new_state(rt.engine.live_capacity())
    slots = experts.cache.num_slots

    def out_of_memory(self, num_tokens, used, capacity=None):
        raise RuntimeError("CUDA out of memory")

    real, KVCache.reserve = KVCache.reserve, out_of_memory
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            make_kv_room(experts, state, 200)
    finally:
        KVCache.reserve = real
    assert all(c.capacity == 64 for c in state.kv_caches()) and experts.cache.num_slots == slots
    experts.cache.check()


def test_kv_given_back_stays_at_least_the_reservation(model_spec):
    """A shorter session gives back KV that grew past the reservation, down to the reservation
    and no further (below it no slot is gained; the buffers would only grow again)."""
    from agentrt.engine.elastic import give_back_kv_room, make_kv_room

    config, _ = _elastic_config(model_spec, 4096, 40)
    config = OffloadConfig(**{**config.__dict__, "vram_budget": config.vram_budget * 3})
    rt = Runtime.open(model_spec, cache="off", offload=config)
    experts, state = rt.engine.offload, rt.engine.new_state(rt.engine.live_capacity())
    slots = experts.cache.num_slots
    make_kv_room(experts, state, 9000)
    state.token_ids = [1] * 9000  # (a long session's tokens, as far as the KV goes)
    assert experts.cache.num_slots < slots
    give_back_kv_room(experts, state, 300)
    assert all(c.capacity == 4096 for c in state.kv_caches())
    assert experts.cache.num_slots == slots
    experts.cache.check()


def test_offload_config_needs_a_staging_area_in_auto_mode():
    from agentrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="staging_bytes must be > 0"):
        OffloadConfig(mode="auto", staging_bytes=0)
    assert OffloadConfig(mode="static", staging_bytes=0).staging_bytes == 0


def test_offload_config_checks_the_cpu_kernel():
    from agentrt.errors import InvalidArgumentError

    assert OffloadConfig(mode="auto").cpu_kernel == "auto"
    assert OffloadConfig(mode="auto", cpu_kernel="native").cpu_kernel == "native"
    with pytest.raises(InvalidArgumentError, match="cpu kernel"):
        OffloadConfig(mode="auto", cpu_kernel="fast")


def test_the_cpu_kernel_auto_picks_native_where_the_cpu_has_vector_dot_products():
    """auto = native only with AVX512-BF16 or AVX2 with FMA (elsewhere the kernel's plain loop
    loses to torch); torch, and any experts that are not bfloat16, use torch's kernels."""
    from agentrt.offload.cpu_kernel import has_fast_dot, kernel_for, kernel_name, native_experts

    assert kernel_for("torch") is None and kernel_for("native", torch.float32) is None
    assert kernel_for("auto", torch.float32) is None
    want = native_experts() if has_fast_dot() else None
    if want is not None and not want.fast_path:  # (a compiler without those instructions)
        want = None
    assert kernel_for("auto") is want
    with pytest.raises(ValueError, match="cpu kernel"):
        kernel_for("fast")
    assert kernel_name(kernel_for("auto")) == ("native" if want is not None else "torch")


def test_cpu_layers_and_calibration_use_the_native_kernel(tmp_path):
    """Decode in CPU layers (static / layer baselines, eager path) computes each token's experts
    with the native kernel like the host step does, and calibration measures that kernel into a
    profile of its own."""
    from agentrt.models.moe import expert_ffn
    from agentrt.offload.calibrate import calibrate, profile_path
    from agentrt.offload.experts import Bandwidths, OffloadedExperts

    kernel = _native_or_skip()
    torch.manual_seed(0)
    store = ExpertStore(range(1), 4, hidden=64, inter=32, dtype=torch.bfloat16, pin=False)
    store.flat[0].copy_(torch.randn_like(store.flat[0], dtype=torch.float32) * 0.2)
    experts = OffloadedExperts(
        store,
        ExpertCache(store, 1, "cpu", "lru"),
        Bandwidths(0.0, 1.0),
        cpu_layers=frozenset({0}),
        cpu_kernel=kernel,
    )
    x = torch.randn(1, 64).to(torch.bfloat16)
    ids, w = torch.tensor([[2, 0, 3]]), torch.tensor([[0.5, 0.3, 0.2]]).to(torch.bfloat16)
    got = experts(0, x, ids, w).float()
    gate_up, down = store.gate_up(0).float(), store.down(0).float()
    want = sum(
        w[0, j].float() * expert_ffn(x.float(), gate_up[e], down[e])
        for j, e in enumerate([2, 0, 3])
    )
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * want.abs().max().item())
    profile = calibrate(store, torch.device("cpu"), count=8, kernel=kernel)
    assert profile.cpu > 0 and profile.cpu_overlapped > 0
    torch_path = profile_path(tmp_path, torch.device("cpu"), store.dtype, store.expert_bytes)
    native_path = profile_path(
        tmp_path, torch.device("cpu"), store.dtype, store.expert_bytes, "native"
    )
    assert native_path != torch_path and native_path.name.endswith("__native.json")


def test_a_failed_cuda_runtime_call_clears_the_last_error_and_raises():
    """`CudaCalls` (raw CUDA runtime calls; exercised here with a stand-in library): a non-zero
    return raises, after `cudaGetLastError` cleared the error torch's next launch would report."""
    from types import SimpleNamespace

    from agentrt.offload.copies import CudaCalls

    cleared = []
    lib = SimpleNamespace(
        cudaMemcpyAsync=lambda *args: 1,  # cudaErrorInvalidValue
        cudaEventRecord=lambda *args: 0,
        cudaGetLastError=lambda: cleared.append(True) or 0,
    )
    calls = CudaCalls(lib)
    calls.record(1, 0)  # success: nothing cleared
    assert cleared == []
    with pytest.raises(RuntimeError, match="error 1"):
        calls.copy([torch.zeros(4)], [torch.ones(4)], 0)
    assert cleared == [True]
    assert CudaCalls.open("cpu", torch.zeros(4)) is None  # not a CUDA device: torch's calls


def test_copy_only_sizes_its_prefetch_by_the_copies_alone(monkeypatch):
    """The split starts q* from the overlapped pair (B_P', B_H'); copy-only has no CPU side
    competing for memory, so its copy bandwidth (which sizes its prefetch) is B_P alone."""
    from agentrt.engine import placement
    from agentrt.offload.calibrate import Profile

    profile = Profile(50e9, 60e9, 30e9, 40e9, 1, "gpu", "cpu", 4)
    monkeypatch.setattr(placement, "profile_for", lambda *args: profile)
    store = _store(layers=1, experts=4)
    split = placement.bandwidths(store, "cpu", OffloadConfig(mode="auto"), False)
    alone = placement.bandwidths(store, "cpu", OffloadConfig(mode="auto", split=False), False)
    assert (split.copy, split.cpu) == (30e9, 40e9) and alone.copy == 50e9


def test_the_layer_chain_ceiling_adds_the_gpu_time_to_the_cpu_share():
    """A token's CPU experts sit on the chain of layers (T >= t_gpu + C / B_H') while copies
    may overlap everything (N - C <= B_P' T): T >= (t_gpu B_H' + N) / (B_P' + B_H'), never
    under N / DRAM nor t_gpu; copy-only, N / B_P."""
    from agentrt.bench.offload_figures import add_ceilings, chain_seconds

    assert chain_seconds(1.0, 0.01, 50.0, 70.0, 1e3) == pytest.approx((0.01 * 70 + 1) / 120)
    assert chain_seconds(1.0, 0.0, 50.0, 70.0, 100.0) == pytest.approx(1 / 100)  # DRAM
    assert chain_seconds(1.0, 0.001, 50.0, None, 1e3) == pytest.approx(1 / 50)  # copy-only
    assert chain_seconds(1e-6, 0.02, 50.0, 70.0, 100.0) == 0.02  # the GPU alone
    split = {"offload": "auto", "split": True, "misses_per_token": 100.0}
    split |= {"prefetch_hits_per_token": 60.0, "measured_copy_gb_s": 50.0}
    split |= {"measured_cpu_gb_s": 70.0, "tok_s": 30.0}
    static = {"offload": "static", "cpu_experts_per_token": 170.0, "tok_s": 25.0}
    runs = [{"offload": "none", "ms_per_token": 10.0}, split, static]
    add_ceilings(runs, dram=100e9, expert_bytes=6_000_000)
    need = 160 * 6_000_000
    assert split["host_read_bytes_per_token"] == need
    want = 1 / max(need / 100e9, (0.01 * 70e9 + need) / 120e9)
    assert split["chain_ceiling_tok_s"] == pytest.approx(want)
    assert split["chain_ceiling_tok_s"] <= split["host_memory_ceiling_tok_s"]
    assert split["chain_ceiling_vs_static"] == pytest.approx(want / 25.0)
    assert "chain_ceiling_tok_s" not in static


def test_calibration_falls_back_to_the_callers_thread_when_the_pool_cannot_start():
    """A native kernel whose pool's threads cannot be made (start raises OSError and turns
    `pooled` off, as `NativeExperts.start` does) is calibrated on the calling thread, as decode
    then runs it, and its profile is keyed without `-pool`."""
    from agentrt.offload import calibrate as cal
    from agentrt.offload.calibrate import calibrate, profile_kernel

    class NoPool:
        pooled, posted, runs = True, False, 0

        def start(self, *args) -> None:
            self.pooled = False
            raise OSError("native CPU expert kernel: no thread pool (code -1)")

        def run(self, gate_up, down, weights, x, out, accumulate=False) -> None:
            self.runs += 1
            out.zero_()

    kernel = NoPool()
    assert profile_kernel(kernel) == "native-pool" and profile_kernel(None) == "torch"
    profile = calibrate(_store(layers=1, experts=4), torch.device("cpu"), count=4, kernel=kernel)
    assert profile.cpu > 0 and profile.cpu_overlapped > 0
    assert kernel.runs == 4 + cal.ROUNDS * (4 + 4)  # (warm-up, then each round: alone, overlapped)
    assert profile_kernel(kernel) == "native"


def test_a_shorter_context_gives_the_kv_room_back_to_the_expert_cache(model_spec, reference):
    """Elastic both ways: a long request grows KV past its reservation and shrinks the expert
    cache; a later request that needs less than half of that KV (a new, shorter session) shrinks
    the KV again, and the cache grows back to its size before, with its experts copied back at
    the next decode step. Outputs still equal the dense model's."""
    ids, want_tokens, _ = reference
    grow = 1024  # (KV grows in steps of this many tokens)
    config, _ = _elastic_config(model_spec, grow, 40)
    rt = Runtime.open(model_spec, cache="off", offload=config)
    cache = rt.engine.offload.cache
    assert cache.num_slots == 40
    long_prompt = (ids[::-1] * (grow // len(ids) + 1))[: grow + 16]  # (another session)
    rt.generate(long_prompt, max_tokens=2)
    assert cache.num_slots < 40
    assert rt.generate(ids, max_tokens=20) == want_tokens  # the short session
    assert cache.num_slots == 40 and not cache.pending
    assert all(c.capacity <= grow for c in rt._state.kv_caches())
    cache.check()


def test_kv_grows_ahead_between_turns_so_the_next_turn_rebuilds_nothing(model_spec, reference):
    """Under a budget the live sequence's KV starts at the budget's reservation (it costs the
    expert cache nothing, and the start-up decode graph is captured on it). Between turns,
    `prepare_ahead` grows KV left with less than one prefill chunk of room, taking it from the
    expert cache, whose experts come back at once; the next turn of the same session, within
    that room, then finds the same buffers and the same pool (nothing rebuilt on its path, so
    no graph captured there) and is not given back; its tokens equal the dense model's."""
    ids, _, _ = reference
    grow, chunk = 1024, 256
    config, _ = _elastic_config(model_spec, grow, 40)
    rt = Runtime.open(model_spec, cache="off", offload=config, prefill_chunk=chunk)
    dense = Runtime.open(model_spec, cache="off", prefill_chunk=chunk)
    cache, state = rt.engine.offload.cache, rt._live_state()
    assert all(c.capacity == grow for c in state.kv_caches())
    assert not rt.prepare_ahead()  # (nothing in the live sequence yet)
    first = (ids * (grow // len(ids) + 1))[: grow - 150]
    out = rt.generate(first, max_tokens=4)
    assert cache.num_slots == 40 and state.num_tokens > grow - chunk
    assert rt.prepare_ahead()
    assert cache.num_slots < 40 and not cache.pending
    assert all(c.capacity >= state.num_tokens + chunk for c in state.kv_caches())
    buffers, resizes = [c.k.data_ptr() for c in state.kv_caches()], cache.resizes
    second = first + out + ids[:100]  # the session goes on
    assert rt.generate(second, max_tokens=4) == dense.generate(second, max_tokens=4)
    assert cache.resizes == resizes and [c.k.data_ptr() for c in state.kv_caches()] == buffers
    assert not rt.prepare_ahead()  # (room left for another chunk)
    cache.check()


def test_packed_mxfp4_rows_hold_an_expert_in_17_32_of_a_byte_per_weight():
    """A packed expert row: gate_up's codes and exponents, then down's; 17/32 of a byte per
    weight; values on the FP4 grid (one power of two per block of 32) come back exactly, and the
    reference matvec over selected rows equals the dense product."""
    from agentrt.models.mxfp4 import FP4_VALUES
    from agentrt.offload.mxfp4_rows import (
        RowLayout,
        grouped_reference,
        matvec_reference,
        pack_row,
        unpack,
    )

    layout = RowLayout(hidden=64, inter=96)
    gate_up, down = layout.gate_up, layout.down
    assert (gate_up.codes, gate_up.scales, down.codes) == (0, 192 * 32, 192 * 34)
    assert layout.row_bytes == 3 * 64 * 96 * 17 // 32 == down.scales + 64 * 3
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor(FP4_VALUES)

    def on_grid(rows, cols):  # FP4 codes times a power of two per block of 32
        codes = grid[torch.randint(0, 16, (rows, cols), generator=gen)]
        powers = 2.0 ** torch.randint(-8, 0, (rows, cols // 32, 1), generator=gen)
        return (codes.view(rows, -1, 32) * powers).view(rows, cols)

    experts = [(on_grid(192, 64), on_grid(64, 96)) for _ in range(3)]
    rows = torch.stack([pack_row(layout, a, b) for a, b in experts])
    assert rows.dtype == torch.uint8 and rows.shape == (3, layout.row_bytes)
    assert torch.equal(unpack(rows, gate_up, torch.float32)[1], experts[1][0])
    assert torch.equal(unpack(rows, down, torch.float32)[2], experts[2][1])
    slots, x = torch.tensor([2, 0, 2]), torch.randn(3, 96, generator=gen)
    want = torch.stack([experts[s][1] @ x[i] for i, s in enumerate(slots.tolist())])
    torch.testing.assert_close(matvec_reference(rows, slots, down, x), want)
    x = torch.randn(7, 64, generator=gen)  # a prefill's runs: 3 tokens of expert 1, 4 of 0
    got = grouped_reference(rows, [1, 0], [3, 4], gate_up, x)
    torch.testing.assert_close(got, torch.cat([x[:3] @ experts[1][0].T, x[3:] @ experts[0][0].T]))
    with pytest.raises(ValueError):
        RowLayout(hidden=48, inter=96)


def _packed_store(biased: bool):
    """Two layers of 6 experts (H 64, I 32) whose values sit on the MXFP4 grid, so packing them
    loses nothing; with biases and gpt-oss's clamped SwiGLU when `biased`."""
    from agentrt.models.moe import PLAIN, RoutedExperts, SwiGLU
    from agentrt.models.mxfp4 import dequantize, quantize

    torch.manual_seed(0)
    act = SwiGLU(7.0, 1.702) if biased else PLAIN

    def on_grid(*shape):
        return dequantize(*quantize(torch.randn(*shape) * 0.3), torch.float32)

    routed = RoutedExperts(
        {layer: on_grid(6, 64, 64) for layer in range(2)},
        {layer: on_grid(6, 64, 32) for layer in range(2)},
        {layer: torch.randn(6, 64) for layer in range(2)} if biased else None,
        {layer: torch.randn(6, 64) for layer in range(2)} if biased else None,
        act=act,
    )
    return routed, ExpertStore.from_routed(routed, pin=False, packed=True)


@pytest.mark.parametrize("biased", [False, True])
def test_packed_store_rows_compute_like_the_unpacked_experts(biased):
    """A packed store holds 17/32 of a byte per weight; its rows dequantize to the weights it
    was given, a decode token's experts over packed slots (`token_experts`) and a prefill
    part's (`part_ffn`) equal the unpacked computation."""
    from agentrt.models.moe import expert_ffn
    from agentrt.offload.packed import part_ffn, resident_ffn, token_experts
    from agentrt.offload.pairs import looped_ffn

    routed, store = _packed_store(biased)
    assert store.expert_bytes == 3 * 64 * 32 * 17 // 32 and store.flat[0].dtype == torch.uint8
    assert not store.plain  # (the native bf16 kernel does not read packed rows)
    torch.testing.assert_close(store.gate_up(1), routed.gate_up[1], rtol=0, atol=0)
    torch.testing.assert_close(store.expert_views(0)[2][3], routed.down[0][3], rtol=0, atol=0)
    x, ids = torch.randn(1, 64), [4, 0, 5]
    slots = torch.tensor([1, 2, 0])
    rows = store.flat[1][ids][[2, 0, 1]]  # (slots: the experts in another order)
    got = token_experts(store, 1, rows, slots, x, torch.tensor(ids))
    weights = torch.tensor([0.5, 0.0, 2.0])
    scaled = token_experts(store, 1, rows, slots, x, torch.tensor(ids), weights)
    assert scaled.dtype == torch.float32 and not scaled[1].any()
    torch.testing.assert_close(scaled, got * weights.unsqueeze(1), rtol=0, atol=0)
    for j, expert in enumerate(ids):
        bias = store.expert_biases(1, expert, "cpu")
        want = expert_ffn(
            x, routed.gate_up[1][expert], routed.down[1][expert], *bias, act=store.act
        )
        torch.testing.assert_close(got[j], want[0], rtol=1e-5, atol=1e-5)
    counts, experts = [3, 0, 2], [5, 1, 2]
    xs, scale = torch.randn(5, 64), torch.rand(5, 1)
    biases = None
    if biased:
        biases = (routed.gate_up_bias[0][experts], routed.down_bias[0][experts])
    got = part_ffn(store, store.flat[0][experts], counts, xs, scale, biases)
    gate_up, down = routed.gate_up[0][experts], routed.down[0][experts]
    want = looped_ffn(xs, gate_up, down, counts, scale, biases, store.act)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a resident layer (every expert in order in one block) over a chunk, as RoutedExperts
    xs, ids = torch.randn(7, 64), torch.randint(0, 6, (7, 2))
    weights = torch.rand(7, 2)
    got = resident_ffn(store, 1, store.flat[1], xs, ids, weights)
    torch.testing.assert_close(got, routed(1, xs, ids, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("biased", [False, True])
def test_native_mxfp4_cpu_kernel_matches_the_dequantized_experts(biased):
    """The native kernel over packed rows (`cpu_mxfp4`): a token's weighted sum over several
    experts (with biases and the clamped SwiGLU, and accumulating) equals its plain-torch
    reference (torch's experts on the dequantized weights, inputs and activations quantized as
    the kernel does), and the unquantized experts within the int16 quantization's error; so
    does prefill's rows call. Non-finite inputs give NaN outputs."""
    from agentrt.models.moe import expert_ffn
    from agentrt.offload.cpu_mxfp4 import mxfp4_kernel, reference_ffn

    routed, store = _packed_store(biased)
    kernel = _packed_kernel_or_skip(store)

    def summed(ffn, x, ids, w):
        return sum(
            wi * ffn(
                x[None], routed.gate_up[1][e], routed.down[1][e],
                *store.expert_biases(1, e, "cpu"), act=store.act,
            )[0]
            for wi, e in zip(w, ids, strict=True)
        )  # fmt: skip

    x, ids, w = torch.randn(64), [4, 1, 3], [0.5, 0.3, 0.2]
    out = torch.full((64,), 2.0)
    kernel.run_experts(1, ids, w, x.bfloat16(), out, accumulate=True)
    want = summed(reference_ffn, x.bfloat16().float(), ids, w)
    # (an activation on a rounding edge may land one step of its block's int16 grid away)
    tol = {"rtol": 1e-5, "atol": 1e-4 * want.abs().max().item()}
    torch.testing.assert_close(out, want + 2.0, **tol)
    kernel.run_experts(1, ids, w, x, out)
    torch.testing.assert_close(out, summed(reference_ffn, x, ids, w), **tol)
    exact = summed(expert_ffn, x, ids, w)
    torch.testing.assert_close(out, exact, rtol=1e-3, atol=1e-3 * exact.abs().max().item())
    # prefill's rows: 3, 1 and 5 rows of experts 5, 0 and 2, weighted per row
    from agentrt.offload.pairs import looped_ffn

    experts, counts = [5, 0, 2], {5: 3, 0: 1, 2: 5}
    xs, scale = torch.randn(9, 64), torch.rand(9, 1)
    out = torch.empty(9, 64)
    kernel.run_rows(1, experts, [counts.get(e, 0) for e in range(6)], xs, scale, out)
    biases = None
    if biased:
        biases = (routed.gate_up_bias[1][experts], routed.down_bias[1][experts])
    gate_up, down = routed.gate_up[1][experts], routed.down[1][experts]
    want, begin = torch.empty(9, 64), 0
    for i, rows in enumerate([3, 1, 5]):
        bias = (biases[0][i], biases[1][i]) if biased else (None, None)
        ys = reference_ffn(xs[begin : begin + rows], gate_up[i], down[i], *bias, act=store.act)
        want[begin : begin + rows] = ys * scale[begin : begin + rows]
        begin += rows
    # (an activation on a rounding edge may land one step of its block's int16 grid away)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
    exact = looped_ffn(xs, gate_up, down, [3, 1, 5], scale, biases, store.act)
    torch.testing.assert_close(out, exact, rtol=1e-3, atol=1e-3 * exact.abs().max().item())
    # a NaN or an infinity in a row's input makes that row's output NaN, as fp32 math would,
    # never finite values (the integer quantization must not swallow it)
    xs[4, 7], xs[0, 3] = float("nan"), float("inf")
    kernel.run_rows(1, experts, [counts.get(e, 0) for e in range(6)], xs, scale, out)
    assert out[[0, 4]].isnan().all() and not out[[1, 2, 3, 5, 6, 7, 8]].isnan().any()
    kernel.run_experts(1, ids, w, xs[4], out[0])
    assert out[0].isnan().all()
    # a block too small for its scale (below ~3.9e-34) counts as zero, here as in the reference
    x = torch.randn(64)
    x[:32] *= 1e-36
    kernel.run_experts(1, ids, w, x, out[0])
    torch.testing.assert_close(out[0], summed(reference_ffn, x, ids, w), **tol)
    # every kernel bound to this library (one pool, one posted call in C) takes turns by one lock
    assert mxfp4_kernel(_packed_store(False)[1])._lock is kernel._lock


@pytest.mark.parametrize("pooled,refused", [(False, False), (True, False), (True, True)])
def test_host_step_with_packed_rows_sums_the_cpu_experts(pooled, refused, monkeypatch):
    """A graph host step over packed MXFP4 experts: the token's experts that found no slot run
    on packed rows' kernel (on its thread pool with `pooled`, while the host step prefetches
    and fills the inputs), and the pinned buffer gets their weighted sum; `refused`: every
    other admission fails, and those copies run after the pool's experts, added."""
    from agentrt.models.moe import expert_ffn

    routed, store = _packed_store(True)
    kernel = _packed_kernel_or_skip(store)
    monkeypatch.setattr(kernel, "pooled", pooled)
    experts, cache, steps = _graph_host_steps(store, kernel, True)
    if refused:
        admit, calls = cache.admit, []

        def every_other(*args):  # the first, third, ... admission fails
            calls.append(args)
            return None if len(calls) % 2 else admit(*args)

        monkeypatch.setattr(cache, "admit", every_other)
    for layer, ids, w, x, io in steps:
        on_cpu = [j for j in range(4) if io.gw_h[j] == 0]
        want = sum(
            w[j] * expert_ffn(
                x[None], routed.gate_up[layer][ids[j]], routed.down[layer][ids[j]],
                *store.expert_biases(layer, ids[j], "cpu"), act=store.act,
            )[0]
            for j in on_cpu
        )  # fmt: skip
        if not on_cpu:
            assert torch.count_nonzero(io.cpu_h) == 0
            continue
        scale = want.abs().max().item()
        torch.testing.assert_close(io.cpu_h, want, rtol=1e-3, atol=1e-3 * scale)
    assert experts.totals.cpu > 0 and not kernel.posted


@pytest.mark.parametrize("hidden,inter,biased", [(96, 64, True), (320, 160, False)])
def test_native_mxfp4_kernel_on_random_packed_rows(hidden, inter, biased):
    """Random packed rows (any code byte, exponents over 2^-9..2^2, odd numbers of blocks) on
    other shapes: 1 to 5 experts of a token, and prefill rows of 1 to 7 per expert, equal the
    plain-torch reference on the rows' dequantized weights."""
    from agentrt.models.moe import PLAIN, SwiGLU
    from agentrt.offload.cpu_mxfp4 import reference_ffn

    act = SwiGLU(7.0, 1.702) if biased else PLAIN
    store = ExpertStore(range(1), 8, hidden, inter, torch.float32, pin=False, bias=biased,
                        act=act, packed=True)  # fmt: skip
    gen = torch.Generator().manual_seed(hidden)
    rows = store.flat[0]
    rows.random_(0, 256, generator=gen)
    for part in (store.layout.gate_up, store.layout.down):
        scales = rows[:, part.scales : part.scales + part.rows * part.groups]
        scales.random_(118, 130, generator=gen)
    if biased:
        for b in store.biases(0, "cpu"):
            b.copy_(torch.randn(b.shape, generator=gen))
    kernel = _packed_kernel_or_skip(store)
    _, gate_up, down = store.expert_views(0)

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        bias = store.expert_biases(0, e, "cpu")
        return reference_ffn(x, gate_up[e].float(), down[e].float(), *bias, act=act)

    for n in range(1, 6):
        ids = torch.randperm(8, generator=gen)[:n].tolist()
        w, x = torch.rand(n, generator=gen).tolist(), torch.randn(hidden, generator=gen)
        out = torch.empty(hidden)
        kernel.run_experts(0, ids, w, x, out)
        want = sum(wi * expert(e, x[None])[0] for wi, e in zip(w, ids, strict=True))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
    counts = [int(c) for c in torch.randint(0, 8, (8,), generator=gen)]
    experts = [e for e in range(8) if counts[e]]
    xs = torch.randn(sum(counts), hidden, generator=gen)
    scale = torch.rand(sum(counts), generator=gen)
    out = torch.empty(sum(counts), hidden)
    kernel.run_rows(0, experts, counts, xs, scale, out)
    want, begin = torch.empty_like(out), 0
    for e in experts:
        rows_e = slice(begin, begin + counts[e])
        want[rows_e] = expert(e, xs[rows_e]) * scale[rows_e, None]
        begin += counts[e]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


PACKED_POOL_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])  # (the tests' folder)
from test_offload import _packed_store
from agentrt.offload.cpu_mxfp4 import mxfp4_kernel
for biased in (False, True):
    routed, store = _packed_store(biased)
    k = mxfp4_kernel(store)
    k.pool_threads = 3  # (the pool's size, fixed by its first call; may exceed the cores here)
    for call in range(12):
        k.schedule((16, 1, 0)[call % 3])  # claimed chunks of 16 or 1 items, fixed shares
        k.active_threads = lambda: 3 - call % 3  # (all 3, or fewer: helpers busy)
        ids = [(call + j) % 6 for j in range(1 + call % 4)]
        w, x = [0.5, 0.3, 0.2, 0.7][: len(ids)], torch.randn(64)
        want, out = torch.full((64,), 2.0), torch.full((64,), float("nan"))
        k.run_experts(1, ids, w, x, want, accumulate=True)
        k.start_experts(1, ids, w, x, out)
        assert k.posted and k.finish() > 0 and not k.posted
        k.start_experts(1, ids, w, x, out.fill_(2.0), accumulate=True)
        k.finish()
        assert torch.equal(out, want), (biased, call)
    import random  # many short calls on 1-3 threads: those that sat calls out must rejoin
    rng = random.Random(0)
    for call in range(400):
        k.active_threads = lambda: rng.randint(1, 3)
        k.start_experts(1, ids, w, x, out)
        k.finish()
        k.run_experts(1, ids, w, x, want)
        assert torch.equal(out, want), (biased, call)
print("ok")
POST = "start_experts"
"""


@pytest.mark.slow
def test_packed_mxfp4_kernel_pool_computes_the_same_bits_as_its_openmp_path():
    """Packed rows' kernel on its thread pool (`start_experts`, then `finish`: graph decode's
    host steps) computes what its OpenMP path (`run_experts`) does, bit for bit: 1-4 experts,
    with and without biases, on 1-3 threads, items claimed in chunks of 16 or 1, or fixed
    shares, accumulated
    (in a subprocess: the first call fixes the pool's size); calibration then measures the
    overlapped bandwidths through the pool."""
    import subprocess
    import sys
    from pathlib import Path

    _packed_kernel_or_skip(_packed_store(False)[1])
    proc = subprocess.run(
        [sys.executable, "-c", PACKED_POOL_CHECK + POOL_CALIBRATION, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"] * 2


@pytest.mark.parametrize("name", ["split", "copy-only"])
def test_packed_mxfp4_experts_offloaded_equal_dense(model_spec, name):
    """`packed_mxfp4`: the experts stay MXFP4 in the host store, the slots and the staging;
    prefill logits and greedy decode equal the dense model whose experts hold the same MXFP4
    values (the load rounds them to MXFP4)."""
    from agentrt.models.mxfp4 import dequantize, quantize
    from agentrt.offload.cpu_kernel import native_experts

    dense = Runtime.open(model_spec, cache="off")
    experts = dense.engine.model.experts
    for stack in [*experts.gate_up.values(), *experts.down.values()]:
        stack.copy_(dequantize(*quantize(stack), stack.dtype))
    ids = dense.tokenizer.encode(PROMPT)
    want = dense.engine.prefill(dense.engine.new_state(), ids, all_logits=True)
    want_tokens = dense.generate(ids, max_tokens=12)
    config = dataclasses.replace(CONFIGS[name], packed_mxfp4=True)
    rt = Runtime.open(model_spec, cache="off", offload=config)
    offload = rt.engine.offload
    assert offload.store.packed and offload.cache.slots.dtype == torch.uint8
    if native_experts() is not None:  # (a C compiler: the CPU side runs the packed kernel)
        assert offload.packed_cpu is not None
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    assert rt.generate(ids, max_tokens=12) == want_tokens
    offload.cache.check()
    assert offload.prefill.totals.layers > 0 and offload.totals.copied > 0
    assert (offload.totals.cpu > 0) == (name == "split")


def test_a_synthetic_model_with_packed_experts_draws_them_packed():
    """`synthetic:NAME` with `packed_mxfp4` draws its experts as MXFP4 codes straight into the
    host store (weights of about the synthetic init's spread); the offloaded model equals the
    dense one given the same (dequantized) experts, biases and all."""
    from agentrt.models.synthetic import INIT_STD

    spec = "synthetic:tiny-gpt-oss"
    config = dataclasses.replace(CONFIGS["split"], packed_mxfp4=True)
    rt = Runtime.open(spec, cache="off", offload=config)
    store = rt.engine.offload.store
    assert 0.5 * INIT_STD < store.gate_up(0).float().std().item() < 2 * INIT_STD
    dense = Runtime.open(spec, cache="off")
    experts = dense.engine.model.experts
    for layer in store.layers:
        experts.gate_up[layer].copy_(store.gate_up(layer))
        experts.down[layer].copy_(store.down(layer))
        assert torch.equal(experts.gate_up_bias[layer], store.bias[layer][0])
    ids = rt.tokenizer.encode(PROMPT)
    want = dense.engine.prefill(dense.engine.new_state(), ids, all_logits=True)
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    assert rt.generate(ids, max_tokens=8) == dense.generate(ids, max_tokens=8)


@pytest.mark.slow
def test_expert_format_auto_keeps_mxfp4_experts_packed_where_the_model_has_them(tmp_path):
    """`expert_format` auto (the default): packed for models whose experts come as MXFP4 (an
    MXFP4 checkpoint, the synthetic gpt-oss shapes) when offloaded with mode auto; unpacked for
    the others, and for every model kept resident."""
    from agentrt.errors import InvalidArgumentError
    from agentrt.models.registry import mxfp4_experts
    from agentrt.models.tiny import build_tiny
    from agentrt.session.options import packed_experts

    mxfp4_dir = build_tiny(tmp_path / "mxfp4", "tiny-gpt-oss", mxfp4=True)
    bf16_dir = build_tiny(tmp_path / "bf16", "tiny-gpt-oss")
    assert mxfp4_experts(str(mxfp4_dir)) and not mxfp4_experts(str(bf16_dir))
    assert mxfp4_experts("synthetic:gpt-oss-120b") and mxfp4_experts("synthetic:gpt-oss-20b@skew=1")
    for spec in ("synthetic:qwen3.5-35b-a3b", "synthetic:tiny-gpt-oss", "tiny", str(tmp_path)):
        assert not mxfp4_experts(spec)
    assert packed_experts("auto", "synthetic:gpt-oss-120b", "auto")
    assert not packed_experts("auto", "synthetic:gpt-oss-120b", "none")
    assert not packed_experts("model", "synthetic:gpt-oss-120b", "auto")
    assert packed_experts("mxfp4", "synthetic:tiny-gpt-oss", "auto")
    with pytest.raises(InvalidArgumentError, match="expert format"):
        packed_experts("fp8", "tiny", "auto")
    rt = Runtime.open(str(mxfp4_dir), cache="off", expert_cache_slots=12)
    assert rt.engine.offload.store.packed
    rt = Runtime.open(str(bf16_dir), cache="off", expert_cache_slots=12)
    assert not rt.engine.offload.store.packed
    assert Runtime.open(str(mxfp4_dir), cache="off").engine.offload is None


@pytest.mark.slow
def test_bench_decode_and_prefill_with_packed_experts(tmp_path):
    """`bench decode` and `bench prefill` with `--expert-format mxfp4`: the experts stay packed
    (the reports say so, with the packed row's bytes per expert), the baselines run too."""
    import json

    from util import invoke_cli

    from agentrt.offload.mxfp4_rows import RowLayout

    cfg = config_of("synthetic:tiny-gpt-oss")
    row = RowLayout(cfg.hidden_size, cfg.moe_intermediate_size).row_bytes
    common = ["--model", "synthetic:tiny-gpt-oss", "--device", "cpu", "--expert-format", "mxfp4"]
    out = tmp_path / "decode.json"
    args = ["bench", "decode", *common, "--prompt-len", "40", "--tokens", "4"]
    result = invoke_cli(*args, "--offload", "auto,static", "--vram-budget", "1.2GiB", "--json", out)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["expert_format"] == "mxfp4" and report["expert_bytes"] == row
    # (packed experts: no CPU warm-up by default, and the label says so)
    assert [r["label"] for r in report["runs"]] == ["auto/split/lfu/no-warm", "static"]
    assert report["runs"][0]["cpu_warm"] is False
    out = tmp_path / "prefill.json"
    args = ["bench", "prefill", *common, "--offload", "auto", "--expert-cache-slots", "12"]
    args += ["--lengths", "96", "--suffixes", "16", "--prefix", "64", "--repeat", "1"]
    result = invoke_cli(*args, "--prefill-plan", "auto", "--json", out)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["expert_format"] == "mxfp4"


def test_a_bf16_checkpoint_packs_layer_by_layer_as_it_loads():
    """Loading unpacked weights into a packed store holds about one layer unpacked at a time:
    the loader reports each finished layer, which is packed and its stacks freed."""
    from agentrt.models.loader import load_model
    from agentrt.models.tiny import ensure_tiny
    from agentrt.offload.packed_load import PackedSink

    path = ensure_tiny(quiet=True)
    store = ExpertStore.for_config(config_of("tiny"), torch.float32, pin=False, packed=True)
    peak = []

    class Counting(PackedSink):
        def layer_loaded(self, layer: int) -> None:
            peak.append(len(self.gate_up.made) + len(self.down.made))
            super().layer_loaded(layer)

    sink = Counting(store)
    load_model(path, "cpu", torch.float32, experts=sink)
    assert len(peak) == len(store.layers) and max(peak) <= 2
    assert not sink.gate_up.made and not sink.down.made
    want = load_model(path, "cpu", torch.float32).experts.gate_up[store.layers[-1]]
    error = (store.gate_up(store.layers[-1]) - want).abs().max()
    assert error < 0.2 * want.abs().max()  # (MXFP4 rounding: at most a sixth of a block's peak)


def test_bench_decode_keeps_the_settings_measured_when_one_cannot_open(tmp_path):
    """A setting that cannot open (a budget too small for auto) is reported under `failed`; the
    settings measured before and after it stay in the report."""
    import json

    from util import invoke_cli

    out = tmp_path / "d.json"
    args = ["bench", "decode", "--device", "cpu", "--offload", "none,auto,static"]
    args += ["--vram-budget", "2MiB", "--tokens", "2", "--prompt-len", "8", "--json", str(out)]
    result = invoke_cli(*args)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [r["label"] for r in report["failed"]] == ["auto/split/lfu"]
    assert "leaves no room for experts" in report["failed"][0]["error"]
    assert [r["label"] for r in report["runs"]][0] == "none" and len(report["runs"]) == 2


def test_kv_grows_to_what_the_budget_allows_when_doubling_does_not_fit(model_spec, reference):
    """Under a budget the KV grows to double its size when that fits, else to the tokens needed
    (in whole growth steps, or exactly): a prompt the budget can hold is never refused because
    a doubled KV would not fit."""
    ids, _, want_logits = reference
    config, _ = _elastic_config(model_spec, 64, 12)
    rt = Runtime.open(model_spec, cache="off", offload=config)
    state = rt.engine.new_state(rt.engine.live_capacity())
    long_ids = (ids * 4)[:100]
    logits = rt.engine.prefill(state, long_ids, all_logits=True)
    dense = Runtime.open(model_spec, cache="off")
    want = dense.engine.prefill(dense.engine.new_state(), long_ids, all_logits=True)
    assert (logits - want).abs().max().item() < 1e-4
    assert all(64 < c.capacity < 128 for c in state.kv_caches())
    rt.engine.offload.cache.check()


def test_prepare_ahead_brings_back_experts_a_turn_without_decode_left_out(model_spec, reference):
    """A turn that grew the KV (the expert pool rebuilt smaller) but ran no decode step (one
    token) leaves the kept experts waiting; `prepare_ahead` copies them back between turns
    even when the KV needs no growth, so the next turn does not start with an empty pool."""
    ids, _, _ = reference
    config, _ = _elastic_config(model_spec, 1024, 40)
    rt = Runtime.open(model_spec, cache="prefix", offload=config, prefill_chunk=256)
    cache = rt.engine.offload.cache
    rt.generate(ids, max_tokens=30)  # decode fills the cache
    rt.generate((ids * 40)[:1200], max_tokens=1)
    assert cache.pending and cache.num_slots < 40
    assert not rt.prepare_ahead()  # (no growth: room for a chunk is left)
    assert not cache.pending and sum(o is not None for o in cache.owner) == cache.num_slots
    cache.check()


def test_a_request_allowed_the_whole_context_still_gets_kv_given_back(model_spec, reference):
    """A short request whose limit is the whole context (a server request without max_tokens)
    after a long session still gives the KV room back to the expert cache."""
    from agentrt.engine.sampling import SamplingParams

    ids, _, _ = reference
    config, _ = _elastic_config(model_spec, 1024, 40)
    rt = Runtime.open(model_spec, cache="prefix", offload=config, prefill_chunk=256)
    cache = rt.engine.offload.cache
    rt.generate((ids * 40)[:1500], max_tokens=4)
    assert cache.num_slots < 40
    params = SamplingParams(max_tokens=rt.engine.max_context)
    for _ in rt.engine.stream(rt._live_state(), ids[::-1][:40], params, None, rt.reuse):
        break  # (the KV is given back before the first token)
    assert cache.num_slots == 40
    cache.check()


def test_a_pool_that_cannot_be_allocated_is_made_smaller_not_left_empty(model_spec, monkeypatch):
    """Memory short of the budget when the pool is rebuilt (another process took it): the new
    pool has half as many slots (then a quarter...), never none at all with every later
    expert a miss."""
    config, _ = _elastic_config(model_spec, 64, 40)
    rt = Runtime.open(model_spec, cache="off", offload=config)
    cache = rt.engine.offload.cache
    real, failures = ExpertCache._new_pool, []

    def short_of_memory(self, num_slots, policy):
        if num_slots > 0 and not failures:
            failures.append(num_slots)
            raise torch.OutOfMemoryError("out of memory (simulated)")
        real(self, num_slots, policy)

    monkeypatch.setattr(ExpertCache, "_new_pool", short_of_memory)
    rt.generate(list(range(10, 200)), max_tokens=2)
    assert failures and cache.num_slots == failures[0] // 2 > 0
    cache.check()


def test_a_session_cut_back_keeps_its_kv_and_its_reuse(model_spec, reference):
    """A prompt shorter than the live sequence that shares most of itself with it (the same
    session, its earlier reasoning dropped, say) is no new session: the KV is not given back,
    and a model whose state can be cut back reuses the shared tokens."""
    ids, _, _ = reference
    config, _ = _elastic_config(model_spec, 1024, 40)
    config = OffloadConfig(**{**config.__dict__, "vram_budget": config.vram_budget * 3})
    rt = Runtime.open(model_spec, cache="prefix", offload=config, prefill_chunk=256)
    cache = rt.engine.offload.cache
    before, session = cache.num_slots, (ids * 100)[:3000]
    rt.generate(session, max_tokens=4)
    slots = cache.num_slots
    assert rt._state.kv_caches()[0].capacity >= 3000 and slots < before
    from agentrt.engine.sampling import SamplingParams

    gen = rt.engine.generate(rt._live_state(), session[:1400], SamplingParams(2), rt.reuse)
    assert cache.num_slots == slots
    if not rt.engine.cfg.is_hybrid:
        assert gen.cached_tokens == 1400 - 1
