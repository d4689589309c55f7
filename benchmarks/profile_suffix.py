"""Where a short suffix prefill's time goes (CUDA), as in an agent session with the semantic cache:
a layer-truncated synthetic model (same per-layer shapes as the full one), a prompt that grows by
a random 40-400-token suffix ending in a boundary token each step, 8 greedy tokens per step.

Per step it prints the engine's timings for: `semantic` (restore + suffix prefill + captures, the
background writer running as in a real session), `flushed` (the same, after waiting for the writer),
and `continue` (plain suffix prefill on a live state: the compute floor). Then a cProfile of one
semantic step and a torch profile of one suffix prefill. Prints JSON lines, then tables.

    python benchmarks/profile_suffix.py [layers] [steps] [prefix]     (default 8 24 2000)

With PREFILL_GRAPHS=1 the engine runs prefills as CUDA graphs (`--prefill-graphs`).
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import random
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from profile_capture import DEVICE, marker_cache, sync, timed  # noqa: E402
from profile_step import build  # noqa: E402

from agentrt.engine import Engine, Generation, SamplingParams  # noqa: E402
from agentrt.engine.config import EngineConfig  # noqa: E402
from agentrt.engine.reuse import SemanticReuse  # noqa: E402
from agentrt.statecache.config import StateCacheConfig  # noqa: E402


def main() -> None:
    args = [int(a) for a in sys.argv[1:]] + [8, 24, 2000][len(sys.argv) - 1 :]
    layers, steps, prefix = args[:3]
    model = build("qwen3.5-35b-a3b", layers, DEVICE)
    graphs = os.environ.get("PREFILL_GRAPHS") == "1"  # --prefill-graphs
    engine = Engine(
        model,
        EngineConfig(device=DEVICE, dtype="bfloat16", prefill_chunk=4096, prefill_graphs=graphs),
    )
    config = StateCacheConfig(state_dir=Path(tempfile.mkdtemp()))
    cache, marker = marker_cache(engine, config, b"profile-suffix")
    reuse = SemanticReuse(cache)
    params = SamplingParams(max_tokens=8)
    rnd = random.Random(0)

    def grow(ids: list[int]) -> list[int]:
        return ids + [rnd.randrange(marker - 1) for _ in range(rnd.randrange(40, 400))] + [marker]

    def session(first: int, flush: bool, warm: int = 0) -> list[dict]:
        state = engine.new_state()
        ids, rows = [first] + [rnd.randrange(marker - 1) for _ in range(prefix)] + [marker], []
        for step in range(steps + warm):
            if flush:
                cache.flush()
            gen = Generation()
            list(engine.stream(state, ids, params, gen, reuse))
            t = gen.timings
            rows.append(
                {
                    "step": step,
                    "prompt": len(ids),
                    "cached": gen.cached_tokens,
                    "source": gen.restore_source,
                    "ttft": round(t.ttft_s, 4),
                    "restore": round(t.restore_s, 4),
                    "prefill": round(t.prefill_s, 4),
                    "capture": round(t.capture_s, 4),
                }
            )
            ids = grow(ids + gen.token_ids)
        return rows[warm:]

    def continued(first: int) -> list[dict]:
        state = engine.new_state()
        ids, rows = [first] + [rnd.randrange(marker - 1) for _ in range(prefix)] + [marker], []
        engine.prefill(state, ids)
        for step in range(steps):
            new = grow(ids)[len(ids) :]
            seconds = round(timed(lambda n=new: engine.prefill(state, n)), 4)
            rows.append({"step": step, "suffix": len(new), "prefill": seconds})
            ids += new
        return rows

    session(1, False, warm=3)
    out = {
        "semantic": session(2, False),
        "flushed": session(3, True),
        "continue": continued(4),
    }
    for name, rows in out.items():
        for row in rows:
            print(json.dumps({"mode": name, **row}))
    for name, rows in out.items():
        vals = sorted(r["prefill"] for r in rows)
        print(json.dumps({"mode": name, "median_prefill": vals[len(vals) // 2], "max": vals[-1]}))
    cache.flush()

    state = engine.new_state()
    ids = [5] + [rnd.randrange(marker - 1) for _ in range(prefix)] + [marker]
    list(engine.stream(state, ids, params, Generation(), reuse))
    ids = grow(ids)
    prof = cProfile.Profile()
    prof.enable()
    list(engine.stream(state, ids, params, Generation(), reuse))
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(35)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    new = grow(ids)[len(ids) :]
    with profile(activities=activities) as tprof:
        engine.prefill(state, new)
        sync()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    cache.close()


if __name__ == "__main__":
    main()
