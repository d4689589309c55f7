"""`StateCache`: capture admission, the background writer, the RAM tier, lookup and restore.

Saving: the caller hands over live device tensors (KV caches and the linear-layer states at a
position); only the KV chunks the store lacks and the record's own tail/linear states are copied
to host (pinned, non-blocking, ordered on the current stream), then a bounded queue feeds one
writer thread that compresses and commits each checkpoint in one LMDB transaction. A full queue
drops the checkpoint (counted) unless the caller waits for room (`save(wait=...)`, which the
semantic reuse does after the response for checkpoints its prefill could not queue); prefill
never waits on disk.

Restoring: candidates are the boundaries of the new prompt (plus 256-token block edges for
attention-only models), longest first; the first record whose payloads verify is decoded on
worker threads, each copying its chunks straight into the device KV caches. Corrupt records are
deleted and the next candidate is tried. Recent payloads also live in an in-process RAM tier.
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from agentrt.config import ModelConfig, StateCacheConfig
from agentrt.cputhreads import keep_freed_buffers, single_threaded
from agentrt.models.cache import KVCache, LinearCache
from agentrt.statecache.blobs import BlobLoad
from agentrt.statecache.boundaries import Boundaries
from agentrt.statecache.codec import (
    CorruptPayload,
    Layout,
    Record,
    pack_parts,
    pack_tensors,
    row_bytes,
    unpack_scatter,
)
from agentrt.statecache.keys import BLOCK, FORMAT_VERSION, PrefixKeys
from agentrt.statecache.staging import PinnedRing
from agentrt.statecache.store import Store

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def layout_for(cfg: ModelConfig, dtype: torch.dtype) -> Layout:
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim = 2 * key_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    rec = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return Layout(
        num_attn=len(cfg.attention_layers),
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        kv_dtype=DTYPE_NAMES[dtype],
        num_linear=len(cfg.linear_layers),
        conv_shape=(conv_dim, cfg.linear_conv_kernel_dim - 1),
        conv_dtype=DTYPE_NAMES[dtype],
        rec_shape=rec,
    )


@dataclass
class Hit:
    pos: int
    kind: str
    source: str  # "ram" | "lmdb"; with "+live_kv" when the KV already in the caches was kept


@dataclass
class _Job:
    key: bytes
    pos: int
    kind: str
    chunk_keys: list[bytes]
    lo: int  # first token held in `kv`
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # host copies of tokens [lo, pos)
    # host copies of the conv and recurrent states stacked over the layers ([] without any)
    stacked: list[torch.Tensor]
    event: torch.cuda.Event | None
    region: tuple[int, int] | None = None  # pinned staging region holding kv/stacked
    new_chunks: list[bytes] = field(default_factory=list)

    def linear(self) -> list[torch.Tensor]:
        """Per layer, the conv states, then the recurrent ones (views of `stacked`)."""
        return [t for group in self.stacked for t in group.unbind(0)]


# how many tokens before its prefix's end a checkpoint's state may be (the delta rule's chunk:
# `Engine.capture_grid`)
MAX_EARLY = 63

# longest a restore waits for the writer to store a checkpoint an earlier request queued (past
# that the request recomputes instead: a writer that far behind must not stall requests)
PENDING_WAIT_S = 1.0


class _RamTier:
    """LRU of decoded payloads (chunks and blobs), bounded by bytes, shared by threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.items: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, key: bytes):
        with self.lock:
            item = self.items.get(key)
            if item is None:
                return None
            self.items.move_to_end(key)
            return item[0]

    def put(self, key: bytes, value: object, size: int) -> None:
        if size > self.max_bytes:
            return
        with self.lock:
            if key in self.items:
                self.bytes -= self.items.pop(key)[1]
            self.items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                self.bytes -= self.items.popitem(last=False)[1][1]

    def drop(self, key: bytes) -> None:
        with self.lock:
            item = self.items.pop(key, None)
            if item is not None:
                self.bytes -= item[1]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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


class StateCache:
    """Checkpoints of one model in one state directory."""

    def __init__(
        self,
        config: StateCacheConfig,
        fingerprint: bytes,
        label: str,
        layout: Layout,
        boundaries: Boundaries,
        block_edges: bool,
        device: torch.device,
    ) -> None:
        self.config = config
        self.fp = fingerprint
        self.label = label
        self.layout = layout
        self.boundaries = boundaries
        self.block_edges = block_edges
        self.device = device
        self.store = Store(config.state_dir, config.max_bytes)
        self.ram = _RamTier(config.ram_bytes)
        self.stats: Counter[str] = Counter()
        self.last_error: str | None = None
        self.dirty = False  # the last restore_into wrote into the caches and then failed
        self.last_full = False  # the last `save` found the writer's queue or ring full
        self._lock = threading.Lock()
        self._known: set[bytes] = set()  # chunk keys present in LMDB
        self._pending: set[bytes] = set()  # chunk keys carried by queued jobs
        self._queued: Counter[bytes] = Counter()  # checkpoint keys of queued jobs
        self._written = threading.Condition(self._lock)  # notified after each job
        # checkpoints to write, and keys of records to touch (hit counts: a write transaction,
        # so it happens on the writer thread, never in a request)
        self._queue: queue.Queue[_Job | bytes | None] = queue.Queue(maxsize=config.queue_size)
        # restores read and decompress chunks in parallel: one thread per core, up to 16
        restore_threads = max(config.workers, min(16, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(
            max_workers=restore_threads,
            thread_name_prefix="agentrt-restore",
            initializer=single_threaded,  # one thread per worker, no OpenMP team each
        )
        # the writer compresses a checkpoint's payloads (5 MiB KV chunks, ~4 MiB blob parts) on
        # these threads at once: one zstd stream runs at ~250-340 MiB/s, and zstd's own threads
        # barely split inputs that small
        self._compress = ThreadPoolExecutor(
            max_workers=config.workers,
            thread_name_prefix="agentrt-compress",
            initializer=single_threaded,
        )
        keep_freed_buffers()  # the writer's frees must not hold the GIL in munmap
        self._ring = PinnedRing.shared(config.staging_bytes) if device.type == "cuda" else None
        self._writer = threading.Thread(target=self._write_loop, name="agentrt-writer", daemon=True)
        self._writer.start()
        self._closed = False
        atexit.register(self.close)

    def wait_staging(self, timeout: float | None = None) -> None:
        """Block until the pinned staging ring is allocated (it is allocated in the background)."""
        if self._ring is not None:
            self._ring.ready.wait(timeout)

    # ------------------------------------------------------------------ capture

    def capture_positions(self, ids: Sequence[int], start: int) -> dict[int, str]:
        """Boundaries in ids[start:] worth a checkpoint: the last one always, others at least
        `min_distance` tokens apart (from each other and from `start`), none already stored."""
        keys = PrefixKeys(self.fp, ids)
        chosen: dict[int, str] = {}
        last = None
        for pos, kind in reversed(self.boundaries.find(ids, start)):
            if pos <= start:
                continue
            if last is not None and (
                last - pos < self.config.min_distance or pos - start < self.config.min_distance
            ):
                continue
            if self._stored(keys.key(pos)):
                continue
            chosen[pos] = kind
            last = pos
        return dict(sorted(chosen.items()))

    def _stored(self, key: bytes) -> bool:
        return self.ram.get(key) is not None or self.store.has_record(key)

    def save(
        self,
        ids: Sequence[int],
        pos: int,
        kind: str,
        kv_caches: Sequence[KVCache],
        conv: Sequence[torch.Tensor],
        rec: Sequence[torch.Tensor],
        at: int | None = None,
        wait: float = 0.0,
    ) -> bool:
        """Queue a checkpoint of the state after `ids[:pos]` (device tensors are copied now).

        `at` (at most `pos`, default `pos`): the caches' state is the one after `ids[:at]` (a
        capture the prefill took a little early, `Engine.capture_grid`). The record is still
        found by the prefix `ids[:pos]` and restores `at` tokens. When the writer is behind
        (its queue or staging ring full), waits up to `wait` seconds for it to make room, then
        drops the checkpoint (counted; `last_full` tells the caller, who may try again later)."""
        deadline = time.perf_counter() + wait
        self.last_full = False
        while True:
            outcome = self._try_save(ids, pos, kind, kv_caches, conv, rec, at)
            if not outcome.endswith("_full"):
                return outcome == "queued"
            left = deadline - time.perf_counter()
            if left <= 0:  # (counted once, however many tries)
                self.stats[f"dropped_{outcome}"] += 1
                self.last_full = True
                return False
            with self._lock:  # woken after each job the writer finishes
                self._written.wait(min(left, 0.05))

    def _try_save(self, ids, pos, kind, kv_caches, conv, rec, at) -> str:
        """One attempt of `save`: "queued", "skipped" (stored already), "queue_full" or
        "staging_full" (the writer is behind)."""
        keys = PrefixKeys(self.fp, ids)
        key = keys.key(pos)
        at = pos if at is None else at
        if not 0 < at <= pos:
            raise ValueError(f"a checkpoint for {pos} tokens cannot hold the state after {at}")
        pos = at  # what is stored is the state there
        if self._stored(key):
            self.stats["skipped_existing"] += 1
            return "skipped"
        if self._queue.full():  # the writer is behind: give up before copying anything
            return "queue_full"
        chunk_keys = [keys.chunk_key(c) for c in range(pos // BLOCK)]
        new = self._new_chunks(chunk_keys)
        lo = min((chunk_keys.index(ck) * BLOCK for ck in new), default=(pos // BLOCK) * BLOCK)
        job = self._copy_out(key, pos, kind, chunk_keys, lo, kv_caches, conv, rec)
        if job is None:  # the writer is that far behind, as with a full queue
            return "staging_full"
        job.new_chunks = new
        with self._lock:  # counted before the writer can see the job (it uncounts it)
            self._pending.update(new)
            self._queued[key] += 1
            try:
                self._queue.put_nowait(job)  # never blocks, so holding the lock is fine
                return "queued"
            except queue.Full:  # filled since the check above (touches share the queue)
                self._pending.difference_update(new)
                self._uncount(key)
        self._release(job)
        return "queue_full"

    def _uncount(self, key: bytes) -> None:
        """One queued job of `key` less (under `_lock`); wakes restores waiting for it."""
        self._queued[key] -= 1
        if self._queued[key] <= 0:
            del self._queued[key]
        self._written.notify_all()

    def _release(self, job: _Job) -> None:
        """Give a job's staging region back (once its device->host copies are done)."""
        if job.region is None:
            return
        try:
            job.event.synchronize()
        finally:
            self._ring.free(job.region)
            job.region = None

    def _new_chunks(self, chunk_keys: list[bytes]) -> list[bytes]:
        with self._lock:
            unsure = [ck for ck in chunk_keys if ck not in self._known and ck not in self._pending]
        missing = set(self.store.missing_chunks(unsure)) if unsure else set()
        with self._lock:
            self._known.update(ck for ck in unsure if ck not in missing)
        return [ck for ck in unsure if ck in missing]

    def _copy_out(self, key, pos, kind, chunk_keys, lo, kv_caches, conv, rec) -> _Job | None:
        """Host copies of what the job needs: into the pinned ring (asynchronous, ordered on the
        current stream); None when the ring is full (queued jobs hold it: the writer is behind,
        and a synchronous copy into ordinary memory would stall the request). Without a ring
        (CPU, page-locking refused, not allocated yet) into ordinary memory."""
        with torch.inference_mode():
            # the linear layers' states stacked on the device first: two copies to the host
            # instead of two per layer (each costs the request thread ~10 us to queue)
            stacked = [torch.stack(list(group)) for group in (conv, rec) if len(group)]
            sources = [t for c in kv_caches for t in (c.k[:, lo:pos], c.v[:, lo:pos])] + stacked
            span = PinnedRing.span(sources)
            region = self._ring.alloc(span) if self._ring is not None else None
            if region is None:
                if self._ring is not None and self._ring.usable and span <= self._ring.capacity:
                    return None
                hosts = [t.to("cpu", copy=True) for t in sources]
            else:
                hosts = self._ring.views(region, sources)
                for host, src in zip(hosts, sources, strict=True):
                    host.copy_(src, non_blocking=True)
            event = None
            if region is not None:  # on the stream the copies were queued on (this device's)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
        n_kv = 2 * len(kv_caches)
        kv = list(zip(hosts[0:n_kv:2], hosts[1:n_kv:2], strict=True))
        return _Job(key, pos, kind, chunk_keys, lo, kv, hosts[n_kv:], event, region)

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        single_threaded()  # its copies need no OpenMP team (see agentrt.cputhreads)
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if isinstance(job, bytes):
                    self.store.touch(job)
                else:
                    self._write(job)
            except Exception as exc:  # noqa: BLE001 - the writer must survive any single failure
                self.stats["write_errors"] += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                if isinstance(job, _Job):
                    with self._lock:
                        self._pending.difference_update(job.new_chunks)
                        self._uncount(job.key)
                self._queue.task_done()

    def _chunk_from_job(self, job: _Job, index: int) -> list[torch.Tensor] | None:
        start = index * BLOCK - job.lo
        if start < 0:
            return None
        return [t[:, start : start + BLOCK] for pair in job.kv for t in pair]

    def _write(self, job: _Job) -> None:
        t0 = time.perf_counter()
        try:
            if job.region is not None:  # keep staged data only as long as needed
                job.event.synchronize()
                job.kv = [(k.clone(), v.clone()) for k, v in job.kv]
                # two copies, not two per layer (fewer GIL-held steps beside a request)
                job.stacked = [t.clone() for t in job.stacked]
        finally:
            self._release(job)
        self._commit(job)
        self.stats["write_seconds"] += time.perf_counter() - t0

    def _commit(self, job: _Job) -> None:
        tail = job.pos % BLOCK
        tail_kv = [t[:, t.shape[1] - tail :] for pair in job.kv for t in pair]
        blob = tail_kv + job.linear()
        self.ram.put(job.key, (job.kind, blob, job.pos), _nbytes(blob))
        chunks = {}
        for ck in self.store.missing_chunks(job.chunk_keys):
            index = job.chunk_keys.index(ck)
            tensors = self._chunk_from_job(job, index) or self.ram.get(ck)
            if tensors is None:
                self.stats["dropped_missing_chunk"] += 1
                with self._lock:
                    self._known.discard(ck)
                return
            chunks[ck] = tensors
        for index, ck in enumerate(job.chunk_keys):
            tensors = self._chunk_from_job(job, index)
            if tensors is not None:
                self.ram.put(ck, tensors, _nbytes(tensors))
        level = self.config.compress_level
        packing = {ck: self._compress.submit(pack_tensors, t, level) for ck, t in chunks.items()}
        blob_payload = pack_parts(blob, level, pool=self._compress)  # beside the chunks
        payloads = {ck: future.result() for ck, future in packing.items()}
        now = time.time()
        chunk_bytes = sum(map(len, payloads.values()))
        record = Record(
            self.fp,
            self.label,
            job.pos,
            job.kind,
            job.chunk_keys,
            len(blob_payload),
            chunk_bytes,
            now,
            now,
        )
        result = self.store.put_checkpoint(job.key, record, payloads, blob_payload)
        self.stats[f"write_{result}"] += 1
        if result == "written":
            self.stats["bytes_written"] += len(blob_payload) + chunk_bytes
            self.stats["raw_bytes_written"] += _nbytes(blob) + sum(map(_nbytes, chunks.values()))
            with self._lock:
                self._known.update(job.chunk_keys)

    def flush(self) -> None:
        """Wait until every queued checkpoint is written."""
        if not self._closed:
            self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        self._compress.shutdown()
        self._pool.shutdown()
        self.store.close()
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ lookup and restore

    def candidates(self, ids: Sequence[int], min_pos: int = 0) -> list[tuple[int, str]]:
        """Positions where a stored checkpoint could apply, longest first (< len(ids))."""
        # boundaries ending past `min_pos` only: the scan starts there, not at the prompt's start
        found = {p: k for p, k in self.boundaries.find(ids, min_pos) if min_pos < p < len(ids)}
        if self.block_edges:
            for p in range(BLOCK, self._chunked_prefix(ids) + 1, BLOCK):
                if min_pos < p < len(ids):
                    found.setdefault(p, "block")
        return sorted(found.items(), reverse=True)

    def _chunked_prefix(self, ids: Sequence[int]) -> int:
        """Length of the longest prefix of whole blocks whose KV chunks are all stored."""
        keys = PrefixKeys(self.fp, ids)
        chunk_keys = [keys.chunk_key(c) for c in range((len(ids) - 1) // BLOCK)]
        absent = set(self.store.missing_chunks(chunk_keys))
        for index, ck in enumerate(chunk_keys):
            if ck in absent and self.ram.get(ck) is None:
                return index * BLOCK
        return len(chunk_keys) * BLOCK

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
