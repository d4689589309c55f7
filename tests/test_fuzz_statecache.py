"""Fuzzing of the state cache's stored entries (seeded, CI-sized): record headers, blob and KV
chunk payloads, reference counts and the payload total of a real state dir, damaged with random
bytes, odd field values, truncation or deletion, then looked up.

A lookup must restore exactly the state a prefill of the same tokens computes, or an earlier
checkpoint, or miss; the turn's output equals the output without a cache; nothing is evicted
beyond the records found corrupt; `agentrt cache ls|stats|gc --verify` cope with the store; no
LMDB reader slot outlives its lookup. The examples each target tried are printed at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch
from util import TOOLS, agent_requests

from agentrt.errors import AgentrtError
from agentrt.statecache.keys import BLOCK, PrefixKeys
from agentrt.statecache.report import list_rows, stats, verify_all

pytest.importorskip("hypothesis", reason="hypothesis is a test extra")
from fuzzing import fuzz_settings, mutate, mutate_bytes, print_counts, tally  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DB_NAMES = ("records", "blobs", "chunks", "refs", "meta")
Entries = dict[str, list[tuple[bytes, bytes]]]


@pytest.fixture(scope="module", autouse=True)
def _counts(request):
    yield
    print_counts(request.config)


@dataclass(repr=False)
class Setup:
    rt: Any  # a semantic `Runtime` without a RAM tier: every lookup reads LMDB
    probe: list[dict]  # a request that restores a checkpoint of KV chunks and a blob
    ids: list[int]  # its prompt
    reference: list[int]  # its output without a cache
    pristine: Entries  # every LMDB entry before damage
    used: dict[str, list[bytes]]  # per database, the keys the probe's restore reads
    hit: int  # tokens the probe restores from the pristine store

    def __repr__(self) -> str:
        return f"Setup(hit={self.hit})"

    def reset(self):
        """The pristine store (after the writer's queue is done); returns the cache."""
        cache = self.rt.reuse.cache
        cache.flush()
        _load(cache.store, self.pristine)
        return cache

    def lookup(self) -> int:
        """The probe's lookup into a fresh sequence; checks what it restored, returns its
        length (0: a miss)."""
        state = self.rt.engine.new_state()
        start, _ = self.rt.reuse.begin(state, self.ids)
        if start:
            _assert_state_is_prefill(self.rt, self.ids, state)
        return start

    def turn(self):
        """The probe as a whole turn (its lookup goes to LMDB, not to the live sequence)."""
        self.rt._live_state().reset()
        return self.rt.chat(self.probe, tools=TOOLS, max_tokens=3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    from agentrt import Runtime
    from agentrt.statecache.config import StateCacheConfig

    state = tmp_path_factory.mktemp("fuzz-state")
    config = StateCacheConfig(state_dir=state, min_distance=0, queue_size=10_000, ram_bytes=0)
    rt = Runtime.open("tiny", cache="semantic", state_cache=config)
    requests = agent_requests("fuzz", 1500)
    for msgs in requests[:2]:
        rt.chat(msgs, tools=TOOLS, max_tokens=2)
    rt.reuse.cache.flush()
    probe, ids = requests[2], rt.prepare(requests[2], TOOLS).prompt_ids
    reference = Runtime.open("tiny", cache="off").chat(probe, tools=TOOLS, max_tokens=3)
    found = Setup(rt, probe, ids, reference.token_ids, _dump(rt.reuse.cache.store), {}, 0)
    found.hit = found.turn().usage["cached_tokens"]
    found.used = _used_keys(rt, ids, found.hit)
    assert found.hit > BLOCK and all(found.pristine[db] for db in DB_NAMES)
    yield found
    rt.close()


_prefilled: dict[int, Any] = {}


def _assert_state_is_prefill(rt, ids: list[int], state) -> None:
    """A restored state equals the state a plain prefill of the same tokens leaves."""
    pos = state.num_tokens
    if pos not in _prefilled:
        fresh = rt.engine.new_state()
        rt.engine.prefill(fresh, ids[:pos])
        _prefilled[pos] = fresh.export()
    want, got = _prefilled[pos], state.export()
    assert got.token_ids == want.token_ids
    pairs = [
        (a, b) for x, y in zip(got.kv, want.kv, strict=True) for a, b in zip(x, y, strict=True)
    ]
    pairs += list(zip(got.conv + got.recurrent, want.conv + want.recurrent, strict=True))
    for a, b in pairs:
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-3), (pos, (a - b).abs().max())


def _used_keys(rt, ids: list[int], hit: int) -> dict[str, list[bytes]]:
    keys = PrefixKeys(rt.reuse.cache.fp, ids)
    chunks = [keys.chunk_key(c) for c in range(hit // BLOCK)]
    key = keys.key(hit)
    return {"records": [key], "blobs": [key], "chunks": chunks, "refs": chunks, "meta": []}


def _dump(store) -> Entries:
    def read(txn):
        return {
            name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=getattr(store, name))]
            for name in DB_NAMES
        }

    return store._txn(read)


def _load(store, contents: Entries) -> None:
    """Replace everything in the store with `contents`."""

    def write(txn):
        for name in DB_NAMES:
            db = getattr(store, name)
            txn.drop(db, delete=False)
            for key, value in contents[name]:
                txn.put(key, value, db=db)

    store._txn(write, write=True)


def _put(store, db: str, key: bytes, value: bytes | None) -> None:
    """Overwrite (None: delete) one entry."""

    def write(txn):
        if value is None:
            txn.delete(key, db=getattr(store, db))
        else:
            txn.put(key, value, db=getattr(store, db))

    store._txn(write, write=True)


# ----------------------------------------------------------------------------- damage

RECORD_FIELDS = {
    "kind": ["block", "think_end", "message_end", "", "x" * 300],
    "n_tokens": [0, -1, 1, 255, 256, 257, 2**63 - 1],
    "chunk_keys": [[], [b"\x00" * 16], [b"x"] * 50],
    "fingerprint": [b"", b"\x00" * 16],
    "version": [0, -1, 99],
    "hits": [-1, 2**63 - 1],
    "last_used": [float("nan"), float("inf"), float("-inf"), -1e300],
    "blob_bytes": [0, -1, 2**63 - 1],
    "chunk_bytes": [0, -1, 2**63 - 1],
    "label": ["", "\u202e"],
}
COUNTER_VALUES = [0, 1, 2**40, 2**63, 2**64 - 1]


def _damaged_record(data, value: bytes) -> bytes:
    """A record header with a field set to an odd value (or mutated as a tree)."""
    fields = msgspec.msgpack.decode(value)
    if data.draw(st.booleans(), label="record tree"):
        fields = mutate(data, fields)
    else:
        name = data.draw(st.sampled_from(sorted(RECORD_FIELDS)), label="record field")
        choices = RECORD_FIELDS[name]
        if name == "n_tokens":
            choices = [*choices, *(fields[name] + d for d in (-64, -63, -1, 1))]
        fields[name] = data.draw(st.sampled_from(choices), label="field value")
    try:
        return msgspec.msgpack.encode(fields)
    except (OverflowError, TypeError, ValueError):  # (ints past 64 bits, lone surrogates)
        return mutate_bytes(data, value)


def _damaged(data, db: str, value: bytes) -> bytes | None:
    """New bytes for an entry (None: delete it)."""
    op = data.draw(st.sampled_from(["bytes", "bytes", "delete", "structured"]), label="damage")
    if op == "delete":
        return None
    if op == "structured" and db == "records":
        return _damaged_record(data, value)
    if op == "structured" and len(value) == 8:  # a counter (reference count, payload total)
        return data.draw(st.sampled_from(COUNTER_VALUES)).to_bytes(8, "little")
    if op == "structured" and len(value) >= 16:  # a header field (magic, crc, sizes) overwritten
        at = data.draw(st.integers(0, 15), label="header at")
        return value[:at] + data.draw(st.binary(min_size=1, max_size=8)) + value[at + 1 :]
    damaged = mutate_bytes(data, value)
    return damaged if damaged != value else value[:-1]


def _damage(data, setup: Setup, store) -> None:
    """Damage 1-3 entries, half the time ones the probe's restore reads."""
    for _ in range(data.draw(st.integers(1, 3), label="entries")):
        db = data.draw(st.sampled_from(DB_NAMES), label="db")
        entries = setup.pristine[db]
        if setup.used[db] and data.draw(st.booleans(), label="used entry"):
            entries = [(k, v) for k, v in entries if k in setup.used[db]]
        key, value = entries[data.draw(st.integers(0, len(entries) - 1), label="entry")]
        _put(store, db, key, _damaged(data, db, value))


def _outcome(setup: Setup, restored: int) -> str:
    return "hit" if restored == setup.hit else "earlier hit" if restored else "miss"


# ----------------------------------------------------------------------------- tests


@fuzz_settings(max_examples=30)
@given(data=st.data())
@pytest.mark.slow
def test_fuzz_state_cache_entries(setup, data):
    """Damaged records, payloads, reference counts or totals: the lookup restores a right
    state or misses, the turn's output is the one without a cache, `agentrt cache ls|stats|gc
    --verify` cope with the store as it is."""
    cache = setup.reset()
    _damage(data, setup, cache.store)
    records, dropped = len(cache.store.list_records()), cache.stats["corrupt_deleted"]
    setup.lookup()
    try:
        result = setup.turn()
    except AgentrtError:
        tally("state cache lookup", "error")
    else:
        assert result.token_ids == setup.reference
        tally("state cache lookup", _outcome(setup, result.usage["cached_tokens"]))
    cache.flush()
    # far below the size cap nothing is evicted: only records found corrupt are gone
    kept = len(cache.store.list_records())
    assert kept >= records - (cache.stats["corrupt_deleted"] - dropped), (records, kept)
    list_rows(cache.store)
    stats(cache.store)
    verify_all(cache.store)
    cache.store.collect_orphans()
    cache.store.evict(cache.store.max_bytes // 2)
    readers = cache.store.env.readers().strip().splitlines()[1:]
    assert len(readers) <= 1, readers  # no reader slot outlives its lookup


@pytest.mark.parametrize(
    ("field", "value"), [(name, v) for name, values in RECORD_FIELDS.items() for v in values]
)
def test_every_odd_record_field_restores_right_or_misses(setup, field, value):
    """The header of the record the probe restores, one field at a time set to an odd value:
    the lookup restores exactly what a prefill computes, or an earlier checkpoint, or none."""
    cache = setup.reset()
    key = setup.used["records"][0]
    fields = msgspec.msgpack.decode(dict(setup.pristine["records"])[key])
    _put(cache.store, "records", key, msgspec.msgpack.encode(fields | {field: value}))
    tally("record header sweep", _outcome(setup, setup.lookup()))


@pytest.mark.parametrize("db", ["meta", "refs"])
@pytest.mark.parametrize("value", [*(v.to_bytes(8, "little") for v in COUNTER_VALUES), b"", b"x"])
def test_damaged_counters_keep_the_checkpoints(setup, db, value):
    """A payload total or reference count set to an odd value: the next turn restores as
    usual, its checkpoints are written and do not evict the ones stored (far below the size
    cap), and eviction still works."""
    cache = setup.reset()
    keys = [k for k, _ in setup.pristine[db]] if db == "meta" else setup.used["refs"]
    for key in keys:
        _put(cache.store, db, key, value)
    errors = cache.stats["write_errors"]
    result = setup.turn()
    cache.flush()
    assert result.token_ids == setup.reference and result.usage["cached_tokens"] == setup.hit
    assert len(cache.store.list_records()) >= len(setup.pristine["records"])
    assert cache.stats["write_errors"] == errors, cache.last_error
    cache.store.collect_orphans()  # `agentrt cache gc`
    cache.store.evict(0)
    tally("counter sweep", "ok")
