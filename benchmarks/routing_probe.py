"""The expert-cache hit rate a synthetic model's routing gives, measured on the CPU from the
model's first layers: which `@skew=S` reproduces a target regime (e.g. about 30% LRU hits with
15% of the experts resident) without spending GPU time on guesses.

A token's routing in layer l depends only on the layers before it, and every tensor of a
synthetic model is drawn from its own seed (seed, name), so a model cut to its first N layers
routes those layers exactly as the whole model built on the CPU does (a model built on CUDA
draws other values from the same distributions). The probe builds that cut model for each skew,
runs real text through it (teacher-forced, one prefill: the routing a decode of the same text
would see), records each MoE layer's top-k experts per token, and replays them through an LRU
cache shared by the probed layers with `residency` of their experts, as the engine's expert
cache is shared by all layers, and through the engine's own policies (`agentrt.offload.policy`:
LRU, and LFU at the count half-lives asked for). Hits are counted after the first `warmup`
tokens. It measures the cache alone: the engine's prefetch and its CPU split change which
experts are resident.

    python benchmarks/routing_probe.py --model synthetic:qwen3.5-35b-a3b --skews 0,0.25,0.3 \
        [--layers 4] [--tokens 1024] [--residency 0.15] [--tokenizer .tok/qwen3] \
        [--lfu-half-lives 4096]

Prints one JSON line per skew: the LRU hit rate over the probed layers and per layer, each
policy's hit rate, and the share of routed pairs that the most popular 15% of each layer's
experts receive.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agentrt.bench.offload import text_ids
from agentrt.bench.offload_figures import lru_counts, policy_step
from agentrt.engine import Engine
from agentrt.engine.config import EngineConfig
from agentrt.models.config import ModelConfig
from agentrt.models.synthetic import build_in_memory, hf_config, resolve_size
from agentrt.offload.policy import LFU, LRU


class RoutingRecorder:
    """Routed experts that record each call's expert ids per layer, then compute as before."""

    def __init__(self, experts) -> None:
        self.experts = experts
        self.ids: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, hidden, topk_ids, topk_weights):
        self.ids.setdefault(layer, []).append(topk_ids.detach().cpu())
        return self.experts(layer, hidden, topk_ids, topk_weights)

    def __getattr__(self, name: str):
        return getattr(self.experts, name)


def cut_config(size: str, layers: int) -> ModelConfig:
    """The config of `size` cut to its first `layers` layers (the same layer types)."""
    raw = hf_config(size)
    raw["num_hidden_layers"] = layers
    raw["layer_types"] = raw["layer_types"][:layers]
    return ModelConfig.from_hf(raw)


def routing(size: str, cfg: ModelConfig, ids: list[int], dtype) -> dict[int, torch.Tensor]:
    """Each MoE layer's `[T, k]` expert ids over `ids` in synthetic `size` built with `cfg`
    (`cut_config`) on the CPU."""
    model = build_in_memory(size, "cpu", dtype, cfg=cfg)
    recorder = RoutingRecorder(model.experts)
    model.set_experts(recorder)
    engine = Engine(model, EngineConfig(device="cpu", dtype=str(dtype).split(".")[-1]))
    with torch.inference_mode():
        engine.prefill(engine.new_state(), ids)
    return {layer: torch.cat(parts) for layer, parts in recorder.ids.items()}


def lru_hits(routes: dict[int, torch.Tensor], slots: int, warmup: int) -> dict:
    """Replay the tokens' experts, layer by layer within a token, through one LRU of `slots`."""
    tokens = min(len(r) for r in routes.values())
    log = [(layer, ids[t].tolist()) for t in range(tokens) for layer, ids in routes.items()]
    counts = lru_counts(log, slots, warmup * len(routes))
    total = sum(c[1] for c in counts.values())
    return {
        "lru_hit_rate": sum(c[0] for c in counts.values()) / total if total else None,
        "per_layer": {layer: round(c[0] / c[1], 3) for layer, c in counts.items()},
    }


def policy_hits(routes: dict[int, torch.Tensor], slots: int, warmup: int, policy) -> float:
    """The hit rate of one cache of `slots` shared by the layers under `policy`, used as the
    engine's expert cache uses it (`policy_step`)."""
    resident: set[tuple[int, int]] = set()
    hits = looked = 0
    tokens = min(len(r) for r in routes.values())
    for t in range(tokens):
        for layer, ids in routes.items():
            hit = policy_step(policy, resident, layer, ids[t].tolist(), slots)
            if t >= warmup:
                hits += hit
                looked += len(ids[t])
    return hits / looked if looked else 0.0


def policy_rates(routes, slots: int, warmup: int, lfu_halves: list[int]) -> dict[str, float]:
    """The engine's policies' hit rates on `routes`: LRU, and LFU at each count half-life."""
    policies = {"lru": LRU(), **{f"lfu:{h}": LFU(half_life=h) for h in lfu_halves}}
    return {
        name: round(policy_hits(routes, slots, warmup, policy), 3)
        for name, policy in policies.items()
    }


def top_share(routes: dict[int, torch.Tensor], experts: int, share: float) -> float:
    """The mean share of routed pairs that the most popular `share` of a layer's experts get."""
    top = max(1, round(share * experts))
    shares = []
    for ids in routes.values():
        counts = torch.bincount(ids.flatten(), minlength=experts).sort(descending=True).values
        shares.append(float(counts[:top].sum() / counts.sum()))
    return sum(shares) / len(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="synthetic:qwen3.5-35b-a3b")
    parser.add_argument("--skews", default="0,0.25,0.3", help="router skews to probe")
    parser.add_argument("--layers", type=int, default=4, help="first layers built and probed")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of real text")
    parser.add_argument("--warmup", type=int, default=128, help="tokens before hits count")
    parser.add_argument("--residency", type=float, default=0.15, help="experts' share cached")
    parser.add_argument("--tokenizer", default=None, help="real text through this tokenizer")
    parser.add_argument(
        "--lfu-half-lives", default="4096", help="LFU count half-lives (uses) to replay"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if "@" in args.model:
        parser.error("give the skews with --skews, not in --model")
    size = resolve_size(args.model.removeprefix("synthetic:"))
    dtype = getattr(torch, args.dtype)
    lfu_halves = [int(h) for h in args.lfu_half_lives.split(",")]
    for skew in [float(s) for s in args.skews.split(",")]:
        name = size + (f"@skew={skew:g}" if skew else "")
        cfg = cut_config(name, args.layers)
        ids = text_ids(cfg.vocab_size, args.tokens, None, args.tokenizer)
        began = time.perf_counter()
        routes = routing(name, cfg, ids, dtype)
        slots = round(args.residency * cfg.num_experts * len(routes))
        report = {
            "model": f"synthetic:{name}",
            "layers": sorted(routes),
            "tokens": args.tokens,
            "residency": args.residency,
            "slots": slots,
            **lru_hits(routes, slots, args.warmup),
            "policy_hit_rate": policy_rates(routes, slots, args.warmup, lfu_halves),
            "top_share": round(top_share(routes, cfg.num_experts, args.residency), 3),
            "seconds": round(time.perf_counter() - began, 1),
        }
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
