"""`agentrt bench prefill --offload auto`: offloaded prefill of every prefill plan in one
invocation, on one model built once (routed experts in one host store, the rest on the device).

Rows: cold prompts of each length, and suffixes of each length after a cached prefix (the
prefix prefilled once, its state restored before each timed suffix). Per row: seconds (median
of `repeat`), tok/s, bytes copied, the CPU's share of the (token, expert) pairs, the plans the
layers took, and the floor `max(routed missing expert bytes / B_P, resident compute time)`:
B_P from the calibration profile, the resident time from the same rows with every expert on the
device (run first, in the same invocation; `resident` may instead hand over an earlier run's
resident rows, or be False: no resident floor). Ratios: each plan against
the best fixed plan of the same row, and each suffix against `stream`.
Synthetic models carry random weights with real shapes: figures say nothing about quality.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from agentrt.engine import Engine
from agentrt.engine.config import EngineConfig
from agentrt.engine.placement import install, profile_for
from agentrt.errors import InvalidArgumentError
from agentrt.models.registry import config_of
from agentrt.offload.config import OffloadConfig, parse_bytes
from agentrt.offload.cpu_mxfp4 import cpu_kernel_for
from agentrt.offload.planner import size_class, strategies_for
from agentrt.offload.stats import PrefillTotals

FIXED_PLANS = ("stream", "routed", "predicted", "reserve")


def offload_prefill(
    spec: str,
    device: str,
    dtype: str | None,
    budget: str | None,
    plans: list[str],
    lengths: list[int],
    suffixes: list[int],
    prefix_len: int,
    chunk: int,
    repeat: int = 3,
    seed: int = 0,
    split: bool = True,
    slots: int | None = None,
    tokenizer_dir: str | None = None,
    resident: bool | list[dict] = True,
    cpu_kernel: str = "auto",
    linear_attn: str = "auto",
    profile: bool = False,
    packed: bool = False,
    stagings: list[float] | None = None,
    interleave: bool = False,
) -> dict[str, Any]:
    """The report of `bench prefill --offload auto` (see the module docstring; `packed`: the
    experts kept MXFP4; `stagings`: staging ring sizes in layers of experts, each plan timed
    with each, the rows' plans named `PLAN@SIZE` (None: the engine's default ring);
    `interleave`: every plan in one engine, its passes interleaved round by round)."""
    from agentrt.bench.engine import machine
    from agentrt.bench.offload import load_offloadable, make_resident, text_ids
    from agentrt.offload.packed_load import load_sink

    dtype = dtype or EngineConfig.default_dtype(device)
    longest = max([*lengths, prefix_len + max(suffixes, default=0)])
    experts = config_of(spec).num_experts  # (lengths within its context: `fits_context`)
    if interleave and (stagings or profile):
        raise InvalidArgumentError(
            "interleaved plans share one engine: no staging sizes or profile"
        )
    for size in stagings or []:
        if _staging_experts(size, experts) < 1:
            raise InvalidArgumentError(f"a staging ring of {size:g} layers holds no expert")
    model, store, cfg = load_offloadable(spec, device, dtype, seed, packed)
    ids = text_ids(cfg.vocab_size, longest + max(suffixes, default=0), None, tokenizer_dir)
    kernel = cpu_kernel_for(cpu_kernel, store)
    bandwidths = profile_for(store, torch.device(device), kernel=kernel)
    link = _bulk_copy_bw(store, device)
    rows = _Rows(lengths, suffixes, prefix_len, ids, repeat, device, profile)
    runs = []
    if resident is True:
        print("agentrt: bench prefill, experts resident ...", file=sys.stderr)
        resident_backend = make_resident(model, store, device)
        engine = _engine(model, device, dtype, chunk, linear_attn, resident_backend)
        runs += rows.time(engine, None, "resident")
        model.set_experts(load_sink(store))
        del engine, resident_backend
        _free(device)
    budget_bytes = parse_bytes(budget) if budget else None
    staging = 0
    named = _named(plans, stagings)
    for plan, size, name in named[:1] if interleave else named:
        print(f"agentrt: bench prefill, plan {name} ...", file=sys.stderr)
        config = OffloadConfig(
            mode="auto",
            split=split,
            prefill_plan=plan,
            vram_budget=budget_bytes,
            expert_cache_slots=slots,
            cpu_kernel=cpu_kernel,
            staging_bytes=None if size is None else _staging_bytes(store, size),
        )
        experts = install(model, store, device, config)
        filled = _fill_cache(experts, seed)
        engine = _engine(model, device, dtype, chunk, linear_attn, experts)
        staging = experts.prefill.staging_bytes
        if interleave:
            timed = rows.time_rounds(engine, experts, [(n, p) for p, _, n in named])
        else:
            timed = rows.time(engine, experts, plan, name)
        for run in timed:
            runs.append({**run, "cached_at_start": filled, "staging_gib": staging / 2**30})
        model.set_experts(load_sink(store))
        del engine, experts
        _free(device)
    _add_floors(runs, link, store.expert_bytes, resident if isinstance(resident, list) else [])
    report = {
        "bench": "prefill-offload",
        "model": spec,
        "device": device,
        "dtype": dtype,
        "vram_budget": budget,
        "expert_format": "mxfp4" if packed else "model",
        "prefill_chunk": chunk,
        "split": split,
        "prefix_tokens": prefix_len,
        "repeat": repeat,
        "expert_bytes": store.expert_bytes,
        "staging_gib": staging / 2**30,
        "cache_state": "filled with random experts before the rows (a decode working set)",
        "interleaved": interleave,  # (every plan in one engine, round by round)
        "pinned_store": store.pinned,
        "profile_gb_s": {"copy": bandwidths.copy / 1e9, "cpu": bandwidths.cpu_overlapped / 1e9},
        "bulk_copy_gb_s": link / 1e9,  # B_P of the floor: one layer's experts in one copy
        "machine": machine(),
        "runs": runs,
        "ratios": _ratios(runs),
    }
    print(_table(runs), file=sys.stderr)
    return report


def offload_prefill_options(spec, device, dtype, seed, lengths, chunk, repeat, o: dict) -> dict:
    """`offload_prefill` with the options of `bench prefill` (`o`, by their CLI names)."""
    from agentrt.session.options import packed_experts

    return offload_prefill(
        spec,
        device,
        dtype,
        o["vram_budget"],
        o["prefill_plan"],
        lengths,
        o["suffixes"],
        o["prefix_len"],
        chunk,
        repeat=repeat,
        seed=seed,
        split=o["split"] == "on",
        slots=o["expert_cache_slots"],
        tokenizer_dir=o["tokenizer"],
        resident=o["resident"],
        cpu_kernel=o["cpu_kernel"],
        linear_attn=o["linear_attn"],
        profile=o["profile"],
        packed=packed_experts(o["expert_format"], spec),
        stagings=o["staging"],
        interleave=o["interleave"],
    )


def _staging_bytes(store, layers: float) -> int:
    """A staging ring of `layers` layers of experts (at least two parts: `offload.ring`)."""
    return _staging_experts(layers, store.num_experts) * store.expert_bytes


def _staging_experts(layers: float, num_experts: int) -> int:
    """Experts a staging ring of `layers` layers holds."""
    return round(layers * num_experts)


def _engine(model, device: str, dtype: str, chunk: int, linear_attn: str, offload=None) -> Engine:
    config = EngineConfig(device=device, dtype=dtype, prefill_chunk=chunk, linear_attn=linear_attn)
    return Engine(model, config, offload)


def _bulk_copy_bw(store, device: str) -> float:
    """Host->device bytes/s of one layer's experts in one copy (median of 3): the link's rate,
    which the floor takes (the calibration's B_P is of expert-sized copies)."""
    source = store.flat[store.layers[0]]
    if not device.startswith("cuda"):
        return float("inf")
    dest = torch.empty_like(source, device=device)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dest.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del dest
    return source.numel() * source.element_size() / statistics.median(times)


def _fill_cache(experts, seed: int) -> int:
    """Fill the expert cache's free slots with random experts, as decode leaves it (prefill
    admits nothing); returns how many it holds."""
    cache, store = experts.cache, experts.store
    keys = [(layer, e) for layer in store.layers for e in range(store.num_experts)]
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    for i in order[: len(cache.free)]:
        layer, expert = keys[i]
        slot = cache.admit(layer, expert, exclude=set())
        cache.slot_rows[slot].copy_(store.flat[layer][expert])
    return sum(1 for key in cache.owner if key is not None)


def _warm_passes(auto: bool, tokens: int, chunk: int) -> int:
    """Warm-up passes before a row of `tokens` tokens in `chunk`-token chunks: one, or for
    `auto` a first pass, one of each strategy it tries for those chunks' sizes, then one more."""
    if not auto:
        return 1
    sizes = {min(tokens, chunk), tokens % chunk or chunk}
    return max(len(strategies_for(size_class(n))) for n in sizes) + 2


class _Rows:
    """Times one engine over the cold lengths and the suffixes after the prefix."""

    def __init__(self, lengths, suffixes, prefix_len, ids, repeat, device, profile) -> None:
        self.lengths, self.suffixes, self.prefix_len = lengths, suffixes, prefix_len
        self.ids, self.repeat, self.device = ids, repeat, device
        self.profile = profile  # one more run of each offloaded row under cProfile

    def time(self, engine: Engine, experts, plan: str, name: str | None = None) -> list[dict]:
        """The rows of one engine running `plan` (named `name`, by default the plan), each
        after warm-up passes of its own kind and length (the first engine of the invocation
        compiles and tunes the kernels for each shape; `auto` measures its costs and each of its
        strategies per size of chunk, in the row's own setting: a first pass, one of each
        strategy, then one more)."""
        auto, name = plan == "auto", name or plan
        chunk = engine.config.prefill_chunk
        out = []
        for length in self.lengths:
            for _ in range(_warm_passes(auto, length, chunk)):
                engine.prefill(engine.new_state(capacity=length + 8), self.ids[:length])
            state = engine.new_state()  # (KV grows as the engine grows it: elastic under a budget)
            out.append(self._row(engine, name, experts, "cold", length, state, None))
        if self.suffixes:
            state = engine.new_state(capacity=self.prefix_len + max(self.suffixes) + 8)
            engine.prefill(state, self.ids[: self.prefix_len])
            snap = state.export()
            for length in self.suffixes:
                part = self.ids[self.prefix_len : self.prefix_len + length]
                for _ in range(_warm_passes(auto, length, chunk)):
                    self._restart(state, snap)
                    engine.prefill(state, part)
                out.append(self._row(engine, name, experts, "suffix", length, state, snap))
        return out

    def time_rounds(self, engine: Engine, experts, plans: list[tuple[str, str]]) -> list[dict]:
        """`time` for every (name, plan) of `plans` in one engine: per row, each plan's warm-up
        passes, then `repeat` rounds that time each plan once, each round starting one plan
        further on (no plan always runs first); rows grouped by plan, as `time` gives them."""
        out = []
        for length in self.lengths:
            out += self._rounds(engine, experts, plans, "cold", length, engine.new_state(), None)
        if self.suffixes:
            state = engine.new_state(capacity=self.prefix_len + max(self.suffixes) + 8)
            _use_plan(experts, plans[0][1])
            engine.prefill(state, self.ids[: self.prefix_len])
            snap = state.export()
            for length in self.suffixes:
                out += self._rounds(engine, experts, plans, "suffix", length, state, snap)
        names = [name for name, _ in plans]
        return sorted(out, key=lambda r: names.index(r["plan"]))

    def _rounds(self, engine, experts, plans, kind, length, state, snap) -> list[dict]:
        begin = self.prefix_len if kind == "suffix" else 0
        part, chunk = self.ids[begin : begin + length], engine.config.prefill_chunk
        for _, plan in plans:
            _use_plan(experts, plan)
            for _ in range(_warm_passes(plan == "auto", length, chunk)):
                self._restart(state, snap)
                engine.prefill(state, part)
        times = {name: [] for name, _ in plans}
        totals = {name: PrefillTotals() for name, _ in plans}
        last = {}
        for r in range(self.repeat):
            for name, plan in plans[r % len(plans) :] + plans[: r % len(plans)]:
                _use_plan(experts, plan)
                self._restart(state, snap)
                before, t0 = experts.prefill.totals.as_dict(), time.perf_counter()
                engine.prefill(state, part)
                _sync(self.device)
                times[name].append(time.perf_counter() - t0)
                _accumulate(totals[name], before, experts.prefill.totals)
                last[name] = _streamer_seen(experts, state)
        zero = PrefillTotals().as_dict()
        return [
            {
                **_timed_row(name, kind, length, times[name]),
                **totals[name].since(zero, self.repeat),
                **last[name],
            }
            for name, _ in plans
        ]

    def _row(self, engine, plan, experts, kind, length, state, snap) -> dict:
        begin = self.prefix_len if kind == "suffix" else 0
        part = self.ids[begin : begin + length]
        before = None if experts is None else experts.prefill.totals.as_dict()
        times = []
        for _ in range(self.repeat):
            self._restart(state, snap)
            t0 = time.perf_counter()
            engine.prefill(state, part)
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        row = _timed_row(plan, kind, length, times)
        if experts is not None:
            row.update(experts.prefill.totals.since(before, self.repeat))
            row.update(_streamer_seen(experts, state))
            if self.profile:
                row["profile"] = self._profiled(engine, state, snap, part)
        return row

    def _restart(self, state, snap) -> None:
        """The row's starting state (the cached prefix, or empty), the device idle."""
        if snap is not None:
            state.import_(snap)
        else:
            state.reset()
        _sync(self.device)

    def _profiled(self, engine, state, snap, part, top: int = 30) -> list[dict]:
        """One more run of the row under cProfile: its `top` functions by own host time."""
        self._restart(state, snap)
        profiler = cProfile.Profile()
        profiler.runcall(lambda: (engine.prefill(state, part), _sync(self.device)))
        stats = pstats.Stats(profiler).stats
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        return [
            {
                "function": f"{Path(file).name}:{line}({name})",
                "calls": calls,
                "own_ms": 1e3 * own,
                "cumulative_ms": 1e3 * cumulative,
            }
            for (file, line, name), (_, calls, own, cumulative, _) in rows
        ]


def _streamer_state(streamer) -> dict:
    """What the streamer measured by the end of a row (the costs its plans used)."""
    return {
        # (the last pass's plan's; each plan of pass follows its own)
        "cpu_gb_s": streamer.cpu.read_bw / 1e9,
        "cpu_gb_s_by_plan": {
            k: v.read_bw / 1e9 for k, v in sorted(streamer.measures.rates.items())
        },
        "exposed_ms": 1e3 * streamer.exposed_s,
        "dispatch_ms": 1e3 * streamer.dispatch_s,
        "overhead_ms": {
            f"{plan}@{2**b}": 1e3 * v
            for (plan, b), v in sorted(streamer.measures.overheads.items())
        },
        "prediction_accuracy": streamer.accuracy,
        # auto: seconds per pass of each strategy by size of chunk, and the last pass's
        "pass_s": {
            f"{2**b}{'@long' if long else ''}": dict(v)  # (@long: after a long context)
            for (b, long), v in sorted(streamer.clock.measured.items())
        },
        "mode": streamer.mode,
    }


def _add_floors(runs: list[dict], copy_bw: float, expert_bytes: int, earlier: list[dict]) -> None:
    """Each offloaded row's floor and its time against it (`earlier`: resident rows timed by an
    earlier run of the same invocation)."""
    rows = [*earlier, *runs]
    resident = {(r["kind"], r["tokens"]): r["seconds"] for r in rows if r["plan"] == "resident"}
    for r in runs:
        if r["plan"] == "resident":
            continue
        r["transfer_floor_s"] = r["routed_missing"] * expert_bytes / copy_bw
        r["resident_s"] = resident.get((r["kind"], r["tokens"]))
        r["floor_s"] = max(r["transfer_floor_s"], r["resident_s"] or 0.0)
        r["vs_floor"] = r["seconds"] / r["floor_s"] if r["floor_s"] else None


def _timed_row(name: str, kind: str, length: int, times: list[float]) -> dict:
    """A row's timing: its plan's name, kind and tokens, the median of `times` and tok/s."""
    seconds = statistics.median(times)
    return {
        "plan": name,
        "kind": kind,
        "tokens": length,
        "seconds": seconds,
        "tok_s": length / seconds,
        "all_s": times,
    }


def _streamer_seen(experts, state) -> dict:
    """What a row's last pass left: each layer's plan (of the last chunk), the streamer's
    measured costs, the expert cache's slots (KV past its reservation takes slots from it)
    and the context's tokens."""
    return {
        "plan_per_layer": dict(experts.prefill.last_plans),
        "streamer": _streamer_state(experts.prefill),
        "expert_cache_slots": experts.cache.num_slots,
        "context_tokens": state.num_tokens,
    }


def _use_plan(experts, plan: str) -> None:
    """The offloaded prefill's plan from its next pass on (`auto` picks each pass's)."""
    experts.prefill.plan = experts.prefill.mode = plan


def _accumulate(acc: PrefillTotals, before: dict, now: PrefillTotals) -> None:
    """Add to `acc` what `now` counted since `before` (an earlier `as_dict()` of it)."""
    for key, value in now.as_dict().items():
        if key == "plans":
            acc.plans.update({k: v - before["plans"].get(k, 0) for k, v in value.items()})
        else:
            setattr(acc, key, getattr(acc, key) + value - before[key])


def _named(plans: list[str], stagings: list[float] | None) -> list[tuple[str, float | None, str]]:
    """(plan, staging ring size or None, the rows' name) for each engine to time, in order: a
    plan with a ring is named `PLAN@SIZE`; a plan listed again is timed again, its rows named
    `PLAN#2`, `PLAN#3`, ... (a plan's own time told apart from its place in the order)."""
    out, seen = [], {}
    for plan in plans:
        seen[plan] = seen.get(plan, 0) + 1
        base = plan if seen[plan] == 1 else f"{plan}#{seen[plan]}"
        for size in stagings or [None]:
            out.append((plan, size, base if size is None else f"{base}@{size:g}"))
    return out


def _ratios(runs: list[dict]) -> dict[str, float]:
    """Per row and staging ring: each plan against the best fixed plan (a fixed plan timed
    twice counts with its faster rows), suffixes also against stream."""
    by_row: dict[tuple, dict[str, float]] = {}
    for r in runs:
        plan, _, size = r["plan"].partition("@")
        by_row.setdefault((r["kind"], r["tokens"], size), {})[plan] = r["seconds"]
    out = {}
    for (kind, tokens, size), seconds in by_row.items():
        fixed = [v for p, v in seconds.items() if p.partition("#")[0] in FIXED_PLANS]
        ring = f"@{size}" if size else ""
        for plan, value in seconds.items():
            if plan == "resident":
                continue
            if fixed:
                out[f"{kind}{tokens}_{plan}{ring}_vs_best_fixed"] = value / min(fixed)
            if kind == "suffix" and "stream" in seconds and plan != "stream":
                out[f"{kind}{tokens}_{plan}{ring}_vs_stream"] = value / seconds["stream"]
    return out


def _table(runs: list[dict]) -> str:
    lines = [f"{'plan':<9} {'row':<12} {'s':>8} {'tok/s':>9} {'GB':>7} {'cpu%':>6} {'x floor':>8}"]
    for r in runs:
        floor = r.get("vs_floor")
        lines.append(
            f"{r['plan']:<9} {r['kind'] + str(r['tokens']):<12} {r['seconds']:>8.3f} "
            f"{r['tok_s']:>9.0f} {r.get('copy_gb', 0):>7.2f} "
            f"{100 * r.get('cpu_pair_share', 0):>6.1f} "
            f"{floor if floor is not None else float('nan'):>8.2f}"
        )
    return "\n".join(lines)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    from agentrt.bench.offload import _free as free

    free(device)
