"""Decode's packed MXFP4 matvec on the GPU, gpt-oss-120b expert shapes (hidden 2880, expert
intermediate 2880, 128 experts): one token's top-4 experts through gate_up, then down reading
gpt-oss's clamped SwiGLU of each expert's gate and up halves, both with the experts' bias rows
(decode's path: bf16 activations read as they are, each expert's output weighted in the down
product), per kernel tile given. Each call picks 4 other experts (the
128 experts' 1.7 GB do not fit the L2 cache, as a decode step's do not). Checks each tile
against the plain-torch reference first. Prints JSON: microseconds per layer (gate_up + down),
the rate the packed bytes are read at, and the best tile (`mxfp4_rows.MATVEC_TILE`); beside them
torch's bf16 product over the same experts dequantized (twice the bytes: the unpacked path's
reference).

    python benchmarks/bench_mxfp4_matvec.py [--tiles 16,128,4 32,64,4 8,512,4,1]

A tile is rows,bytes,warps (`mxfp4_rows.matvec`'s), with a fourth value 1 for products reduced
each step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import gpu_ms  # noqa: E402

from agentrt.models.moe import SwiGLU  # noqa: E402
from agentrt.offload.mxfp4_rows import (  # noqa: E402
    MATVEC_TILE,
    RowLayout,
    matvec,
    matvec_reference,
    unpack,
)

SIZE, EXPERTS, TOP_K, DRAWS = 2880, 128, 4, 32
TILES = ["8,128,4", "4,128,2", "8,64,2", "16,64,4", "8,256,4,1", "8,512,8,1", "16,256,8,1"]


def _rows(layout: RowLayout, gen: torch.Generator) -> torch.Tensor:
    """Random codes; exponents around 2^-7 (weights of the synthetic spread)."""
    rows = torch.randint(0, 256, (EXPERTS, layout.row_bytes), dtype=torch.uint8, generator=gen)
    for part in (layout.gate_up, layout.down):
        rows[:, part.scales : part.scales + part.rows * part.groups] = 120
    return rows.cuda()


ACT = (SwiGLU(7.0, 1.702), torch.bfloat16)
WEIGHTS = (torch.tensor([0.4, 0.3, 0.2, 0.1]), torch.bfloat16)  # (the routing weights: fp32)


def _layer(rows, layout, draws, x, h, biases, tile):
    """One layer's two matvecs over the next draw of experts (ids = slots here), as decode
    runs them: x in bf16, the outputs weighted in the down product."""
    slots = next(draws)
    matvec(rows, slots, layout.gate_up, x, (biases[0], slots), tile=tile)
    scale = (WEIGHTS[0].to(rows.device), WEIGHTS[1])
    matvec(rows, slots, layout.down, h, (biases[1], slots), ACT, tile=tile, scale=scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", nargs="+", default=TILES)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    layout = RowLayout(SIZE, SIZE)
    rows = _rows(layout, gen)
    draws_list = [torch.randperm(EXPERTS, generator=gen)[:TOP_K].cuda() for _ in range(DRAWS)]
    x = torch.randn(layout.gate_up.cols, generator=gen).cuda().to(torch.bfloat16)
    h = torch.randn(TOP_K, 2 * layout.down.cols, generator=gen).cuda()
    parts = (layout.gate_up, layout.down)
    biases = [torch.randn(EXPERTS, p.rows, generator=gen).cuda() for p in parts]
    packed = TOP_K * (layout.gate_up.nbytes + layout.down.nbytes)
    report: dict = {"experts": TOP_K, "packed_bytes_per_layer": packed, "tiles": {}}
    for text in args.tiles:
        tile = tuple(int(v) for v in text.split(","))
        error = 0.0
        first = draws_list[0]
        for part, xs, bias, act in (
            (layout.gate_up, x, (biases[0], first), None),
            (layout.down, h, (biases[1], first), ACT),
        ):
            want = matvec_reference(rows, first, part, xs, bias, act)
            got = matvec(rows, first, part, xs, bias, act, tile=tile)
            error = max(error, ((got - want).norm() / want.norm()).item())
        draws = itertools.cycle(draws_list)
        ms = gpu_ms(lambda: _layer(rows, layout, draws, x, h, biases, tile), 64)  # noqa: B023
        report["tiles"][text] = {"us": ms * 1e3, "gb_s": packed / ms / 1e6, "rel_error": error}
    dense = {p: unpack(rows, getattr(layout, p), torch.bfloat16) for p in ("gate_up", "down")}
    xb, hb = x.to(torch.bfloat16), h[:, : layout.down.cols].to(torch.bfloat16)
    draws = itertools.cycle(draws_list)

    def bf16_layer():
        slots = next(draws)
        torch.bmm(dense["gate_up"][slots], xb.expand(TOP_K, -1).unsqueeze(2))
        torch.bmm(dense["down"][slots], hb.unsqueeze(2))

    ms = gpu_ms(bf16_layer, 64)
    report["bf16_gathered_us"] = ms * 1e3
    # (the fused activation rounds once where torch's bf16 ops round each step)
    exact = {t: e for t, e in report["tiles"].items() if e["rel_error"] < 1e-2}
    report["best_tile"] = min(exact, key=lambda t: exact[t]["us"]) if exact else None
    report["default_tile"] = ",".join(map(str, MATVEC_TILE))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
