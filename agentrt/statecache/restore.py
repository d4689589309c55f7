"""The state cache's read side (a mixin of `StateCache`): a checkpoint found, verified, read
from the RAM tier or LMDB, decompressed on worker threads into host buffers laid out like
the caches, then uploaded; corrupt records are deleted and the next candidate tried."""

from __future__ import annotations

import functools
import queue
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from agentrt.models.kv import KVCache, LinearCache
from agentrt.statecache.blobs import BlobLoad
from agentrt.statecache.codec import (
    CorruptPayload,
    Record,
    row_bytes,
    unpack_scatter,
)
from agentrt.statecache.keys import BLOCK, FORMAT_VERSION, PrefixKeys
from agentrt.statecache.staging import PinnedRing


@dataclass
class Hit:
    """A restored checkpoint: the tokens it holds, its boundary kind, where it came from."""

    pos: int
    kind: str
    source: str  # "ram" | "lmdb"; with "+live_kv" when the KV already in the caches was kept


# how many tokens before its prefix's end a checkpoint's state may be (the delta rule's chunk:
# `Engine.capture_grid`)
MAX_EARLY = 63

# longest a restore waits for the writer to store a checkpoint an earlier request queued (past
# that the request recomputes instead: a writer that far behind must not stall requests)
PENDING_WAIT_S = 1.0


def _raise_first(jobs: list[Future]) -> None:
    """Raise the first failure among finished `jobs`, and let go of them first: reachable from
    the raising frame, a future would tie the failure's traceback to itself, a cycle that keeps
    the workers' LMDB read transactions, and their reader slots, until a garbage collection
    (a run of corrupt payloads used up `max_readers` before one came)."""
    failure = next((e for e in map(Future.exception, jobs) if e is not None), None)
    jobs.clear()
    if failure is not None:
        try:
            raise failure
        finally:
            failure = None


class Restorer:
    """Lookup and restore of `StateCache` (its attributes: see `StateCache.__init__`)."""

    def restore_into(
        self,
        ids: Sequence[int],
        min_pos: int,
        kv_caches: Sequence[KVCache],
        linear: Sequence[LinearCache],
        kv_valid: int = 0,
        count_miss: bool = True,
    ) -> Hit | None:
        """Fill the caches with the longest verified checkpoint for a prefix of `ids` longer than
        `min_pos`. Returns None (caches untouched) when there is none, or when every candidate
        that was tried turned out corrupt (caches then hold garbage: the caller resets them).
        `count_miss=False`: the caller counts the miss (it may still reuse state it holds).

        `kv_valid`: the caches' KV already holds `ids[:kv_valid]` (the live sequence agrees with
        the prompt that far). KV can be cut back, linear-attention state cannot: a checkpoint
        within that range only needs its snapshot (conv / recurrent state), not its KV chunks."""
        keys = PrefixKeys(self.fp, ids)
        self.dirty = False
        candidates = self.candidates(ids, min_pos)
        if self._queued:  # the writer has work queued: hash the candidates only then
            self._await_queued([keys.key(pos) for pos, _ in candidates])
        for pos, kind in candidates:
            # once a failed candidate wrote into the caches, their KV is no longer the live one
            kv_ready = pos <= kv_valid and not self.dirty
            hit = self._restore(keys, pos, kind, kv_caches, linear, kv_ready, min_pos)
            if hit is not None:
                self.stats[f"hits_{hit.source}"] += 1
                self.stats["restored_tokens"] += hit.pos
                return hit
        if count_miss:
            self.stats["misses"] += 1
        return None

    def _restore(
        self,
        keys: PrefixKeys,
        pos: int,
        kind: str,
        kv_caches,
        linear,
        kv_ready: bool = False,
        min_pos: int = 0,
    ) -> Hit | None:
        """Load the checkpoint of the prefix of `pos` tokens (a record, or for attention-only
        models bare chunks at a block edge); None when absent, corrupt (corrupt records are
        deleted) or holding no more than `min_pos` tokens."""
        key = keys.key(pos)
        entry = self.ram.get(key)  # (kind, blob tensors, tokens held) from this process
        source = "ram" if entry is not None else "lmdb"
        try:
            record = self.store.get_record(key) if entry is None else None
        except CorruptPayload:  # an unreadable header: the record is dropped like a bad payload
            self.stats["corrupt_deleted"] += 1
            self.store.delete(key)
            return None
        if entry is not None:
            kind, pos = entry[0], entry[2]
        elif record is not None and self._valid(record, pos):
            kind, pos = record.kind, record.n_tokens
        elif record is None and self.block_edges and pos % BLOCK == 0:
            kind = "block"  # KV chunks alone hold the state of an attention-only model
        else:
            return None
        if pos <= min_pos:  # taken early (`save(at=...)`): no better than what the caller has
            return None
        kv_ready = kv_ready and kind != "block"
        chunk_keys = [] if kv_ready else [keys.chunk_key(c) for c in range(pos // BLOCK)]
        try:
            self._fill(key, pos, chunk_keys, entry, kv_caches, linear, kind != "block", kv_ready)
        except CorruptPayload:
            self.stats["corrupt_deleted"] += 1
            self.dirty = True
            self.ram.drop(key)
            self.store.delete(key)
            return None
        except KeyError:  # a payload vanished (evicted, possibly by another process)
            self.stats["payload_missing"] += 1
            return None
        if record is not None:
            self._touch(key)
        return Hit(pos, kind, source + ("+live_kv" if kv_ready else ""))

    def _await_queued(self, keys: list[bytes], timeout: float = PENDING_WAIT_S) -> None:
        """Wait (up to `timeout`) until no checkpoint among `keys` is still queued for writing:
        one captured by an earlier request must apply even when the writer has not reached it."""
        wanted = set(keys)
        with self._written:
            if not wanted & self._queued.keys():
                return
            self.stats["waited_for_writer"] += 1
            self._written.wait_for(lambda: not wanted & self._queued.keys(), timeout)

    def _touch(self, key: bytes) -> None:
        """Count a hit on the writer thread (a full queue drops the count, never blocks)."""
        try:
            self._queue.put_nowait(key)
        except queue.Full:
            self.stats["touch_dropped"] += 1

    def _valid(self, record: Record, pos: int) -> bool:
        """The record of the prefix of `pos` tokens is this model's, in this format, and holds
        the state after those tokens or after at most 63 fewer (`save(at=...)`). ("block" is
        never stored: it names bare KV chunks, which would restore without the record's blob.)"""
        return (
            record.fingerprint == self.fp
            and record.version == FORMAT_VERSION
            and pos - MAX_EARLY <= record.n_tokens <= pos
            and record.n_tokens > 0
            and record.kind != "block"
        )

    def _fill(
        self, key, pos, chunk_keys, entry, kv_caches, linear, needs_blob: bool, kv_ready: bool
    ) -> None:
        """Worker threads read what RAM lacks straight from LMDB's memory map, decompress it into
        host buffers laid out like the caches (the blob in parts, see `BlobLoad`), then one
        upload per tensor. A payload that vanished raises KeyError (caches then hold a partial
        state: `dirty`). With `kv_ready` (and no `chunk_keys`) the caches keep their KV."""
        ram_chunks = {ck: self.ram.get(ck) for ck in chunk_keys}
        blob = entry[1] if entry is not None else None
        load: BlobLoad | None = None
        with torch.inference_mode():
            if any(cache.capacity < pos for cache in kv_caches):
                self.dirty = True  # growing drops what the caches held
            for cache in kv_caches:
                cache.reserve(pos, pos if kv_ready else 0)
            try:
                if not chunk_keys:  # a prefix shorter than a chunk, or the live KV kept
                    if needs_blob:
                        if blob is None:
                            load = self._load_chunks(key, pos, [], {}, [], True)
                            blob = load.tensors(self.layout, pos)
                        self.dirty = True
                        self._fill_blob(kv_caches, linear, pos, blob, load)
                    return
                self._fill_chunks(
                    key, pos, chunk_keys, ram_chunks, blob, kv_caches, linear, needs_blob
                )
            finally:
                if load is not None:
                    load.release(self.device)

    def _fill_chunks(self, key, pos, chunk_keys, ram_chunks, blob, kv_caches, linear, needs_blob):
        full = len(chunk_keys) * BLOCK
        targets = [t[:, :full] for cache in kv_caches for t in (cache.k, cache.v)]
        staged, region = self._stage_for_upload(targets)
        if staged is targets:
            self.dirty = True  # chunks land straight in the caches
        load = None
        try:
            load_blob = needs_blob and blob is None
            load = self._load_chunks(key, pos, chunk_keys, ram_chunks, staged, load_blob)
            blob = blob if load is None else load.tensors(self.layout, pos)
            self.dirty = True
            self._upload(staged, targets, non_blocking=region is not None)
            if needs_blob:
                self._fill_blob(kv_caches, linear, pos, blob, load)
        finally:
            if region is not None:  # one wait for the KV and blob copies queued from the ring
                torch.cuda.current_stream(self.device).synchronize()
                self._ring.free(region)
            if load is not None:
                load.release(self.device)
        self.dirty = False

    def _load_chunks(self, key, pos, chunk_keys, ram_chunks, staged, load_blob: bool):
        """Chunks into `staged` on worker threads (what RAM lacks read straight from LMDB's map),
        and the record's blob parts beside them when `load_blob`; returns the `BlobLoad` (or
        None). Waits for every worker before returning or raising, so none writes afterwards."""

        # each chunk decompresses straight into its rows of the staged buffers: per attention
        # layer k then v, per kv head BLOCK tokens (the chunk payload's own order)
        heads = [[row_bytes(t[h]) for h in range(t.shape[0])] for t in staged]
        span = BLOCK * self.layout.kv_row_bytes()

        def fill(index: int, ck: bytes) -> None:
            tensors = ram_chunks[ck]
            if tensors is not None:
                self._fill_chunk(staged, index, tensors)
                return
            places = [row[index * span : (index + 1) * span] for rows in heads for row in rows]
            if self.store.read_chunk(ck, functools.partial(unpack_scatter, outs=places)) is None:
                raise KeyError("payload missing")

        load, jobs = None, []
        try:
            with self.store.parallel_reads():
                if load_blob:
                    raw = self.layout.blob_bytes(pos % BLOCK)
                    load = BlobLoad(self.store, self._ring, key, raw)
                tasks = load.jobs() if load is not None else []
                tasks += [functools.partial(fill, i, ck) for i, ck in enumerate(chunk_keys)]
                try:
                    for task in tasks:
                        jobs.append(self._pool.submit(task))
                finally:
                    wait(jobs)  # none may write into the buffers after this returns
            _raise_first(jobs)
        except BaseException:
            if load is not None:
                load.release(self.device)
            raise
        return load

    def _stage_for_upload(self, targets: list[torch.Tensor]):
        """Host buffers to assemble device-bound KV in: the targets themselves on CPU, else a
        pinned ring region when free, else ordinary memory."""
        if self.device.type != "cuda":
            return targets, None
        region = self._ring.alloc(PinnedRing.span(targets)) if self._ring is not None else None
        if region is not None:
            return self._ring.views(region, targets), region
        return [torch.empty(t.shape, dtype=t.dtype) for t in targets], None

    def _upload(
        self, staged: list[torch.Tensor], targets: list[torch.Tensor], non_blocking
    ) -> None:
        """Staged KV into the caches (asynchronous from a pinned region: the caller waits for
        the copies before freeing it)."""
        if staged is targets:
            return
        for host, dev in zip(staged, targets, strict=True):
            dev.copy_(host, non_blocking=non_blocking)

    def _fill_chunk(self, staged: list[torch.Tensor], index: int, tensors) -> None:
        """Copy one chunk (all layers' k and v, `[Hkv, BLOCK, D]` each) into the staged buffers."""
        lo = index * BLOCK
        with torch.inference_mode():
            for dest, src in zip(staged, tensors, strict=True):
                dest[:, lo : lo + BLOCK].copy_(src)

    def _fill_blob(self, kv_caches, linear, pos: int, blob: list[torch.Tensor], load) -> None:
        """Blob tensors into the caches; asynchronous copies when `load` holds them pinned (its
        `release` waits for them)."""
        non_blocking = load is not None and load.pinned
        tail = pos % BLOCK
        for i, cache in enumerate(kv_caches):
            cache.k[:, pos - tail : pos].copy_(blob[2 * i], non_blocking=non_blocking)
            cache.v[:, pos - tail : pos].copy_(blob[2 * i + 1], non_blocking=non_blocking)
        states = blob[2 * len(kv_caches) :]
        for j, cache in enumerate(linear):
            cache.conv.copy_(states[j], non_blocking=non_blocking)
            cache.recurrent.copy_(states[len(linear) + j], non_blocking=non_blocking)
            cache.captured.clear()
