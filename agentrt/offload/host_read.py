"""A Triton kernel that copies words from pinned host memory to the device with the GPU's own
cores (loads through the pinned buffer's device-visible address), not the copy engines; imported
only where Triton is."""

import triton
import triton.language as tl

BLOCK = 1024  # words per program


# (no specialisation: one compiled variant for every alignment and length, loaded at start-up,
# never inside a CUDA-graph capture)
@triton.jit(do_not_specialize=["src_ptr", "dst_ptr", "n"])
def copy_words(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """`dst[:n] = src[:n]` (32-bit words)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=mask), mask=mask)


def launch(src, dst, words: int) -> None:
    copy_words[(triton.cdiv(words, BLOCK),)](src, dst, words, BLOCK=BLOCK, num_warps=4)
