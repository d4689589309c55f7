"""One-time work on a request's path: open the runtime as a server would (start-up and its
warm-up included), then prefill prompts of each length twice in a row (one generated token),
cold each time. A first call much slower than the second paid for something one-time
(compilation, autotuning, an allocation); with `TRITON_PRINT_AUTOTUNING=1` Triton names each
kernel it tunes, in the same log, between the lines of the lengths that paid.

    python benchmarks/first_calls.py [--model synthetic:qwen3.5-35b-a3b] [--device cuda]
        [--vram-budget 16GiB] [--prefill-chunk 8192] [--lengths 1024,2048,...]

Prints one line per call and a JSON summary (start-up laps, per length first and second s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from agentrt.session.runtime import Runtime

LENGTHS = "512,1024,1536,2048,2560,3072,3584,4096,4608,6144,8192"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="synthetic:qwen3.5-35b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vram-budget", default="16GiB", help="'' for the model resident")
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument("--lengths", default=LENGTHS, help="prompt lengths, in this order")
    args = parser.parse_args()
    options = {"cache": "off", "prefill_chunk": args.prefill_chunk}
    if args.vram_budget:
        options.update(vram_budget=args.vram_budget, offload="auto")
    rt = Runtime.open(args.model, device=args.device, **options)
    vocab = rt.engine.cfg.vocab_size - 1
    rows = []
    for n, length in enumerate(int(x) for x in args.lengths.split(",")):
        times = []
        for k in range(2):
            ids = [(13 + 29 * i + 7919 * (2 * n + k)) % vocab for i in range(length)]
            t0 = time.perf_counter()
            rt.generate(ids, max_tokens=1)
            rt.engine.synchronize()
            times.append(time.perf_counter() - t0)
            print(f"first_calls: {length} tokens, call {k + 1}: {times[-1]:.3f} s", file=sys.stderr)
        rows.append({"tokens": length, "first_s": times[0], "second_s": times[1]})
    print(json.dumps({"startup": rt.startup, "rows": rows}))
    rt.close()


if __name__ == "__main__":
    main()
