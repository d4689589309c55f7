"""The expert cache's policies on the host: the time a decode layer's policy calls take (touch
each routed expert, rank the misses, evict a victim for each admitted one), replaying a skewed
synthetic routing, and the hit rate each policy gets on it. CPU only; prints one JSON line per
policy.

    python benchmarks/bench_policy.py [--layers 40] [--experts 256] [--top-k 8] \\
        [--slots 1547] [--tokens 600] [--skew 0.9] [--policies lru,lfu]

Routing: each layer's experts drawn with fixed popularities exp(skew * z), z standard normal
(the `@skew=` emulation's kind of favourites), top-k distinct experts a token. Every miss is
admitted (no CPU split, no prefetch), so a layer evicts more often than in the engine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from agentrt.bench.offload_figures import policy_step
from agentrt.offload.policy import POLICIES


def routes(layers: int, experts: int, top_k: int, tokens: int, skew: float, seed: int = 0):
    """`tokens` lists of each layer's top-k expert ids."""
    rng = np.random.default_rng(seed)
    popularity = [np.exp(skew * rng.standard_normal(experts)) for _ in range(layers)]
    popularity = [p / p.sum() for p in popularity]
    return [
        [
            rng.choice(experts, top_k, replace=False, p=popularity[layer]).tolist()
            for layer in range(layers)
        ]
        for _ in range(tokens)
    ]


def replay(name: str, routing, slots: int, warmup: int) -> dict:
    """One policy over `routing`: its hit rate and the time of a layer's policy calls."""
    policy, resident = POLICIES[name](), set()
    hits = looked = 0
    times = []
    for t, token in enumerate(routing):
        for layer, ids in enumerate(token):
            began = time.perf_counter()
            hit = policy_step(policy, resident, layer, ids, slots)
            times.append(time.perf_counter() - began)
            if t >= warmup:
                hits += hit
                looked += len(ids)
    return {
        "policy": name,
        "hit_rate": round(hits / looked, 4),
        "us_per_layer": round(1e6 * sum(times) / len(times), 2),
        "us_worst_layer": round(1e6 * max(times), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--slots", type=int, default=1547)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=100, help="tokens before hits count")
    parser.add_argument("--skew", type=float, default=0.9)
    parser.add_argument("--policies", default="lru,lfu")
    args = parser.parse_args()
    routing = routes(args.layers, args.experts, args.top_k, args.tokens, args.skew)
    for name in args.policies.split(","):
        print(json.dumps(replay(name, routing, args.slots, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
