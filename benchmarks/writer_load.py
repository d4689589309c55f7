"""How much the state-cache writer's whole write of a checkpoint (compression threads, LMDB
commit) delays another thread, per number of compression threads: a random state shaped like
MODEL's (default synthetic:qwen3.5-35b-a3b) at TOKENS tokens (default 8192) on the CPU, saved
ROUNDS times (new KV each round, so every chunk is written; no RAM tier) while the main thread
sleeps 0.2 ms at a time and records its wake-ups later than 1 ms (`writer_stall.late_wakeups`;
as a decode step's host side would be late), for each of WORKERS (a comma list; 0: the state
cache's default, 4). Prints one JSON line per count: write seconds, wake-ups later than 1 ms,
their total lateness and the longest, per checkpoint.

    python benchmarks/writer_load.py [TOKENS] [WORKERS] [ROUNDS] [MODEL]   (8192 0,1,4 3)
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from writer_stall import late_wakeups  # noqa: E402

from agentrt.engine.state import SequenceState, new_layer_caches  # noqa: E402
from agentrt.models.registry import config_of  # noqa: E402
from agentrt.statecache import Boundaries, StateCache  # noqa: E402
from agentrt.statecache.config import StateCacheConfig  # noqa: E402
from agentrt.statecache.manager import layout_for  # noqa: E402


def _flush(cache: StateCache, done: threading.Event) -> None:
    cache.flush()
    done.set()


def one_count(workers: int, tokens: int, rounds: int, spec: str) -> dict:
    cfg = config_of(spec)
    root = Path(tempfile.mkdtemp(prefix="agentrt-writer-load-"))
    config = StateCacheConfig(state_dir=root, ram_bytes=0, min_distance=0)
    config = StateCacheConfig(**{**config.__dict__, "workers": workers or config.workers})
    marker = cfg.vocab_size - 1
    layout, bounds = layout_for(cfg, torch.bfloat16), Boundaries({"message_end": ((marker,),)})
    cache = StateCache(config, b"writer-load", spec, layout, bounds, False, torch.device("cpu"))
    state = SequenceState(cfg, new_layer_caches(cfg, "cpu", torch.bfloat16, tokens + 16, 1024))
    gen = torch.Generator().manual_seed(0)
    conv = [c.conv.normal_(generator=gen) for c in state.linear_caches()]
    rec = [c.recurrent.normal_(generator=gen) for c in state.linear_caches()]
    seconds, late = 0.0, []
    for _ in range(rounds):
        ids = torch.randint(0, cfg.vocab_size - 2, (tokens,), generator=gen).tolist()
        ids[-2] = marker
        state.reset()
        state.adopt(ids[: tokens - 1])
        for kv in state.kv_caches():
            kv.k.normal_(generator=gen)
            kv.v.normal_(generator=gen)
        done = threading.Event()
        t0 = time.perf_counter()
        cache.save(ids, tokens - 1, "message_end", state.kv_caches(), conv, rec)
        flusher = threading.Thread(target=_flush, args=(cache, done))
        flusher.start()
        late += late_wakeups(done.is_set)
        flusher.join()
        seconds += time.perf_counter() - t0
    written = cache.stats["raw_bytes_written"]
    cache.close()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "workers": config.workers,
        "checkpoint_mb": round(written / rounds / 1e6, 1),
        "write_s": round(seconds / rounds, 3),
        "late_over_1ms": round(len(late) / rounds, 1),
        "late_ms_per_checkpoint": round(1e3 * sum(late) / rounds, 1),
        "longest_ms": round(1e3 * max(late, default=0.0), 2),
    }


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    counts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "0,1,4").split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    spec = sys.argv[4] if len(sys.argv) > 4 else "synthetic:qwen3.5-35b-a3b"
    for workers in counts:
        print(json.dumps({"tokens": tokens} | one_count(workers, tokens, rounds, spec)), flush=True)


if __name__ == "__main__":
    main()
