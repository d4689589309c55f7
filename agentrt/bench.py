"""Benchmarks behind `agentrt bench prefill|decode|accuracy`: each loads the model once, runs every
requested configuration in the same invocation and returns a JSON-ready dict (machine, command
settings, figures, ratios). Timings synchronise the device; nothing here is a unit test.
Synthetic models carry random weights with real shapes: figures say nothing about model quality.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from agentrt.config import EngineConfig
from agentrt.engine import Engine, SamplingParams
from agentrt.errors import AgentrtError
from agentrt.models import copy_model, torch_dtype
from agentrt.models.registry import open_model


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # how idle OpenMP workers wait (agentrt.cputhreads sets them for offloaded decode)
        "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
    }
    if os.path.isdir("/proc/self/task"):  # more than one OpenMP team shows as extra threads
        info["process_threads"] = len(os.listdir("/proc/self/task"))
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import fla  # noqa: F401

        info["fla"] = getattr(fla, "__version__", "present")
    except Exception:  # noqa: BLE001
        info["fla"] = None
    return info


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engines(
    spec,
    device,
    dtype,
    kernels: Sequence[str],
    chunk: int,
    seed: int,
    graphs: Sequence[str] = ("on",),
):
    """Load once; yield (kernel, engine) for every kernel x CUDA-graph setting, sharing weights."""
    dtype = dtype or EngineConfig.default_dtype(device)
    source = open_model(spec, device, torch_dtype(dtype), seed=seed)
    for graph in graphs:
        for kernel in kernels:
            cfg = EngineConfig(
                device=device,
                dtype=dtype,
                prefill_chunk=chunk,
                linear_attn=kernel,
                cuda_graphs=graph == "on",
            )
            yield kernel, Engine(source.model, cfg)


def random_ids(vocab: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def _time_prefill(engine: Engine, ids: list[int], device: str) -> float:
    state = engine.new_state(capacity=len(ids))
    _sync(device)
    t0 = time.perf_counter()
    engine.prefill(state, ids)
    _sync(device)
    return time.perf_counter() - t0


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def prefill(spec, device, dtype, kernels, lengths, chunk, repeat, seed) -> dict[str, Any]:
    runs = []
    for kernel, engine in _engines(spec, device, dtype, kernels, chunk, seed):
        for length in lengths:
            ids = random_ids(engine.cfg.vocab_size, length, seed)
            _time_prefill(engine, ids[: min(length, chunk)], device)  # warm-up (kernels, autotune)
            times = [_time_prefill(engine, ids, device) for _ in range(repeat)]
            best = statistics.median(times)
            runs.append(
                {
                    "linear_attn": kernel,
                    "backend": engine.linear_backend,
                    "prompt_tokens": length,
                    "median_s": best,
                    "tok_s": length / best,
                    "all_s": times,
                    "peak_gpu_gib": _peak_gib(device),
                }
            )
    return {
        "bench": "prefill",
        "model": spec,
        "device": device,
        "dtype": dtype or EngineConfig.default_dtype(device),
        "prefill_chunk": chunk,
        "machine": machine(),
        "runs": runs,
        "ratios": _ratios(runs, "prompt_tokens"),
    }


def decode(
    spec, device, dtype, kernels, prompt_len, tokens, seed, graphs=("on",)
) -> dict[str, Any]:
    """Greedy decode tok/s after a `prompt_len` prompt, per kernel and CUDA-graph setting."""
    runs = []
    for kernel, engine in _engines(spec, device, dtype, kernels, 2048, seed, graphs):
        runs.append(_decode_run(engine, kernel, prompt_len, tokens, seed, device))
        engine.decode_graph = None  # free the captured graph before the next configuration
    return {
        "bench": "decode",
        "model": spec,
        "device": device,
        "dtype": dtype or EngineConfig.default_dtype(device),
        "machine": machine(),
        "runs": runs,
        "ratios": _ratios(runs, "prompt_tokens"),
    }


def _decode_run(
    engine: Engine, kernel: str, prompt_len: int, tokens: int, seed: int, device: str
) -> dict:
    ids = random_ids(engine.cfg.vocab_size, prompt_len, seed)
    state = engine.new_state(capacity=prompt_len + tokens + 8)
    token = int(engine.prefill(state, ids).argmax())
    for _ in range(3):  # warm-up steps (and graph capture)
        token = int(engine.decode_step(state, token).argmax())
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = int(engine.decode_step(state, token).argmax())
    elapsed = time.perf_counter() - t0
    graph = engine.decode_graph is not None and engine.decode_graph.enabled
    return {
        "linear_attn": kernel,
        "backend": engine.linear_backend,
        "cuda_graph": graph,
        "prompt_tokens": prompt_len,
        "tokens": tokens,
        "tok_s": tokens / elapsed,
        "ms_per_token": 1000 * elapsed / tokens,
        "peak_gpu_gib": _peak_gib(device),
    }


def _ratios(runs: list[dict], key: str) -> dict[str, float]:
    """tok/s of every run relative to the torch-kernel run of the same `key` (and graph setting)."""
    out = {}
    label = lambda r: r["backend"] + ("" if r.get("cuda_graph", True) else "-eager")  # noqa: E731
    for run in runs:
        same = [
            r for r in runs if r[key] == run[key] and r.get("cuda_graph") == run.get("cuda_graph")
        ]
        base = next((r for r in same if r["backend"] == "torch"), None)
        if base is not None and run is not base:
            out[f"{label(run)}_vs_{label(base)}@{run[key]}"] = run["tok_s"] / base["tok_s"]
        eager = next(
            (
                r
                for r in runs
                if r[key] == run[key]
                and r["backend"] == run["backend"]
                and r.get("cuda_graph") is False
            ),
            None,
        )
        if run.get("cuda_graph") and eager is not None:
            out[f"{run['backend']}_graph_vs_eager@{run[key]}"] = run["tok_s"] / eager["tok_s"]
    return out


def accuracy(spec, device, dtype, kernels, length, seed, eager=False) -> dict[str, Any]:
    """Compare logits (one prefill of `length` random tokens) and 32 greedy tokens to fp32 CPU."""
    dtype = dtype or EngineConfig.default_dtype(device)
    ref_model = open_model(spec, "cpu", torch.float32, seed=seed).model
    ref = Engine(ref_model, EngineConfig(device="cpu", dtype="float32", linear_attn="torch"))
    ids = random_ids(ref.cfg.vocab_size, length, seed)
    ref_logits = ref.prefill(ref.new_state(), ids, all_logits=True)
    ref_greedy = ref.generate(ref.new_state(), ids, SamplingParams(max_tokens=32)).token_ids
    model = copy_model(ref_model, device, torch_dtype(dtype))
    runs = []
    for kernel in kernels:
        eng = Engine(
            model,
            EngineConfig(device=device, dtype=dtype, linear_attn=kernel, cuda_graphs=not eager),
        )
        logits = eng.prefill(eng.new_state(), ids, all_logits=True).float().cpu()
        greedy = eng.generate(eng.new_state(), ids, SamplingParams(max_tokens=32)).token_ids
        runs.append(_compare(kernel, eng.linear_backend, logits, ref_logits, greedy, ref_greedy))
    return {
        "bench": "accuracy",
        "model": spec,
        "device": device,
        "dtype": dtype,
        "prompt_tokens": length,
        "reference": "cpu float32, torch kernels",
        "machine": machine(),
        "runs": runs,
    }


def _compare(kernel, backend, logits, ref, greedy, ref_greedy) -> dict[str, Any]:
    diff = (logits - ref).abs()
    same = next(
        (i for i, (a, b) in enumerate(zip(greedy, ref_greedy, strict=False)) if a != b),
        len(ref_greedy),
    )
    return {
        "linear_attn": kernel,
        "backend": backend,
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "max_abs_ref": float(ref.abs().max()),
        "rel_max_diff": float(diff.max() / ref.abs().max()),
        "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
        "greedy_tokens_identical_prefix": same,
        "greedy_tokens": len(ref_greedy),
    }


# ----------------------------------------------------------------------------- state cache


def _timed(device: str, fn):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def statecache(
    spec,
    device,
    dtype,
    lengths,
    state_dir,
    seed,
    capture_every: int = 2000,
    rounds: int | None = None,
    note: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Checkpoint sizes, writer throughput, restore latency (LMDB / RAM tier) vs recompute, and
    prefill overhead of capture, for one long random prompt per length. `rounds` of timings
    per length (default `default_rounds`); `note` hears of each round as it starts."""
    import shutil
    from pathlib import Path

    from agentrt.config import StateCacheConfig
    from agentrt.statecache import Boundaries, StateCache
    from agentrt.statecache.manager import layout_for

    dtype = dtype or EngineConfig.default_dtype(device)
    source = open_model(spec, device, torch_dtype(dtype), seed=seed)
    engine = Engine(source.model, EngineConfig(device=device, dtype=dtype))
    marker = engine.cfg.vocab_size - 1  # a token that ends a "message": checkpoints go after it
    bounds = Boundaries({"message_end": ((marker,),)})
    root = Path(state_dir)
    shutil.rmtree(root, ignore_errors=True)
    config = StateCacheConfig(
        state_dir=root, max_bytes=64 * 2**30, ram_bytes=16 * 2**30, min_distance=0, queue_size=64
    )
    layout = layout_for(engine.cfg, engine.dtype)

    def open_cache(ram: int = config.ram_bytes) -> StateCache:
        cfg = StateCacheConfig(**{**config.__dict__, "ram_bytes": ram})
        return StateCache(
            cfg,
            b"bench-" + spec.encode(),
            spec,
            layout,
            bounds,
            not engine.cfg.is_hybrid,
            engine.device,
        )

    cache = open_cache()
    cache.wait_staging()  # as in a long-running server, whose ring was pinned at start-up
    runs = []
    for length in lengths:
        reps = rounds or default_rounds(length)
        args = (marker, length, seed, capture_every, device, reps, note)
        runs.append(_statecache_run(engine, cache, open_cache, *args))
    cache.close()
    info = {"bench": "statecache", "model": spec, "device": device, "dtype": dtype}
    return {**info, "machine": machine(), "capture_every": capture_every, "runs": runs}


def default_rounds(length: int) -> int:
    """Timing rounds of `bench statecache` per prompt length: each round writes every one of
    its checkpoints in full (about 1.7 GB at 32K tokens on qwen3.5-35b-a3b's shapes), so long
    prompts get fewer."""
    return 7 if length <= 8192 else 3 if length <= 32768 else 1


def _statecache_run(
    engine, cache, open_cache, marker, length, seed, every, device, reps, note
) -> dict[str, Any]:
    ids = random_ids(engine.cfg.vocab_size - 1, length, seed + length)
    ids[-2] = marker  # boundary: checkpoint at length-1, the last token stays to prefill
    many = list(range(every, length - 1, every))
    for p in many:
        ids[p - 1] = marker
    target = length - 1
    # other first tokens: prompts as long, with keys of their own (a capture of a stored
    # checkpoint would be skipped), so every capture timing does the full work
    variants = [_other_start(ids, r, marker) for r in range(3 * reps)]
    state = engine.new_state(capacity=length + 16)
    warm = random_ids(
        engine.cfg.vocab_size - 1, 2048, seed + 1
    )  # warm kernels and the capture path
    _prefill_capture(engine, cache, _reset(state), warm, [2047])
    cache.flush()
    _, logits = _timed(device, lambda: engine.prefill(_reset(state), ids))

    def capture(prompt: list[int], positions: list[int]) -> float:
        run = lambda: _prefill_capture(engine, cache, _reset(state), prompt, positions)  # noqa: E731
        return _timed(device, run)[0]

    # plain, one checkpoint, many checkpoints: interleaved, each round on its own prompts, the
    # writer idle at each start; the overheads are medians of the per-round ratios, so a drift
    # of the host's speed over the run (prefill here is bound by host time) cancels out
    plain, t_end, t_many, write_s, write_raw, dropped0 = [], [], [], 0.0, 0, _dropped(cache)
    for r in range(reps):
        note(f"{length} tokens: round {r + 1}/{reps}")
        prompt = variants[3 * r]
        plain.append(_timed(device, lambda p=prompt: engine.prefill(_reset(state), p))[0])
        t_end.append(capture(ids if r == 0 else variants[3 * r + 1], [target]))
        seconds0, raw0 = cache.stats["write_seconds"], cache.stats["raw_bytes_written"]
        t_write, _ = _timed(device, cache.flush)
        write_s += cache.stats["write_seconds"] - seconds0
        write_raw += cache.stats["raw_bytes_written"] - raw0
        t_many.append(capture(variants[3 * r + 2], many + [target]))
        cache.flush()
    record = cache.store.get_record(_key(cache, ids, target))
    t_plain = _median(plain)
    t_ram, hit_ram = _median_timed(reps, device, lambda: _restore(cache, state, ids))
    t_lmdb, hit_lmdb = _lmdb_restores(reps, device, open_cache, state, ids)
    _restore(cache, state, ids)
    held = state.num_tokens  # the checkpoint's state: `target`, or up to 63 tokens before it
    if held == 0:  # not stored (the writer dropped it, counted in `dropped_many` / stats)
        raise AgentrtError(
            f"bench statecache: the checkpoint at {target} tokens was not stored (see the "
            "state cache's drop and error counts)"
        )
    restored = engine.prefill(state, ids[held:])
    engine.prefill(_reset(state), ids[:held])  # the same prefix recomputed, then the same suffix
    recomputed = engine.prefill(state, ids[held:])
    raw = cache.layout.blob_bytes(target)  # as if all of it were one record's snapshot
    end_ratios = sorted(e / p for e, p in zip(t_end, plain, strict=True))
    many_ratios = sorted(m / p for m, p in zip(t_many, plain, strict=True))
    return {
        "prompt_tokens": length,
        "checkpoint_tokens": target,
        "checkpoint_state_tokens": held,  # less than target: taken on the capture grid
        "repeats": reps,
        "recompute_s": t_plain,
        "recompute_spread_s": [min(plain), max(plain)],
        "prefill_capture_end_s": _median(t_end),
        "capture_overhead_end": _median(end_ratios) - 1,
        "capture_overhead_end_range": [end_ratios[0] - 1, end_ratios[-1] - 1],
        "captures_many": len(many) + 1,
        "prefill_capture_many_s": _median(t_many),
        "capture_overhead_many": _median(many_ratios) - 1,
        "capture_overhead_many_range": [many_ratios[0] - 1, many_ratios[-1] - 1],
        "dropped_many": _dropped(cache) - dropped0,  # writer behind: staging or queue full
        "writer_flush_s": t_write,
        "writer_busy_s": write_s,
        "writer_mib_s": write_raw / 2**20 / write_s if write_s > 0 else None,
        "snapshot_bytes": record.blob_bytes if record else None,
        "kv_chunk_bytes": record.chunk_bytes if record else None,
        "raw_bytes": raw,
        "restore_ram_s": t_ram,
        "restore_lmdb_s": t_lmdb,
        "restore_sources": [hit_ram, hit_lmdb],
        "speedup_ram": t_plain / t_ram,
        "speedup_lmdb": t_plain / t_lmdb,
        "restored_vs_recomputed_max_abs_diff": float((restored - recomputed).abs().max()),
        "restored_vs_one_pass_max_abs_diff": float((restored - logits).abs().max()),
        "max_abs_logit": float(logits.abs().max()),
    }


def _dropped(cache) -> int:
    return cache.stats["dropped_staging_full"] + cache.stats["dropped_queue_full"]


def _other_start(ids: list[int], index: int, marker: int) -> list[int]:
    out = list(ids)
    out[0] = (ids[0] + 1 + index) % marker  # never the marker itself
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _median_timed(reps: int, device: str, fn):
    runs = [_timed(device, fn) for _ in range(reps)]
    return _median([t for t, _ in runs]), runs[0][1]


def _lmdb_restores(reps: int, device: str, open_cache, state, ids):
    """Median restore time of a new process's cache (nothing in RAM, everything from LMDB); its
    pinned ring is set up at start-up, as in a server, so that stays outside the timing."""
    times, hit = [], None
    for _ in range(reps):
        fresh = open_cache(0)
        fresh.wait_staging()
        seconds, source = _timed(device, lambda fresh=fresh: _restore(fresh, state, ids))
        fresh.close()
        times.append(seconds)
        hit = hit or source
    return _median(times), hit


def _reset(state):
    state.reset()
    return state


def _key(cache, ids, pos):
    from agentrt.statecache.keys import PrefixKeys

    return PrefixKeys(cache.fp, ids).key(pos)


def _prefill_capture(engine, cache, state, ids, positions):
    engine.prefill(state, ids, capture=positions)
    for pos in positions:
        at, conv, rec = state.capture_for(pos)  # eager fla prefill: on the 64-token grid
        cache.save(ids, pos, "message_end", state.kv_caches(), conv, rec, at=at)


def _restore(cache, state, ids) -> str | None:
    state.reset()
    hit = cache.restore_into(ids, 0, state.kv_caches(), state.linear_caches())
    if hit is None:
        return None
    state.adopt(ids[: hit.pos])
    return hit.source


# ----------------------------------------------------------------------------- TTFT over traces


def ttft(rt, load, modes, variants, max_tokens, run, warmup: int = 8) -> dict[str, Any]:
    """Replay the same traces in every cache mode (fresh state directory each) on one runtime.

    `load(drop_reasoning)` returns the traces; `run(traces, target, label)` returns a report.
    First, untimed, the first `warmup` requests of the first trace run once in semantic mode
    (kernel compilation and autotuning, CUDA-graph capture, pinned buffers), so that one-time
    start-up costs land in no mode's figures.
    """
    import tempfile
    from pathlib import Path

    import msgspec

    from agentrt.config import StateCacheConfig
    from agentrt.replay.replay import local_target

    if warmup:
        first = load(False)[0]
        first = msgspec.structs.replace(first, requests=first.requests[:warmup])
        with tempfile.TemporaryDirectory(prefix="agentrt-warmup-") as state_dir:
            rt.set_cache("semantic", StateCacheConfig(state_dir=Path(state_dir)))
            run([first], local_target(rt), "warm-up")
            rt.set_cache("off")
    reports: dict[str, list[dict]] = {}
    for variant in variants:
        traces = load(variant == "dropped")
        reports[variant] = []
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="agentrt-ttft-") as state_dir:
                rt.set_cache(mode, StateCacheConfig(state_dir=Path(state_dir)))
                rep = run(traces, local_target(rt), f"{variant}/{mode}")
                cache = getattr(rt.reuse, "cache", None)
                if cache is not None:  # hits per tier, drops, write errors: what TTFT hides
                    cache.flush()
                    rep["state_cache_stats"] = dict(cache.stats)
                rt.set_cache("off")
            reports[variant].append(rep)
    return {
        "bench": "ttft",
        "machine": machine(),
        "max_tokens": max_tokens,
        "warmup_requests": warmup,
        "prefill_chunk": rt.engine.config.prefill_chunk,
        "prefill_graphs": rt.engine.prefill_graphs is not None,
        "reports": reports,
        "ratios": _ttft_ratios(reports),
    }


def _ttft_ratios(reports: dict[str, list[dict]]) -> dict[str, float]:
    """How many times lower semantic TTFT is than each baseline (p50, p99, max), per variant."""
    out = {}
    for variant, reps in reports.items():
        by_mode = {r["summary"]["cache"]: r["summary"]["ttft_s"] for r in reps}
        if "semantic" not in by_mode:
            continue
        for base in ("off", "prefix"):
            if base in by_mode:
                for stat in ("p50", "p99", "max"):
                    sem = by_mode["semantic"][stat]
                    out[f"{variant}:{base}/semantic:{stat}"] = (
                        by_mode[base][stat] / sem if sem > 0 else 0.0
                    )
    return out


# ----------------------------------------------------------------------------- bandwidths


def bandwidth(
    spec: str, device: str, dtype: str | None, count: int, cpu_kernel: str = "auto"
) -> dict[str, Any]:
    """Measure and save the copy / CPU-expert bandwidth profile for `spec`'s expert shape, the
    CPU side through the kernel `cpu_kernel` selects (auto, torch or native)."""
    from dataclasses import asdict

    from agentrt.config import home_dir
    from agentrt.models.registry import config_of
    from agentrt.offload.calibrate import (
        calibrate,
        dram_read_bandwidth,
        profile_kernel,
        profile_path,
        save_profile,
    )
    from agentrt.offload.cpu_kernel import kernel_for, kernel_name
    from agentrt.offload.store import ExpertStore

    dtype = dtype or EngineConfig.default_dtype(device)
    kernel = kernel_for(cpu_kernel, torch_dtype(dtype), strict=True)
    cpu_kernel = kernel_name(kernel)
    cfg = config_of(spec)
    store = ExpertStore(
        cfg.moe_layers[:1],
        cfg.num_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        torch_dtype(dtype),
        pin=device.startswith("cuda"),
    )
    torch.nn.init.uniform_(store.flat[store.layers[0]], -0.02, 0.02)
    profile = calibrate(store, torch.device(device), count, kernel)
    dram = dram_read_bandwidth()
    key = profile_kernel(kernel)  # (`-pool` where the kernel runs on its thread pool)
    path = profile_path(
        home_dir() / "profiles", torch.device(device), store.dtype, store.expert_bytes, key
    )
    save_profile(profile, path)
    gb = {k: round(v / 1e9, 2) for k, v in asdict(profile).items() if isinstance(v, float)}
    return {
        "bench": "bw",
        "model": spec,
        "device": device,
        "dtype": dtype,
        "profile": asdict(profile),
        "gb_per_s": gb,
        "dram_read_gb_s": round(dram / 1e9, 2),
        "cpu_kernel": cpu_kernel,
        "cpu_kernel_fraction_of_dram_read": profile.cpu / dram,
        "saved_to": str(path),
        "machine": machine(),
    }
