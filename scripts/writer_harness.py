"""How much the state-cache writer, writing checkpoints of qwen3.5-35b-a3b's shapes (bf16 KV of
10 attention layers, 30 linear layers' conv and fp32 recurrent state) from a growing agent
transcript, delays the thread that serves requests: the main thread queues a checkpoint every
STEP tokens (as turns do) on the CPU, then sleeps 0.2 ms at a time and records how late it
wakes until the writer is idle. Prints JSON: checkpoints, wake-ups later than 1 ms, their total
lateness and the longest.

    python scripts/writer_harness.py [checkpoints] [step]     (default 12 1024)

PIN=1 puts the cache's threads on core 1 and the main thread on core 0, so that only the GIL is
shared between them (on a 2-core machine the cores would be contended too).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from writer_stall import late_wakeups  # (this script's folder is on the path)

from agentrt.models.cache import KVCache
from agentrt.models.synthetic import model_config
from agentrt.statecache import Boundaries, StateCache
from agentrt.statecache.config import StateCacheConfig
from agentrt.statecache.manager import layout_for


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    step = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    cfg = model_config("qwen3.5-35b-a3b")
    layout, length = layout_for(cfg, torch.bfloat16), count * step + 1
    g = torch.Generator().manual_seed(0)
    kv = [
        KVCache(
            *(
                torch.randn(cfg.num_kv_heads, length, cfg.head_dim, generator=g).bfloat16()
                for _ in range(2)
            )
        )
        for _ in cfg.attention_layers
    ]
    conv = [torch.randn(*layout.conv_shape, generator=g).bfloat16() for _ in cfg.linear_layers]
    rec = [torch.randn(*layout.rec_shape, generator=g) * 0.1 for _ in cfg.linear_layers]
    ids = torch.randint(0, 1000, (length,), generator=g).tolist()
    root = Path(tempfile.mkdtemp(prefix="writer-harness-"))
    config = StateCacheConfig(state_dir=root, max_bytes=64 << 30, min_distance=0, queue_size=64)
    pin = os.environ.get("PIN") == "1" and hasattr(os, "sched_setaffinity")
    if pin:  # the cache's threads on core 1 (they inherit it), this one on core 0: only the GIL
        os.sched_setaffinity(0, {1})  # is shared then, not the cores
    cache = StateCache(
        config, b"harness", "harness", layout, Boundaries({}), False, torch.device("cpu")
    )
    if pin:
        os.sched_setaffinity(0, {0})
    gaps, start = [], time.perf_counter()
    try:
        for n in range(1, count + 1):
            cache.save(ids, n * step, "message_end", kv, conv, rec)
            until = time.perf_counter() + 0.05  # a turn's worth of other work between saves
            gaps += late_wakeups(lambda u=until: time.perf_counter() >= u)
        cache.flush()
    finally:
        cache.close()
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "checkpoints": count,
                "tokens_per_step": step,
                "seconds": round(time.perf_counter() - start, 3),
                "written": cache.stats["write_written"],
                "gaps_over_1ms": len(gaps),
                "stalled_ms": round(sum(gaps) * 1e3, 2),
                "longest_gap_ms": round(max(gaps, default=0) * 1e3, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
