"""Reading a record blob (tail KV, conv and recurrent states) for a restore: its parts are
decompressed on the restore workers at once, each straight into its place in one host buffer,
which is a pinned staging region when the ring has room (the upload to the device is then one
asynchronous copy per tensor) and ordinary memory otherwise."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from agentrt.statecache.codec import (
    CorruptPayload,
    Layout,
    blob_parts,
    blob_tensors,
    row_bytes,
    unpack_into,
)
from agentrt.statecache.staging import PinnedRing
from agentrt.statecache.store import Store

T = TypeVar("T")


Reader = Callable[[Callable[[memoryview], T]], T | None]  # decode(stored blob), None: absent


def lmdb_reader(store: Store, key: bytes) -> Reader:
    """Reads of the blob of `key` from LMDB (inside `Store.parallel_reads`)."""
    return functools.partial(store.read_chunk, key, blob=True)


def ram_reader(payload: memoryview) -> Reader:
    """Reads of a blob the RAM tier holds."""
    return lambda decode: decode(memoryview(payload))


class BlobLoad:
    """One blob being read. Create it inside `Store.parallel_reads`, run `jobs()` on workers
    (inside the same hold), then `tensors()`; `release()` once the uploads from it are queued."""

    def __init__(self, read: Reader, ring: PinnedRing | None, raw: int) -> None:
        """`read`: where the stored blob is (`lmdb_reader`, `ram_reader`); `raw`: its raw size
        by the model's layout; a part table that disagrees is `CorruptPayload` before anything
        is allocated."""
        table = read(lambda view: (blob_parts(view), len(view)))
        if table is None:
            raise KeyError("payload missing")
        self.read, self.ring = read, ring
        self.parts, self.stored_len = table
        if sum(size for _, _, size in self.parts) != raw:
            raise CorruptPayload("blob size does not match the model's state layout")
        self.region = ring.alloc(raw) if ring is not None else None
        if self.region is not None:
            self.buffer = ring.buffer[self.region[0] : self.region[0] + raw]
        else:
            self.buffer = torch.empty(raw, dtype=torch.uint8)

    @property
    def pinned(self) -> bool:
        return self.region is not None

    def jobs(self) -> list[Callable[[], None]]:
        """One job per part: read it from the map and decompress it into its place."""
        dest, at, out = row_bytes(self.buffer), 0, []
        for start, length, size in self.parts:
            out.append(functools.partial(self._part, start, length, dest[at : at + size]))
            at += size
        return out

    def _part(self, start: int, length: int, place: memoryview) -> None:
        def decode(view) -> bool:
            if len(view) != self.stored_len:  # replaced since the part table was read
                raise KeyError("payload changed")
            unpack_into(memoryview(view)[start : start + length], place)
            return True

        if self.read(decode) is None:
            raise KeyError("payload missing")  # deleted (evicted) since the part table was read

    def tensors(self, layout: Layout, pos: int) -> list[torch.Tensor]:
        """Views of the buffer: tail KV (k, v per chunked attention layer), the window's KV (per
        windowed one), conv states, then recurrent states."""
        tail_kv, window, conv, rec = blob_tensors(self.buffer, layout, pos)
        return [t for pair in tail_kv + window for t in pair] + conv + rec

    def release(self, device: torch.device) -> None:
        """Give the pinned region back, after the copies queued from it are done (a wait that
        costs nothing when the caller has just waited for them)."""
        if self.region is not None:
            torch.cuda.current_stream(device).synchronize()
            self.ring.free(self.region)
            self.region = None
