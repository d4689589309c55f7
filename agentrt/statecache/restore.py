"""The state cache's read side (a mixin of `StateCache`): a checkpoint found, verified, read
from the RAM tier or LMDB, decompressed on worker threads into host buffers laid out like
the caches, then uploaded; corrupt records are deleted and the next candidate tried."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from agentrt.models.kv import KVCache, LinearCache
from agentrt.statecache.blobs import BlobLoad, lmdb_reader, ram_reader
from agentrt.statecache.codec import (
    CorruptPayload,
    Record,
    row_bytes,
    unpack_scatter,
)
from agentrt.statecache.keys import BLOCK, FORMAT_VERSION, PrefixKeys


@dataclass
class Hit:
    """A restored checkpoint: the tokens it holds, its boundary kind, where it came from."""

    pos: int
    kind: str
    source: str  # "ram" | "lmdb"; with "+live_kv" when the KV already in the caches was kept


# how many tokens before its prefix's end a checkpoint's state may be (the delta rule's chunk:
# `Engine.capture_grid`)
MAX_EARLY = 63

# chunks go to the device in groups of about this many bytes (through one scratch buffer there)
UPLOAD_GROUP_BYTES = 32 << 20

# longest a restore waits for the writer to store a checkpoint an earlier request queued (past
# that the request recomputes instead: a writer that far behind must not stall requests)
PENDING_WAIT_S = 1.0

# records whose hits may wait for the writer to store them (`_touch`)
TOUCH_LIMIT = 10_000


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
            self._await_queued([keys.key(pos) for pos, _ in candidates], min_pos)
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
        if record is not None or entry is not None:
            self._touch(key)
        return Hit(pos, kind, source + ("+live_kv" if kv_ready else ""))

    def _await_queued(
        self, keys: list[bytes], min_pos: int = 0, timeout: float = PENDING_WAIT_S
    ) -> None:
        """Wait (up to `timeout`) until no checkpoint among `keys` that holds more than `min_pos`
        tokens is still queued for writing: one captured by an earlier request must apply even
        when the writer has not reached it. One whose state was taken at or before `min_pos`
        (`save(at=...)`: the turn's end, captured on the chunk grid before it, which the device
        tier holds already) would not apply, so no restore waits for it (a held writer's whole
        work, otherwise, on the next turn's path)."""
        wanted = set(keys)

        def useful_queued() -> bool:
            return any(max(self._queued[k]) > min_pos for k in wanted & self._queued.keys())

        with self._written:
            if not useful_queued():
                return
            self.stats["waited_for_writer"] += 1
        held = not self._resume.is_set()  # (for this request's prefill: it needs them first)
        self.resume_writes()
        with self._written:
            self._written.wait_for(lambda: not useful_queued(), timeout)
        if held:
            self.hold_writes()

    def _touch(self, key: bytes) -> None:
        """Count a hit on a stored record (from either tier: the eviction score ranks by hits).
        The writer thread stores the counts gathered in one transaction once it idles: one per
        restore would be an fsync'd write beside every request. Beyond `TOUCH_LIMIT` records
        waiting, new ones are dropped (counted)."""
        with self._lock:
            if len(self._touches) < TOUCH_LIMIT or key in self._touches:
                self._touches[key] += 1
            else:
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
        """Worker threads copy (or decompress) each KV chunk, from the RAM tier or straight
        from LMDB's memory map, into a host staging buffer in the payloads' own order, while
        this thread uploads the finished ones a group at a time and lays them out in the
        caches on the device (`_upload_group`); the record's blob is read beside them. A
        payload that vanished raises KeyError (caches then hold a partial state: `dirty`).
        With `kv_ready` (and no `chunk_keys`) the caches keep their KV."""
        ram_chunks = {ck: self.ram.get(ck) for ck in chunk_keys}
        read = ram_reader(entry[1]) if entry is not None else lmdb_reader(self.store, key)
        with torch.inference_mode():
            if any(cache.capacity < pos for cache in kv_caches):
                self.dirty = True  # growing drops what the caches held
            for cache in kv_caches:
                cache.reserve(pos, pos if kv_ready else 0)
            span = BLOCK * self.layout.kv_token_bytes()
            staged, region = self._staging(len(chunk_keys) * span)
            load = None
            try:
                load = self._load(
                    pos, chunk_keys, ram_chunks, staged, span, read, needs_blob, kv_caches
                )
                if needs_blob:
                    self.dirty = True
                    self._fill_blob(kv_caches, linear, pos, load.tensors(self.layout, pos), load)
            finally:
                if region is not None:  # one wait for the copies queued from the ring
                    torch.cuda.current_stream(self.device).synchronize()
                    self._ring.free(region)
                if load is not None:
                    load.release(self.device)
        self.dirty = False

    def _load(self, pos, chunk_keys, ram_chunks, staged, span, read, needs_blob, kv_caches):
        """Chunks into `staged` on worker threads, uploaded into the caches group by group as
        they finish, and the record's blob parts beside them when `needs_blob`; returns the
        `BlobLoad` (or None). Waits for every worker before returning or raising, so none
        writes afterwards."""

        def fill(index: int, ck: bytes) -> None:
            place = [row_bytes(staged[index * span : (index + 1) * span])]
            payload = ram_chunks[ck]
            if payload is not None:  # (the RAM tier's bytes never left this process)
                unpack_scatter(payload, place, verify=False)
            elif self.store.read_chunk(ck, functools.partial(unpack_scatter, outs=place)) is None:
                raise KeyError("payload missing")

        load, jobs = None, []
        try:
            with self.store.parallel_reads():
                if needs_blob:
                    load = BlobLoad(read, self._ring, self.layout.blob_bytes(pos))
                # (one list of futures, which `_raise_first` clears: see there)
                jobs = [self._pool.submit(fill, i, ck) for i, ck in enumerate(chunk_keys)]
                jobs += [self._pool.submit(job) for job in (load.jobs() if load else [])]
                try:
                    self._upload_chunks(jobs[: len(chunk_keys)], staged, span, kv_caches)
                finally:
                    wait(jobs)  # none may write into the buffers after this returns
            _raise_first(jobs)
        except BaseException:
            if load is not None:
                load.release(self.device)
            raise
        return load

    def _staging(self, num_bytes: int) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """A host buffer to assemble chunks in: a pinned ring region when free (on CUDA), else
        ordinary memory."""
        region = None
        if self._ring is not None and num_bytes:
            region = self._ring.alloc(num_bytes)
        if region is not None:
            return self._ring.buffer[region[0] : region[0] + num_bytes], region
        return torch.empty(num_bytes, dtype=torch.uint8), None

    def _upload_chunks(self, jobs: list[Future], staged, span: int, kv_caches) -> None:
        """As the chunk jobs finish in order, each group of `UPLOAD_GROUP_BYTES` goes to the
        device in one copy and into the caches (stops at the first failed job)."""
        if not jobs:
            return
        group = max(1, UPLOAD_GROUP_BYTES // span)
        scratch = None
        if self.device.type == "cuda":
            scratch = torch.empty(
                min(group, len(jobs)) * span, dtype=torch.uint8, device=self.device
            )
        for lo in range(0, len(jobs), group):
            hi = min(lo + group, len(jobs))
            wait(jobs[lo:hi])
            if any(job.exception() is not None for job in jobs[lo:hi]):
                return  # (the caller raises it)
            self.dirty = True  # chunks land in the caches from here on
            self._upload_group(staged[lo * span : hi * span], lo, hi - lo, scratch, kv_caches)

    def _upload_group(self, host: torch.Tensor, first: int, count: int, scratch, kv_caches):
        """`count` chunks from chunk `first` (payload order: per attention layer k then v, per
        kv head BLOCK tokens) into the caches: one copy to the device, then one call that lays
        each tensor's rows out in the cache (few Python-level calls: this thread competes with
        the read threads for the interpreter)."""
        data = host
        if scratch is not None:
            data = scratch[: host.numel()]
            data.copy_(host, non_blocking=host.is_pinned())
        layout = self.layout
        shape = (count, len(layout.chunked) * 2, layout.kv_heads, BLOCK, layout.head_dim)
        chunks = data.view(kv_caches[0].k.dtype).view(shape).transpose(0, 2).unbind(1)
        lo, hi = first * BLOCK, (first + count) * BLOCK
        rows = (layout.kv_heads, count, BLOCK, layout.head_dim)
        caches = [kv_caches[i] for i in layout.chunked]
        targets = [t[:, lo:hi].view(rows) for cache in caches for t in (cache.k, cache.v)]
        torch._foreach_copy_(targets, list(chunks))

    def _fill_blob(self, kv_caches, linear, pos: int, blob: list[torch.Tensor], load) -> None:
        """Blob tensors into the caches; asynchronous copies when `load` holds them pinned (its
        `release` waits for them)."""
        non_blocking, layout = load.pinned, self.layout
        spans = {i: pos % BLOCK for i in layout.chunked}  # (past the last whole block)
        spans.update((i, layout.window_tokens(pos)) for i in layout.windowed)
        for i, (index, span) in enumerate(spans.items()):  # (the blob's order)
            cache = kv_caches[index]
            cache.k[:, pos - span : pos].copy_(blob[2 * i], non_blocking=non_blocking)
            cache.v[:, pos - span : pos].copy_(blob[2 * i + 1], non_blocking=non_blocking)
        states = blob[2 * len(kv_caches) :]
        for j, cache in enumerate(linear):
            cache.conv.copy_(states[j], non_blocking=non_blocking)
            cache.recurrent.copy_(states[len(linear) + j], non_blocking=non_blocking)
            cache.captured.clear()
