"""Routed experts of one qwen3.5-35b-a3b MoE layer (256 experts, top-8, hidden 2048, expert
intermediate 512, bf16) on the GPU, grouped-GEMM path: the current one (routing weights scale the
activations, then a plain sum) against the previous combine (unweighted outputs, then one
`[1, k] x [k, H]` product per token). Prints JSON lines of GPU ms per call (CUDA events over 20
back-to-back calls) and the largest difference between the two.

    python benchmarks/bench_moe.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from agentrt.models.moe import RoutedExperts, _grouped_mm_fn, unsort


def previous(experts: RoutedExperts, x, ids, weights) -> torch.Tensor:
    grouped = _grouped_mm_fn()
    order, token_of = experts._sort(ids)
    counts = torch.zeros(experts.gate_up[0].shape[0], dtype=torch.int32, device=x.device)
    counts.index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1), dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    h = grouped(x[token_of], experts.gate_up[0].transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    ys = grouped((F.silu(gate) * up).contiguous(), experts.down[0].transpose(1, 2), offs=offs)
    unsorted = unsort(ys, order, ids.shape[1])
    return torch.bmm(weights.unsqueeze(1).to(ys.dtype), unsorted).squeeze(1)


def gpu_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    num_experts, hidden, inter, top_k = 256, 2048, 512, 8
    dev, dt = "cuda", torch.bfloat16
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=dt) * 0.02
    down = torch.randn(num_experts, hidden, inter, device=dev, dtype=dt) * 0.02
    experts = RoutedExperts({0: gate_up}, {0: down})
    for tokens in (64, 512, 2048, 4096):
        x = torch.randn(tokens, hidden, device=dev, dtype=dt)
        logits = torch.randn(tokens, num_experts, device=dev)
        weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        now = gpu_ms(lambda x=x, i=ids, w=weights: experts.grouped_mm(0, x, i, w))
        before = gpu_ms(lambda x=x, i=ids, w=weights: previous(experts, x, i, w))
        diff = (experts.grouped_mm(0, x, ids, weights) - previous(experts, x, ids, weights)).abs()
        row = {"tokens": tokens, "now_ms": round(now, 4), "previous_ms": round(before, 4)}
        print(json.dumps({**row, "max_abs_diff": diff.max().item()}))


if __name__ == "__main__":
    main()
