"""`agentrt bench ttft` (worst-case time to first token over replayed traces) and `agentrt bench
bw` (host memory and PCIe bandwidths)."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from agentrt.bench.engine import machine
from agentrt.engine.config import EngineConfig
from agentrt.models import torch_dtype


def ttft(
    rt,
    load,
    modes,
    variants,
    max_tokens,
    run,
    warmup: int = 8,
    partial=None,
    state=None,
    state_root=None,
) -> dict[str, Any]:
    """Replay the same traces in every cache mode (fresh state directory each) on one runtime.

    `load(drop_reasoning)` returns the traces; `run(traces, target, label)` returns a report.
    First, untimed, the first `warmup` requests of the first trace run once in semantic mode
    (kernel compilation and autotuning, CUDA-graph capture, pinned buffers), so that one-time
    start-up costs land in no mode's figures. `partial(report)` hears the report so far after
    each mode (a run cut short by a time limit keeps the modes it finished). `state`: the
    state cache's settings (a `StateCacheConfig`; None: its defaults) but its directory; each
    mode's fresh one is made inside `state_root` (None: the system's temporary directory).
    """
    import msgspec

    from agentrt.replay.replay import local_target

    if warmup:
        first = load(False)[0]
        first = msgspec.structs.replace(first, requests=first.requests[:warmup])
        with _fresh_cache(state, state_root, "agentrt-warmup-") as config:
            rt.set_cache("semantic", config)
            run([first], local_target(rt), "warm-up")
            rt.set_cache("off")
    reports: dict[str, list[dict]] = {}
    for variant in variants:
        traces = load(variant == "dropped")
        reports[variant] = []
        for mode in modes:
            with _fresh_cache(state, state_root, "agentrt-ttft-") as config:
                rt.set_cache(mode, config)
                rep = run(traces, local_target(rt), f"{variant}/{mode}")
                cache = getattr(rt.reuse, "cache", None)
                if cache is not None:  # hits per tier, drops, write errors: what TTFT hides
                    cache.flush()
                    rep["state_cache_stats"] = dict(cache.stats)
                rt.set_cache("off")
            reports[variant].append(rep)
            if partial is not None:
                so_far = {v: list(reps) for v, reps in reports.items()}  # (a snapshot)
                partial(_report(rt, max_tokens, warmup, so_far, complete=False))
    return _report(rt, max_tokens, warmup, reports, complete=True)


@contextmanager
def _fresh_cache(state, root, prefix: str) -> Iterator[Any]:
    """`state` (a `StateCacheConfig` or None: the defaults) on a fresh, empty state directory,
    made inside `root` (None: the system's temporary directory) and removed after."""
    from agentrt.host.private import private_dir
    from agentrt.statecache.config import StateCacheConfig

    root = private_dir(root) if root is not None else None
    with tempfile.TemporaryDirectory(prefix=prefix, dir=root) as state_dir:
        base = state or StateCacheConfig()
        yield dataclasses.replace(base, state_dir=Path(state_dir))


def _report(rt, max_tokens: int, warmup: int, reports, complete: bool) -> dict[str, Any]:
    return {
        "bench": "ttft",
        "complete": complete,  # (False: written after a mode, more were to come)
        "machine": machine(),
        "max_tokens": max_tokens,
        "warmup_requests": warmup,
        "prefill_chunk": rt.engine.config.prefill_chunk,
        "prefill_graphs": rt.engine.prefill_graphs is not None,
        "startup": dict(rt.startup),  # seconds Runtime.open took, per phase
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


# what runs merged into one report must share (a run's report keys)
MERGE_KEYS = ("max_tokens", "prefill_chunk", "prefill_graphs", "setting")


def merge_reports(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several `bench ttft` reports of the same model and settings that each
    replayed part of the traces or modes (runs split to fit a time limit): per variant and
    mode, every request of every run (a request replayed twice, by trace and id, counts once:
    the later run's), its TTFT percentiles and token counts recomputed, and the ratios. Each
    mode's summary counts the requests other modes of its variant replayed and it did not
    (`missing_requests`: its percentiles cover fewer requests; the ratios then compare
    different sets). Raises InvalidArgumentError for runs of other models or settings."""
    from agentrt.replay.replay import ttft_summary

    _check_mergeable(runs)
    rows: dict[tuple[str, str], dict[tuple[str, str], dict]] = {}
    models: dict[tuple[str, str], str] = {}
    for run in runs:
        for variant, reps in run["reports"].items():
            for rep in reps:
                key = (variant, rep["summary"]["cache"])
                rows.setdefault(key, {}).update({(r["trace"], r["id"]): r for r in rep["requests"]})
                models[key] = rep["summary"].get("model", "")
    every: dict[str, set] = {}  # variant -> the requests any of its modes replayed
    for (variant, _), by_id in rows.items():
        every.setdefault(variant, set()).update(by_id)
    reports: dict[str, list[dict]] = {}
    for (variant, mode), by_id in rows.items():
        requests = [dict(r, index=i) for i, r in enumerate(by_id.values())]
        summary = ttft_summary(
            [r["ttft_s"] for r in requests],
            sum(r["prompt_tokens"] for r in requests),
            sum(r["cached_tokens"] for r in requests),
        )
        missing = len(every[variant] - by_id.keys())
        summary.update(cache=mode, model=models[variant, mode], missing_requests=missing)
        reports.setdefault(variant, []).append({"summary": summary, "requests": requests})
    return {
        "bench": "ttft",
        "merged_from": len(runs),
        "complete": all(run.get("complete", False) for run in runs),
        **{key: runs[0].get(key) for key in MERGE_KEYS},
        "reports": reports,
        "ratios": _ttft_ratios(reports),
    }


def _check_mergeable(runs: list[dict[str, Any]]) -> None:
    """Every run a `bench ttft` report of the same model and settings."""
    from agentrt.errors import InvalidArgumentError

    if not runs or any(run.get("bench") != "ttft" or "reports" not in run for run in runs):
        raise InvalidArgumentError("every file to merge must be a `bench ttft` report")
    for key in MERGE_KEYS:
        if len({repr(run.get(key)) for run in runs}) > 1:
            raise InvalidArgumentError(f"the reports differ in {key!r}: not one replay's parts")
    names = {
        rep["summary"].get("model")
        for run in runs
        for reps in run["reports"].values()
        for rep in reps
    }
    if len(names) > 1:
        raise InvalidArgumentError(f"the reports replayed different models: {sorted(names)}")


# ----------------------------------------------------------------------------- bandwidths


def bandwidth(
    spec: str, device: str, dtype: str | None, count: int, cpu_kernel: str = "auto"
) -> dict[str, Any]:
    """Measure and save the copy / CPU-expert bandwidth profile for `spec`'s expert shape, the
    CPU side through the kernel `cpu_kernel` selects (auto, torch or native)."""
    from dataclasses import asdict

    from agentrt.env import home_dir
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
