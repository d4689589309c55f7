"""CPU expert kernel in the arrangement decode gives it: short bursts (1-2 experts per layer) after
the host waited on the GPU, with expert copies in flight. Prints JSON (GB/s of expert weights).

    python scripts/cpu_burst.py [threads]      # needs CUDA; run under different OMP_* settings

Modes: `stream` (experts back to back, as `bench bw` calibrates), `burst` (wait on a GPU kernel
of ~0.3 ms, then 1 expert), `burst_copies` (the same with 6 expert copies issued first, as the
host step does), `burst2_copies` (2 experts)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from agentrt.models.moe import expert_ffn as ffn

H, INTER, EXPERTS = 2048, 512, 192


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    dev = torch.device("cuda")
    gate_up = torch.randn(EXPERTS, 2 * INTER, H).to(torch.bfloat16).pin_memory()
    down = torch.randn(EXPERTS, H, INTER).to(torch.bfloat16).pin_memory()
    per = (gate_up[0].numel() + down[0].numel()) * 2
    flat_src = gate_up.view(EXPERTS, -1)
    dest = torch.empty(8, flat_src.shape[1], dtype=torch.bfloat16, device=dev)
    copy_stream = torch.cuda.Stream(dev)
    x = torch.randn(1, H).to(torch.bfloat16)
    acc = torch.zeros(H, dtype=torch.float32)
    out: dict[str, object] = {
        "threads": torch.get_num_threads(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP", "GOMP", "KMP"))},
    }
    with torch.inference_mode():
        t0, n = time.perf_counter(), 0
        for i in range(256):
            ffn(x, gate_up[i % EXPERTS], down[i % EXPERTS])
            n += 1
        out["stream"] = n * per / (time.perf_counter() - t0) / 1e9
        cursor = 0
        for mode, per_burst, copies in (
            ("burst", 1, 0),
            ("burst_copies", 1, 6),
            ("burst2_copies", 2, 6),
        ):
            spent, count = 0.0, 0
            for step in range(150):
                torch.cuda._sleep(400_000)  # ~0.2-0.3 ms of GPU work the host waits on
                torch.cuda.current_stream(dev).synchronize()
                if copies:
                    with torch.cuda.stream(copy_stream):
                        for j in range(copies):
                            src = flat_src[(cursor + 97 * j) % EXPERTS]
                            dest[j].copy_(src, non_blocking=True)
                t0 = time.perf_counter()
                for _ in range(per_burst):
                    cursor = (cursor + 37) % EXPERTS
                    acc.add_(ffn(x, gate_up[cursor], down[cursor])[0].float(), alpha=0.5)
                if step >= 10:
                    spent += time.perf_counter() - t0
                    count += per_burst
                copy_stream.synchronize()
            out[mode] = count * per / spent / 1e9
            out[mode + "_ms_per_expert"] = 1e3 * spent / count
    print(json.dumps(out))


if __name__ == "__main__":
    main()
