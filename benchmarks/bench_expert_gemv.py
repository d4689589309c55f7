"""One decode token's routed experts on CUDA: `expert_gemv.token_moe`'s two kernels over a sweep
of tiles, against torch's paths for the same token (`RoutedExperts.grouped_mm`, the gather +
batched matmul the offload slots used). bf16 stacks of random values with a model's shapes.
Prints JSON: microseconds per token, eager (host launches included) and of GPU time (calls
captured in a CUDA graph, as decode runs them; the tiles are compared by it), and the experts'
bytes read per second at the best tiles.

    python benchmarks/bench_expert_gemv.py [--shapes 256x2048x512x8,128x2880x2880x4]

The best tiles of a shape print as `AGENTRT_EXPERT_GEMV_TILES` takes them (`best_env`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from agentrt.models.expert_gemv import DOWN_BLOCK, GATE_UP_BLOCK, token_moe
from agentrt.models.moe import RoutedExperts


def median_us(fn, iters: int) -> float:
    """One call's microseconds, eager (host launches included), median of `iters`."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def graph_us(fn, iters: int, calls: int = 20) -> float:
    """One call's microseconds of GPU time: `calls` calls captured in one CUDA graph (as a
    decode step runs them, without host launches), median of `iters` replays over `calls`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # (compiles, and warms up outside the capture)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_us(graph.replay, iters) / calls


def tiles(default: tuple[int, ...], rows: tuple[int, ...]):
    yield default
    for n, k, warps, stages in itertools.product(rows, (256, 512), (4, 8), (1, 3)):
        if (n, k, warps, stages) != default:
            yield n, k, warps, stages


def sweep_shape(experts: int, hidden: int, inter: int, top_k: int, iters: int) -> dict:
    moe = RoutedExperts.empty([0], experts, hidden, inter, "cuda", torch.bfloat16)
    for stack in (moe.gate_up[0], moe.down[0]):
        stack.normal_(std=0.02)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(experts, device="cuda")[:top_k].unsqueeze(0)
    w = torch.softmax(torch.randn(1, top_k, device="cuda"), -1)
    nbytes = top_k * 3 * hidden * inter * 2
    stacks = (moe.gate_up[0], moe.down[0])
    row = {"shape": dict(experts=experts, hidden=hidden, inter=inter, top_k=top_k)}
    for name in ("grouped_mm", "gathered"):
        fn = functools.partial(getattr(moe, name), 0, x, ids, w)
        row[name] = {"eager_us": median_us(fn, iters), "graph_us": graph_us(fn, iters)}
    results = {}
    for part, default, rows in (
        ("gate_up", GATE_UP_BLOCK, (4, 8, 16, 32)),
        ("down", DOWN_BLOCK, (4, 8, 16, 32)),
    ):
        for tile in tiles(default, rows):
            blocks = (tile, DOWN_BLOCK) if part == "gate_up" else (GATE_UP_BLOCK, tile)
            try:
                us = graph_us(lambda b=blocks: token_moe(x, ids, w, *stacks, blocks=b), iters)
            except Exception as exc:  # (a tile Triton refuses: too many registers, ...)
                results[f"{part} {tile}"] = repr(exc)[:80]
                continue
            results[f"{part} {tile}"] = round(us, 2)
    best = {p: min((v, k) for k, v in results.items() if k.startswith(p) and isinstance(v, float))
            for p in ("gate_up", "down")}  # fmt: skip
    both = (eval(best["gate_up"][1].split(" ", 1)[1]), eval(best["down"][1].split(" ", 1)[1]))
    default = functools.partial(token_moe, x, ids, w, *stacks)
    row["default"] = {"eager_us": median_us(default, iters), "graph_us": graph_us(default, iters)}
    row["best_graph_us"] = graph_us(lambda: token_moe(x, ids, w, *stacks, blocks=both), iters)
    row["best_env"] = "/".join(",".join(map(str, t)) for t in both)
    row["best_gb_s"] = nbytes / row["best_graph_us"] / 1e3
    row["sweep_us"] = results
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="256x2048x512x8", help="EXHxIxk,...")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    for shape in args.shapes.split(","):
        out["rows"].append(sweep_shape(*map(int, shape.split("x")), iters=args.iters))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
