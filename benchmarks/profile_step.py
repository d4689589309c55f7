"""Profile one prefill chunk and eager decode steps of a layer-truncated synthetic model on CUDA
(same per-layer shapes as the full model), and time the expert-dispatch variants (for one token
also `expert_gemv.token_moe`). Prints tables.
Usage: python benchmarks/profile_step.py [size] [num_layers]"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from agentrt.engine import Engine
from agentrt.engine.config import EngineConfig
from agentrt.models import build_empty
from agentrt.models.config import FULL, LINEAR
from agentrt.models.expert_gemv import token_moe
from agentrt.models.synthetic import init_value, model_config, named_tensors


def build(size: str, layers: int, device: str = "cuda"):
    cfg = model_config(size)
    types = (
        tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers))
        if cfg.is_hybrid
        else (FULL,) * layers
    )
    cfg = cfg.with_changes(num_layers=layers, layer_types=types)
    model = build_empty(cfg, device, torch.bfloat16)
    with torch.inference_mode():
        for name, t in named_tensors(model):
            init_value(name, t, 0, cfg.arch == "qwen3_5_moe")
    return model


def timed(fn, n=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / n


def main() -> None:
    size = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-35b-a3b"
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    model = build(size, layers)
    for kernel in ("fla", "torch"):
        eng = Engine(
            model,
            EngineConfig(device="cuda", dtype="bfloat16", linear_attn=kernel, cuda_graphs=False),
        )
        ids = torch.randint(0, 1000, (2048,)).tolist()
        state = eng.new_state(capacity=4096)
        eng.prefill(state, ids)
        state = eng.new_state(capacity=4096)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.prefill(state, ids)
            torch.cuda.synchronize()
        print(f"=== prefill 2048 tokens, {layers} layers, {kernel}")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=18, max_name_column_width=70
            )
        )
        for _ in range(3):
            eng.decode_step(state, 5)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                eng.decode_step(state, 5)
            torch.cuda.synchronize()
        print(f"=== decode x5, {layers} layers, {kernel}")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=18, max_name_column_width=70
            )
        )
    experts = model.experts
    layer = sorted(experts.gate_up)[0]
    e, h = experts.gate_up[layer].shape[0], experts.gate_up[layer].shape[2]
    k = model.config.num_experts_per_tok
    for tokens in (1, 16, 2048):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(tokens)])
        w = torch.rand(tokens, k, device="cuda", dtype=torch.bfloat16)
        row = {"tokens": tokens}
        if tokens == 1:  # one decode token's two kernels, straight from the stacks
            args = (x, ids, w, experts.gate_up[layer], experts.down[layer])
            row["token_moe_ms"] = round(timed(lambda args=args: token_moe(*args)), 3)
        for name in ("grouped_mm", "gathered", "looped"):
            if name == "gathered" and tokens > 64:
                continue
            fn = getattr(experts, name)
            row[name + "_ms"] = round(
                timed(lambda fn=fn, x=x, ids=ids, w=w: fn(layer, x, ids, w)), 3
            )
        print("experts", row)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
