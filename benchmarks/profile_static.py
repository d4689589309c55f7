"""Graphed vs eager prefill of short pieces, and decode, on the GPU (`--prefill-graphs`): the
qwen3.5-35b-a3b-shaped synthetic model (LAYERS layers, default all 40), a random prefix of
PREFIX tokens, then per bucket length: the piece as graph replays and eagerly, each also with
two capture positions inside it (cuts of one replay vs splits of the eager recurrence); then
decode steps with KV reserved for the graphs vs grown as needed. Medians of REPS runs at the
same position (the state is rewound by length only: timing, not correctness). Prints JSON lines,
then the GPU kernels of one decode step and of one static pass (the kernels a replay runs) at
64 and 2048 tokens.

    python benchmarks/profile_static.py [layers] [prefix] [reps]     (default 40 8000 5)
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from profile_capture import timed  # noqa: E402
from profile_step import build  # noqa: E402

from agentrt.engine import Engine  # noqa: E402
from agentrt.engine.config import EngineConfig  # noqa: E402
from agentrt.engine.cuda_graph import PrefillGraphs  # noqa: E402


def main() -> None:
    args = [int(a) for a in sys.argv[1:]] + [40, 8000, 5][len(sys.argv) - 1 :]
    layers, prefix, reps = args[:3]
    model = build("qwen3.5-35b-a3b", layers, "cuda")
    rnd = random.Random(0)
    vocab = model.config.vocab_size

    def rand_ids(n: int) -> list[int]:
        return [rnd.randrange(vocab) for _ in range(n)]

    graphed = Engine(model, EngineConfig(device="cuda", dtype="bfloat16", prefill_graphs=True))
    graphs = graphed.prefill_graphs
    state = graphed.new_state()
    ids = rand_ids(prefix)
    graphed.prefill(state, ids)
    first = timed(lambda: graphed.prefill(state, rand_ids(100)))  # captures every graph
    print(json.dumps({"layers": layers, "prefix": prefix, "first_graphed_prefill_s": first}))

    def median(run, n: int, capture: list[int]) -> float:
        times = []
        for _ in range(reps):
            del state.token_ids[prefix:]
            piece = rand_ids(n)
            times.append(timed(lambda p=piece: run(state, p, capture=capture)))
        del state.token_ids[prefix:]
        return round(statistics.median(times), 5)

    for n in (64, 128, 256, 512, 1024, 2048, 3000):
        cuts = [prefix + n // 3, prefix + n // 2]
        row = {"tokens": n}
        for name, graphs_on in (("graph", True), ("eager", False)):
            graphed.prefill_graphs = graphs if graphs_on else None
            row[f"{name}_s"] = median(graphed.prefill, n, [])
            row[f"{name}_2cuts_s"] = median(graphed.prefill, n, cuts)
        graphed.prefill_graphs = graphs
        print(json.dumps(row))
    assert graphs.enabled, "prefill graphs were turned off"

    plain = Engine(model, EngineConfig(device="cuda", dtype="bfloat16"))
    for name, engine in (("reserved", graphed), ("grown", plain)):
        st = engine.new_state()
        engine.prefill(st, ids)
        engine.prefill(st, rand_ids(100))  # graphed: reserves KV for the graphs
        for _ in range(3):
            engine.decode_step(st, 5)
        steps = [timed(lambda e=engine, s=st: e.decode_step(s, 5)) for _ in range(20)]
        print(
            json.dumps(
                {
                    "decode": name,
                    "kv_capacity": st.kv_caches()[0].capacity,
                    "median_step_s": round(statistics.median(steps), 5),
                    "graph": engine.decode_graph is not None and engine.decode_graph.enabled,
                }
            )
        )

    st = plain.new_state()  # one eager decode step: the kernels a decode graph replays
    plain.prefill(st, ids)
    plain.decode_graph = None
    with torch.inference_mode():
        for _ in range(2):  # warm-up, then profiled
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                plain.decode_step(st, 5)
                torch.cuda.synchronize()
    print("decode step (eager, same kernels as the graph)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))

    eager_static = PrefillGraphs(model, torch.device("cuda"), capture=False)
    for n in (64, 2048):
        piece = rand_ids(n)
        with torch.inference_mode():
            for _ in range(2):  # warm-up, then profiled
                del state.token_ids[prefix:]
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    eager_static.run(state, piece)
                    torch.cuda.synchronize()
        print(f"static pass, {n} tokens")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22))


if __name__ == "__main__":
    main()
