"""Where the state-cache writer's time goes for checkpoints of qwen3.5-35b-a3b's shapes (10
attention layers' bf16 KV, 30 linear layers' conv and recurrent fp32 states, ~63 MB a blob),
on the CPU: one checkpoint after CONTEXT tokens (all its KV chunks new), then COUNT more 150
tokens apart (the blob and a new chunk now and then, as a replayed turn's are). Prints JSON:
seconds per checkpoint in the writer (`write_s`), in framing the blob (`pack_parts`), in the
LMDB put (`put_checkpoint`). With `staged`, the copies go through a staging ring as on CUDA
(plain memory standing in for page-locked), so the writer works from its regions.

    python benchmarks/writer_phases.py [CONTEXT] [COUNT] [staged]     (default 8192 8)
"""

from __future__ import annotations

import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

import agentrt.statecache.writer as writer
from agentrt.models.kv import KVCache
from agentrt.models.registry import config_of
from agentrt.statecache import Boundaries, StateCache
from agentrt.statecache.config import StateCacheConfig
from agentrt.statecache.manager import layout_for
from agentrt.statecache.staging import PinnedRing
from agentrt.statecache.store import Store

SPENT: collections.Counter[str] = collections.Counter()


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0

    return wrapper


class _Event:  # a CUDA event's stand-in: the staged copies are synchronous on the CPU
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _plain_allocate(ring: PinnedRing) -> None:  # (plain memory: no page-locking on the CPU)
    ring.buffer = torch.empty(ring.capacity, dtype=torch.uint8)
    ring.ready.set()


def _staging_ring(state: StateCache) -> None:
    PinnedRing._allocate = _plain_allocate
    torch.cuda.Event, torch.cuda.current_stream = _Event, lambda device=None: None
    state._ring = PinnedRing(state.config.staging_bytes)
    state._ring.ready.wait()


def main(context: int = 8192, count: int = 8, staged: bool = False) -> None:
    cfg = config_of("synthetic:qwen3.5-35b-a3b")
    layout = layout_for(cfg, torch.bfloat16)
    kv = [
        KVCache.empty(cfg.num_kv_heads, cfg.head_dim, context + 4096, "cpu", torch.bfloat16, 1024)
        for _ in cfg.attention_layers
    ]
    for cache in kv:
        cache.k.normal_(), cache.v.normal_()
    conv = [torch.randn(layout.conv_shape) for _ in range(layout.num_linear)]
    rec = [torch.randn(layout.rec_shape) for _ in range(layout.num_linear)]
    writer.pack_parts = timed("pack_parts", writer.pack_parts)
    Store.put_checkpoint = timed("put_checkpoint", Store.put_checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        config = StateCacheConfig(state_dir=Path(tmp), min_distance=0, queue_size=100)
        bounds = Boundaries({"message_end": ((cfg.vocab_size - 1,),)})
        state = StateCache(config, b"w" * 16, "phases", layout, bounds, False, torch.device("cpu"))
        if staged:
            _staging_ring(state)
        rng = random.Random(0)
        ids = [rng.randrange(1000) for _ in range(context + 150 * count + 1)]
        for i in range(count + 1):
            before, spent = state.stats["write_seconds"], dict(SPENT)
            state.save(ids, context + 150 * i, "message_end", kv, conv, rec)
            state.flush()
            row = {k: round(v - spent.get(k, 0.0), 4) for k, v in SPENT.items()}
            row.update(checkpoint=i, write_s=round(state.stats["write_seconds"] - before, 4))
            print(json.dumps(row))
        state.close()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), staged="staged" in sys.argv[3:])
