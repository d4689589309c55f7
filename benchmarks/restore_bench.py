"""Restore time of one LMDB checkpoint of a model-shaped state, without the model (CPU only).

Builds a random `SequenceState` shaped like MODEL (default synthetic:qwen3.5-35b-a3b: 10 attention
layers of KV, 30 linear-attention states) holding TOKENS tokens, saves one checkpoint into a fresh
state directory, then restores it three times from a fresh cache object (nothing in RAM: every
byte comes from LMDB) and prints the times. Usage:
    python benchmarks/restore_bench.py [TOKENS] [MODEL]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentrt.engine.state import SequenceState, new_layer_caches
from agentrt.models.registry import config_of
from agentrt.statecache import Boundaries, StateCache
from agentrt.statecache.config import StateCacheConfig
from agentrt.statecache.manager import layout_for


def main(tokens: int, spec: str) -> None:
    cfg = config_of(spec)
    root = Path(tempfile.mkdtemp(prefix="agentrt-restore-"))
    conf = StateCacheConfig(state_dir=root, max_bytes=8 * 2**30, ram_bytes=0, min_distance=0)
    marker = cfg.vocab_size - 1
    layout, bounds = layout_for(cfg, torch.bfloat16), Boundaries({"message_end": ((marker,),)})

    def open_cache() -> StateCache:
        return StateCache(conf, b"restore-bench", spec, layout, bounds, False, torch.device("cpu"))

    state = SequenceState(cfg, new_layer_caches(cfg, "cpu", torch.bfloat16, tokens + 16, 1024))
    gen = torch.Generator().manual_seed(0)
    for cache in state.kv_caches():
        cache.k.normal_(generator=gen)
        cache.v.normal_(generator=gen)
    ids = torch.randint(0, cfg.vocab_size - 2, (tokens,), generator=gen).tolist()
    ids[-2] = marker
    state.adopt(ids[: tokens - 1])
    conv = [c.conv.normal_(generator=gen) for c in state.linear_caches()]
    rec = [c.recurrent.normal_(generator=gen) for c in state.linear_caches()]
    writer = open_cache()
    t0 = time.perf_counter()
    writer.save(ids, tokens - 1, "message_end", state.kv_caches(), conv, rec)
    writer.flush()
    seconds, raw = time.perf_counter() - t0, writer.stats["raw_bytes_written"]
    mib = raw / 2**20
    print(f"save + write of {mib:.0f} MiB: {seconds:.3f} s ({mib / seconds:.0f} MiB/s)")
    writer.close()
    for _ in range(3):
        fresh = open_cache()
        state.reset()
        t0 = time.perf_counter()
        hit = fresh.restore_into(ids, 0, state.kv_caches(), state.linear_caches())
        print(f"restore of {tokens - 1} tokens from LMDB: {time.perf_counter() - t0:.3f} s ({hit})")
        fresh.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 32768,
        *(sys.argv[2:3] or ["synthetic:qwen3.5-35b-a3b"]),
    )
