"""Host time of captured decode's host steps, emulated on the CPU (no GPU needed): an
`OffloadedExperts` over a store of Qwen3.5-35B-A3B's expert counts (40 layers, 256 experts,
top-8, an LFU cache of 1,547 slots, bf16 experts and their native kernel) or, with `--shape
gpt-oss-120b`, gpt-oss-120b's (36 layers, 128 experts, top-4, 650 slots, packed MXFP4 experts
with biases and the clamped SwiGLU, their native kernel), with tiny expert shapes, so that the
copies and the CPU experts cost next to nothing and what remains is the host step's own work
in Python: planning, admissions, the native pool's post, the prefetch, the bookkeeping.
Routing is drawn from a skewed law per layer (Pareto popularity), the next layer's prediction
right 85% of the time, the prefetch capped at 3 experts a layer (2 for gpt-oss-120b),
bandwidths as on an H100 host (copies 52 GB/s, CPU 100 GB/s). Prints JSON: microseconds per
host step (the minimum over 6 batches of 25 tokens) from its start to the CPU experts' post,
its whole time, its planning, and the work it leaves for the next piece's run (`after_us`: 0
where the code runs it inside the step), with the counts per token.

    python benchmarks/host_step_cpu.py [--skew 1.2] [--shape gpt-oss-120b]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch

from agentrt.models.moe import PLAIN, SwiGLU
from agentrt.offload.cpu_kernel import native_experts
from agentrt.offload.cpu_mxfp4 import mxfp4_kernel
from agentrt.offload.experts import Bandwidths, OffloadedExperts
from agentrt.offload.host_step import LayerIO
from agentrt.offload.slots import ExpertCache
from agentrt.offload.store import ExpertStore

# layers, experts, top-k, cache slots, prefetch cap, packed MXFP4 (biases, clamped SwiGLU)
SHAPES = {
    "qwen3.5-35b-a3b": (40, 256, 8, 1547, 3, False),
    "gpt-oss-120b": (36, 128, 4, 650, 2, True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skew", type=float, default=1.2, help="Pareto shape (lower: more skew)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-35b-a3b")
    args = parser.parse_args()
    layers, n_experts, top_k, slots, cap, packed = SHAPES[args.shape]
    torch.manual_seed(0)
    store = ExpertStore(
        range(layers),
        n_experts,
        hidden=64,
        inter=32,
        dtype=torch.bfloat16,
        pin=False,
        bias=packed,
        act=SwiGLU(7.0, 1.702) if packed else PLAIN,
        packed=packed,
    )
    kernel = mxfp4_kernel(store) if packed else native_experts()
    if kernel is not None:
        kernel.pooled = True  # (as on a GPU host's 16 cores)
    cache = ExpertCache(store, slots, "cpu", "lfu")
    routers = {layer: torch.randn(n_experts, 64) for layer in store.layers}
    experts = OffloadedExperts(
        store, cache, Bandwidths(52e9, 100e9), cpu_kernel=kernel, routers=routers
    )
    experts._prefetch_cap = lambda own=0: max(1, cap - own)
    ios = [LayerIO(top_k=top_k, hidden=64, dtype=store.dtype, device="cpu") for _ in range(layers)]
    rng = random.Random(0)
    weights = [
        list(itertools.accumulate(rng.paretovariate(args.skew) for _ in range(n_experts)))
        for _ in range(layers)
    ]

    def draw(layer: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < top_k:
            e = rng.choices(range(n_experts), cum_weights=weights[layer])[0]
            ids += [] if e in ids else [e]
        return ids

    def token() -> None:
        routes = [draw(layer) for layer in range(layers)]
        for layer, io in enumerate(ios):
            io.ids_np[:], io.w_np[:] = routes[layer], [1 / top_k] * top_k
            if layer + 1 < layers:
                right = routes[layer + 1]
                guess = [e if rng.random() < 0.85 else rng.randrange(n_experts) for e in right]
                guess = list(dict.fromkeys(guess))
                guess += [e for e in range(n_experts) if e not in guess][: top_k - len(guess)]
                io.pred_np[:] = guess
            later = experts._host_step(layer, io)
            if later is not None:  # (the work a graph replay runs once the next piece is launched)
                later()

    for _ in range(30):
        token()
    t = experts.totals
    names = ("cpu_start_seconds", "host_seconds", "plan_seconds", "after_seconds")
    best = [float("inf")] * len(names)
    for _ in range(6):
        before, steps = [getattr(t, n, 0.0) for n in names], t.host_steps
        for _ in range(25):
            token()
        steps = t.host_steps - steps
        now = [(getattr(t, n, 0.0) - b) / steps * 1e6 for n, b in zip(names, before, strict=True)]
        best = [min(a, b) for a, b in zip(best, now, strict=True)]
    tokens = t.host_steps / layers
    report = dict(zip(("to_cpu_post_us", "host_step_us", "plan_us", "after_us"), best, strict=True))
    report = {k: round(v, 1) for k, v in report.items()}
    report |= {
        "hit_rate": round(cache.hit_rate(), 3),
        "per_token": {k: round(getattr(t, k) / tokens, 1) for k in ("copied", "prefetched", "cpu")},
        "native_pool": kernel is not None,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
