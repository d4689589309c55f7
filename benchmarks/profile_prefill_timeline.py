"""Where an offloaded prefill chunk's time goes on the GPU (CUDA): one chunk of LENGTH tokens of
MODEL under a VRAM budget (`--offload auto`, plan PLAN, the expert cache filled with random
experts first, as `bench prefill` does), after two warm-up passes, under the torch profiler.

From the profile's device timeline it reports: the chunk's wall time (without and under the
profiler); per stream, the time its kernels and copies kept it busy; the time the copy engine
(host->device copies) and the compute stream were busy together, and each alone; the compute
stream's idle gaps (their sum and the largest); the costliest kernels; the host's time blocked
in synchronisation. Prints JSON and writes the chrome trace to $OUT (gzip) when OUT is set.

    python benchmarks/profile_prefill_timeline.py [MODEL] [LENGTH] [PLAN] [BUDGET] [FORMAT]
    (default synthetic:gpt-oss-120b 8192 auto 16GiB mxfp4)
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from agentrt.bench.offload import load_offloadable, text_ids
from agentrt.bench.prefill import _engine, _fill_cache
from agentrt.engine.placement import install, profile_for
from agentrt.offload.config import OffloadConfig, parse_bytes


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for begin, end in sorted(spans):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def _length(spans) -> float:
    return sum(end - begin for begin, end in spans)


def _intersect(a, b) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(trace: dict) -> dict:
    """The device-side summary of a chrome trace (times in ms)."""
    device = [
        e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    h2d = _union([(e["ts"], e["ts"] + e["dur"]) for e in device if "HtoD" in e.get("name", "")])
    compute_stream = defaultdict(list)
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in device:
        if "HtoD" in e.get("name", ""):
            continue
        compute_stream[e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
        kernels[e["name"][:90]].append(e["dur"])
    busiest = max(compute_stream, key=lambda s: _length(_union(compute_stream[s])))
    compute = _union(compute_stream[busiest])
    others = _union([s for k, v in compute_stream.items() if k != busiest for s in v])
    gaps = [b[0] - a[1] for a, b in zip(compute, compute[1:], strict=False)]
    both = _intersect(h2d, compute)
    begin = min(s[0] for s in [*h2d, *compute])
    end = max(s[1] for s in [*h2d, *compute])
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    sync = [
        e["dur"]
        for e in trace["traceEvents"]
        if e.get("cat") == "cuda_runtime" and "Synchronize" in e.get("name", "")
    ]
    ms = 1e-3
    return {
        "device_span_ms": (end - begin) * ms,
        "h2d_busy_ms": _length(h2d) * ms,
        "compute_busy_ms": _length(compute) * ms,
        "other_streams_busy_ms": _length(others) * ms,
        "both_busy_ms": both * ms,
        "h2d_only_ms": (_length(h2d) - both) * ms,
        "compute_only_ms": (_length(compute) - both) * ms,
        "compute_gaps_ms": sum(gaps) * ms,
        "compute_gaps_over_1ms": sum(g for g in gaps if g > 1000) * ms,
        "largest_gaps_ms": [g * ms for g in sorted(gaps, reverse=True)[:10]],
        "host_sync_ms": sum(sync) * ms,
        "top_kernels_ms": {name: [sum(d) * ms, len(d)] for name, d in top},
    }


def main() -> None:
    args = sys.argv[1:]
    spec = args[0] if args else "synthetic:gpt-oss-120b"
    length = int(args[1]) if len(args) > 1 else 8192
    plan = args[2] if len(args) > 2 else "auto"
    budget = args[3] if len(args) > 3 else "16GiB"
    packed = (args[4] if len(args) > 4 else "mxfp4") == "mxfp4"
    model, store, cfg = load_offloadable(spec, "cuda", "bfloat16", 0, packed)
    ids = text_ids(cfg.vocab_size, length, None, None)
    profile_for(store, torch.device("cuda"))
    config = OffloadConfig(mode="auto", prefill_plan=plan, vram_budget=parse_bytes(budget))
    experts = install(model, store, "cuda", config)
    _fill_cache(experts, 0)
    engine = _engine(model, "cuda", "bfloat16", length, "auto", experts)
    for _ in range(2):
        engine.prefill(engine.new_state(capacity=length + 8), ids)
    torch.cuda.synchronize()
    state = engine.new_state(capacity=length + 8)
    t0 = time.perf_counter()
    engine.prefill(state, ids)
    torch.cuda.synchronize()
    plain = time.perf_counter() - t0  # (the profiler's own host cost left out)
    state = engine.new_state(capacity=length + 8)
    totals = experts.prefill.totals
    host0 = (totals.host_seconds, totals.wait_seconds)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.prefill(state, ids)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    path = Path(os.environ.get("OUT", "/tmp")) / "prefill_trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(f"{path}.gz", "wt") as f:
        json.dump(trace, f)
    path.unlink()
    report = {
        "model": spec,
        "tokens": length,
        "plan": plan,
        "budget": budget,
        "wall_s": plain,
        "profiled_wall_s": wall,
        "host_s": totals.host_seconds - host0[0],
        "wait_s": totals.wait_seconds - host0[1],
        "plans": dict(experts.prefill.last_plans),
        "gpu": torch.cuda.get_device_name(),
        **timeline(trace),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
