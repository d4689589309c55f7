"""Where the capture overhead of a prefill goes (CUDA): a layer-truncated synthetic model (same
per-layer shapes as the full one), one prompt, checkpoints every EVERY tokens. Times, as medians
of 3 (each on a prompt with its own first token, so no checkpoint is found stored):
plain prefill; prefill with the cuts only (linear states recorded, nothing saved); prefill and
the saves (device->host copies queued, as `bench statecache` does), interleaved over ROUNDS
rounds (every run's time is printed, and the save runs' phases); then a torch profile of one
such run. Prints JSON, then the profile table.

    python benchmarks/profile_capture.py [tokens] [layers] [every]     (default 8192 8 2000)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from profile_step import build  # noqa: E402

from agentrt.engine import Engine  # noqa: E402
from agentrt.engine.config import EngineConfig  # noqa: E402
from agentrt.statecache import Boundaries, StateCache  # noqa: E402
from agentrt.statecache.config import StateCacheConfig  # noqa: E402
from agentrt.statecache.manager import layout_for  # noqa: E402

ROUNDS = 5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script only


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def event() -> torch.cuda.Event | None:
    if DEVICE != "cuda":
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def marker_cache(engine: Engine, config: StateCacheConfig, name: bytes) -> tuple[StateCache, int]:
    """A state cache for `engine` whose one boundary is the last vocabulary id (returned too),
    its pinned staging ring ready."""
    marker = engine.cfg.vocab_size - 1
    layout = layout_for(engine.cfg, engine.dtype)
    bounds = Boundaries({"message_end": ((marker,),)})
    cache = StateCache(config, name, "profile", layout, bounds, False, engine.device)
    cache.wait_staging()
    return cache, marker


def main() -> None:
    args = [int(a) for a in sys.argv[1:]] + [8192, 8, 2000][len(sys.argv) - 1 :]
    tokens, layers, every = args[:3]
    model = build("qwen3.5-35b-a3b", layers, DEVICE)
    engine = Engine(model, EngineConfig(device=DEVICE, dtype="bfloat16", cuda_graphs=False))
    config = StateCacheConfig(state_dir=Path(tempfile.mkdtemp()), min_distance=0, queue_size=64)
    cache, marker = marker_cache(engine, config, b"profile-capture")
    base = torch.randint(0, marker - 1, (tokens,)).tolist()
    positions = list(range(every, tokens - 1, every)) + [tokens - 1]
    state = engine.new_state(capacity=tokens + 16)

    def prompt(i: int) -> list[int]:
        ids = list(base)
        ids[0] = i
        return ids

    def plain(ids):
        state.reset()
        engine.prefill(state, ids)

    def cuts(ids):
        state.reset()
        engine.prefill(state, ids, capture=positions)

    loop: dict[str, list[float]] = {"prefill": [], "host": [], "gpu": [], "drain": []}

    def saves(ids):
        t0 = time.perf_counter()
        cuts(ids)
        sync()
        t1 = time.perf_counter()
        loop["prefill"].append(t1 - t0)  # (the same work as `cuts`: its own spread)
        begin = event()
        for pos in positions:
            at, conv, rec = state.capture_for(pos)
            cache.save(ids, pos, "message_end", state.kv_caches(), conv, rec, at=at)
        loop["host"].append(time.perf_counter() - t1)
        end = event()
        if begin is not None:
            end.synchronize()
            loop["gpu"].append(begin.elapsed_time(end) / 1000)

    plain(prompt(0))
    saves(prompt(1))  # warm-up of every path
    cache.flush()
    for values in loop.values():
        values.clear()
    out: dict[str, float | int | list] = {"tokens": tokens, "layers": layers}
    out["checkpoints"] = len(positions)
    first = iter(range(10, 10_000))  # a new first token for every run
    runs: dict[str, list[float]] = {"plain": [], "cuts": [], "cuts_and_saves": []}
    for _ in range(ROUNDS):  # interleaved: a drift of the host's speed hits each alike
        for name, fn in (("plain", plain), ("cuts", cuts), ("cuts_and_saves", saves)):
            ids = prompt(next(first))
            runs[name].append(timed(lambda fn=fn, ids=ids: fn(ids)))
            t0 = time.perf_counter()
            cache.flush()
            if name == "cuts_and_saves":
                loop["drain"].append(time.perf_counter() - t0)
    for name, values in runs.items():
        out[f"{name}_s"] = median(values)
        out[f"{name}_runs_s"] = [round(v, 4) for v in values]
    out["cuts_overhead"] = out["cuts_s"] / out["plain_s"] - 1
    out["saves_overhead"] = out["cuts_and_saves_s"] / out["plain_s"] - 1
    # the save runs' phases: the prefill with cuts, the save loop's host time queueing, the
    # device time from its first to its last queued copy, the writer's drain after the run
    for name, values in loop.items():
        if not values:  # (no device timing on the CPU)
            continue
        out[f"save_run_{name}_s"] = median(values)
        out[f"save_run_{name}_runs_s"] = [round(v, 4) for v in values]
    print(json.dumps(out, indent=2))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        saves(prompt(next(first)))
        sync()
    cache.flush()
    key = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    cache.close()


if __name__ == "__main__":
    main()
