"""LMDB storage of checkpoints: records, content-addressed KV chunks (reference counted) and
per-record blobs, each checkpoint written in one transaction.

Databases: `records` (prefix key -> msgpack `Record`), `chunks` (chunk key -> payload), `refs`
(chunk key -> number of records using it), `blobs` (prefix key -> payload), `meta` (totals).
The map starts small and doubles when full, up to the configured cap plus headroom; past that,
writes evict the least valuable records first. Several processes may share one directory
(LMDB's single-writer lock; a map grown by another process is adopted on the next transaction).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from agentrt.errors import AgentrtError
from agentrt.host.cputhreads import waiting
from agentrt.host.private import FILE_MODE, private_dir
from agentrt.statecache.codec import CorruptPayload, Record, decode_record, encode_record
from agentrt.statecache.damage import CORRUPTION, damaged, fill_out
from agentrt.statecache.mapmode import MapMode, writemap

T = TypeVar("T")
_U64 = struct.Struct("<Q")
_MIN_MAP = 64 * 2**20
_TOTAL = b"payload_bytes"


def _u64(value: bytes | None) -> int:
    """A stored counter; absent or damaged (not 8 bytes) reads as 0."""
    return _U64.unpack(value)[0] if value is not None and len(value) == _U64.size else 0


class _ResizeLock:
    """Transactions share it; a map resize (`set_mapsize`, which LMDB forbids while this process
    has a transaction open) takes it alone. So a request's reads never queue behind the
    background writer's commit (LMDB itself lets readers run beside the one writer), and a
    waiting resize goes first (new transactions wait for it). Shared holds are re-entrant per
    thread; a thread that holds it shared must not ask for it alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0  # shared holds
        self._resizing = False
        self._waiting = 0  # resizes waiting
        self._mine = threading.local()

    @contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._mine, "depth", 0)
        if depth == 0:
            with self._cond:
                while self._resizing or self._waiting:
                    self._cond.wait()
                self._active += 1
        self._mine.depth = depth + 1
        try:
            yield
        finally:
            self._mine.depth = depth
            if depth == 0:
                with self._cond:
                    self._active -= 1
                    if self._active == 0:
                        self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        if getattr(self._mine, "depth", 0):
            raise RuntimeError("state cache: a map resize inside a transaction of the same thread")
        with self._cond:
            self._waiting += 1
            while self._resizing or self._active:
                self._cond.wait()
            self._waiting -= 1
            self._resizing = True
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


DB_NAMES = (b"records", b"chunks", b"refs", b"blobs", b"meta")


class _SharedEnv:
    """One LMDB environment per directory per process (LMDB allows no second one), shared by
    every `Store` on that directory; `lock` keeps map resizes away from open transactions."""

    opened: dict[str, _SharedEnv] = {}
    registry_lock = threading.Lock()

    def __init__(self, path: Path, map_size: int) -> None:
        # through write(2) unless `writemap()` (or another process on the directory uses the
        # map); commits sync data before the meta page (crash safe); data.mdb and lock.mdb are
        # owner-only (checkpoints come from users' conversations)
        self.mode = MapMode(path, writemap())
        try:
            self.env = lmdb.open(
                str(path),
                map_size=map_size,
                max_dbs=8,
                max_readers=512,
                subdir=True,
                writemap=self.mode.writemap,
                mode=FILE_MODE,
            )
            fill_out(path, self.env)  # (before anything reads a page: `open_db` does)
            # the named databases, opened once with the environment: opening one takes LMDB's
            # write lock without giving up the interpreter, which deadlocks beside a write
            # running on another thread of this process (a second Store on the directory, say)
            self.dbs = {name: self.env.open_db(name) for name in DB_NAMES}
        except CORRUPTION as exc:
            self._close_failed()
            raise damaged(path, exc) from None
        except lmdb.Error as exc:
            self._close_failed()
            raise AgentrtError(f"cannot open the state cache in {path}: {exc}") from None
        self.lock = _ResizeLock()
        self.users = 0

    def _close_failed(self) -> None:
        if getattr(self, "env", None) is not None:
            self.env.close()
        self.mode.release()

    @classmethod
    def acquire(cls, path: Path, map_size: int) -> _SharedEnv:
        key = str(path.resolve())
        with cls.registry_lock:
            shared = cls.opened.get(key)
            if shared is None:
                shared = cls.opened[key] = cls(path, map_size)
            shared.users += 1
            return shared

    def release(self, path: Path) -> None:
        with self.registry_lock:
            self.users -= 1
            if self.users == 0:
                self.opened.pop(str(path.resolve()), None)
                self.env.close()
                self.mode.release()


class Store:
    """One state directory."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        private_dir(path, warn_open=True)
        self.path = path
        self.max_bytes = max_bytes
        self.map_limit = int(max_bytes * 1.5) + _MIN_MAP
        existing = (path / "data.mdb").stat().st_size if (path / "data.mdb").exists() else 0
        size = min(self.map_limit, max(_MIN_MAP, existing))
        self.shared = _SharedEnv.acquire(path, size)
        self.env = self.shared.env
        self.closed = False
        self.records, self.chunks, self.refs, self.blobs, self.meta = (
            self.shared.dbs[name] for name in DB_NAMES
        )
        self.evictions = 0  # records this object evicted (a writer's knowledge of chunks ages)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.shared.release(self.path)

    # ------------------------------------------------------------------ transactions

    def _txn(
        self,
        fn: Callable[[lmdb.Transaction], T],
        write: bool = False,
        views: bool | None = None,
        keep_chunks: frozenset[bytes] = frozenset(),
    ) -> T:
        """Run `fn` in a transaction; adopt map growth by other processes, grow when full.

        `views` (default: for write transactions) makes `get` return views into the map, valid
        until the transaction ends or writes, instead of copies: a copy of a payload (a 5 MiB KV
        chunk) is made under the GIL, and the writer's existence checks of a long prompt's
        chunks stalled the request thread by tens of milliseconds with copies. `fn` must then
        use what it reads at once (test, measure, decode) and return nothing that views it.
        A full map at its limit evicts, sparing `keep_chunks` as `evict` does."""
        views = write if views is None else views
        for _ in range(64):
            try:
                with self.shared.lock.shared(), self.env.begin(write=write, buffers=views) as txn:
                    out = fn(txn)
                    if write:  # (the commit waits on the disk: its thread counts as no busy helper)
                        with waiting():
                            txn.commit()
                    return out
            except lmdb.MapResizedError:
                with self.shared.lock.alone():
                    self.env.set_mapsize(0)
            except lmdb.MapFullError:
                if not self._grow():
                    self.evict(int(self.total_bytes() * 0.8), keep_chunks=keep_chunks)
        raise RuntimeError("state cache: could not complete an LMDB transaction")

    def _grow(self) -> bool:
        with self.shared.lock.alone():
            current = self.env.info()["map_size"]
            if current >= self.map_limit:
                return False
            self.env.set_mapsize(min(self.map_limit, current * 2))
            return True

    # ------------------------------------------------------------------ reads

    def get_record(self, key: bytes) -> Record | None:
        data = self._txn(lambda txn: txn.get(key, db=self.records))
        return decode_record(data) if data is not None else None

    def has_record(self, key: bytes) -> bool:
        return self._txn(lambda txn: txn.get(key, db=self.records) is not None, views=True)

    def missing_chunks(self, keys: list[bytes]) -> list[bytes]:
        missing = lambda txn: [k for k in keys if txn.get(k, db=self.chunks) is None]  # noqa: E731
        return self._txn(missing, views=True)

    def read_payloads(
        self, key: bytes, chunk_keys: list[bytes]
    ) -> tuple[list[bytes | None], bytes | None]:
        """Copies of the chunk payloads (None where absent) and the blob of one record."""

        def read(txn):
            chunks = [txn.get(k, db=self.chunks) for k in chunk_keys]
            return chunks, txn.get(key, db=self.blobs)

        return self._txn(read)

    @contextmanager
    def parallel_reads(self) -> Iterator[None]:
        """Hold the environment lock shared, so no map resize happens in this process, while
        worker threads read chunks with `read_chunk` (they rely on this hold: they take none)."""
        with self.shared.lock.shared():
            yield

    def read_chunk(
        self, key: bytes, decode: Callable[[memoryview], T], blob: bool = False
    ) -> T | None:
        """`decode(payload)` of a chunk (or with `blob`, of a record's blob) straight from the
        memory map (no copy), in this thread's own read transaction; None when absent. Only
        inside `parallel_reads`."""
        try:
            with self.env.begin(buffers=True) as txn:
                view = txn.get(key, db=self.blobs if blob else self.chunks)
                return None if view is None else decode(view)
        except lmdb.Error:  # e.g. another process grew the map mid-restore: treat as absent
            return None

    def total_bytes(self) -> int:
        return self._txn(lambda txn: _u64(txn.get(_TOTAL, db=self.meta)), views=True)

    def list_records(self) -> list[tuple[bytes, Record]]:
        def read(txn):
            out = []
            for key, data in txn.cursor(db=self.records):
                try:
                    out.append((bytes(key), decode_record(data)))
                except CorruptPayload:
                    continue
            return out

        return self._txn(read)

    def stats(self) -> dict[str, Any]:
        def read(txn):
            return {
                "records": txn.stat(self.records)["entries"],
                "chunks": txn.stat(self.chunks)["entries"],
                "payload_bytes": _u64(txn.get(_TOTAL, db=self.meta)),
            }

        info = self._txn(read)
        with self.shared.lock.shared():  # no resize while the map's meta pages are read
            info["map_bytes"] = self.env.info()["map_size"]
        info["file_bytes"] = (self.path / "data.mdb").stat().st_size
        return info

    # ------------------------------------------------------------------ writes

    def put_checkpoint(
        self, key: bytes, record: Record, chunks: dict[bytes, bytes], blob: bytes
    ) -> str:
        """Write one checkpoint atomically. Returns "written", "exists" or "missing_chunk".
        Room made for it (eviction) never deletes a stored chunk it references and does not
        carry (a record holding its last reference stays); what that leaves over the cap is
        evicted once it is written, other records than it (its chunks referenced by it then,
        those records can go)."""
        size = len(blob) + sum(map(len, chunks.values()))
        needed = frozenset(ck for ck in record.chunk_keys if ck not in chunks)
        if self.total_bytes() + size > self.max_bytes:
            self.evict(int(self.max_bytes * 0.8), keep_chunks=needed)
        self._make_room(size)
        put = lambda txn: self._put(txn, key, record, chunks, blob)  # noqa: E731
        result = self._txn(put, write=True, keep_chunks=needed)
        if self.total_bytes() > self.max_bytes:
            self.evict(int(self.max_bytes * 0.8), keep=key)
        return result

    def _make_room(self, size: int) -> None:
        """Grow the map ahead of a write of `size` bytes (plus B-tree overhead), so that a large
        checkpoint is written once, not retried after every doubling that turned out too small.
        The environment lock is taken alone only when the map must grow."""
        with self.shared.lock.shared():  # no resize while the map's meta pages are read
            if self._room_needed(size) is None:
                return
        with self.shared.lock.alone():
            needed = self._room_needed(size)  # again: another thread may have grown it
            if needed is not None:
                self.env.set_mapsize(needed)

    def _room_needed(self, size: int) -> int | None:
        """The map size a write of `size` bytes needs, or None when the map is big enough (or
        at its limit). Reads the environment's info without a transaction (hold the lock)."""
        info, page = self.env.info(), self.env.stat()["psize"]
        needed = (info["last_pgno"] + 1) * page + int(size * 1.25) + _MIN_MAP
        if needed <= info["map_size"] or info["map_size"] >= self.map_limit:
            return None
        return min(self.map_limit, max(needed, 2 * info["map_size"]))

    def _put(self, txn, key: bytes, record: Record, chunks: dict[bytes, bytes], blob: bytes) -> str:
        if txn.get(key, db=self.records) is not None:
            return "exists"
        absent = [ck for ck in record.chunk_keys if txn.get(ck, db=self.chunks) is None]
        if any(ck not in chunks for ck in absent):
            return "missing_chunk"  # nothing written: the empty transaction commits harmlessly
        for ck in absent:
            txn.put(ck, chunks[ck], db=self.chunks)
        for ck in record.chunk_keys:  # (a damaged count saturates; `collect_orphans` frees)
            refs = min(_u64(txn.get(ck, db=self.refs)) + 1, 2**64 - 1)
            txn.put(ck, _U64.pack(refs), db=self.refs)
        txn.put(key, blob, db=self.blobs)
        txn.put(key, encode_record(record), db=self.records)
        added = len(blob) + sum(len(chunks[ck]) for ck in absent)
        total = _u64(txn.get(_TOTAL, db=self.meta)) + added
        txn.put(_TOTAL, _U64.pack(total), db=self.meta)
        return "written"

    def touch(self, hits: Mapping[bytes, int]) -> None:
        """Add `hits[key]` to each record's hits and refresh its last_used, in one transaction
        (keys no longer stored, or whose header is unreadable, are skipped)."""
        now = time.time()

        def update(txn):
            for key, count in hits.items():
                data = txn.get(key, db=self.records)
                try:
                    rec = decode_record(data) if data is not None else None
                except CorruptPayload:
                    continue
                if rec is not None:
                    rec.hits += count
                    rec.last_used = now
                    txn.put(key, encode_record(rec), db=self.records)

        self._txn(update, write=True)

    def delete(self, key: bytes) -> bool:
        return self._txn(lambda txn: self._delete(txn, key), write=True)

    def _delete(self, txn, key: bytes) -> bool:
        data = txn.get(key, db=self.records)
        if data is None:
            return False
        try:  # (before any write: `data` may be a view into the map)
            chunk_keys = decode_record(data).chunk_keys
        except CorruptPayload:
            chunk_keys = []
        freed = len(txn.get(key, db=self.blobs) or b"")
        txn.delete(key, db=self.records)
        txn.delete(key, db=self.blobs)
        for ck in chunk_keys:
            refs = _u64(txn.get(ck, db=self.refs)) - 1
            if refs > 0:
                txn.put(ck, _U64.pack(refs), db=self.refs)
                continue
            freed += len(txn.get(ck, db=self.chunks) or b"")
            txn.delete(ck, db=self.refs)
            txn.delete(ck, db=self.chunks)
        total = max(_u64(txn.get(_TOTAL, db=self.meta)) - freed, 0)
        txn.put(_TOTAL, _U64.pack(total), db=self.meta)
        return True

    # ------------------------------------------------------------------ eviction

    @staticmethod
    def score(record: Record, now: float) -> float:
        """Value of a record: recompute cost saved per byte, decayed by age (1 h half-life)."""
        per_byte = record.n_tokens / max(record.blob_bytes + record.chunk_bytes, 1)
        return per_byte * (1 + record.hits) * 0.5 ** ((now - record.last_used) / 3600)

    def evict(
        self,
        target_bytes: int,
        keep: bytes | None = None,
        keep_chunks: frozenset[bytes] = frozenset(),
    ) -> int:
        """Delete the lowest-scoring records but `keep` until stored payloads fit
        `target_bytes`, none holding the last reference to one of `keep_chunks` (the stored
        chunks a checkpoint being written needs and does not carry: `put_checkpoint`)."""
        if self.total_bytes() > (self.path / "data.mdb").stat().st_size:
            self._recount()  # a damaged total would otherwise evict everything, every write
        now, removed = time.time(), 0
        ranked = sorted(self.list_records(), key=lambda kr: self.score(kr[1], now))
        for key, record in ranked:
            if self.total_bytes() <= target_bytes:
                break
            shared = keep_chunks.intersection(record.chunk_keys) if keep_chunks else ()
            if key == keep or (shared and self._last_holder(shared)):
                continue
            removed += self.delete(key)
        self.evictions += removed
        return removed

    def _last_holder(self, chunk_keys) -> bool:
        """Whether a record referencing `chunk_keys` holds the last reference to one of them."""
        return self._txn(
            lambda txn: any(_u64(txn.get(ck, db=self.refs)) <= 1 for ck in chunk_keys),
            write=False,
        )

    def _recount(self) -> None:
        """Set the payload total to the bytes of the stored chunks and blobs."""

        def count(txn):
            dbs = (self.chunks, self.blobs)
            total = sum(len(value) for db in dbs for _, value in txn.cursor(db=db))
            txn.put(_TOTAL, _U64.pack(total), db=self.meta)

        self._txn(count, write=True)

    def collect_orphans(self) -> int:
        """Remove chunks no record references (left by interrupted bookkeeping)."""

        def sweep(txn):
            used = set()
            for _, data in txn.cursor(db=self.records):
                try:
                    used.update(decode_record(data).chunk_keys)
                except CorruptPayload:
                    continue
            chunk_keys = txn.cursor(db=self.chunks).iternext(keys=True, values=False)
            orphans = [bytes(k) for k in chunk_keys if bytes(k) not in used]
            freed = 0
            for ck in orphans:
                freed += len(txn.get(ck, db=self.chunks))
                txn.delete(ck, db=self.chunks)
                txn.delete(ck, db=self.refs)
            total = max(_u64(txn.get(_TOTAL, db=self.meta)) - freed, 0)
            txn.put(_TOTAL, _U64.pack(total), db=self.meta)
            return len(orphans)

        return self._txn(sweep, write=True)

    def clear(self) -> None:
        def drop(txn):
            for db in (self.records, self.chunks, self.refs, self.blobs, self.meta):
                txn.drop(db, delete=False)

        try:
            self._txn(drop, write=True)
        except CORRUPTION as exc:
            raise damaged(self.path, exc) from None
