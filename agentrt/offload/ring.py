"""The staging ring of offloaded prefill: a few device buffers of `part_size` experts each, used
in turn. A `Fill` (one part of one layer: its experts in buffer order, the positions copied from
the pinned host store) is queued, then issued into the next buffer on the copy stream once that
buffer's last reader has been queued (the copy stream waits for its event), then taken by the
compute (the current stream waits for the fill's copies), then released. Fills are taken in the
order they were queued, so fills for the next layer can be queued ahead and their copies run
while the current layer computes. A routed fill's experts are scattered in the host store (one
copy each): with `copies.CudaCalls` they are queued straight through the CUDA runtime (about
5 us of host time each, against about 30 through torch). Knows nothing of routing or plans."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from agentrt.offload.copies import DEVICE_TO_DEVICE, CudaCalls
from agentrt.offload.store import ExpertStore

PARTS_PER_LAYER = 8  # a staging part holds this share of a layer's experts
STAGING_PARTS = 4  # buffers in the ring, by default (half a layer of experts)


def part_size(num_experts: int) -> int:
    return max(1, -(-num_experts // PARTS_PER_LAYER))


def staging_parts(num_experts: int, staging_bytes: int | None, expert_bytes: int) -> int:
    """Buffers the ring gets from `staging_bytes` (default: `STAGING_PARTS`), at least two."""
    part = part_size(num_experts)
    if staging_bytes is None:
        return STAGING_PARTS
    if staging_bytes == 0:  # (every layer resident or on the CPU: the baselines)
        return 0
    return max(2, staging_bytes // (part * expert_bytes))


def staging_bytes_for(num_experts: int, expert_bytes: int, staging_bytes: int | None) -> int:
    """Device bytes the ring takes."""
    parts = staging_parts(num_experts, staging_bytes, expert_bytes)
    return parts * part_size(num_experts) * expert_bytes


@dataclass(eq=False)
class Fill:
    """One part of one layer: its experts in buffer order, the positions copied from the host
    (the others are cache hits, copied from their slots when the part runs)."""

    layer: int
    experts: list[int]
    copies: list[int]
    kind: str = "routed"  # its plan's (stream, predicted and reserve ones are queued ahead)
    buffer: int = -1
    ready: object = None  # event on the copy stream after the copies (None: done)


class StagingRing:
    """The buffers, their last readers' events, and the fills queued and issued."""

    def __init__(
        self,
        store: ExpertStore,
        staging_bytes: int | None,
        device: torch.device,
        copy_stream: torch.cuda.Stream | None,
        calls: CudaCalls | None = None,
    ) -> None:
        self.store, self.device, self.copy_stream = store, device, copy_stream
        self.calls = calls if copy_stream is not None else None  # raw copies (None: torch's)
        self.part = part_size(store.num_experts)
        num = staging_parts(store.num_experts, staging_bytes, store.expert_bytes)
        self.buffers = [
            torch.zeros(self.part, store.expert_numel, dtype=store.storage_dtype, device=device)
            for _ in range(num)
        ]
        self.freed: list[object] = [None] * num  # event after the last reader of each buffer
        self.queue: deque[Fill] = deque()  # fills not yet issued, in order
        self.issued: deque[Fill] = deque()  # issued, not yet taken
        self.next_buffer = 0

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def fills(self, layer: int, experts: list[int], copied: set[int], kind: str) -> list[Fill]:
        """`experts` in parts, those in `copied` copied from the host store (the others are
        cache hits)."""
        out = []
        for i in range(0, len(experts), self.part):
            chunk = experts[i : i + self.part]
            copies = [p for p, e in enumerate(chunk) if e in copied]
            out.append(Fill(layer, chunk, copies, kind))
        return out

    def drop(self) -> None:
        """Forget queued fills (copies already issued may still run: the copy stream orders
        them before any later fill of the same buffer)."""
        self.queue.clear()
        self.issued.clear()

    def ahead_for(self, layer: int) -> list[Fill]:
        """The fills queued for `layer` (fills left for another layer, by a pass that stopped
        part-way, are dropped)."""
        pending = [*self.issued, *self.queue]
        if pending and pending[0].layer != layer:
            self.drop()
            return []
        return [f for f in pending if f.layer == layer]

    def issue_ready(self) -> None:
        """Issue queued fills while the ring has a buffer whose last reader has been queued."""
        if self.queue and not self.buffers:
            raise RuntimeError("offloaded prefill needs a staging area (staging_bytes is 0)")
        while self.queue and len(self.issued) < len(self.buffers):
            fill = self.queue.popleft()
            self._issue(fill)
            self.issued.append(fill)

    def _issue(self, fill: Fill) -> None:
        """Copy the fill's missing experts into the next buffer of the ring (runs of
        consecutive experts as one copy), on the copy stream after the buffer's last reader."""
        fill.buffer = self.next_buffer
        self.next_buffer = (self.next_buffer + 1) % len(self.buffers)
        buf, source = self.buffers[fill.buffer], self.store.flat[fill.layer]
        runs = _runs([(p, fill.experts[p]) for p in fill.copies])
        if self.copy_stream is None:
            for pos, expert, n in runs:
                buf[pos : pos + n].copy_(source[expert : expert + n])
            return
        if self.freed[fill.buffer] is not None:
            self.copy_stream.wait_event(self.freed[fill.buffer])
        if self.calls is not None:
            row, handle = source.stride(0) * source.element_size(), self.copy_stream.cuda_stream
            target, origin = buf.data_ptr(), source.data_ptr()
            for pos, expert, n in runs:
                self.calls.copy_bytes(target + pos * row, origin + expert * row, n * row, handle)
        else:
            with torch.cuda.stream(self.copy_stream):
                for pos, expert, n in runs:
                    buf[pos : pos + n].copy_(source[expert : expert + n], non_blocking=True)
        fill.ready = torch.cuda.Event()
        fill.ready.record(self.copy_stream)

    def take(self, fill: Fill) -> torch.Tensor:
        """The fill's buffer, once the current stream waits for its copies."""
        while not any(f is fill for f in self.issued):  # (the ring was full when queued)
            self.issue_ready()
        if fill.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(fill.ready)
        return self.buffers[fill.buffer]

    def copy_hits(self, buf: torch.Tensor, cache, hits: list[tuple[int, int]], stream: int) -> None:
        """Cache hits (buffer position, slot of `cache`) into a part's buffer, on the current
        stream (`stream`: its handle, for the raw copies)."""
        if self.calls is None:
            for pos, slot in hits:
                buf[pos].copy_(cache.slot_rows[slot])
            return
        slots = cache.slots
        row = slots.stride(0) * slots.element_size()
        assert row == buf.stride(0) * buf.element_size()
        target, origin = buf.data_ptr(), slots.data_ptr()
        for pos, slot in hits:
            self.calls.copy_bytes(
                target + pos * row, origin + slot * row, row, stream, DEVICE_TO_DEVICE
            )

    def release(self, fill: Fill) -> None:
        """The fill's readers are queued: its buffer may be filled again after them."""
        assert self.issued[0] is fill  # parts run in the order they were queued
        self.issued.popleft()
        if self.copy_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.freed[fill.buffer] = event
        self.issue_ready()


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(position, expert) pairs -> (position, expert, length) runs where both advance by one."""
    runs: list[list[int]] = []
    for pos, expert in pairs:
        if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == expert:
            runs[-1][2] += 1
        else:
            runs.append([pos, expert, 1])
    return [tuple(r) for r in runs]
