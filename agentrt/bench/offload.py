"""`agentrt bench decode --offload ...`: decode throughput of every expert placement in one
invocation, on one model built once (routed experts in one host store, the rest on the device).

Decode feeds tokens of real text (teacher forcing) rather than the model's own greedy output, so
routing follows real token statistics even with random weights (a random model's greedy output
tends to repeat one token, which would inflate the hit rate). Per setting: tok/s, expert-cache
hit rate, experts copied and CPU-computed per token, PCIe bytes per token, peak device memory
(allocator statistics) against the budget, and the docs/architecture.md §8 bound
`1 / (t_gpu + misses_per_token * S / B_miss)` with t_gpu from the all-resident run (`none`) and
B_miss from the calibration profile (copies: B_P; split: B_P' + B_H'; static/layer: B_H).
Beside it, the host-memory ceiling: every expert that is not on the device when its layer comes
is read from host DRAM once (copied or computed on the CPU), so no engine with that hit rate
decodes faster than `DRAM read bandwidth / those bytes per token`, whatever its GPU time. The
DRAM read bandwidth (`dram_read_gb_s`) is the fastest host-memory read the invocation saw: a
multi-threaded sum at its start, the calibration's copies and CPU experts running together, and
every run's CPU experts (`dram_read_sources_gb_s`); each `auto` run's ceiling is compared with
`static`'s measured tok/s (`ceiling_vs_static`). The layer-chain ceiling (`chain_ceiling_tok_s`,
`auto` runs) adds the GPU time: a token's layers form one chain (a layer's CPU experts need its
GPU work up to the router, the next layer's GPU work needs their sum), so the CPU's share C of
the missing bytes N adds to the GPU time, T >= t_gpu + C / B_H', while copies may overlap
everything, N - C <= B_P' * T; hence T >= (t_gpu * B_H' + N) / (B_P' + B_H'), with the run's own
measured bandwidths (copy-only: T >= N / B_P), and T >= N / DRAM, T >= t_gpu. t_gpu (the
resident run) includes the GPU's own expert work, which could overlap the CPU's: the ceiling is
that much too low, by the share of expert work in t_gpu.
With `repeat` > 1 the settings run that many rounds, interleaved (all settings, then all again),
and each setting reports the round of median tok/s with every round's tok/s beside it; `layer`
runs once (per prompt length), last (it moves layers to the host for good).
"""

from __future__ import annotations

import cProfile
import gc
import io
import itertools
import pstats
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentrt.bench.engine import reset_peak
from agentrt.bench.offload_figures import (
    add_bounds,
    add_ceilings,
    after_prompt,
    ceiling_lines,
    lru_replay,
    ratios,
    summary_table,
)
from agentrt.engine import Engine
from agentrt.engine.config import EngineConfig
from agentrt.engine.placement import install, profile_for
from agentrt.errors import AgentrtError, InvalidArgumentError
from agentrt.host.heap import CollectorClock
from agentrt.models import torch_dtype
from agentrt.models.moe import RoutedExperts
from agentrt.models.registry import config_of, open_model
from agentrt.offload.calibrate import dram_read_bandwidth
from agentrt.offload.config import OffloadConfig, parse_bytes
from agentrt.offload.cpu_kernel import kernel_name
from agentrt.offload.cpu_mxfp4 import cpu_kernel_for
from agentrt.offload.packed_load import finish_loading, load_sink
from agentrt.offload.store import ExpertStore

WARMUP_STEPS = 16  # decode steps before timing: graph capture, a warm expert cache
PROFILE_STEPS = 16  # with `py_profile`: decode steps profiled after the timed ones


def settings(
    offloads,
    splits,
    policies,
    prefetches=(True,),
    warms=(True,),
    overlaps=(OffloadConfig.overlap,),
    paces=(None,),
) -> list[dict[str, Any]]:
    """Every combination; split, policy, prefetch, the CPU experts' warm-up, the overlap and
    the prefetch pace (None: the environment's) only vary for `auto`. `none` first (it gives
    t_gpu), `layer` last (it moves layers to the host for good)."""
    order = {"none": 0, "auto": 1, "static": 2, "layer": 3}
    out: list[dict[str, Any]] = []
    for mode in sorted(dict.fromkeys(offloads), key=order.__getitem__):
        if mode == "auto":
            out += [
                dict(offload=mode, split=s, policy=p, prefetch=f, cpu_warm=w, overlap=o, pace=a)
                for f, s, p, w, o, a in itertools.product(
                    dict.fromkeys(prefetches),
                    dict.fromkeys(splits),
                    dict.fromkeys(policies),
                    dict.fromkeys(warms),
                    dict.fromkeys(overlaps),
                    dict.fromkeys(paces),
                )
            ]
        else:
            out.append({"offload": mode})
    return out


def _resolved(setting: dict[str, Any], packed: bool) -> dict[str, Any]:
    """`setting` with the CPU experts' warm-up it left to the store (None) spelled out."""
    if setting.get("cpu_warm", False) is not None:
        return setting
    return {**setting, "cpu_warm": OffloadConfig().warms(packed)}


def label(setting: dict[str, Any]) -> str:
    if setting["offload"] != "auto":
        return setting["offload"]
    name = f"auto/{'split' if setting['split'] else 'copy-only'}/{setting['policy']}"
    name += "" if setting.get("prefetch", True) else "/no-prefetch"
    name += "" if setting.get("cpu_warm", True) else "/no-warm"
    overlap = setting.get("overlap", OffloadConfig.overlap)
    if overlap != OffloadConfig.overlap:  # (the defaults unnamed)
        name += "/overlap" if overlap else "/no-overlap"
    pace = setting.get("pace")
    return name if pace is None else name + ("/paced" if pace else "/unpaced")


def text_ids(vocab: int, count: int, text: str | None, tokenizer_dir: str | None) -> list[int]:
    """`count` token ids of real text: `text` (a file or a directory of .py/.md/.txt files,
    default this package's own sources), through the tokenizer when there is one, else UTF-8."""
    root = Path(text) if text else Path(__file__).parent
    kinds = ("*.py", "*.md", "*.txt")
    files = [root] if root.is_file() else sorted(f for k in kinds for f in root.rglob(k))
    corpus = "\n".join(f.read_text(errors="replace") for f in files)
    if not corpus.strip():
        raise InvalidArgumentError(f"--text {root}: no text in it (a file, or .py/.md/.txt files)")
    if tokenizer_dir:
        from agentrt.session.tokenizer import load_tokenizer

        ids = load_tokenizer(tokenizer_dir).encode(corpus)
    else:
        ids = list(corpus.encode())
    ids = [i % vocab for i in ids]
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def load_offloadable(spec: str, device: str, dtype: str, seed: int, packed: bool = False):
    """The model with its routed experts in one host store (pinned on CUDA; `packed`: MXFP4
    rows), the store, and the model's config."""
    cfg = config_of(spec)
    pin = device.startswith("cuda")
    store = ExpertStore.for_config(cfg, torch_dtype(dtype), pin=pin, packed=packed)
    sink = load_sink(store)
    model = open_model(spec, device, torch_dtype(dtype), seed=seed, experts=sink).model
    finish_loading(sink)
    return model, store, cfg


def make_resident(model, store: ExpertStore, device: str):
    """Every expert of the store on `device` (the all-resident baseline), swapped into `model`;
    returns the engine's offload backend (None, or for a packed store every expert preloaded
    into device slots, where the packed kernels compute them)."""
    if store.packed:
        return install(model, store, device, OffloadConfig(mode="static", cpu_moe_layers=0))
    model.set_experts(resident_experts(store, device))
    return None


def resident_experts(store: ExpertStore, device: str) -> RoutedExperts:
    """Every expert of the store copied to `device`, unpacked."""
    return RoutedExperts(
        {layer: store.gate_up(layer).to(device) for layer in store.layers},
        {layer: store.down(layer).to(device) for layer in store.layers},
    )


def offload_decode(
    spec: str,
    device: str,
    dtype: str | None,
    budget: str | None,
    runs: list[dict[str, Any]],
    prompt_len: int | Sequence[int],
    tokens: int,
    seed: int,
    graphs: bool,
    text: str | None = None,
    tokenizer_dir: str | None = None,
    kv_reserve_tokens: int = 32768,
    repeat: int = 1,
    cpu_kernel: str = "auto",
    py_profile: str | None = None,
    packed: bool = False,
) -> dict[str, Any]:
    """The report of `bench decode --offload` (see the module docstring). `prompt_len`: one
    prompt length, or several: every setting then runs after each (rounds interleaved, one
    calibration), labels get `@LENGTH`, and `after_prompt` compares each length's tok/s and hit
    rate with the first's. `py_profile`: a text file that gets, per setting and round, the
    costliest Python functions of `PROFILE_STEPS` more decode steps run under cProfile after
    the timed ones (not timed)."""
    from agentrt.bench.engine import machine

    lengths = [prompt_len] if isinstance(prompt_len, int) else list(dict.fromkeys(prompt_len))
    dtype = dtype or EngineConfig.default_dtype(device)
    model, store, cfg = load_offloadable(spec, device, dtype, seed, packed)
    extra = PROFILE_STEPS if py_profile else 0
    steps = WARMUP_STEPS + tokens + extra
    ids = text_ids(cfg.vocab_size, max(lengths) + steps, text, tokenizer_dir)
    if py_profile:
        Path(py_profile).write_text("")
    kernel = cpu_kernel_for(cpu_kernel, store, strict=True)
    cpu_kernel = kernel_name(kernel)  # (what runs: auto resolved, native unbuildable -> torch)
    profile = profile_for(store, torch.device(device), kernel=kernel)
    dram_probe = dram_read_bandwidth()
    budget_bytes = parse_bytes(budget) if budget else None
    rounds: dict[tuple[str, int], list[dict]] = {}
    failed: list[dict[str, str]] = []
    runs = [_resolved(s, store.packed) for s in runs]
    movable = [s for s in runs if s["offload"] != "layer"]
    order = [(s, n) for _ in range(repeat) for n in lengths for s in movable]
    order += [(s, n) for n in lengths for s in runs if s["offload"] == "layer"]
    for setting, length in order:
        name = label(setting) + (f" after {length} tokens" if len(lengths) > 1 else "")
        print(f"agentrt: bench decode {name} ...", file=sys.stderr)
        config = OffloadConfig(
            mode=setting["offload"] if setting["offload"] != "none" else "auto",
            split=setting.get("split", True),
            policy=setting.get("policy", OffloadConfig.policy),
            prefetch=setting.get("prefetch", True),
            cpu_warm=setting.get("cpu_warm", True),
            overlap=setting.get("overlap", OffloadConfig.overlap),
            prefetch_pace=setting.get("pace"),
            cpu_kernel=cpu_kernel,
            vram_budget=budget_bytes,
            kv_reserve_tokens=kv_reserve_tokens,  # bandwidths: the saved profile, then measured
        )
        prompt = ids[: length + steps]
        try:
            run = _run(model, store, device, dtype, setting, config, prompt, length, tokens, graphs)
        except (AgentrtError, torch.OutOfMemoryError) as exc:  # (the other settings still run)
            failed.append({"label": name, "error": str(exc).splitlines()[0]})
            print(f"agentrt: bench decode {name} failed: {failed[-1]['error']}", file=sys.stderr)
            model.set_experts(load_sink(store))
            _free(device)
            if len(failed) == len(order):
                raise
            continue
        if py_profile:
            _append_profile(py_profile, run.pop("_py_profile"), name)
        run["within_budget"] = (
            None
            if budget_bytes is None or run["peak_gpu_bytes"] is None or setting["offload"] == "none"
            else run["peak_gpu_bytes"] <= budget_bytes
        )
        rounds.setdefault((run["label"], length), []).append(run)
    groups = {n: [_median_round(r) for (_, m), r in rounds.items() if m == n] for n in lengths}
    groups = {n: group for n, group in groups.items() if group}
    results = [run for group in groups.values() for run in group]
    for group in groups.values():
        add_bounds(group, profile, store.expert_bytes)
    dram_sources = {
        "sum": dram_probe,
        "calibration_copies_and_cpu": profile.copy_overlapped + profile.cpu_overlapped,
        # (runs whose CPU experts were read into the caches ahead do not measure host memory)
        "decode_cpu_experts": max(
            [(r["measured_cpu_gb_s"] or 0) * 1e9 for r in results if not r["cpu_warmed_per_token"]]
            or [0.0]
        ),
    }
    dram = max(dram_sources.values())
    all_ratios: dict[str, float] = {}
    for n, group in groups.items():
        add_ceilings(group, dram, store.expert_bytes)
        found = ratios(group)
        all_ratios.update(found if len(lengths) == 1 else {f"{k}@{n}": v for k, v in found.items()})
    if len(lengths) > 1:
        for run in results:
            run["label"] += f"@{run['prompt_tokens']}"
    report = {
        "bench": "decode-offload",
        "model": spec,
        "device": device,
        "dtype": dtype,
        "vram_budget": budget,
        "prompt_tokens": lengths[0] if len(lengths) == 1 else lengths,
        "tokens": tokens,
        "warmup_steps": WARMUP_STEPS,
        "repeat": repeat,
        "cpu_kernel": cpu_kernel,
        "decode_inputs": "teacher-forced real text" + (" (tokenizer)" if tokenizer_dir else ""),
        "expert_bytes": store.expert_bytes,
        "expert_format": "mxfp4" if store.packed else "model",
        "pinned_store": store.pinned,
        "profile_gb_s": {
            k: round(getattr(profile, k) / 1e9, 2)
            for k in ("copy", "cpu", "copy_overlapped", "cpu_overlapped")
        },
        "dram_read_gb_s": dram / 1e9,
        "dram_read_sources_gb_s": {k: v / 1e9 for k, v in dram_sources.items()},
        "machine": machine(),
        "runs": results,
        "ratios": all_ratios,
    }
    if failed:
        report["failed"] = failed
    if len(lengths) > 1:
        report["after_prompt"] = after_prompt(groups)
    print(summary_table(results), file=sys.stderr)
    if ceilings := ceiling_lines(results, dram):
        print(ceilings, file=sys.stderr)
    return report


def _run(model, store, device, dtype, setting, config, ids, prompt_len, tokens, graphs) -> dict:
    """One setting's timed decode of `tokens` steps (then, if `ids` holds more, those steps
    under cProfile, into the run's `_py_profile`)."""
    _free(device)
    reset_peak(device)
    if setting["offload"] == "none":
        experts = make_resident(model, store, device)
    else:
        experts = install(model, store, device, config)
    engine = Engine(model, EngineConfig(device=device, dtype=dtype, cuda_graphs=graphs), experts)
    state = engine.new_state(capacity=len(ids) + 8)
    engine.prefill(state, ids[:prompt_len])
    if setting["offload"] == "auto":
        experts.route_log = []
    for token in ids[prompt_len : prompt_len + WARMUP_STEPS]:
        engine.decode_step(state, token)
    engine.synchronize()
    before = _counters(experts)
    timed_from = len(getattr(experts, "route_log", None) or ())
    t0 = time.perf_counter()
    with CollectorClock() as collector:
        for token in ids[prompt_len + WARMUP_STEPS : prompt_len + WARMUP_STEPS + tokens]:
            engine.decode_step(state, token)
        engine.synchronize()
    elapsed = time.perf_counter() - t0
    after = _counters(experts)
    if experts is not None and engine.decode_graph and engine.decode_graph.enabled:
        # (a captured step runs no host step at fixed layers: there every routed expert hits)
        after["hits"] += tokens * model.config.num_experts_per_tok * len(experts.fixed_slots)
    lru = _lru_regime(experts, timed_from)  # (before the profiled steps: timed ones only)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    profiled = _profiled_steps(engine, state, ids[prompt_len + WARMUP_STEPS + tokens :])
    run = {
        "label": label(setting),
        **setting,
        "prompt_tokens": prompt_len,
        "cuda_graph": bool(engine.decode_graph and engine.decode_graph.enabled),
        "tok_s": tokens / elapsed,
        "ms_per_token": 1000 * elapsed / tokens,
        **_per_token(before, after, tokens, store.expert_bytes, setting["offload"] == "auto"),
        "expert_cache_slots": experts.cache.num_slots if experts else None,
        # the prefetches' share of a layer's time at the end (None: pacing off, the default)
        "prefetch_pace": experts.pace.share if experts and experts.pace.on else None,
        # the share of all routed experts the cache holds: the hit rate's reference (near-uniform
        # routing hits about this often from the cache alone; skewed routing, `@skew=`, more)
        "expert_residency": (
            experts.cache.num_slots / (len(store.layers) * store.num_experts) if experts else None
        ),
        "q_star_bandwidths_gb_s": _gb(experts.bw) if experts else None,
        "cpu_layers": sorted(experts.cpu_layers) if experts else [],
        "peak_gpu_bytes": peak,  # (of the timed steps and those before them)
        # Python's cycle collector in the timed steps: its time and its full passes
        "gc_ms_per_token": 1e3 * collector.seconds / tokens,
        "gc_full_passes": collector.passes[2],
    }
    # for `static` and `layer`, whose routing stays on the device: the share of uses their
    # resident layers serve
    run["lru_hit_rate"] = run["cache_hit_rate"] if lru is None else lru
    run["peak_gpu_gib"] = run["peak_gpu_bytes"] / 2**30 if run["peak_gpu_bytes"] else None
    if profiled is not None:
        run["_py_profile"] = profiled
    engine.decode_graph = None
    if experts is not None:
        experts.close()
    model.set_experts(load_sink(store))  # drop the device cache / resident copy
    del engine, state, experts
    return run


def _profiled_steps(engine, state, ids: list[int]) -> cProfile.Profile | None:
    """Decode `ids` under Python's profiler (None when there are none)."""
    if not ids:
        return None
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for token in ids:
            engine.decode_step(state, token)
        engine.synchronize()
    finally:
        profiler.disable()
    return profiler


def _append_profile(path: str, profiler: cProfile.Profile, name: str, top: int = 30) -> None:
    """Append the `top` functions by own time (then by cumulative time) of one run to `path`."""
    text = io.StringIO()
    text.write(f"=== {name}: {PROFILE_STEPS} decode steps under cProfile\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text.getvalue())


def _median_round(runs: list[dict]) -> dict:
    """The round of median tok/s (the upper middle of an even count), with every round's tok/s."""
    middle = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return {**middle, "tok_s_rounds": [r["tok_s"] for r in runs]}


def _gb(bw) -> dict[str, float]:
    """The bandwidths q* used at the end of the run (adapted to what decode measured)."""
    return {"copy": bw.copy / 1e9, "cpu": bw.cpu / 1e9}


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _counters(experts) -> dict[str, int]:
    names = ("hits", "misses", "copied", "cpu", "bytes", "copy_s", "copy_b", "cpu_s", "cpu_b")
    names += ("host_n", "host_s", "plan_s", "prefetched", "prefetch_hits", "start_s", "wait_s")
    names += ("warmed", "warm_used", "after_s", "paced", "late")
    if experts is None:
        return dict.fromkeys(names, 0)
    stats, t = experts.cache.stats.values(), experts.totals
    values = (sum(s.hits for s in stats), sum(s.misses for s in stats), t.copied, t.cpu)
    values += (t.bytes_copied, t.copy_seconds, t.copy_timed_bytes, t.cpu_seconds)
    values += (t.cpu_timed_bytes, t.host_steps, t.host_seconds, t.plan_seconds)
    values += (t.prefetched, t.prefetch_hits, t.cpu_start_seconds, t.cpu_wait_seconds)
    values += (t.warmed, t.warm_used, t.after_seconds, experts.pace.checks, experts.pace.late)
    return dict(zip(names, values, strict=True))


def _lru_regime(experts, timed_from: int) -> float | None:
    """What a plain LRU cache of the run's slots hits on the routing logged from `timed_from`
    on (the warm-up steps before it warm the cache): the regime a figure belongs to, whatever
    the run's policy; None without a log (not `auto`). Stops the logging."""
    log = getattr(experts, "route_log", None)
    if log is None:
        return None
    experts.route_log = None
    return lru_replay(log, experts.cache.num_slots, timed_from)


def _per_token(
    before: dict, after: dict, tokens: int, expert_bytes: int, cached: bool
) -> dict[str, Any]:
    """Per-token figures over the timed steps. hit rate = expert uses served from device memory
    (for static/layer the CPU layers' experts count as misses)."""
    d = {k: after[k] - before[k] for k in before}
    looked_up = d["hits"] + d["misses"] + (0 if cached else d["cpu"])
    return {
        "hit_rate": d["hits"] / looked_up if looked_up else None,
        # the cache's own hits under the run's policy, without the experts prefetch copied ahead
        "cache_hit_rate": (d["hits"] - d["prefetch_hits"]) / looked_up if looked_up else None,
        "misses_per_token": d["misses"] / tokens,
        "copied_per_token": d["copied"] / tokens,
        "cpu_experts_per_token": d["cpu"] / tokens,
        "pcie_bytes_per_token": d["bytes"] / tokens,
        "cpu_expert_bytes_per_token": d["cpu"] * expert_bytes / tokens,
        # copied ahead on the previous layer's prediction (in pcie_bytes_per_token; those the
        # layer then routed to count as hits)
        "prefetched_per_token": d["prefetched"] / tokens,
        "prefetch_hits_per_token": d["prefetch_hits"] / tokens,
        "prefetch_accuracy": d["prefetch_hits"] / d["prefetched"] if d["prefetched"] else None,
        # of the layers that awaited prefetches, those whose copies were still running when
        # the piece that reads them was launched (`PrefetchPace`)
        "prefetch_late_share": d["late"] / d["paced"] if d["paced"] else None,
        # the next layer's likely CPU experts read into the CPU's caches ahead, and of which
        # that layer computed on the CPU
        "cpu_warmed_per_token": d["warmed"] / tokens,
        "cpu_warm_used_per_token": d["warm_used"] / tokens,
        # bandwidths as decode saw them (copies: CUDA events; CPU experts: wall time)
        "measured_copy_gb_s": d["copy_b"] / d["copy_s"] / 1e9 if d["copy_s"] else None,
        "measured_cpu_gb_s": d["cpu_b"] / d["cpu_s"] / 1e9 if d["cpu_s"] else None,
        # graph decode's host steps (between pieces): all of them, planning + issuing copies,
        # CPU experts; the rest of a token's time is the GPU pieces and waiting for them
        "host_steps_per_token": d["host_n"] / tokens,
        "host_ms_per_token": 1e3 * d["host_s"] / tokens,
        "host_plan_ms_per_token": 1e3 * d["plan_s"] / tokens,
        "host_cpu_experts_ms_per_token": 1e3 * d["cpu_s"] / tokens,
        # of the host steps: to the CPU experts' post on the native kernel's pool (the serial
        # part before the CPU starts), and waiting for the pool after the step's own work
        "host_to_cpu_start_ms_per_token": 1e3 * d["start_s"] / tokens,
        "host_cpu_wait_ms_per_token": 1e3 * d["wait_s"] / tokens,
        # their bookkeeping and prefetches, run while the next piece runs (not in host_ms)
        "host_after_ms_per_token": 1e3 * d["after_s"] / tokens,
    }
