"""Restore time of one checkpoint of a model-shaped state, without the model: from LMDB (a
fresh cache object, nothing in RAM) and from the RAM tier (the cache that wrote it).

Builds a random `SequenceState` shaped like MODEL (default synthetic:qwen3.5-35b-a3b: 10 attention
layers of KV, 30 linear-attention states) holding TOKENS tokens on DEVICE, saves one checkpoint
into a fresh state directory, then restores it three times from each tier with THREADS
read threads (a comma list runs it once per count; 0: the default) and prints the times (and,
with PROFILE=1 in the environment, a cProfile of one restore of each tier; with BREAKDOWN=1,
when each upload group's chunks were ready and how long its upload took to dispatch, from the
restore's start). Usage:
    python benchmarks/restore_bench.py [TOKENS] [MODEL] [DEVICE] [THREADS]
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentrt.engine.state import SequenceState, new_layer_caches
from agentrt.models.registry import config_of
from agentrt.statecache import Boundaries, StateCache
from agentrt.statecache.config import StateCacheConfig, restore_threads
from agentrt.statecache.manager import layout_for
from agentrt.statecache.restore import Restorer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Groups:
    """With BREAKDOWN=1: the time each upload group's chunks were ready and its dispatch ended."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []
        self.t0 = 0.0
        if os.environ.get("BREAKDOWN") == "1":
            upload = Restorer._upload_group

            def timed(this, *args, **kwargs):
                ready = time.perf_counter()
                upload(this, *args, **kwargs)
                self.marks.append((ready - self.t0, time.perf_counter() - self.t0))

            Restorer._upload_group = timed

    def start(self) -> None:
        self.marks.clear()
        self.t0 = time.perf_counter()

    def report(self) -> str:
        if not self.marks:
            return ""
        ready = [f"{r * 1e3:.1f}" for r, _ in self.marks]
        dispatch = sum(d - r for r, d in self.marks)
        return f"; groups ready at ms {' '.join(ready)}; upload dispatch {dispatch * 1e3:.1f} ms"


GROUPS = _Groups()  # (patched once, for every thread count's restores)


def _restores(label, cache, state, ids, device, reps: int = 3) -> None:
    for i in range(reps + 1):
        state.reset()
        _sync(device)
        prof = cProfile.Profile() if os.environ.get("PROFILE") == "1" and i == reps else None
        GROUPS.start()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        hit = cache.restore_into(ids, 0, state.kv_caches(), state.linear_caches())
        _sync(device)
        seconds = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
        elif i:  # (the first restore warms allocations)
            print(
                f"restore of {len(ids) - 1} tokens from {label}: {seconds:.4f} s ({hit})"
                + GROUPS.report()
            )


def main(tokens: int, spec: str, device_name: str, threads: int) -> None:
    device = torch.device(device_name)
    cfg = config_of(spec)
    root = Path(tempfile.mkdtemp(prefix="agentrt-restore-"))
    conf = StateCacheConfig(
        state_dir=root,
        max_bytes=8 * 2**30,
        ram_bytes=4 * 2**30,
        min_distance=0,
        restore_threads=threads,
    )
    marker = cfg.vocab_size - 1
    layout, bounds = layout_for(cfg, torch.bfloat16), Boundaries({"message_end": ((marker,),)})

    def open_cache(ram: bool) -> StateCache:
        config = conf if ram else StateCacheConfig(**{**conf.__dict__, "ram_bytes": 0})
        cache = StateCache(config, b"restore-bench", spec, layout, bounds, False, device)
        cache.wait_staging()
        return cache

    state = SequenceState(cfg, new_layer_caches(cfg, device, torch.bfloat16, tokens + 16, 1024))
    gen = torch.Generator(device).manual_seed(0)
    for cache in state.kv_caches():
        cache.k.normal_(generator=gen)
        cache.v.normal_(generator=gen)
    ids = torch.randint(0, cfg.vocab_size - 2, (tokens,)).tolist()
    ids[-2] = marker
    state.adopt(ids[: tokens - 1])
    conv = [c.conv.normal_(generator=gen) for c in state.linear_caches()]
    rec = [c.recurrent.normal_(generator=gen) for c in state.linear_caches()]
    writer = open_cache(True)
    t0 = time.perf_counter()
    writer.save(ids, tokens - 1, "message_end", state.kv_caches(), conv, rec)
    writer.flush()
    seconds, raw = time.perf_counter() - t0, writer.stats["raw_bytes_written"]
    stored = writer.stats["bytes_written"]
    print(
        f"save + write of {raw / 2**20:.0f} MiB ({stored / max(raw, 1):.2f} stored): "
        f"{seconds:.3f} s ({raw / 2**20 / seconds:.0f} MiB/s), {restore_threads(conf)} read "
        f"threads, {device}"
    )
    _restores("RAM", writer, state, ids, device)
    writer.close()
    fresh = open_cache(False)
    _restores("LMDB", fresh, state, ids, device)
    fresh.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    for count in (args[3] if len(args) > 3 else "0").split(","):
        main(
            int(args[0]) if args else 32768,
            args[1] if len(args) > 1 else "synthetic:qwen3.5-35b-a3b",
            args[2] if len(args) > 2 else "cpu",
            int(count),
        )
