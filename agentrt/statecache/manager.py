"""`StateCache`: one model's checkpoints in one state directory. This module holds its set-up,
capture admission (`capture_positions`, `save`) and lookup candidates; the writer thread is in
`writer.py`, restores in `restore.py`, the RAM tier in `ram.py`.

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
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from agentrt.host.cputhreads import (
    HelperPool,
    background_helper,
    keep_freed_buffers,
    single_threaded,
)
from agentrt.models.config import ModelConfig
from agentrt.models.kv import KVCache
from agentrt.statecache.boundaries import Boundaries, choose_captures
from agentrt.statecache.codec import (
    Layout,
)
from agentrt.statecache.config import StateCacheConfig, restore_threads
from agentrt.statecache.keys import BLOCK, PrefixKeys
from agentrt.statecache.keys import fingerprint as model_fingerprint
from agentrt.statecache.ram import RamTier
from agentrt.statecache.restore import Restorer
from agentrt.statecache.staging import PinnedRing
from agentrt.statecache.store import Store
from agentrt.statecache.writer import Writer, _Job

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def layout_for(cfg: ModelConfig, dtype: torch.dtype) -> Layout:
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim = 2 * key_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    rec = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    sliding = set(cfg.sliding_layers) if cfg.sliding_window else set()
    windowed = tuple(i for i, layer in enumerate(cfg.attention_layers) if layer in sliding)
    return Layout(
        num_attn=len(cfg.attention_layers),
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        kv_dtype=DTYPE_NAMES[dtype],
        num_linear=len(cfg.linear_layers),
        conv_shape=(conv_dim, cfg.linear_conv_kernel_dim - 1),
        conv_dtype=DTYPE_NAMES[dtype],
        rec_shape=rec,
        window=cfg.sliding_window if windowed else 0,
        windowed=windowed,
    )


class StateCache(Writer, Restorer):
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
        if layout.windowed:  # (records of the same model stored before windows: not theirs)
            windows = {"model": fingerprint.hex(), "kv_window": [layout.window, *layout.windowed]}
            self.fp = model_fingerprint(windows)
        self.label = label
        self.layout = layout
        self.boundaries = boundaries
        # (bare chunks cannot restore windowed layers: their KV is only in records' blobs)
        self.block_edges = block_edges and not layout.windowed
        self.device = device
        self.store = Store(config.state_dir, config.max_bytes)
        self.ram = RamTier(config.ram_bytes)
        self.stats: Counter[str] = Counter()
        self.last_error: str | None = None
        self.dirty = False  # the last restore_into wrote into the caches and then failed
        self.last_full = False  # the last `save` found the writer's queue or ring full
        self._lock = threading.Lock()
        self._known: set[bytes] = set()  # chunk keys present in LMDB
        self._known_at = 0  # the store's evictions when `_known` was last emptied
        self._pending: set[bytes] = set()  # chunk keys carried by queued jobs
        # checkpoint keys of queued jobs -> the positions their states are at (`save(at=...)`)
        self._queued: dict[bytes, list[int]] = {}
        self._written = threading.Condition(self._lock)  # notified after each job
        self._resume = threading.Event()  # cleared while writes are held (`hold_writes`)
        self._resume.set()
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=config.queue_size)
        # hits on stored records not yet counted in LMDB (the writer stores them: `_touch`)
        self._touches: Counter[bytes] = Counter()
        self._pool = ThreadPoolExecutor(
            max_workers=restore_threads(config),
            thread_name_prefix="agentrt-restore",
            initializer=single_threaded,  # one thread per worker, no OpenMP team each
        )
        # the writer compresses a checkpoint's payloads (5 MiB KV chunks, ~4 MiB blob parts) on
        # these threads at once: one zstd stream runs at ~250-340 MiB/s, and zstd's own threads
        # barely split inputs that small
        self._compress = HelperPool(  # (counted: the CPU kernels' pool yields them cores)
            max_workers=config.workers,
            thread_name_prefix="agentrt-compress",
            initializer=background_helper,
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
        """Boundaries in ids[start:] worth a checkpoint (`boundaries.choose_captures`), none
        already stored."""
        keys = PrefixKeys(self.fp, ids)

        def stored(pos: int) -> bool:
            return self._stored(keys.key(pos))

        return choose_captures(self.boundaries, ids, start, self.config.min_distance, stored)

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

    @property
    def writes_pending(self) -> int:
        """Checkpoints queued or being written."""
        return self._queue.unfinished_tasks

    def flush(self) -> None:
        """Wait until every queued checkpoint is written (writes held are resumed)."""
        if not self._closed:
            self.resume_writes()
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
