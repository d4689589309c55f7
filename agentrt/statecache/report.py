"""Read-only views of a state directory for `agentrt cache ...`: listing, totals, verification."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from agentrt.statecache.codec import CorruptPayload, unpack
from agentrt.statecache.store import Store


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def list_rows(store: Store) -> list[dict[str, Any]]:
    now = time.time()
    rows = []
    for key, rec in sorted(store.list_records(), key=lambda kr: -kr[1].last_used):
        rows.append({
            "key": key.hex()[:16], "model": rec.label, "fingerprint": rec.fingerprint.hex()[:12],
            "tokens": rec.n_tokens, "kind": rec.kind, "chunks": len(rec.chunk_keys),
            "mib": (rec.blob_bytes + rec.chunk_bytes) / 2**20, "hits": rec.hits,
            "last_used": _age(now - rec.last_used),
        })  # fmt: skip
    return rows


def stats(store: Store) -> dict[str, Any]:
    info = store.stats()
    per_model: dict[str, dict[str, int]] = defaultdict(
        lambda: {"records": 0, "hits": 0, "tokens": 0}
    )
    for _, rec in store.list_records():
        entry = per_model[f"{rec.label} ({rec.fingerprint.hex()[:8]})"]
        entry["records"] += 1
        entry["hits"] += rec.hits
        entry["tokens"] += rec.n_tokens
    info["payload_gib"] = round(info["payload_bytes"] / 2**30, 4)
    info["per_model"] = dict(per_model)
    info["hits"] = sum(m["hits"] for m in per_model.values())
    return info


def verify_all(store: Store) -> int:
    """Decompress every payload; delete records whose blob or chunks fail. Returns how many."""
    bad = 0
    for key, rec in store.list_records():
        chunks, blob = store.read_payloads(key, rec.chunk_keys)
        try:
            if blob is None or any(c is None for c in chunks):
                raise CorruptPayload("missing payload")
            for payload in [blob, *chunks]:
                unpack(payload)
        except CorruptPayload:
            store.delete(key)
            bad += 1
    return bad
