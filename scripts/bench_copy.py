"""Ways to bring k missing experts (qwen3.5-35b-a3b: 6.29 MB each, bf16) from the pinned host store
into their GPU cache slots, on the GPU machine: one `copy_` per expert on a side stream (what
`OffloadedExperts._copy_in` does: a DMA copy each, ~15 us of host time per call), against one
Triton kernel launch that reads all k experts straight from pinned host memory (zero-copy over
PCIe: pinned memory is mapped into the GPU's address space under unified addressing). Prints JSON
lines: host time to issue, time until done, GB/s, per k; and checks the kernel copied right.

    python scripts/bench_copy.py           (on a CUDA machine with triton)
    TRITON_INTERPRET=1 python scripts/bench_copy.py --check   (CPU: the kernel's indexing only)
"""

from __future__ import annotations

import json
import sys
import time

import torch
import triton
import triton.language as tl

EXPERT_NUMEL = 3 * 512 * 2048  # gate_up [2I, H] + down [H, I] of one expert


@triton.jit
def _gather_rows(src, dst, src_rows, dst_rows, numel, BLOCK: tl.constexpr):
    """dst[dst_rows[i]] = src[src_rows[i]] for rows of `numel` elements; grid (k, blocks)."""
    i, b = tl.program_id(0), tl.program_id(1)
    s = tl.load(src_rows + i).to(tl.int64)
    d = tl.load(dst_rows + i).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(dst + d * numel + offs, tl.load(src + s * numel + offs, mask=mask), mask=mask)


class _Pointer:
    """A tensor's memory passed to Triton as a plain pointer (pinned host memory is readable
    from the GPU at the same address)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def gather(src: torch.Tensor, dst: torch.Tensor, src_rows, dst_rows, block: int = 8192) -> None:
    numel = src.shape[1]
    grid = (src_rows.numel(), triton.cdiv(numel, block))
    source = _Pointer(src) if dst.is_cuda and not src.is_cuda else src  # CPU interpreter: as is
    _gather_rows[grid](source, dst, src_rows, dst_rows, numel, BLOCK=block)


def check() -> None:
    """The kernel's indexing on small rows (CPU interpreter or GPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.arange(6 * 1000, dtype=torch.float32).reshape(6, 1000)
    src = src.pin_memory() if dev == "cuda" else src
    dst = torch.zeros(4, 1000, device=dev)
    rows_s = torch.tensor([5, 0, 3], device=dev)
    rows_d = torch.tensor([2, 0, 1], device=dev)
    gather(src, dst, rows_s, rows_d, block=256)
    want = torch.zeros(4, 1000)
    want[[2, 0, 1]] = src[[5, 0, 3]].cpu()
    assert torch.equal(dst.cpu(), want), "gather kernel copied wrong rows"
    print(json.dumps({"check": "ok", "device": dev}))


def bench() -> None:
    experts, slots = 256, 64
    host = torch.randn(experts, EXPERT_NUMEL, dtype=torch.bfloat16).pin_memory()
    dev = torch.zeros(slots, EXPERT_NUMEL, dtype=torch.bfloat16, device="cuda")
    rows = list(dev.unbind(0))
    stream = torch.cuda.Stream()
    nbytes = EXPERT_NUMEL * 2
    for k in (1, 2, 5, 8):
        for name in ("copy_", "triton"):
            issue, total = [], []
            for rep in range(12):
                src = [(rep * 7 + 13 * j) % experts for j in range(k)]
                dst = [(rep * 3 + 5 * j) % slots for j in range(k)]
                src_t = torch.tensor(src, device="cuda")
                dst_t = torch.tensor(dst, device="cuda")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    if name == "copy_":
                        for s, d in zip(src, dst, strict=True):
                            rows[d].copy_(host[s], non_blocking=True)
                    else:
                        gather(host, dev, src_t, dst_t)
                t1 = time.perf_counter()
                stream.synchronize()
                t2 = time.perf_counter()
                if rep >= 2:  # the first ones compile / warm up
                    issue.append(t1 - t0)
                    total.append(t2 - t0)
                assert torch.equal(dev[dst[-1]].cpu(), host[src[-1]]), name
            med = sorted(total)[len(total) // 2]
            row = {"experts": k, "method": name, "issue_us": round(1e6 * min(issue), 1)}
            row |= {"done_ms": round(1e3 * med, 3), "gb_s": round(k * nbytes / med / 1e9, 1)}
            print(json.dumps(row))


if __name__ == "__main__":
    check()
    if "--check" not in sys.argv:
        bench()
