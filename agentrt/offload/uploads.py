"""The small host->device transfers of offloaded experts, kept out of the copy engines' queue: a
prefill layer's index tables (the pairs' sort positions, each part's grouped-GEMM offsets, rows
per expert, expert ids and MXFP4 tiles) and its CPU experts' outputs, and in captured decode a
layer's slots, weights and CPU experts' sum (queued behind the next layer's prefetches else).

A `cudaMemcpyAsync` from pinned memory runs on a copy engine, and the engines run host->device
copies in the order they were queued, whatever their stream: a table of a few hundred bytes
queued after the next parts' expert copies (tens of MB each) waits for them, and the compute
that needs it waits too (an H100's timeline of a gpt-oss-120b chunk: copies and compute busy
together a quarter of the time, the compute idle behind each part's copies). Here the GPU's
cores read the pinned buffer instead (`host_read`), so the transfer runs when the compute
stream reaches it. Where that cannot run (no Triton, or a first launch fails) the copy engines
are used, as before; `AGENTRT_HOST_READ=0` asks for them (to compare the two).

Owns: the pinned sources until the kernels reading them have run; the layer's tables.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import accumulate

import torch

from agentrt.env import switched_off
from agentrt.offload.mxfp4_rows import tile_table
from agentrt.offload.ring import Fill


class Uploads:
    """Host->device transfers through the GPU's cores (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.direct = self.on_cuda and not switched_off("HOST_READ") and _host_read() is not None
        self._held: deque[list] = deque()  # [event after the read, its pinned source]
        if self.direct:  # (compiled and loaded now: a first launch may not run in a capture)
            probe = torch.arange(4, dtype=torch.int32, pin_memory=True)
            if not torch.equal(self.from_host(probe, hold=False).cpu(), probe):
                self.direct = False
                _warn(RuntimeError("a test transfer read wrong values"))

    def tables(self, *lists: list[int]) -> list[torch.Tensor]:
        """`lists` as int64 tensors on the device, from one transfer (each starts 16-byte
        aligned, so the kernels reading them compile one variant whatever the layout)."""
        flat: list[int] = []
        starts = []
        for values in lists:
            starts.append(len(flat))
            flat += values
            flat += [0] * (len(flat) % 2)
        host = torch.tensor(flat, dtype=torch.int64, pin_memory=self.on_cuda)
        dev = self.from_host(host) if self.on_cuda else host
        return [
            dev[start : start + len(values)] for start, values in zip(starts, lists, strict=True)
        ]

    def from_host(
        self, src: torch.Tensor, out: torch.Tensor | None = None, hold: bool = True
    ) -> torch.Tensor:
        """A pinned, contiguous `src` into `out` (default: a new device tensor), queued on the
        current stream (`hold`: keep `src` until the read has run; False for buffers that live
        as long as the engine, as inside a CUDA-graph capture, where no event may be queried)."""
        if out is None:
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        nbytes = src.numel() * src.element_size()
        readable = src.is_pinned() and src.is_contiguous() and out.is_contiguous()
        if not (
            self.direct and nbytes and readable and nbytes % 4 == 0 and self._read(src, out, hold)
        ):
            out.copy_(src, non_blocking=True)
        return out

    def _read(self, src: torch.Tensor, out: torch.Tensor, hold: bool) -> bool:
        """The kernel's read of `src` into `out`; False where it could not be queued (then the
        copy engines are used from now on)."""
        entry: list = [None, src]
        if hold:  # (its memory is read until the kernel has run: held before the launch)
            self._held.append(entry)
        try:
            with torch.cuda.device(self.device):  # (Triton launches on the current device)
                words = src.numel() * src.element_size() // 4
                _host_read().launch(
                    src.view(-1).view(torch.int32), out.view(-1).view(torch.int32), words
                )
        except Exception as exc:  # (a Triton or driver that cannot read pinned memory)
            self.direct = False
            _warn(exc)
            return False
        finally:
            if hold:
                entry[0] = torch.cuda.Event()
                entry[0].record(torch.cuda.current_stream(self.device))
        while self._held and self._held[0][0] is not None and self._held[0][0].query():
            self._held.popleft()
        return True


@dataclass(frozen=True)
class PartTables:
    """One part's tables on the device: its grouped-GEMM offsets (cumulative rows, int32), rows
    per expert, expert ids (its biases), and MXFP4 tiles `[3, n]` (packed stores; else None)."""

    offsets: torch.Tensor
    counts: torch.Tensor
    experts: torch.Tensor
    tiles: torch.Tensor | None


def layer_tables(
    uploads: Uploads,
    position: list[int],
    parts: list[Fill],
    counts: list[int],
    block_m: int | None,
) -> tuple[torch.Tensor, list[PartTables]]:
    """The layer's sort positions (per expert) and each part's tables, from one transfer
    (`block_m`: the MXFP4 grouped kernel's tokens per tile; None: no tiles)."""
    lists: list[list[int]] = [position]
    for fill in parts:
        rows = [counts[e] for e in fill.experts]
        offsets = list(accumulate(rows))
        tiles = tile_table(list(range(len(rows))), rows, block_m) if block_m else []
        lists += [offsets, rows, list(fill.experts), tiles]
    pos, *rest = uploads.tables(*lists)
    out = []
    for i in range(len(parts)):
        offsets, rows, experts, tiles = rest[4 * i : 4 * i + 4]
        grid = tiles.view(3, -1) if block_m else None
        out.append(PartTables(offsets.to(torch.int32), rows, experts, grid))
    return pos, out


_KERNEL: list = []


def _host_read():
    """The `host_read` module, or None without Triton."""
    if not _KERNEL:
        try:
            from agentrt.offload import host_read
        except Exception:  # (no Triton: a CPU-only torch)
            host_read = None
        _KERNEL.append(host_read)
    return _KERNEL[0]


def _warn(exc: Exception) -> None:
    import sys

    print(
        f"agentrt: small host->device transfers of offloaded experts go through the copy engines "
        f"(the GPU cannot read pinned memory here: {str(exc).splitlines()[0][:200]})",
        file=sys.stderr,
    )
