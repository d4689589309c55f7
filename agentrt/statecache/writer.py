"""The state cache's write side (a mixin of `StateCache`): a checkpoint's new KV chunks and
snapshot copied to host (pinned, non-blocking), queued, then compressed and committed in one
LMDB transaction by the writer thread; the RAM tier keeps the payloads it wrote."""

from __future__ import annotations

import functools
import queue
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from agentrt.env import switched_off
from agentrt.host.cputhreads import background_helper, busy, waiting
from agentrt.statecache.codec import (
    Record,
    pack_parts,
    pack_tensors,
    raw_length,
)
from agentrt.statecache.keys import BLOCK, PrefixKeys
from agentrt.statecache.ram import nbytes
from agentrt.statecache.staging import PinnedRing

# chunk keys the writer remembers as stored before it asks LMDB afresh (~100 MB of keys)
KNOWN_LIMIT = 1_000_000

# seconds without a job after which the writer stores the hits counted (`_store_touches`)
TOUCH_IDLE_S = 2.0

# while writes are held (`hold_writes`: a request prefills, or decodes with no older checkpoint
# pending), the writer starts no checkpoint unless one has waited this long or its queue or
# staging ring is half full: the checkpoint writes' CPU and memory traffic slowed the prefill
# and decode steps beside them (the next turn reuses the live state meanwhile)
HOLD_LIMIT_S = 30.0


@functools.cache
def decode_hold() -> bool:
    """Whether the writer holds checkpoints while a request runs (`AGENTRT_DECODE_HOLD=0`: it
    writes whenever it has work, for comparisons); read once."""
    return not switched_off("DECODE_HOLD")


@dataclass
class _Job:
    key: bytes
    pos: int
    kind: str
    chunk_keys: list[bytes]
    lo: int  # first token held in `kv`
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # host copies of tokens [lo, pos), chunked layers
    window: list[tuple[torch.Tensor, torch.Tensor]]  # the windowed layers' last window's KV
    # host copies of the conv and recurrent states stacked over the layers ([] without any)
    stacked: list[torch.Tensor]
    event: torch.cuda.Event | None
    region: tuple[int, int] | None = None  # pinned staging region holding kv/stacked
    new_chunks: list[bytes] = field(default_factory=list)
    queued_at: float = field(default_factory=time.perf_counter)

    def linear(self) -> list[torch.Tensor]:
        """Per layer, the conv states, then the recurrent ones (views of `stacked`)."""
        return [t for group in self.stacked for t in group.unbind(0)]


class Writer:
    """Saving and the writer thread of `StateCache` (its attributes: see `StateCache.__init__`)."""

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
            self._queued.setdefault(key, []).append(pos)
            try:
                self._queue.put_nowait(job)  # never blocks, so holding the lock is fine
                return "queued"
            except queue.Full:  # filled since the check above (by another thread)
                self._pending.difference_update(new)
                self._uncount(key, pos)
        self._release(job)
        return "queue_full"

    def _uncount(self, key: bytes, pos: int) -> None:
        """One queued job of `key` (its state at `pos`) less (under `_lock`); wakes restores
        waiting for it."""
        positions = self._queued[key]
        positions.remove(pos)
        if not positions:
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
            if self.store.evictions != self._known_at or len(self._known) > KNOWN_LIMIT:
                self._known.clear()  # (chunks known stored may be gone since: ask LMDB again)
                self._known_at = self.store.evictions
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
            layout, kv_caches = self.layout, list(kv_caches)
            chunked = [kv_caches[i] for i in layout.chunked]
            windowed = [kv_caches[i] for i in layout.windowed]
            first = pos - layout.window_tokens(pos)
            sources = [t for c in chunked for t in (c.k[:, lo:pos], c.v[:, lo:pos])]
            sources += [t for c in windowed for t in (c.k[:, first:pos], c.v[:, first:pos])]
            sources += stacked
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
        n_kv, n_all = 2 * len(chunked), 2 * len(kv_caches)
        kv = list(zip(hosts[0:n_kv:2], hosts[1:n_kv:2], strict=True))
        window = list(zip(hosts[n_kv:n_all:2], hosts[n_kv + 1 : n_all : 2], strict=True))
        return _Job(key, pos, kind, chunk_keys, lo, kv, window, hosts[n_all:], event, region)

    # ------------------------------------------------------------------ writer thread

    def hold_writes(self) -> None:
        """A request runs: the writer starts no checkpoint until `resume_writes` (see
        `HOLD_LIMIT_S`; a job already started finishes); `AGENTRT_DECODE_HOLD=0` turns that
        off."""
        if decode_hold():
            self._resume.clear()

    def resume_writes(self) -> None:
        self._resume.set()

    def _await_resume(self, job: _Job) -> None:
        """Before writing `job`: wait while writes are held, up to `HOLD_LIMIT_S` after it was
        queued and while the queue and the staging ring are under half full."""
        while not self._resume.is_set():
            left = job.queued_at + HOLD_LIMIT_S - time.perf_counter()
            ring = self._ring.held_share() if self._ring is not None else 0.0
            if left <= 0 or self._queue.qsize() * 2 >= self._queue.maxsize or ring >= 0.5:
                self.stats["hold_overrun"] += 1
                return
            self._resume.wait(min(left, 0.05))

    def _write_loop(self) -> None:
        background_helper()  # its copies need no OpenMP team (see agentrt.host.cputhreads)
        while True:
            try:
                job = self._queue.get(timeout=TOUCH_IDLE_S if self._touches else None)
            except queue.Empty:  # idle with hits counted: store them now
                self._guarded(self._store_touches)
                continue
            try:
                if job is None:
                    self._guarded(self._store_touches)
                    return
                self._await_resume(job)
                self._guarded(self._write, job)
            finally:
                try:
                    if job is not None:
                        with self._lock:
                            self._pending.difference_update(job.new_chunks)
                            self._uncount(job.key, job.pos)
                finally:  # (else `flush` and `close` would wait for it forever)
                    self._queue.task_done()

    def _guarded(self, work, *args) -> None:
        """Run `work(*args)`; count and remember what it raises (the writer survives any
        failure)."""
        try:
            work(*args)
        except Exception as exc:  # noqa: BLE001
            self.stats["write_errors"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"

    def _store_touches(self) -> None:
        """Add the hits counted since the last time to their records, in one transaction."""
        with self._lock:
            hits, self._touches = self._touches, Counter()
        if hits:
            self.store.touch(hits)

    def _chunk_from_job(self, job: _Job, index: int) -> list[torch.Tensor] | None:
        start = index * BLOCK - job.lo
        if start < 0:
            return None
        return [t[:, start : start + BLOCK] for pair in job.kv for t in pair]

    def _write(self, job: _Job) -> None:
        """Commit a job straight from its staging region (framing copies what it keeps, so a
        copy out of the ring first would move every byte once more), then give the region back."""
        t0 = time.perf_counter()
        try:
            if job.region is not None:
                job.event.synchronize()
            with busy():
                self._commit(job)
        finally:
            self._release(job)
        self.stats["write_seconds"] += time.perf_counter() - t0

    def _commit(self, job: _Job) -> None:
        """Pack the checkpoint's new chunks and its blob, keep the payloads in the RAM tier (a
        restore reads them as it reads LMDB's), then store them."""
        tail = job.pos % BLOCK
        tail_kv = [t[:, t.shape[1] - tail :] for pair in job.kv for t in pair]
        blob = tail_kv + [t for pair in job.window for t in pair] + job.linear()
        chunks, payloads = {}, {}
        for ck in self.store.missing_chunks(job.chunk_keys):
            tensors = self._chunk_from_job(job, job.chunk_keys.index(ck))
            payload = self.ram.get(ck) if tensors is None else None  # (packed by an earlier job)
            if tensors is None and payload is None:
                self.stats["dropped_missing_chunk"] += 1
                with self._lock:
                    self._known.discard(ck)
                return
            if tensors is None:
                payloads[ck] = payload
            else:
                chunks[ck] = tensors
        level = self.config.compress_level
        packing = {ck: self._compress.submit(pack_tensors, t, level) for ck, t in chunks.items()}
        blob_payload = pack_parts(blob, level, pool=self._compress)  # beside the chunks
        with waiting():
            payloads.update((ck, future.result()) for ck, future in packing.items())
        for ck, payload in payloads.items():
            self.ram.put(ck, payload, len(payload))
        self.ram.put(job.key, (job.kind, blob_payload, job.pos), len(blob_payload))
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
        if result == "missing_chunk":  # (not stored: nor kept in RAM, to be captured again)
            self.ram.drop(job.key)
        if result == "written":
            self.stats["bytes_written"] += len(blob_payload) + chunk_bytes
            raw_chunks = sum(raw_length(p) for p in payloads.values())
            self.stats["raw_bytes_written"] += nbytes(blob) + raw_chunks
            with self._lock:
                self._known.update(job.chunk_keys)
