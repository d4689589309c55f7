"""Prefix keys: a chained blake2b over token ids rooted in the model fingerprint.

The chain advances one 256-token block at a time (`edge` keys); the key of any prefix is the
edge key of its last full block, extended by the remaining tokens. Identical key <=> identical
prefix of the same model, stable across processes and machines (ids packed little-endian).
KV chunk keys are derived from edge keys, so chunks are shared by every prefix that contains them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

BLOCK = 256
# 2: record blobs are containers of parts (codec.pack_parts); 3: a record may hold the state of
# up to 63 fewer tokens than its prefix (`StateCache.save(at=...)`), which builds of format 2
# would take as invalid and never rewrite: in the key root, formats never share keys; 4: payloads
# may be stored uncompressed (`codec.RAW_MAGIC`), which builds of format 3 would take as corrupt
FORMAT_VERSION = 4


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for part in parts:
        h.update(part)
    return h.digest()


def _pack(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def fingerprint(parts: dict[str, Any]) -> bytes:
    """Model fingerprint from JSON-safe identity parts (config, weights identity, dtype, ...)."""
    payload = json.dumps({**parts, "state_format": FORMAT_VERSION}, sort_keys=True).encode()
    return _h(b"agentrt-fingerprint", payload)


class PrefixKeys:
    """Keys of the prefixes of one token list (edge keys computed lazily, once)."""

    def __init__(self, root: bytes, ids: Sequence[int]) -> None:
        self.ids = ids
        self.edges = [root]

    def edge(self, block: int) -> bytes:
        while len(self.edges) <= block:
            b = len(self.edges)
            self.edges.append(
                _h(self.edges[-1], b"b", _pack(self.ids[(b - 1) * BLOCK : b * BLOCK]))
            )
        return self.edges[block]

    def key(self, pos: int) -> bytes:
        """Key of the prefix `ids[:pos]`."""
        if pos > len(self.ids):
            raise ValueError("position past the end of the token list")
        block, rest = divmod(pos, BLOCK)
        base = self.edge(block)
        return base if rest == 0 else _h(base, b"t", _pack(self.ids[block * BLOCK : pos]))

    def chunk_key(self, index: int) -> bytes:
        """Key of the KV of tokens [index*BLOCK, (index+1)*BLOCK) (which depend on the prefix)."""
        return _h(self.edge(index + 1), b"kv")
