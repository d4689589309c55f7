"""Offloaded prefill on the CPU (device slots and staging are CPU tensors, copies are memcpy): the
planner's choices on constructed costs, every plan's output equal to the dense model's, the
staging ring after a pass that stopped part-way, and a prefill that leaves the decode working
set in the expert cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agentrt import Runtime
from agentrt.offload.config import OffloadConfig
from agentrt.offload.passes import LONG_CONTEXT, PassClock
from agentrt.offload.planner import (
    EXPLORE_EVERY,
    Costs,
    choose,
    pick_strategy,
    plan_ahead,
    predicted_plan,
    reserve_plan,
    routed_plan,
    size_class,
    strategies_for,
    stream_plan,
)
from agentrt.offload.stats import PrefillTotals

PROMPT = "def main():\n    print('hello')  # the agent edits files and runs tests\n" * 10

# one expert: 1 s to copy, 1 s to read on the CPU, plus 0.5 s per token there
COSTS = Costs(expert_bytes=100, copy_bw=100.0, cpu_bw=100.0, cpu_flops=1.0, token_flops=0.5)


def test_stream_plan_copies_every_missing_expert():
    plan = stream_plan([3, 1, 2], COSTS)
    assert plan.kind == "stream" and plan.copy == (3, 1, 2) and plan.cpu == ()
    assert plan.seconds == pytest.approx(3.0)


def test_routed_plan_sends_the_fewest_token_experts_to_the_cpu_while_it_helps():
    routed = {1: 1, 2: 1, 3: 4, 4: 10, 5: 10, 6: 10}
    plan = routed_plan(routed, COSTS, split=True)
    # 6 s of copies; e1 and e2 cost 1.5 s each on the CPU (copies 4 s, CPU 3 s); e3 would
    # cost 3 s more (CPU 6 s > copies 3 s): it stays a copy
    assert plan.kind == "split" and plan.cpu == (1, 2) and plan.copy == (3, 4, 5, 6)
    assert plan.seconds == pytest.approx(4.0)
    assert routed_plan(routed, COSTS, split=False).cpu == ()
    slow = Costs(100, 100.0, 1.0, 1.0, 0.5)  # the CPU reads 100x slower than it copies
    assert routed_plan(routed, slow, split=True).kind == "routed"
    # 2 s of dispatch before the CPU experts can start: e1 alone (CPU side 3.5 s, copies 5 s)
    # helps, e2 too would not (CPU 5 s against copies 4 s... max 5 s = no gain)
    late = Costs(100, 100.0, 100.0, 1.0, 0.5, dispatch_s=2.0)
    plan = routed_plan(routed, late, split=True)
    assert plan.cpu == (1,) and plan.seconds == pytest.approx(5.0)


def test_choose_streams_unless_copying_only_the_routed_experts_saves_time():
    missing = list(range(10))
    few = {0: 1, 1: 1}  # a short suffix: 2 of 10 missing experts routed
    assert choose("auto", missing, few, COSTS, split=False).kind == "routed"
    every = {e: 50 for e in missing}  # a long chunk: every missing expert routed
    assert choose("auto", missing, every, COSTS, split=False).kind == "stream"
    exposed = Costs(100, 100.0, 100.0, 1.0, 0.5, exposed_s=9.0)  # attention the copies wait out
    assert choose("auto", missing, few, exposed, split=False).kind == "stream"
    assert choose("stream", missing, few, COSTS, split=False).kind == "stream"
    assert choose("routed", missing, every, COSTS, split=False).kind == "routed"


def test_plan_ahead_weighs_streaming_prediction_and_waiting():
    costs = Costs(100, 100.0, 100.0, 1.0, 0.5, exposed_s=2.0)
    assert plan_ahead(0, None, 1.0, costs) == "none"  # nothing missing
    assert plan_ahead(10, 6.0, 10.0, costs) == "predicted"  # streaming and waiting: 10 s
    assert plan_ahead(10, 7.0, 4.0, costs) == "none"
    assert plan_ahead(10, 12.0, 12.0, costs) == "stream"  # a long chunk: every expert routed
    assert plan_ahead(10, None, 12.0, costs) == "stream"


def test_routed_plan_counts_the_copies_queued_ahead_of_its_own():
    routed = {1: 1, 2: 1, 3: 4}
    # 3 s of copies alone: e1 to the CPU (1.5 s against 2 s of copies) and no more
    assert routed_plan(routed, COSTS, split=True).cpu == (1,)
    # behind 10 s of copies queued ahead, every late expert is cheaper on the CPU (6.5 s)
    plan = routed_plan(routed, COSTS, split=True, queued_s=10.0)
    assert plan.cpu == (1, 2, 3) and plan.copy == () and plan.seconds == pytest.approx(10.0)


def test_reserve_plan_balances_the_streamed_copies_against_the_cpu_after_the_routing():
    # 10 missing experts, 64 pairs over 16 experts: a reserved expert is routed with
    # p = 1 - e^-4 = 0.98, 4.07 tokens then: 0.98 * (1 + 0.5 * 4) = 2.95 s each on the CPU
    k, seconds = reserve_plan(10, 64, 16, COSTS)
    assert k == 2 and seconds == pytest.approx(8.0)  # (copies 8 s, CPU 5.9 s; 3: CPU 8.85 s)
    # the CPU waits 4 s for the exposed time and the dispatch: a smaller reserve
    waiting = replace(COSTS, exposed_s=3.0, dispatch_s=1.0)
    assert reserve_plan(10, 64, 16, waiting) == (1, pytest.approx(9.0))
    # a reserved expert that is rarely routed (p = 0.22, then 1 token) costs little: a larger
    # reserve (copies 2 s, CPU 8 * 0.22 * 1.5 = 2.65 s)
    assert reserve_plan(10, 4, 16, COSTS) == (8, pytest.approx(2.654, abs=0.001))
    # nothing beats streaming: the CPU far slower than the copies, or nothing missing
    slow = Costs(100, 100.0, 1.0, 1.0, 0.5)
    assert reserve_plan(10, 64, 16, slow) == (0, pytest.approx(10.0))
    assert reserve_plan(0, 64, 16, COSTS) == (0, 0.0)


def test_auto_measures_each_strategy_then_keeps_the_fastest_and_looks_again_now_and_then():
    both = ("reserve", "routed")
    assert pick_strategy({}, 0, both) == "reserve"
    assert pick_strategy({"reserve": 1.0}, 1, both) == "routed"
    measured = {"reserve": 1.0, "routed": 0.8}
    picks = [pick_strategy(measured, n, both) for n in range(2, 2 + 2 * EXPLORE_EVERY)]
    assert picks.count("reserve") == 2 and picks.count("routed") == 2 * EXPLORE_EVERY - 2
    assert pick_strategy(measured, 5, ("routed",)) == "routed"
    # the first candidate stays unless another is faster by more than MARGIN
    assert pick_strategy({"reserve": 1.0, "routed": 0.98}, 2, both) == "reserve"
    assert pick_strategy({"reserve": 1.0, "routed": 0.97}, 2, both) == "reserve"  # (3%: a tie)
    assert pick_strategy({"reserve": 1.0, "routed": 0.96}, 2, both) == "routed"
    assert pick_strategy({"reserve": 1.0, "routed": 0.98}, EXPLORE_EVERY - 1, both) == "routed"


def test_cpu_rates_follow_the_read_rate_and_keep_the_flop_rate():
    """Prefill's CPU experts: the read rate follows each layer's time beyond its rows' matmuls
    at the fixed FLOP rate (floored at a tenth of the layer's time); an empty CPU side teaches
    nothing."""
    from agentrt.offload.cpu_rates import FOLLOW, CpuRates

    rates = CpuRates(read_bw=100.0, flops=1.0, expert_bytes=100, token_flops=0.5)
    rates.observe(10, 4, 10 * 100 / 400 + 4 * 0.5)  # 400 bytes/s beyond 2 s of matmuls
    assert rates.read_bw == pytest.approx(100 + FOLLOW * 300) and rates.flops == 1.0
    for _ in range(40):
        rates.observe(10, 4, 10 * 100 / 400 + 4 * 0.5)
    assert rates.read_bw == pytest.approx(400.0)
    rates.observe(10, 100, 1.0)  # the matmuls alone outlast it: a tenth of its time, 10000 B/s
    assert rates.read_bw == pytest.approx((1 - FOLLOW) * 400 + FOLLOW * 10000, rel=1e-3)
    before = rates.read_bw
    rates.observe(0, 10, 1.0)
    rates.observe(5, 10, 0.0)
    assert rates.read_bw == before and rates.flops == 1.0


def test_predicted_plan_copies_ahead_the_experts_predicted_the_most_tokens():
    predicted = {1: 1, 2: 1, 3: 20, 4: 20}
    # four copies: 4 s; e1 to the CPU (1.5 s): 3 s; e2 too would leave the CPU at 3 s
    ahead, seconds = predicted_plan(predicted, 0, COSTS, split=True)
    assert ahead == (2, 3, 4) and seconds == pytest.approx(3.0)
    ahead, seconds = predicted_plan(predicted, 2, COSTS, split=False)
    assert ahead == (1, 2, 3, 4) and seconds == pytest.approx(6.0)  # plus 2 late copies
    exposed = Costs(100, 100.0, 100.0, 1.0, 0.5, exposed_s=5.0)  # the CPU waits for routing
    assert predicted_plan(predicted, 0, exposed, split=True)[1] == pytest.approx(6.5)


def _config(plan: str, split: bool = True, slots: int = 10) -> OffloadConfig:
    return OffloadConfig(
        mode="auto",
        expert_cache_slots=slots,
        prefill_plan=plan,
        split=split,
        copy_bandwidth=1.0,
        cpu_bandwidth=1.0,
    )


@pytest.fixture(scope="module")
def dense():
    rt = Runtime.open("tiny", cache="off", prefill_chunk=48)
    ids = rt.tokenizer.encode(PROMPT)
    return ids, rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("plan", ["stream", "routed", "predicted", "reserve", "auto"])
def test_every_plan_equals_the_dense_model(dense, plan, split):
    ids, want = dense
    rt = Runtime.open("tiny", cache="off", prefill_chunk=48, offload=_config(plan, split))
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    totals = rt.engine.offload.prefill.totals
    assert totals.layers > 0 and totals.pairs > 0
    kinds = set(totals.plans)
    if plan == "stream":
        assert kinds == {"stream"} and totals.cpu == 0
    if plan == "routed":
        assert kinds <= {"routed", "split"}
    if plan == "predicted":  # (the first layer of each chunk has no prediction)
        assert "predicted" in kinds and kinds <= {"routed", "split", "predicted"}
        assert 0.0 <= rt.engine.offload.prefill.accuracy <= 1.0
    if plan == "reserve" and split:  # (the first layer of each chunk has nothing ahead)
        assert "reserve" in kinds and kinds <= {"stream", "routed", "split", "reserve"}
        assert totals.cpu > 0
    if plan == "reserve" and not split:  # (no CPU side to reserve for)
        assert "reserve" not in kinds
    if plan == "auto":  # (each strategy timed on its own pass of the chunk's size first)
        clock = rt.engine.offload.prefill.clock
        assert set(clock.measured[size_class(48), False]) == {"reserve", "routed"}  # (5 of 48)
    if not split:
        assert totals.cpu == 0
    rt.engine.offload.cache.check()


def test_each_plan_of_pass_follows_its_own_cpu_rate(dense, monkeypatch):
    """`auto`'s passes of `reserve` and of `routed` follow the CPU read rate (and the routed
    layers' overheads) apart, as the fixed plans' engines do: one strategy's CPU, beside other
    copies, does not move the rate the other plans its split with."""
    from agentrt.offload.cpu_rates import CpuRates

    ids, want = dense
    rt = Runtime.open("tiny", cache="off", prefill_chunk=48, offload=_config("auto"))
    streamer = rt.engine.offload.prefill
    streamer.adaptive = True  # (followed on CUDA only otherwise)
    seen, real = [], CpuRates.observe
    monkeypatch.setattr(
        CpuRates, "observe", lambda self, *a: (seen.append((streamer.mode, self)), real(self, *a))
    )
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    assert {mode for mode, _ in seen} == {"reserve", "routed"}
    assert all(rates is streamer.measures.rates[mode] for mode, rates in seen)
    assert {plan for plan, _ in streamer.measures.overheads} <= {"reserve", "routed"}
    reserve = streamer.measures.rates["reserve"].read_bw
    streamer.mode = "routed"
    streamer.cpu.observe(10, 0, 1e-3)
    assert streamer.measures.rates["reserve"].read_bw == reserve
    assert streamer.costs().cpu_bw == streamer.measures.rates["routed"].read_bw != reserve


@pytest.mark.parametrize("reserve_all", [False, True])
def test_reserve_plans_a_layer_with_nothing_queued_ahead_as_routed(dense, monkeypatch, reserve_all):
    """A layer of the reserve plan with nothing queued ahead (a pass's first layer, or every
    missing expert reserved) waits for its routing and copies only routed experts, never
    streams; where no reserve helps (a CPU this slow) the layers after the first stream."""
    ids, want = dense
    config = replace(_config("reserve"), cpu_bandwidth=1e-6)  # (nothing the CPU should take)
    rt = Runtime.open("tiny", cache="off", prefill_chunk=48, offload=config)
    if reserve_all:
        monkeypatch.setattr("agentrt.offload.prefill.reserve_plan", lambda num, *_: (num, 0.0))
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    streamer = rt.engine.offload.prefill
    kinds = list(streamer.last_plans.values())
    assert kinds[0] == "routed"
    assert set(kinds[1:]) == ({"routed"} if reserve_all else {"stream"})


class _Event:
    """A CUDA event's stand-in: `done` once its work ran, `at` its time in milliseconds."""

    def __init__(self, at: float, done: bool = True) -> None:
        self.at, self.done = at, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end) -> float:
        return end.at - self.at


def test_pass_clock_reads_a_pass_once_its_work_ran_and_picks_by_the_times():
    clock = PassClock(strategies_for)
    assert clock.begin(9, _Event(-5000.0)) == "reserve"  # a size's first pass: not timed
    clock.end(_Event(0.0))
    assert clock.begin(9, _Event(0.0)) == "reserve" and clock.measured[9, False] == {}
    late = _Event(900.0, done=False)
    clock.end(late)
    assert clock.begin(9, _Event(900.0)) == "routed"  # (reserve's pass not read yet)
    clock.end(_Event(1400.0))
    assert clock.measured[9, False] == {}
    late.done = True
    assert clock.begin(9, _Event(1400.0)) == "routed"  # 0.5 s against 0.9 s
    assert clock.measured[9, False] == {"reserve": 0.9, "routed": 0.5}
    clock.begin(10, _Event(1500.0))
    clock.begin(10, _Event(2000.0))  # a pass that never reached its last layer: not read
    assert clock.begin(10, _Event(3000.0)) == "reserve" and clock.measured[10, False] == {}


def test_auto_never_tries_routed_on_chunks_past_its_largest():
    """Chunks of more than ROUTED_MAX_TOKENS tokens reach every expert many times over:
    `routed` would copy the same experts later, so they run `reserve` without a trial."""
    from agentrt.offload.planner import ROUTED_MAX_TOKENS

    largest = size_class(ROUTED_MAX_TOKENS)
    assert strategies_for(largest) == ("reserve", "routed")
    assert strategies_for(size_class(ROUTED_MAX_TOKENS + 1)) == ("reserve",)
    # (a trial of `routed` on a 1.4-1.5K-token suffix made a replay's slowest turns)
    assert strategies_for(size_class(1400)) == ("reserve",)
    assert strategies_for(size_class(512)) == ("reserve", "routed")
    clock, at = PassClock(strategies_for), 0.0
    for size in (largest, largest + 1, size_class(8192)):
        picks = []
        for _ in range(2 * EXPLORE_EVERY):
            picks.append(clock.begin(size, _Event(at), 0))
            at += 100.0
            clock.end(_Event(at))
        assert ("routed" in picks) == (size == largest)


def test_the_engine_tells_the_offloaded_experts_where_each_chunk_starts(dense, monkeypatch):
    from agentrt.offload.experts import OffloadedExperts

    ids, _ = dense
    rt = Runtime.open("tiny", cache="off", prefill_chunk=48, offload=_config("auto"))
    starts, real = [], OffloadedExperts.chunk_at
    monkeypatch.setattr(
        OffloadedExperts, "chunk_at", lambda self, at: (starts.append(at), real(self, at))
    )
    state = rt.engine.new_state()
    rt.engine.prefill(state, ids[:100])
    rt.engine.prefill(state, ids[100:130])
    assert starts == [0, 48, 96, 100] and rt.engine.offload.prefill.context == 100


def test_pass_clock_times_passes_after_a_long_context_apart():
    """A size's passes after a long context (where attention, which a plan waiting for the
    routing cannot hide, is longer) are measured and chosen apart from those near the start;
    the size's first pass, whatever its setting, is the only one not timed."""
    clock = PassClock(strategies_for)
    clock.begin(9, _Event(0.0))
    at = 0.0
    for context, took in ((0, 500.0), (0, 900.0), (LONG_CONTEXT, 800.0), (32768, 600.0)):
        clock.begin(9, _Event(at), context)
        at += took
        clock.end(_Event(at))
    clock.begin(11, _Event(at))  # (reads the last pass)
    assert clock.measured[9, False] == {"reserve": 0.5, "routed": 0.9}
    assert clock.measured[9, True] == {"reserve": 0.8, "routed": 0.6}
    assert clock.begin(9, _Event(at), 0) == "reserve"
    assert clock.begin(9, _Event(at), 40000) == "routed"


@pytest.mark.parametrize("model", ["tiny", "gpt-oss"])
def test_cpu_experts_on_row_workers_equal_the_team_and_the_dense_model(
    dense, tiny_gpt_oss, monkeypatch, model
):
    """With AGENTRT_PREFILL_CPU_WORKERS=1 the CPU experts torch computes are spread over
    single-threaded workers (balanced by rows): the same outputs as one after another on the
    team (biased gpt-oss experts too), and the offloaded model still equals the dense one."""
    from agentrt.offload.prefill_cpu import RowWorkers, _balanced, run_cpu_experts

    groups = _balanced([0, 1, 2, 3, 4], [9, 1, 5, 5, 2], 2)
    assert sorted(map(sorted, groups)) == [[0, 4], [1, 2, 3]]  # 11 rows each
    monkeypatch.setenv("AGENTRT_PREFILL_CPU_WORKERS", "1")
    spec = "tiny" if model == "tiny" else str(tiny_gpt_oss)
    rt = Runtime.open(spec, cache="off", prefill_chunk=48, offload=_config("routed"))
    streamer = rt.engine.offload.prefill
    assert isinstance(streamer.row_workers, RowWorkers)
    if model == "tiny":
        ids, want = dense
        got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
        assert (got - want).abs().max().item() < 1e-4 and streamer.totals.cpu > 0
    store, layer = streamer.store, streamer.layers[0]
    counts = [0] * store.num_experts
    for expert, rows in ((0, 3), (1, 40), (2, 7), (3, 30)):
        counts[expert] = rows
    experts = [0, 2, 3, 1]
    x = torch.randn(sum(counts), store.hidden, dtype=store.dtype)
    scale = torch.rand(sum(counts), dtype=store.dtype)
    team, spread, workers = torch.zeros_like(x), torch.zeros_like(x), RowWorkers(3)
    totals = PrefillTotals()
    try:
        with torch.inference_mode():
            run_cpu_experts(store, None, layer, experts, counts, x, scale, team, None, totals)
            run_cpu_experts(store, None, layer, experts, counts, x, scale, spread, workers)
    finally:
        workers.close()
    torch.testing.assert_close(spread, team, rtol=1e-5, atol=1e-6)
    assert team.abs().sum() > 0
    # without the native kernel every row is torch's (counted by path)
    assert (totals.torch_rows, totals.native_rows) == (80, 0) and totals.torch_seconds > 0


@pytest.mark.parametrize("plan", ["stream", "routed", "predicted", "reserve", "auto"])
def test_every_plan_equals_the_dense_model_with_expert_biases(tiny_gpt_oss, plan):
    """gpt-oss experts (biases, the clamped SwiGLU) through each plan: the staged parts'
    grouped GEMMs, the CPU experts (torch's kernels) and the combine equal the dense model."""
    spec = str(tiny_gpt_oss)
    dense = Runtime.open(spec, cache="off", prefill_chunk=48)
    ids = dense.tokenizer.encode(PROMPT)
    want = dense.engine.prefill(dense.engine.new_state(), ids, all_logits=True)
    rt = Runtime.open(spec, cache="off", prefill_chunk=48, offload=_config(plan))
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    totals = rt.engine.offload.prefill.totals
    assert totals.layers > 0 and (totals.cpu > 0) == (plan != "stream")
    rt.engine.offload.cache.check()


def test_fills_left_by_a_pass_that_stopped_are_dropped():
    """A forward pass that stops after a layer (an error, a cancel) leaves the next layer's
    fills queued; the next pass starts from its first layer and must not consume them."""
    rt = Runtime.open("tiny", cache="off", offload=_config("stream"))
    experts = rt.engine.offload
    store, streamer = experts.store, experts.prefill
    first = store.layers[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, store.hidden, generator=gen)
    ids = torch.stack([torch.randperm(store.num_experts, generator=gen)[:4] for _ in range(40)])
    weights = torch.rand(40, 4, generator=gen)
    from agentrt.models.moe import RoutedExperts

    reference = RoutedExperts({first: store.gate_up(first)}, {first: store.down(first)})
    want = reference.looped(first, x, ids, weights)
    streamer.run(first, x, ids, weights)
    assert any(
        f.layer != first for f in (*streamer.ring.issued, *streamer.ring.queue)
    )  # queued ahead
    got = streamer.run(first, x, ids, weights)  # the next pass
    assert (got - want).abs().max().item() < 1e-5


def test_prefill_leaves_the_decode_working_set(dense):
    """Prefill evicts nothing: the experts decode put in the cache stay where they are; it only
    fills free slots (on a fresh start), with the right weights."""
    ids, _ = dense
    rt = Runtime.open("tiny", cache="off", offload=_config("auto", slots=24))
    cache, store = rt.engine.offload.cache, rt.engine.offload.store
    rt.engine.prefill(rt.engine.new_state(), ids)  # a fresh start: free slots fill up
    assert not cache.free and rt.engine.offload.prefill.totals.admitted == 24
    per_layer = [sum(slot >= 0 for slot in row) for row in cache.slot_of.values()]
    assert max(per_layer) <= 3  # 24 slots over 8 layers: each layer its share
    for slot, (layer, expert) in enumerate(cache.owner):
        assert torch.equal(cache.slots[slot], store.flat[layer][expert])
    rt.generate(ids[:8], max_tokens=8)  # decode replaces some
    before = list(cache.owner)
    rt.engine.prefill(rt.engine.new_state(), ids)
    assert cache.owner == before
    cache.check()


def test_bench_prefill_reports_every_plan_against_its_floor():
    """`bench prefill --offload auto`: the resident rows, then every plan's cold and suffix rows
    with bytes copied, the CPU's share, the plans per layer, the floor; ratios from one run."""
    from agentrt.bench.prefill import offload_prefill

    report = offload_prefill(
        "tiny",
        "cpu",
        None,
        None,
        ["auto", "stream", "routed"],
        [96],
        [16],
        64,
        48,
        repeat=1,
        slots=10,
        profile=True,
    )
    runs = report["runs"]
    assert [(r["plan"], r["kind"]) for r in runs] == [
        (plan, kind)
        for plan in ("resident", "auto", "stream", "routed")
        for kind in ("cold", "suffix")
    ]
    for r in runs[2:]:
        assert r["tokens"] in (96, 16) and r["seconds"] > 0
        assert r["floor_s"] >= r["resident_s"] > 0 and r["vs_floor"] > 0
        assert set(r["plan_per_layer"].values()) <= {
            "stream",
            "routed",
            "split",
            "predicted",
            "reserve",
        }
        assert 0.0 <= r["cpu_pair_share"] <= 1.0
        host = r["host_s"]  # (the CPU side's wait for its inputs is part of its time)
        assert 0.0 <= host["cpu_input"] <= host["cpu"] and (host["cpu"] > 0) == (
            r["cpu_experts"] > 0
        )
        paths = r["cpu_paths"]  # (the CPU side's time by path: within its whole time)
        assert paths["native_s"] + paths["torch_s"] <= host["cpu"] + 1e-9
        assert (paths["native_rows"] + paths["torch_rows"] > 0) == (r["cpu_experts"] > 0)
        # the profiled run's costliest functions, costliest first
        own = [f["own_ms"] for f in r["profile"]]
        assert len(own) == 30 and own == sorted(own, reverse=True) and own[0] > 0
        assert all(f["calls"] > 0 and f["cumulative_ms"] >= f["own_ms"] for f in r["profile"])
    stream = next(r for r in runs if r["plan"] == "stream" and r["kind"] == "cold")
    assert set(stream["plans"]) == {"stream"} and stream["copy_gb"] > 0
    assert {"cold96_auto_vs_best_fixed", "suffix16_auto_vs_stream"} <= set(report["ratios"])
    assert report["bench"] == "prefill-offload" and report["staging_gib"] > 0


def test_bench_prefill_profiles_only_when_asked():
    """Without `profile`, no row runs (or reports) the extra cProfile'd pass."""
    from agentrt.bench.prefill import offload_prefill

    report = offload_prefill(
        "tiny", "cpu", None, None, ["stream"], [32], [], 0, 32, repeat=1, slots=10, resident=False
    )
    assert [r["plan"] for r in report["runs"]] == ["stream"]
    assert "profile" not in report["runs"][0] and report["profile_gb_s"]["copy"] > 0


def test_bench_prefill_times_a_plan_listed_twice_again_under_its_own_name(monkeypatch):
    """A plan listed again is timed again in its own engine, its rows named `PLAN#2`, so a
    plan's time can be told from its place in the order; the best fixed plan of a row counts
    the faster of a fixed plan's two timings."""
    import agentrt.bench.prefill as bp
    from agentrt.bench.prefill import _named, _ratios, offload_prefill

    report = offload_prefill(
        "tiny", "cpu", None, None, ["routed", "stream", "routed"], [32], [], 0, 32,
        repeat=1, slots=10, resident=False,
    )  # fmt: skip
    assert [r["plan"] for r in report["runs"]] == ["routed", "stream", "routed#2"]
    assert [r["plans"] for r in report["runs"]] == [{"routed": 8}, {"stream": 8}, {"routed": 8}]
    assert set(report["ratios"]) == {
        f"cold32_{p}_vs_best_fixed" for p in ("routed", "stream", "routed#2")
    }
    warm = []  # (`auto` timed again warms up as `auto` does)
    monkeypatch.setattr(bp, "_warm_passes", lambda auto, *a: warm.append(auto) or 1)
    offload_prefill(
        "tiny", "cpu", None, None, ["auto", "auto"], [32], [], 0, 32, repeat=1, slots=10,
        resident=False,
    )  # fmt: skip
    assert warm == [True, True]
    assert [name for *_, name in _named(["auto", "auto"], [0.5, 1.0])] == [
        "auto@0.5", "auto@1", "auto#2@0.5", "auto#2@1",
    ]  # fmt: skip
    rows = [("auto", 1.2), ("routed", 1.0), ("routed#2", 0.8), ("stream", 2.0)]
    ratios = _ratios([{"plan": p, "kind": "suffix", "tokens": 64, "seconds": s} for p, s in rows])
    assert ratios["suffix64_auto_vs_best_fixed"] == 1.2 / 0.8
    assert ratios["suffix64_routed#2_vs_stream"] == 0.4


def test_bench_prefill_interleaves_the_plans_in_one_engine_round_by_round(monkeypatch):
    """`interleave`: one engine, each row's passes switch plan round by round (each round
    starting one plan further on); each row counts only its own plan's passes."""
    import agentrt.bench.prefill as bp
    from agentrt.errors import InvalidArgumentError

    used, real = [], bp._use_plan
    monkeypatch.setattr(
        bp, "_use_plan", lambda experts, plan: (used.append(plan), real(experts, plan))
    )
    report = bp.offload_prefill(
        "tiny", "cpu", None, None, ["stream", "routed"], [32], [24], 48, 32,
        repeat=3, slots=10, resident=False, interleave=True,
    )  # fmt: skip
    runs = report["runs"]
    assert report["interleaved"] is True
    assert [(r["plan"], r["kind"]) for r in runs] == [
        ("stream", "cold"), ("stream", "suffix"), ("routed", "cold"), ("routed", "suffix"),
    ]  # fmt: skip
    for r in runs:  # (tiny's 8 MoE layers, counted per pass: each row only its plan's)
        assert len(r["all_s"]) == 3 and r["seconds"] > 0
        assert r["plans"] == {r["plan"]: 8}
    timed = used[-6:]  # (the suffix row's three rounds)
    assert timed == ["stream", "routed", "routed", "stream", "stream", "routed"]
    with pytest.raises(InvalidArgumentError, match="one engine"):
        bp.offload_prefill(
            "tiny", "cpu", None, None, ["stream"], [32], [], 0, 32, slots=10,
            resident=False, interleave=True, stagings=[0.5],
        )  # fmt: skip


def test_bench_prefill_times_each_plan_with_each_staging_ring():
    """`stagings` (layers of experts): each plan timed with each ring, named `PLAN@SIZE`, the
    ring's size in the row, and ratios per ring; the CLI refuses a size that is not positive."""
    from click.testing import CliRunner

    from agentrt.bench.prefill import offload_prefill
    from agentrt.cli.main import main
    from agentrt.errors import InvalidArgumentError

    report = offload_prefill(
        "tiny", "cpu", None, None, ["auto", "stream"], [32], [], 0, 32, repeat=1, slots=10,
        resident=False, stagings=[0.5, 1],
    )  # fmt: skip
    runs = report["runs"]
    assert [r["plan"] for r in runs] == ["auto@0.5", "auto@1", "stream@0.5", "stream@1"]
    assert runs[1]["staging_gib"] == pytest.approx(2 * runs[0]["staging_gib"])
    assert runs[3]["staging_gib"] == runs[1]["staging_gib"] > 0
    assert {"cold32_auto@0.5_vs_best_fixed", "cold32_auto@1_vs_best_fixed"} <= set(report["ratios"])
    with pytest.raises(InvalidArgumentError, match="holds no expert"):  # (before any build)
        offload_prefill("tiny", "cpu", None, None, ["auto"], [32], [], 0, 32, stagings=[1, 0.01])
    args = ["bench", "prefill", "--offload", "auto", "--expert-cache-slots", "8", "--staging"]
    for bad in ("0", "1,-2", "x", "nan"):
        result = CliRunner().invoke(main, [*args, bad])
        assert result.exit_code == 2 and "positive numbers" in result.output, result.output


def test_layer_tables_hold_each_parts_offsets_rows_experts_and_tiles():
    """A layer's tables from one transfer: the sort positions as given, each part's cumulative
    rows (int32), rows per expert, expert ids, and MXFP4 tiles as `tile_table` builds them."""
    from agentrt.offload.mxfp4_rows import tile_table
    from agentrt.offload.ring import Fill
    from agentrt.offload.uploads import Uploads, layer_tables

    counts = [5, 0, 130, 2, 0, 1]
    parts = [Fill(3, [0, 1, 2], [0, 2]), Fill(3, [3, 4], []), Fill(3, [5], [0])]
    position = [0, 6, 1, 3, 6, 5]
    pos, tables = layer_tables(Uploads(torch.device("cpu")), position, parts, counts, 64)
    assert pos.tolist() == position and len(tables) == 3
    first = tables[0]
    assert first.offsets.dtype == torch.int32 and first.offsets.tolist() == [5, 5, 135]
    assert first.counts.tolist() == [5, 0, 130] and first.experts.tolist() == [0, 1, 2]
    assert first.tiles.shape == (3, 4)
    assert first.tiles.reshape(-1).tolist() == tile_table([0, 1, 2], [5, 0, 130], 64)
    assert first.tiles.tolist() == [[0, 2, 2, 2], [0, 5, 69, 133], [5, 135, 135, 135]]
    assert tables[1].counts.tolist() == [2, 0] and tables[1].offsets.tolist() == [2, 2]
    assert tables[2].experts.tolist() == [5] and tables[2].tiles.tolist() == [[0], [0], [1]]
    views = [pos] + [t for part in tables for t in (part.counts, part.experts, part.tiles)]
    assert all(v.storage_offset() % 2 == 0 for v in views)  # (16-byte aligned int64 starts)
    _, untiled = layer_tables(Uploads(torch.device("cpu")), position, parts, counts, None)
    assert all(t.tiles is None for t in untiled)


def test_native_rows_kernel_matches_the_fp32_experts():
    """Prefill's CPU experts in the native kernel (rows grouped by expert, each weight row read
    once): each row's weighted expert output, as an fp32 reference computes it."""
    import torch.nn.functional as F

    from agentrt.offload.cpu_kernel import native_experts

    kernel = native_experts()
    if kernel is None:
        pytest.skip("no C compiler (or the native kernel did not build)")
    gen = torch.Generator().manual_seed(3)
    hidden, inter, counts = 200, 96, [1, 3, 0, 8, 2, 13, 5]  # (200: a tail past 64 lanes)
    make = lambda *s: (torch.randn(*s, generator=gen) * 0.05).to(torch.bfloat16)  # noqa: E731
    gate_up = [make(2 * inter, hidden) for _ in counts]
    down = [make(hidden, inter) for _ in counts]
    x = (torch.randn(sum(counts), hidden, generator=gen)).to(torch.bfloat16)
    w = torch.rand(sum(counts), generator=gen)
    out = torch.full((sum(counts), hidden), float("nan"))
    kernel.run_rows(gate_up, down, counts, x, w, out)
    want, begin = [], 0
    for e, count in enumerate(counts):
        rows = x[begin : begin + count].float()
        gate, up = (rows @ gate_up[e].float().T).chunk(2, dim=-1)
        want.append((F.silu(gate) * up) @ down[e].float().T * w[begin : begin + count, None])
        begin += count
    want = torch.cat(want)
    assert not out.isnan().any()
    assert ((out - want).norm() / want.norm()).item() < 1e-2


def test_bf16_prefill_with_native_cpu_experts_stays_close_to_dense():
    """bf16 on the CPU with the native kernel: the split's CPU experts (few rows each) run in
    it, and the logits are as close to the fp32 model as the dense bf16 model's (the kernel
    sums in fp32, so it may be closer). The kernel's decode pool rests meanwhile."""
    from agentrt.offload.cpu_kernel import native_experts

    if native_experts() is None:
        pytest.skip("no C compiler (or the native kernel did not build)")
    fp32 = Runtime.open("tiny", cache="off", prefill_chunk=48)
    ids = fp32.tokenizer.encode(PROMPT)[:96]
    ref = fp32.engine.prefill(fp32.engine.new_state(), ids, all_logits=True)
    dense = Runtime.open("tiny", cache="off", dtype="bfloat16", prefill_chunk=48)
    noise = (dense.engine.prefill(dense.engine.new_state(), ids, all_logits=True) - ref).abs()
    config = OffloadConfig(
        mode="auto",
        expert_cache_slots=10,
        prefill_plan="routed",
        cpu_kernel="native",
        copy_bandwidth=1.0,
        cpu_bandwidth=1.0,
    )
    rt = Runtime.open("tiny", cache="off", dtype="bfloat16", prefill_chunk=48, offload=config)
    kernel = rt.engine.offload.prefill.cpu_kernel
    assert kernel is not None
    kernel._guard.resting = False
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - ref).abs().max().item() <= 1.5 * noise.max().item()
    totals = rt.engine.offload.prefill.totals
    assert totals.cpu > 0
    # every CPU pair counted once by its path, the few-row experts in the native kernel
    assert totals.native_rows > 0 and totals.native_rows + totals.torch_rows == totals.cpu_pairs
    paths = totals.since(PrefillTotals().as_dict())["cpu_paths"]
    assert paths["native_rows"] == totals.native_rows and paths["native_s"] > 0
    assert kernel._guard.resting  # (decode's pool sent to sleep while prefill ran)


def test_a_pass_that_failed_mid_layer_leaves_nothing_for_the_next(dense, monkeypatch):
    """A prefill that raises inside a layer (say, out of memory) leaves queued fills behind;
    the next pass must not consume them: its logits equal the dense model's."""
    from agentrt.offload.prefill import PrefillStreamer

    ids, want = dense
    rt = Runtime.open("tiny", cache="off", prefill_chunk=48, offload=_config("stream"))
    real, calls = PrefillStreamer._grouped_ffn, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(self, *args)

    monkeypatch.setattr(PrefillStreamer, "_grouped_ffn", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    streamer = rt.engine.offload.prefill
    assert not streamer.ring.queue and not streamer.ring.issued
    monkeypatch.setattr(PrefillStreamer, "_grouped_ffn", real)
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4


def test_auto_forgets_a_pass_that_failed_part_way(dense, monkeypatch):
    """`auto`'s pass that raises part-way is not timed, and its strategy is tried again (not
    left as tried but never read); the next prefill measures both and equals the dense model."""
    from agentrt.offload.prefill import PrefillStreamer

    ids, want = dense
    rt = Runtime.open("tiny", cache="off", prefill_chunk=48, offload=_config("auto"))
    streamer, size = rt.engine.offload.prefill, size_class(48)
    real = PrefillStreamer._grouped_ffn

    def failing(self, *args):
        if self.clock.passes.get((size, False)) == 1:  # (the size's first timed pass: reserve)
            raise RuntimeError("out of memory")
        return real(self, *args)

    monkeypatch.setattr(PrefillStreamer, "_grouped_ffn", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert streamer.mode == "reserve" and streamer.clock.measured.get((size, False), {}) == {}
    monkeypatch.setattr(PrefillStreamer, "_grouped_ffn", real)
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    assert set(streamer.clock.measured[size, False]) == {"reserve", "routed"}


def test_a_pass_stopped_after_queuing_fills_serves_nothing_to_the_next_one():
    """A pass stopped after its first layer queued the next layer's fills (say, out of memory
    in that layer's attention, outside the streamer), while the first layer's experts came to
    sit in slots in expert order (resident): decode then evicts experts those fills counted as
    cache hits. The next pass must not consume them: its experts equal the store's."""
    from agentrt.models.moe import RoutedExperts

    # (LRU: the decode steps below evict the second layer's first experts by recency)
    config = replace(_config("stream", split=False, slots=124), prefetch=False, policy="lru")
    rt = Runtime.open("tiny", cache="off", offload=config)
    experts = rt.engine.offload
    store, cache, streamer = experts.store, experts.cache, experts.prefill
    first, second = store.layers[0], store.layers[1]
    num, top_k, gen = store.num_experts, 4, torch.Generator().manual_seed(0)

    def decode(layer: int, chosen: list[int]) -> None:
        x = torch.randn(1, store.hidden, generator=gen)
        experts(layer, x, torch.tensor([chosen]), torch.full((1, top_k), 0.25))

    decode(second, [0, 1, 2, 3])
    x = torch.randn(40, store.hidden, generator=gen)
    ids = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(40)])
    weights = torch.rand(40, top_k, generator=gen)
    streamer.run(first, x, ids, weights)  # (queues the second layer's fills, then stops)
    assert streamer._resident_start(first) is not None
    for layer in store.layers[2:]:
        for e in range(0, num, top_k):
            decode(layer, list(range(e, e + top_k)))
    for e in range(4, 16, top_k):
        decode(second, list(range(e, e + top_k)))
    assert cache.slot_of[second][:4] == [-1] * 4  # (evicted since)
    streamer.run(first, x, ids, weights)
    got = streamer.run(second, x, ids, weights)
    ref = RoutedExperts({second: store.gate_up(second)}, {second: store.down(second)})
    assert (got - ref.looped(second, x, ids, weights)).abs().max().item() < 1e-5
    cache.check()


def test_grouped_expert_gemms_with_biases_equal_the_loop():
    """The grouped path's expert biases, repeated over each expert's rows from the device
    offsets (an expert without rows included), against the reference loop."""
    from agentrt.models.moe import SwiGLU, _grouped_mm_fn
    from agentrt.offload.pairs import grouped_ffn, looped_ffn

    grouped = _grouped_mm_fn()
    if grouped is None:
        pytest.skip("this torch build has no grouped GEMM")
    gen = torch.Generator().manual_seed(0)
    x, scale = torch.randn(7, 8, generator=gen), torch.rand(7, 1, generator=gen)
    gate_up, down = torch.randn(3, 8, 8, generator=gen), torch.randn(3, 8, 4, generator=gen)
    biases = (torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen))
    offs, act = torch.tensor([2, 2, 7], dtype=torch.int32), SwiGLU(7.0, 1.702)
    got = grouped_ffn(grouped, x, gate_up, down, offs, scale, act, biases)
    want = looped_ffn(x, gate_up, down, [2, 0, 5], scale, biases, act)
    assert (got - want).abs().max().item() < 1e-5


def test_bench_prefill_takes_lists_of_offload_and_split(tmp_path):
    """`--offload none,auto --split on,off`: every combination in one invocation (DESIGN's
    contract for bench decode|prefill|ttft), one offloaded report per split value."""
    import json

    from util import invoke_cli

    out = tmp_path / "p.json"
    args = ["bench", "prefill", "--device", "cpu", "--lengths", "96", "--prefill-chunk", "48"]
    args += ["--repeat", "1", "--expert-cache-slots", "10", "--prefill-plan", "stream"]
    result = invoke_cli(*args, "--offload", "none,auto", "--split", "on,off", "--json", str(out))
    assert result.returncode == 0, result.stderr
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["split=on", "split=off"]
    assert [run["split"] for run in runs.values()] == [True, False]
    assert all(run["runs"] for run in runs.values())
    # the resident rows run once, and both splits' floors use them
    assert [r["plan"] for r in runs["split=off"]["runs"]] == ["stream"]
    floors = [r["resident_s"] for run in runs.values() for r in run["runs"] if "resident_s" in r]
    assert len(floors) == 2 and floors[0] == floors[1] > 0


def test_bench_prefill_warms_auto_once_per_strategy_its_chunks_try():
    """`auto`'s rows are timed after a first pass, one pass of each strategy its chunks' sizes
    try (`routed` only up to ROUTED_MAX_TOKENS) and one more; the fixed plans after one."""
    from agentrt.bench.prefill import _warm_passes
    from agentrt.offload.planner import ROUTED_MAX_TOKENS, STRATEGIES

    both, first = len(STRATEGIES) + 2, 3
    assert _warm_passes(True, 512, 8192) == both
    assert _warm_passes(True, ROUTED_MAX_TOKENS, 8192) == both
    assert _warm_passes(True, 8192, 8192) == first
    assert _warm_passes(True, 16384, 8192) == first
    assert _warm_passes(True, 8192 + 512, 8192) == both  # (its last chunk is short)
    assert _warm_passes(False, 512, 8192) == 1
