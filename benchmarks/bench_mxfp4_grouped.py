"""Prefill's packed MXFP4 grouped matmul on the GPU, gpt-oss-120b expert shapes (hidden 2880,
expert intermediate 2880, 128 experts): one 8K-token chunk's runs (top-4, near-uniform: about
256 tokens per expert) through gate_up and down, for each kernel tile given, against torch's
bf16 grouped GEMM on the same weights dequantized (what a resident bf16 model runs). Checks each
tile against the plain-torch reference first. Prints JSON: ms and TFLOP/s per tile and matrix,
and the best tile (for `AGENTRT_MXFP4_TILE`).

    python benchmarks/bench_mxfp4_grouped.py [--tokens 8192] [--tiles 64,128,64,8 128,128,64,8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import gpu_ms  # noqa: E402

from agentrt.models.moe import _grouped_mm_fn  # noqa: E402
from agentrt.offload.mxfp4_rows import (  # noqa: E402
    GROUPED_TILE,
    RowLayout,
    grouped,
    grouped_reference,
    unpack,
)

SIZE, EXPERTS, TOP_K = 2880, 128, 4


def _rows(layout: RowLayout, gen: torch.Generator) -> torch.Tensor:
    """Random codes; exponents around 2^-7 (weights of the synthetic spread)."""
    rows = torch.randint(0, 256, (EXPERTS, layout.row_bytes), dtype=torch.uint8, generator=gen)
    for part in (layout.gate_up, layout.down):
        rows[:, part.scales : part.scales + part.rows * part.groups] = 120
    return rows.cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    default = ",".join(map(str, GROUPED_TILE))
    parser.add_argument("--tiles", nargs="+", default=[default])
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    layout = RowLayout(SIZE, SIZE)
    rows = _rows(layout, gen)
    pairs = torch.randint(0, EXPERTS, (args.tokens * TOP_K,), generator=gen)
    counts = torch.bincount(pairs, minlength=EXPERTS).tolist()
    slots = list(range(EXPERTS))
    report: dict = {"tokens": args.tokens, "pairs": sum(counts), "tiles": {}, "bf16": {}}
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    for name in ("gate_up", "down"):
        part = getattr(layout, name)
        x = torch.randn(sum(counts), part.cols, generator=gen).to(torch.bfloat16).cuda()
        flops = 2.0 * sum(counts) * part.rows * part.cols
        want = grouped_reference(rows, slots, counts, part, x)
        dense = unpack(rows, part, torch.bfloat16)  # [E, rows, cols]
        try:
            ms = gpu_ms(lambda: _grouped_mm_fn()(x, dense.transpose(1, 2), offs=offs), 10)  # noqa: B023
            report["bf16"][name] = {"ms": ms, "tflop_s": flops / ms / 1e9}
        except (RuntimeError, TypeError) as exc:  # (no grouped GEMM for this build or GPU)
            report["bf16"][name] = {"error": str(exc)[:200]}
        for text in args.tiles:
            tile = tuple(int(v) for v in text.split(","))
            got = grouped(rows, slots, counts, part, x, tile)
            error = ((got - want).norm() / want.norm()).item()
            ms = gpu_ms(lambda: grouped(rows, slots, counts, part, x, tile), 10)  # noqa: B023
            entry = report["tiles"].setdefault(text, {})
            entry[name] = {"ms": ms, "tflop_s": flops / ms / 1e9, "rel_error": error}
    exact = {
        t: e for t, e in report["tiles"].items() if max(v["rel_error"] for v in e.values()) < 1e-2
    }
    total = {t: sum(v["ms"] for v in e.values()) for t, e in exact.items()}
    report["best_tile"] = min(total, key=total.get) if total else None
    report["best_ms"] = total.get(report["best_tile"])
    report["bf16_ms"] = sum(v.get("ms", float("nan")) for v in report["bf16"].values())
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
