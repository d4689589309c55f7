"""Wall time per call (host and GPU, synchronised) of fla's chunked and fused recurrent
gated-delta-rule kernels at Qwen3.5-35B-A3B's linear-attention shapes (16 key heads, 32 value
heads, head dims 128, bf16 inputs, fp32 state) for segment lengths T: where the recurrent kernel
stops paying off (`kernels.FLA_RECURRENT_MAX`). Prints one JSON line per T.

    python benchmarks/fla_crossover.py [T ...]     (default 1 8 16 32 64 128 256 512 1024 2048)
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_step import timed  # noqa: E402  (ms per call, 20 calls after one)

from agentrt.models.kernels import fla_ops  # noqa: E402


def main() -> None:
    lengths = [int(a) for a in sys.argv[1:]] or [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    chunk, recurrent = fla_ops()
    for seq in lengths:
        q, k = (torch.randn(1, seq, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in "qk")
        v = torch.randn(1, seq, 32, 128, device="cuda", dtype=torch.bfloat16)
        g = -torch.rand(1, seq, 32, device="cuda")
        beta = torch.rand(1, seq, 32, device="cuda", dtype=torch.bfloat16)
        h0 = torch.zeros(1, 32, 128, 128, device="cuda")
        row = {"T": seq}
        for name, fn in (("chunk_ms", chunk), ("recurrent_ms", recurrent)):
            call = functools.partial(
                fn, q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            row[name] = round(timed(call), 4)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
