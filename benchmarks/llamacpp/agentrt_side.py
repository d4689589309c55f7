"""agentrt's side of the llama.cpp table in one process, on one built model: `bench prefill
--offload auto` (cold prompts, llama-bench's pp rows) and then `bench decode --offload` over
`auto` (the split), `static` and `layer` (our emulations of `--n-cpu-moe` and of the layer
split), both under one VRAM budget. Building the synthetic model pins about 60 GiB of experts
in host memory (about two minutes on the H200 host), so the two benchmarks share one build
instead of paying it twice. Same functions, arguments and report as the two CLI commands.

    python benchmarks/llamacpp/agentrt_side.py --out DIR [--model synthetic:qwen3.5-35b-a3b]
        [--budget 16GiB] [--tokenizer .tok/qwen3] [--lengths 512,4096,8192] [--tokens 64]
        [--expert-format auto|model|mxfp4]

Writes DIR/agentrt_prefill.json and DIR/agentrt_decode.json and prints one JSON line with
the rows the table takes (prefill tok/s per length, decode tok/s per placement).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import agentrt.bench.offload as bench_offload
from agentrt.bench.prefill import offload_prefill
from agentrt.session.options import EXPERT_FORMATS, packed_experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the two JSON reports")
    parser.add_argument("--model", default="synthetic:qwen3.5-35b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", default="16GiB", help="--vram-budget of both benchmarks")
    parser.add_argument("--tokenizer", default=".tok/qwen3", help="real text through this")
    parser.add_argument(
        "--lengths", default="512,4096,8192", help="cold prompt lengths ('none': decode only)"
    )
    parser.add_argument("--chunk", type=int, default=8192, help="--prefill-chunk")
    parser.add_argument("--prompt-len", type=int, default=256, help="decode's prompt")
    parser.add_argument("--tokens", type=int, default=64, help="timed decode steps")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--offloads", default="auto,static,layer", help="decode placements")
    parser.add_argument(
        "--expert-format",
        choices=EXPERT_FORMATS,
        default="auto",
        help="as the CLI's: mxfp4 keeps the experts packed (auto: for gpt-oss sizes)",
    )
    args = parser.parse_args()
    args.packed = packed_experts(args.expert_format, args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # one build for both: each benchmark hands the model back with the store's routed experts
    bench_offload.load_offloadable = functools.cache(bench_offload.load_offloadable)
    lengths = [] if args.lengths == "none" else [int(n) for n in args.lengths.split(",")]
    prefill = {"runs": []}
    if lengths:
        prefill = _prefill(args, lengths)
        (out / "agentrt_prefill.json").write_text(json.dumps(prefill, indent=1))
    # `layer` moves layers to the host for good: decode runs it last, after the prefill rows
    runs = bench_offload.settings(args.offloads.split(","), [True], ["lfu"])
    decode = bench_offload.offload_decode(
        args.model,
        args.device,
        None,
        args.budget,
        runs,
        args.prompt_len,
        args.tokens,
        0,
        graphs=True,
        tokenizer_dir=args.tokenizer,
        repeat=args.repeat,
        packed=args.packed,
    )
    (out / "agentrt_decode.json").write_text(json.dumps(decode, indent=1))
    print(json.dumps(_rows(prefill, decode)))


def _prefill(args: argparse.Namespace, lengths: list[int]) -> dict:
    """`bench prefill --offload auto` over cold prompts of `lengths`."""
    return offload_prefill(
        args.model,
        args.device,
        None,
        args.budget,
        ["auto"],
        lengths,
        [],
        0,
        args.chunk,
        repeat=args.repeat,
        tokenizer_dir=args.tokenizer,
        packed=args.packed,
    )


def _rows(prefill: dict, decode: dict) -> dict:
    """What the side-by-side table takes from the two reports."""
    pp = {
        f"pp{r['tokens']}": r.get("tok_s")
        for r in prefill["runs"]
        if r.get("plan") == "auto" and r.get("kind") == "cold"
    }
    tg = {r["label"]: r["tok_s"] for r in decode["runs"]}
    peak = {r["label"]: r.get("peak_gpu_gib") for r in decode["runs"]}
    return {"prefill_tok_s": pp, "decode_tok_s": tg, "decode_peak_gpu_gib": peak}


if __name__ == "__main__":
    main()
