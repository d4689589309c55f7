"""Engine core: chunked prefill == one pass; captured states == separate prefill of the prefix;
snapshot export/import reproduces logits; MoE dispatch paths agree; sampling."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from util import open_engine, random_ids

from agentrt.engine import SamplingParams
from agentrt.engine.reuse import PrefixReuse
from agentrt.engine.sampling import sample, top_p_filter

N = 230


@pytest.fixture(params=["qwen3_5_moe", "qwen3_moe", "gpt_oss"])
def ckpt(request, hf_checkpoints):
    return hf_checkpoints[request.param]


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 229, 4096])
def test_chunked_prefill_equals_one_pass(ckpt, chunk):
    ids = random_ids(N, seed=11)
    ref = open_engine(ckpt)
    expected = ref.prefill(ref.new_state(), ids, all_logits=True)
    eng = open_engine(ckpt, chunk=chunk)
    got = eng.prefill(eng.new_state(), ids, capture=[3, 50, 99, 101, 200], all_logits=True)
    assert (got - expected).abs().max().item() < 1e-4


def _assert_snapshots_close(a, b):
    assert a.num_tokens == b.num_tokens and a.token_ids == b.token_ids
    for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True):
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
    for x, y in zip(a.conv + a.recurrent, b.conv + b.recurrent, strict=True):
        assert torch.allclose(x, y, atol=1e-5)


@pytest.mark.parametrize("chunk", [64, 100, 4096])
def test_captured_states_equal_prefix_prefill(ckpt, chunk):
    ids = random_ids(N, seed=12)
    captures = [1, 64, 100, 137, 200, N]  # 100 is a chunk edge for chunk=100; 137 splits a chunk
    eng = open_engine(ckpt, chunk=chunk)
    state = eng.new_state()
    eng.prefill(state, ids, capture=captures)
    for pos in captures:
        separate = eng.new_state()
        eng.prefill(separate, ids[:pos])
        _assert_snapshots_close(state.export(pos), separate.export())


@pytest.mark.parametrize("chunk", [100, 4096])
def test_captures_on_the_grid_equal_prefix_prefill(ckpt, chunk):
    """`capture_grid=64`: a capture inside an eager piece is the state after the last chunk
    start (64 tokens from the piece's start) at or before it; positions may be numpy ints."""
    ids = random_ids(N, seed=12)
    eng = open_engine(ckpt, chunk=chunk)
    eng.config = replace(eng.config, capture_grid=64)
    state = eng.new_state()
    asked = [1, 64, 100, 137, 180, 200, N]  # moved with chunk 100: 180; with 4096: 100-200
    eng.prefill(state, ids, capture=[np.int64(p) for p in asked])
    hybrid = eng.cfg.is_hybrid
    assert bool(state.moved) == hybrid  # attention-only models take captures where asked
    for pos in asked:
        at = state.capture_position(pos)
        assert pos - 64 < at <= pos and (at == pos or (at % chunk) % 64 == 0)
        separate = eng.new_state()
        eng.prefill(separate, ids[:at])
        _assert_snapshots_close(state.export(at), separate.export())


def test_graph_replays_take_captures_on_the_grid_of_their_piece(hf_checkpoints):
    """With prefill graphs and `capture_grid=64`, a capture inside a replayed piece moves back
    to the piece's last 64-token step, as in eager pieces; the state there equals a prefill
    of the prefix alone (the static pass here runs eagerly on the CPU)."""
    from agentrt.engine.cuda_graph import PrefillGraphs

    ids = random_ids(300, seed=37)
    eng = open_engine(hf_checkpoints["qwen3_5_moe"])
    eng.config = replace(eng.config, capture_grid=64)
    eng.prefill_graphs = PrefillGraphs(
        eng.model, torch.device("cpu"), (64, 256), capture=False, reserve=0, max_prompt=400
    )
    state = eng.new_state()
    asked = [30, 137, 200, 290]  # pieces: [0, 200) with 30 and 137 inside, then [200, 300)
    eng.prefill(state, ids, capture=asked)
    assert state.moved == {137: 128, 290: 264}
    for pos in asked:
        at = state.capture_position(pos)
        separate = eng.new_state()
        eng.prefill_graphs = None
        eng.prefill(separate, ids[:at])
        _assert_snapshots_close(state.export(at), separate.export())


def test_snapshot_import_then_suffix_reproduces_logits(ckpt):
    ids = random_ids(N, seed=13)
    eng = open_engine(ckpt, chunk=64)
    full = eng.prefill(eng.new_state(), ids, all_logits=True)
    state = eng.new_state()
    eng.prefill(state, ids[:150], capture=[97])
    snap = state.export(97)
    fresh = eng.new_state()
    fresh.import_(snap)
    rest = eng.prefill(fresh, ids[97:], all_logits=True)
    assert (rest - full[97:]).abs().max().item() < 1e-4
    params = SamplingParams(max_tokens=12)
    again = eng.new_state()
    again.import_(snap)
    reused = eng.generate(again, ids, params, reuse=PrefixReuse())
    assert reused.cached_tokens == 97 and reused.checkpoint == "live"
    assert reused.token_ids == eng.generate(eng.new_state(), ids, params).token_ids


def test_hybrid_export_needs_a_captured_position(hf_checkpoints):
    eng = open_engine(hf_checkpoints["qwen3_5_moe"])
    state = eng.new_state()
    eng.prefill(state, random_ids(40), capture=[10])
    assert state.can_export(10) and state.can_export(40) and not state.can_export(20)
    with pytest.raises(ValueError):
        state.export(20)


def test_attention_only_export_anywhere(hf_checkpoints):
    eng = open_engine(hf_checkpoints["qwen3_moe"])
    ids = random_ids(60, seed=14)
    state = eng.new_state()
    eng.prefill(state, ids)
    separate = eng.new_state()
    eng.prefill(separate, ids[:33])
    _assert_snapshots_close(state.export(33), separate.export())


def test_moe_gather_and_grouped_paths_agree(hf_checkpoints):
    eng = open_engine(hf_checkpoints["qwen3_5_moe"])
    experts, layer = eng.model.experts, 0
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 64, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(9)])
    w = torch.rand(9, 3, generator=g)
    assert torch.allclose(
        experts.gathered(layer, x, ids, w), experts.looped(layer, x, ids, w), atol=1e-6
    )
    assert torch.allclose(
        experts.grouped_mm(layer, x, ids, w), experts.looped(layer, x, ids, w), atol=1e-6
    )


def test_decode_matches_prefill_logits(ckpt):
    ids = random_ids(50, seed=15)
    eng = open_engine(ckpt)
    full = eng.prefill(eng.new_state(), ids, all_logits=True)
    state = eng.new_state()
    eng.prefill(state, ids[:40])
    for i in range(40, 50):
        step = eng.decode_step(state, ids[i])
        assert (step - full[i]).abs().max().item() < 1e-4


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_a_pass_that_raises_leaves_no_state_to_reuse(ckpt, step):
    """A pass that raises inside the model (out of memory in its last layer, say) has moved
    linear-attention state past the sequence's tokens: the live state must not be reused by
    the next request (prefix reuse), which then generates what a fresh state does."""
    ids, params = random_ids(80, seed=21), SamplingParams(max_tokens=6)
    again = ids + ids[:5]  # (extends what either failed request left: prefix reuse takes it)
    eng = open_engine(ckpt, chunk=32)
    want = eng.generate(eng.new_state(), again, params).token_ids
    state, last, calls = eng.new_state(), eng.model.layers[-1], []
    real = last.forward

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == (2 if step == "prefill" else 4):  # chunk 2, or the first decode step
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    last.forward = failing
    with pytest.raises(RuntimeError, match="out of memory"):
        eng.generate(state, ids, params, reuse=PrefixReuse())
    last.forward = real
    assert state.num_tokens == 0 or not state.linear_caches()
    assert eng.generate(state, again, params, reuse=PrefixReuse()).token_ids == want


def test_stop_token_ends_generation(ckpt):
    eng = open_engine(ckpt)
    ids = random_ids(20, seed=16)
    free = eng.generate(eng.new_state(), ids, SamplingParams(max_tokens=10)).token_ids
    stopped = eng.generate(
        eng.new_state(), ids, SamplingParams(max_tokens=10, stop_token_ids=(free[3],))
    )
    first = free.index(free[3])
    assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert top_p_filter(probs, 0.7).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert top_p_filter(probs, 0.5).tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert top_p_filter(probs, 1.0).tolist() == probs.tolist()


def test_sampling_is_seeded_and_greedy_is_argmax():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, SamplingParams(), None) == int(logits.argmax())
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    draw = lambda: [
        sample(logits, params, g) for g in [torch.Generator().manual_seed(7)] for _ in range(20)
    ]  # noqa: E731
    assert draw() == draw()
    assert len(set(draw())) > 1


def test_static_decode_step_matches_eager(ckpt):
    """The CUDA-graph form of the decode step (device-tensor position, masked full-capacity
    attention) computes the same logits as the eager step."""
    from agentrt.engine.cuda_graph import DecodeGraph

    ids = random_ids(70, seed=17)
    eng = open_engine(ckpt)
    eager, static = eng.new_state(), eng.new_state()
    eng.prefill(eager, ids[:60])
    eng.prefill(static, ids[:60])
    graph = DecodeGraph(eng.model, torch.device("cpu"))
    for tok in ids[60:]:
        expected = eng.decode_step(eager, tok)
        for cache in static.kv_caches():
            cache.reserve(static.num_tokens + 1, static.num_tokens)
        pos = torch.tensor([static.num_tokens])
        with torch.inference_mode():
            got = graph._static_step(static, torch.tensor([tok]), pos)
        static.token_ids.append(tok)
        assert (got - expected).abs().max().item() < 1e-4


def test_decode_graph_capture_is_tried_again_before_decode_turns_eager(ckpt, capsys):
    """A capture that fails once is tried again (graphs stay on); one that keeps failing turns
    the engine's decode graphs off with a message, and later steps do not try again."""
    from agentrt.engine import cuda_graph

    eng = open_engine(ckpt)
    state = eng.new_state()
    eng.prefill(state, random_ids(20, seed=3))

    class Flaky(cuda_graph.DecodeGraph):
        failures = 1

        def _capture(self, state, key):
            self.tries = getattr(self, "tries", 0) + 1
            if self.tries <= self.failures:
                exc = RuntimeError("capture invalidated\nsecond line")
                exc.add_note("in piece 3 of the step")
                raise exc
            return cuda_graph._Captured(key, None, None, None, None)

    graph = Flaky(eng.model, torch.device("cpu"))
    assert graph._current_for(state) is not None and graph.enabled and graph.tries == 2
    err = capsys.readouterr().err
    assert "capture invalidated, in piece 3 of the step); capturing again" in err
    assert "second line" not in err
    graph = Flaky(eng.model, torch.device("cpu"))
    graph.failures = 99
    assert graph._current_for(state) is None and not graph.enabled
    assert (
        graph.tries == cuda_graph.CAPTURE_ATTEMPTS and "decoding eagerly" in capsys.readouterr().err
    )
    assert graph._current_for(state) is None and graph.tries == cuda_graph.CAPTURE_ATTEMPTS


def test_static_prefill_matches_eager(ckpt):
    """The CUDA-graph form of prefill (prompt padded to a bucket, positions and real length in
    device tensors, padding masked out of KV and linear-attention state) gives the logits,
    states and end captures of the eager prefill, from position 0 and after a prefix; prompts
    longer than every bucket run in pieces; captures inside a piece are its cuts (states
    recorded by reruns with the rest masked), beyond the cut slots they end a piece; prompts
    longer than `max_prompt` run eagerly."""
    from agentrt.engine.cuda_graph import PrefillGraphs

    ids = random_ids(490, seed=23)
    eng = open_engine(ckpt)
    eager, static = eng.new_state(), eng.new_state()
    graphs = PrefillGraphs(
        eng.model, torch.device("cpu"), (16, 64), capture=False, reserve=0, max_prompt=100
    )
    used, run = [], graphs.run

    def counted(state, tokens, cuts=()):
        out = run(state, tokens, cuts)
        if out is not None:
            used.append((len(tokens), list(cuts)))
        return out

    graphs.run = counted
    pieces = [(0, 40, [40]), (40, 50, []), (50, 80, [80]), (80, 180, [180]), (180, 200, [190])]
    pieces += [(200, 300, [210, 300]), (300, 320, [305, 320]), (320, 430, [])]
    pieces += [(430, 480, [435, 440, 450, 470])]
    for lo, hi, capture in pieces:
        eng.prefill_graphs = None
        expected = eng.prefill(eager, ids[lo:hi], capture=capture)
        eng.prefill_graphs = graphs
        got = eng.prefill(static, ids[lo:hi], capture=capture)
        assert (got - expected).abs().max().item() < 1e-4
        assert static.captured_positions() == eager.captured_positions()
        for pos in capture:
            for a, b in zip(*(s.linear_at(pos)[1] for s in (static, eager)), strict=True):
                assert (a - b).abs().max().item() < 1e-5
    assert used == [
        *[(40, []), (10, []), (30, []), (64, []), (36, []), (20, [10]), (64, [10]), (36, [])],
        *[(20, [5]), (20, [5, 10]), (30, [20])],  # (320, 430): 110 > max_prompt, eager
    ]
    assert static.token_ids == eager.token_ids == ids[:480]
    tok = ids[480]
    eng.prefill_graphs = None
    assert (eng.decode_step(static, tok) - eng.decode_step(eager, tok)).abs().max().item() < 1e-4


def test_prefill_graph_replays_refill_their_static_buffers(hf_checkpoints):
    """The capture bookkeeping, on the CPU with a stand-in graph (recording runs the step once
    and keeps its outputs as the static buffers; a replay re-runs it and refills them): every
    graph is recorded at first use and again after the KV buffers grow, never otherwise, and
    replays at new positions and lengths, with and without cuts, give the eager logits and
    captured states."""
    from agentrt.engine.cuda_graph import PrefillGraphs

    class Replayed(PrefillGraphs):
        recorded = 0

        def _capture(self, state, size, slots):
            self.caches = state.linear_caches()
            return super()._capture(state, size, slots)

        def _record(self, step):
            self.recorded += 1
            saved = [(c.conv.clone(), c.recurrent.clone()) for c in self.caches]
            out = step().clone()
            for cache, (conv, rec) in zip(self.caches, saved, strict=True):
                cache.conv.copy_(conv)
                cache.recurrent.copy_(rec)
            held = [c.slots for c in self.caches]

            def replay(caches=self.caches):
                before = [c.slots for c in caches]
                out.copy_(step())
                for cache, old, static in zip(caches, before, held, strict=True):
                    if cache.slots is not old:  # this pass had cuts: refill the held buffers
                        static[0].copy_(cache.slots[0])
                        static[1].copy_(cache.slots[1])
                        cache.slots = static

            return replay, out

    ids = random_ids(2200, seed=31)
    eng = open_engine(hf_checkpoints["qwen3_5_moe"])
    graphs = Replayed(eng.model, torch.device("cpu"), (16, 64), reserve=0, cut_buckets=None)
    eager, state = eng.new_state(), eng.new_state()
    capacities, bounds = [], [0, 30, 35, 99, 160, 170, 420, 430, 500, 640, 1000, 1010, 1990, 2200]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        capture = [lo + (hi - lo) // 3, lo + (hi - lo) // 2] if i % 2 and hi - lo > 4 else []
        eng.prefill_graphs = None
        expected = eng.prefill(eager, ids[lo:hi], capture=capture)
        eng.prefill_graphs = graphs
        got = eng.prefill(state, ids[lo:hi], capture=capture)
        assert (got - expected).abs().max().item() < 1e-4
        for pos in capture:
            for a, b in zip(*(s.linear_at(pos)[1] for s in (state, eager)), strict=True):
                assert (a - b).abs().max().item() < 1e-5
        capacities.append(state.kv_caches()[0].capacity)
    assert graphs.enabled
    per_buffers = len(graphs.buckets)  # one graph per bucket, with cuts
    assert graphs.recorded == per_buffers * len(set(capacities)) > 2 * per_buffers


def test_prefill_graphs_warm_up_once_and_again_only_where_recording_failed(
    hf_checkpoints, monkeypatch
):
    """Start-up runs the model eagerly before the first capture only; a later bucket whose
    recording fails (a kernel variant not compiled yet) is warmed up and recorded again, and
    the graphs stay on."""
    from agentrt.engine import cuda_graph
    from agentrt.engine.cuda_graph import PrefillGraphs

    warmed: list[int] = []
    real_warm_up = cuda_graph._warm_up
    monkeypatch.setattr(
        cuda_graph,
        "_warm_up",
        lambda state, dev, step: (warmed.append(1), real_warm_up(state, dev, step)),
    )

    class FailsOnce(PrefillGraphs):
        attempts = 0

        def _record(self, step):
            self.attempts += 1
            if self.attempts == 2:  # the second bucket's recording
                raise RuntimeError("operation not permitted when stream is capturing")
            return (lambda: None), step().clone()

    eng = open_engine(hf_checkpoints["qwen3_5_moe"])
    graphs = FailsOnce(eng.model, torch.device("cpu"), (16, 32, 64), reserve=0)
    state = eng.new_state()
    assert graphs.prepare(state) and graphs.enabled
    assert len(graphs.graphs) == 3 and graphs.attempts == 4
    assert len(warmed) == 2 and graphs.cold_captures == 1


def test_failed_prefill_graph_capture_falls_back_to_eager(hf_checkpoints, capsys):
    """A capture that fails (here: no CUDA) turns prefill graphs off with a message; the prompt
    runs eagerly from an untouched state, and later prompts skip the graphs."""
    from agentrt.engine.cuda_graph import PrefillGraphs

    ids = random_ids(120, seed=29)
    eng = open_engine(hf_checkpoints["qwen3_5_moe"])
    eager = eng.new_state()
    expected = [eng.prefill(eager, ids[:100]), eng.prefill(eager, ids[100:])]
    eng.prefill_graphs = PrefillGraphs(eng.model, torch.device("cpu"), (64, 128), reserve=0)
    state = eng.new_state()
    got = [eng.prefill(state, ids[:100]), eng.prefill(state, ids[100:])]
    assert not eng.prefill_graphs.enabled and "prefilling eagerly" in capsys.readouterr().err
    for a, b in zip(got, expected, strict=True):
        assert (a - b).abs().max().item() < 1e-5


def test_state_operations_work_outside_inference_mode(hf_checkpoints):
    eng = open_engine(hf_checkpoints["qwen3_moe"])
    state = eng.new_state()
    eng.prefill(state, random_ids(40))
    state.truncate(21)
    assert state.num_tokens == 21
    eng.prefill(state, random_ids(5))
    state.reset()
    assert state.num_tokens == 0


def test_tiny_top_p_and_temperature_stay_finite():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    assert sample(
        logits, SamplingParams(temperature=1.0, top_p=1e-300, seed=0), torch.Generator()
    ) == int(logits.argmax())
    assert sample(logits, SamplingParams(temperature=1e-40), None) == int(logits.argmax())


def test_prefill_graph_buckets(hf_checkpoints):
    """Every piece takes the tightest bucket (one graph per bucket, with cut slots); nothing
    longer than the largest. With plain graphs too, pieces with cuts take the tightest bucket
    that has a cut variant (the largest always has one)."""
    from agentrt.engine.cuda_graph import PrefillGraphs

    eng = open_engine(hf_checkpoints["qwen3_5_moe"])
    graphs = PrefillGraphs(eng.model, torch.device("cpu"))
    assert [graphs.bucket(n) for n in (1, 64, 65, 700, 1025, 3072)] == [
        64,
        64,
        128,
        768,
        1280,
        3072,
    ]
    assert [graphs.bucket(n, cuts=True) for n in (65, 700, 1025, 2049)] == [128, 768, 1280, 2560]
    assert graphs.bucket(3073) is None and graphs.bucket(3073, cuts=True) is None
    assert graphs._variants() == [(b, graphs.cut_slots) for b in graphs.buckets]
    odd = PrefillGraphs(eng.model, torch.device("cpu"), (16, 48), cut_buckets=(16, 32), plain=True)
    assert odd.cut_buckets == (16, 48)
    assert len(odd._variants()) == 4
    assert odd.bucket(20) == 48 and odd.bucket(10, cuts=True) == 16


def test_common_prefix_matches_a_plain_scan():
    import random

    from agentrt.engine.reuse import common_prefix

    rnd = random.Random(0)
    for _ in range(300):
        a = [rnd.randrange(3) for _ in range(rnd.randrange(0, 3000))]
        b = list(a)
        if b and rnd.random() < 0.8:
            b[rnd.randrange(len(b))] += 1
        if rnd.random() < 0.3:
            b = b[: rnd.randrange(len(b) + 1)]
        want = 0
        while want < min(len(a), len(b)) and a[want] == b[want]:
            want += 1
        assert common_prefix(a, b) == want == common_prefix(tuple(b), a)


def test_graph_kv_covers_the_context_when_it_fits():
    """KV for CUDA graphs is reserved up front (growth inside a request would recapture them):
    the whole context when a quarter of free memory holds it, else whole 32K-token steps."""
    from agentrt.engine.cuda_graph import PREFILL_RESERVE, graph_kv_tokens

    per_token = 20 * 1024  # bytes of KV per position
    assert graph_kv_tokens(262144, per_token, 100 * 2**30) == 262144
    tight = graph_kv_tokens(262144, per_token, 8 * 2**30)  # 2 GiB for KV: three 32K steps
    assert tight == 3 * PREFILL_RESERVE and tight * per_token <= 2 * 2**30
    assert graph_kv_tokens(262144, per_token, 2**20) == PREFILL_RESERVE  # at least one step
    assert graph_kv_tokens(4096, per_token, 2**20) == 4096  # never past the context


def test_cuda_defaults_turn_on_prefill_graphs_only_where_they_apply():
    """With nothing asked: CUDA with the experts on the GPU gets prefill graphs (and 2048-token
    chunks); offloaded experts, --eager, the CPU and gpt-oss (whose static passes attend over
    the whole KV capacity) do not get graphs; an explicit choice wins."""
    from agentrt.session.options import (
        RuntimeConfig,
        engine_config,
        offload_config,
        static_prefill,
    )

    def config(device: str, static: bool = True, **kw):
        c = RuntimeConfig(**kw)
        return engine_config(c, device, offload_config(c), static)

    assert static_prefill("tiny") and not static_prefill("synthetic:tiny-gpt-oss")
    assert not config("cuda", static=False).prefill_graphs
    assert config("cuda", static=False, prefill_graphs=True).prefill_graphs

    resident = config("cuda")
    assert resident.prefill_graphs and resident.prefill_chunk == 2048
    offloaded = config("cuda", vram_budget="16GiB")
    assert not offloaded.prefill_graphs and offloaded.prefill_chunk == 8192
    assert not config("cuda", eager=True).prefill_graphs
    assert not config("cuda", prefill_graphs=False).prefill_graphs
    cpu = config("cpu")
    assert not cpu.prefill_graphs and cpu.prefill_chunk == 2048
    assert config("cpu", prefill_graphs=True).prefill_graphs  # (the engine ignores it off CUDA)


def test_the_warm_up_runs_a_whole_chunk_first_offloaded_too():
    """Start-up runs one piece of the whole prefill chunk before the scratch prompt, with the
    experts offloaded too: the kernels only long pieces take (and the norms' larger size
    class) are tuned there, not inside the first long request; the state ends empty."""
    from agentrt.session.runtime import Runtime

    for options in ({}, {"expert_cache_slots": 6}):
        rt = Runtime.open("tiny", device="cpu", cache="off", prefill_chunk=96, **options)
        eng = rt.engine
        assert (eng.offload is not None) == bool(options)
        lengths: list[int] = []
        real = eng.prefill

        def recorded(state, ids, capture=(), _real=real, _seen=lengths, **kw):
            _seen.append(len(ids))
            return _real(state, ids, capture=capture, **kw)

        eng.prefill = recorded
        state = eng.new_state()
        eng._warm_up_run(state)
        assert lengths[0] == 96 and len(lengths) > 1  # (then the scratch prompt)
        assert state.num_tokens == 0
        rt.close()


def test_the_warm_up_prompt_runs_every_kind_of_prefill_piece(hf_checkpoints):
    """The start-up scratch prompt has a piece for each kernel path a request can take: chunked
    with captures inside and at its end, chunked without captures (fla's own pass, whose
    autotuning would otherwise land in a request), both of lengths divisible by 16 and not, and
    a short recurrent piece; on a short context it stops where the context does."""
    from agentrt.engine.engine import WARM_UP_TOKENS

    eng = open_engine(hf_checkpoints["qwen3_5_moe"])
    pieces: list[tuple[int, list[int], int]] = []
    real = eng.prefill

    def recorded(state, ids, capture=(), **kw):
        pieces.append((len(ids), sorted(capture), state.num_tokens))
        return real(state, ids, capture=capture, **kw)

    eng.prefill = recorded
    ids = random_ids(WARM_UP_TOKENS, eng.cfg.vocab_size, 5)
    eng._warm_up_prompt(eng.new_state(), ids)
    assert sum(n for n, _, _ in pieces) == WARM_UP_TOKENS
    plain = {n % 16 == 0 for n, capture, _ in pieces if n > 64 and not capture}
    captured = {n % 16 == 0 for n, capture, _ in pieces if n > 64 and capture}
    assert plain == captured == {True, False}
    assert any(start < c < start + n for n, capture, start in pieces for c in capture)
    assert any(start + n in capture for n, capture, start in pieces)
    assert any(n <= 64 for n, _, _ in pieces)
    pieces.clear()
    state = eng.new_state()
    eng._warm_up_prompt(state, ids[:150])
    assert state.num_tokens == 150
    assert all(start < c <= start + n for n, capture, start in pieces for c in capture)


def test_bench_prefill_runs_each_resolved_kernel_once():
    """`--linear-attn torch,auto,torch` on the CPU: auto resolves to torch, so one run (and no
    ratio of a kernel against itself, whose key would hide another's)."""
    from agentrt.bench.engine import prefill

    report = prefill("tiny", "cpu", None, ["torch", "auto", "torch"], [16], 16, 1, 0)
    assert [r["backend"] for r in report["runs"]] == ["torch"]
    assert report["ratios"] == {}
