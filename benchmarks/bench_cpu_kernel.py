"""A decode token's CPU experts, torch's kernels against agentrt's native bf16 kernel
(`agentrt/offload/cpu_kernel.py`), on qwen3.5-35b-a3b expert shapes (hidden 2048, expert
intermediate 512, bf16), cycling through 64 experts (400 MB: far beyond the caches). Prints
JSON: GB/s of expert weights read per path and experts per call, the DRAM read bandwidth of a
multi-threaded sum (`calibrate.dram_read_bandwidth`) and the largest difference of each path
from fp32 math on the same bf16 values (relative to the output's largest value).

    python benchmarks/bench_cpu_kernel.py
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

from agentrt.offload.calibrate import dram_read_bandwidth
from agentrt.offload.cpu_kernel import native_experts

EXPERTS, INTER, HIDDEN, CALLS = 64, 512, 2048, 48


def main() -> None:
    torch.manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.02).to(torch.bfloat16)
    down = (torch.randn(EXPERTS, HIDDEN, INTER) * 0.02).to(torch.bfloat16)
    x = torch.randn(HIDDEN).to(torch.bfloat16)
    out = torch.zeros(HIDDEN)
    kernel = native_experts()

    def native(ids: list[int]) -> torch.Tensor:
        kernel.run([gate_up[e] for e in ids], [down[e] for e in ids], [1.0] * len(ids), x, out)
        return out

    def torch_path(ids: list[int]) -> torch.Tensor:
        for i, e in enumerate(ids):
            g, u = F.linear(x[None], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, down[e])[0].float()
            out.copy_(y) if i == 0 else out.add_(y)
        return out

    def fp32(ids: list[int]) -> torch.Tensor:
        total = torch.zeros(HIDDEN)
        for e in ids:
            g, u = (gate_up[e].float() @ x.float()).chunk(2)
            total += down[e].float() @ (F.silu(g) * u)
        return total

    per_expert = (gate_up[0].numel() + down[0].numel()) * 2
    report = {"threads": torch.get_num_threads(), "dram_read_gb_s": dram_read_bandwidth() / 1e9}
    paths = {"torch": torch_path, **({"native": native} if kernel is not None else {})}
    want = fp32([1, 2])
    for name, fn in paths.items():
        report[f"{name}_error"] = ((fn([1, 2]) - want).abs().max() / want.abs().max()).item()
        for count in (1, 2, 4):
            fn(list(range(count)))
            t0 = time.perf_counter()
            for call in range(CALLS):
                fn([(call * count + j) % EXPERTS for j in range(count)])
            seconds = time.perf_counter() - t0
            report[f"{name}_{count}_gb_s"] = CALLS * count * per_expert / seconds / 1e9
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}))


if __name__ == "__main__":
    main()
