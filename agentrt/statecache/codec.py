"""Payload encoding: tensors <-> bytes, zstd compression with checksums, and the record header.

A payload value is `MAGIC | crc32(compressed) | raw length | zstd frame (with its own content
checksum, which is what reads verify)`, or, where zstd would save less than a third of the bytes
(random-looking bf16 or fp32 values: keys, values and recurrent states compress to 78-95%),
`RAW_MAGIC | crc32(raw) | raw length | the raw bytes`: a restore then copies them at memory
speed and checks the crc32 (~3 GB/s per thread both) instead of decompressing
(~0.8 GB/s).

A record blob is a container of payloads (`PARTS_MAGIC | count | their lengths | the
payloads`), a few MiB of raw bytes each, so that a
restore decompresses them on several threads at once, each straight into its place in one
buffer (one 60 MB frame took ~70 ms on one core). Any mismatch raises `CorruptPayload`.
`Layout` describes the model state shapes so that a KV chunk (all attention layers, 256 tokens)
or a record blob (tail KV + conv + recurrent states) can be cut back into tensors.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Executor

import msgspec
import numpy as np
import torch
import zstandard

from agentrt.host.cputhreads import waiting
from agentrt.statecache.keys import BLOCK, FORMAT_VERSION

MAGIC = b"ART1"
RAW_MAGIC = b"ARW1"  # stored uncompressed (see the module docstring)
# a payload is stored raw when zstd keeps more than this share of a sample of its bytes: windows
# spread evenly over it, SAMPLE_BYTES in all (a 1 MiB sample of its start cost 85% of framing a
# raw 4 MiB part, and missed a payload whose start alone was random)
RAW_ABOVE = 2 / 3
SAMPLE_BYTES = 1 << 18
SAMPLE_WINDOWS = 4
PARTS_MAGIC = b"ARP1"
PART_BYTES = 4 << 20  # raw bytes per part of a blob (a tensor is never split)
_HEAD = struct.Struct("<4sIQ")
_PARTS_HEAD = struct.Struct("<4sI")
_U64 = struct.Struct("<Q")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_local = threading.local()


class CorruptPayload(Exception):
    """A stored payload failed its checksum or could not be decoded."""


class Layout(msgspec.Struct, frozen=True):
    """Shapes of one model's state (enough to decode any payload of it). `windowed`: the
    attention layers (indices among them) that see only the last `window` positions: their KV
    is never in chunks, each record's blob holds their window instead."""

    num_attn: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    num_linear: int
    conv_shape: tuple[int, int]
    conv_dtype: str
    rec_shape: tuple[int, int, int]
    window: int = 0
    windowed: tuple[int, ...] = ()

    def kv_row_bytes(self) -> int:
        """Bytes of one token's keys (or values) in one kv head."""
        return self.head_dim * _DTYPES[self.kv_dtype].itemsize

    @property
    def chunked(self) -> tuple[int, ...]:
        """The attention layers whose KV is stored in chunks (all but the windowed ones)."""
        return tuple(i for i in range(self.num_attn) if i not in self.windowed)

    def kv_token_bytes(self) -> int:
        """Bytes of one token's KV in a chunk (the chunked layers')."""
        return 2 * len(self.chunked) * self.kv_heads * self.kv_row_bytes()

    def window_tokens(self, pos: int) -> int:
        """Positions of the windowed layers' KV a record after `pos` tokens holds."""
        return min(self.window, pos) if self.windowed else 0

    def blob_bytes(self, pos: int) -> int:
        """Raw size of the blob of a record after `pos` tokens: the chunked layers' KV past the
        last whole block, the windowed layers' window, the linear layers' states."""
        conv = self.conv_shape[0] * self.conv_shape[1] * _DTYPES[self.conv_dtype].itemsize
        rec = self.rec_shape[0] * self.rec_shape[1] * self.rec_shape[2] * 4
        window = 2 * len(self.windowed) * self.kv_heads * self.kv_row_bytes()
        return (
            (pos % BLOCK) * self.kv_token_bytes()
            + self.window_tokens(pos) * window
            + self.num_linear * (conv + rec)
        )


class Record(msgspec.Struct):
    """Header of one checkpoint (msgspec/msgpack in LMDB)."""

    fingerprint: bytes
    label: str
    n_tokens: int
    kind: str
    chunk_keys: list[bytes]
    blob_bytes: int
    chunk_bytes: int
    created: float
    last_used: float
    hits: int = 0
    version: int = FORMAT_VERSION


def encode_record(record: Record) -> bytes:
    return msgspec.msgpack.encode(record)


def decode_record(data: bytes) -> Record:
    try:
        return msgspec.msgpack.decode(data, type=Record)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptPayload(f"bad record header: {exc}") from None


# ----------------------------------------------------------------------------- compression


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return cache[level]


def pack_tensors(tensors: Sequence[torch.Tensor], level: int = 1) -> memoryview:
    """Frame the tensors' bytes laid end to end, compressed straight from tensor memory (no
    joined copy of the raw bytes: the writer thread holds the GIL for less)."""
    return _join(_frame(tensors, level))


def _frame(tensors: Sequence[torch.Tensor], level: int) -> list[bytes]:
    """A payload's pieces (its header, then the compressed stream, or the raw bytes, in pieces),
    not yet joined: a blob joins the pieces of all its payloads once."""
    views = [row_bytes(t.contiguous()) for t in tensors]
    raw_len = sum(v.nbytes for v in views)
    if not _compresses(views, level):
        crc = 0
        for view in views:
            crc = zlib.crc32(view, crc)
        return [_HEAD.pack(RAW_MAGIC, crc, raw_len), *views]
    cobj = _compressor(level).compressobj(size=raw_len)
    parts = [cobj.compress(v) for v in views]
    parts.append(cobj.flush())
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return [_HEAD.pack(MAGIC, crc, raw_len), *parts]


def _compresses(views: Sequence[memoryview], level: int) -> bool:
    """Whether zstd saves at least `1 - RAW_ABOVE` of a sample of the payload's bytes."""
    sample = _sample(views)
    if not sample:
        return True
    return len(_compressor(level).compress(sample)) <= RAW_ABOVE * len(sample)


def _sample(views: Sequence[memoryview]) -> bytes:
    """`SAMPLE_WINDOWS` windows of the payload's bytes (its views laid end to end), spread
    evenly from its start to its end, `SAMPLE_BYTES` in all; the whole of a smaller payload."""
    total = sum(v.nbytes for v in views)
    if total <= SAMPLE_BYTES:
        return _read(views, 0, total)
    width = SAMPLE_BYTES // SAMPLE_WINDOWS
    starts = (i * (total - width) // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS))
    return b"".join(_read(views, start, width) for start in starts)


def _read(views: Sequence[memoryview], start: int, size: int) -> bytes:
    """Bytes [start, start + size) of the views laid end to end."""
    out, base = [], 0
    for view in views:
        lo, hi = max(start - base, 0), min(start + size - base, view.nbytes)
        if lo < hi:
            out.append(bytes(view[lo:hi]))
        base += view.nbytes
    return b"".join(out)


def _join(pieces: Sequence[bytes | memoryview]) -> memoryview:
    """The pieces laid end to end in a new buffer, allocated and copied by numpy, which lets
    other threads run meanwhile; `bytes.join` (and `bytearray(n)`'s zero fill) hold the GIL
    throughout: a stall of the prefill thread for every payload the writer frames
    (`benchmarks/writer_stall.py`)."""
    sizes = [len(piece) for piece in pieces]
    out = np.empty(sum(sizes), dtype=np.uint8)
    offset = 0
    for piece, size in zip(pieces, sizes, strict=True):
        out[offset : offset + size] = np.frombuffer(piece, dtype=np.uint8)
        offset += size
    return memoryview(out)


def unpack(value: bytes | memoryview) -> bytearray:
    """Verify and decompress a payload (or a blob's container of them, laid end to end) into a
    fresh (writable) buffer."""
    if bytes(memoryview(value)[: len(PARTS_MAGIC)]) == PARTS_MAGIC:
        parts = blob_parts(value)
        out = bytearray(sum(raw for _, _, raw in parts))
        view, offset = memoryview(out), 0
        for start, length, raw in parts:
            unpack_into(memoryview(value)[start : start + length], view[offset : offset + raw])
            offset += raw
        return out
    out = bytearray(raw_length(value))
    unpack_into(value, memoryview(out))
    return out


def raw_length(value: bytes | memoryview) -> int:
    """The raw size a payload declares, checked against its zstd frame header (which must also
    declare a content checksum), or for a raw payload against its length, before anyone
    allocates that much: a flipped bit in either size field is `CorruptPayload`, never a huge
    allocation. Nothing is decompressed."""
    view = memoryview(value)
    if len(view) < _HEAD.size:
        raise CorruptPayload("payload too short")
    magic, _crc, raw_len = _HEAD.unpack(view[: _HEAD.size])
    if magic == RAW_MAGIC:
        if len(view) - _HEAD.size != raw_len:
            raise CorruptPayload("raw payload length does not match its header")
        return raw_len
    if magic != MAGIC:
        raise CorruptPayload("payload magic mismatch")
    try:
        params = zstandard.get_frame_parameters(view[_HEAD.size :])
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"payload frame header unreadable: {exc}") from None
    if not params.has_checksum or params.content_size != raw_len:
        raise CorruptPayload("payload frame header does not match its record")
    return raw_len


def unpack_into(value: bytes | memoryview, out: memoryview) -> None:
    """Verify and decompress a payload into `out` (writable, exactly its raw size).

    The zstd frame's own content checksum (verified while decompressing) guards the data; the
    frame header must declare it and the expected size (`raw_length`), so a flipped header bit
    cannot switch the check off. The crc32 in the payload header is still written (the format
    is unchanged) but not recomputed here: over the compressed bytes it cost ~15% of a
    restore's CPU time and caught nothing the content checksum does not."""
    unpack_scatter(value, [out])


def unpack_scatter(
    value: bytes | memoryview, outs: Sequence[memoryview], verify: bool = True
) -> int:
    """`unpack_into` over several places in order (their sizes summing to the raw size): a KV
    chunk goes straight into the per-layer, per-head rows it restores, with no buffer between
    (a fresh one per chunk cost page faults on every restore thread). Returns the raw size.
    `verify=False` skips a raw payload's checksum (for bytes that never left this process:
    the checksum read costs more than the copy)."""
    raw_len = raw_length(value)
    if sum(len(out) for out in outs) != raw_len:
        raise CorruptPayload("payload length does not match its place")
    view = memoryview(value)
    if bytes(view[:4]) == RAW_MAGIC:
        _copy_raw(view, outs, verify)
        return raw_len
    try:
        with zstandard.ZstdDecompressor().stream_reader(memoryview(value)[_HEAD.size :]) as reader:
            for out in outs:
                filled = 0
                while filled < len(out):
                    n = reader.readinto(out[filled:])
                    if n == 0:
                        raise CorruptPayload("payload length mismatch")
                    filled += n
            if reader.read(1):  # also reaches the frame end, where the checksum is checked
                raise CorruptPayload("payload length mismatch")
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"payload does not decompress: {exc}") from None
    return raw_len


def _copy_raw(view: memoryview, outs: Sequence[memoryview], verify: bool = True) -> None:
    """A raw payload's bytes into `outs` in order, checked against its crc32 when `verify`
    (numpy's copy and zlib's crc32 both let other threads run)."""
    (crc,) = struct.unpack_from("<I", view, 4)
    data = np.frombuffer(view, dtype=np.uint8, offset=_HEAD.size)
    if verify and zlib.crc32(data) != crc:
        raise CorruptPayload("raw payload fails its checksum")
    offset = 0
    for out in outs:
        size = len(out)
        np.frombuffer(out, dtype=np.uint8)[:] = data[offset : offset + size]
        offset += size


def row_bytes(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (its own memory, never a copy)."""
    if not t.is_contiguous():
        raise ValueError("row_bytes needs a contiguous tensor")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()).cast("B")


def pack_parts(
    tensors: Sequence[torch.Tensor],
    level: int = 1,
    part_bytes: int = PART_BYTES,
    pool: Executor | None = None,
) -> memoryview:
    """A blob: the tensors in consecutive groups of about `part_bytes` raw bytes (a tensor is
    never split), each group one payload (framed as by `pack_tensors`, on `pool`'s threads at
    once when given), behind a header of their lengths; all of it joined in one copy."""
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > part_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    if pool is None:
        framed = [_frame(group, level) for group in groups]
    else:
        futures = [pool.submit(_frame, group, level) for group in groups]
        with waiting():  # (the pool's threads count themselves while they work)
            framed = [future.result() for future in futures]
    head = _PARTS_HEAD.pack(PARTS_MAGIC, len(framed))
    lengths = [_U64.pack(sum(map(len, pieces))) for pieces in framed]
    return _join([head, *lengths, *(piece for pieces in framed for piece in pieces)])


def blob_parts(value: bytes | memoryview) -> list[tuple[int, int, int]]:
    """(offset, length, raw size) of each payload in a blob container; checks the header."""
    view = memoryview(value)
    if len(view) < _PARTS_HEAD.size:
        raise CorruptPayload("blob too short")
    magic, count = _PARTS_HEAD.unpack(view[: _PARTS_HEAD.size])
    if magic != PARTS_MAGIC:
        raise CorruptPayload("blob magic mismatch")
    offset = _PARTS_HEAD.size + count * _U64.size
    if count == 0 or offset > len(view):
        raise CorruptPayload("blob header damaged")
    parts = []
    for i in range(count):
        at = _PARTS_HEAD.size + i * _U64.size
        (length,) = _U64.unpack(view[at : at + _U64.size])
        if offset + length > len(view):
            raise CorruptPayload("blob shorter than its header")
        parts.append((offset, length, raw_length(view[offset : offset + length])))
        offset += length
    if offset != len(view):
        raise CorruptPayload("blob longer than its header")
    return parts


# ----------------------------------------------------------------------------- tensors <-> bytes


def _take(
    raw: torch.Tensor, offset: int, shape: Sequence[int], dtype: str
) -> tuple[torch.Tensor, int]:
    """The tensor at `offset` of `raw` (a 1-D uint8 tensor), as a view of it."""
    dt = _DTYPES[dtype]
    count = 1
    for s in shape:
        count *= s
    size = count * dt.itemsize
    if offset + size > len(raw):
        raise CorruptPayload("payload shorter than its layout")
    piece = raw[offset : offset + size]
    if piece.storage_offset() % dt.itemsize:  # a view needs aligned storage
        piece = piece.clone()
    return piece.view(dt).view(*shape), offset + size


def _kv(raw: torch.Tensor, offset: int, layout: Layout, tokens: int, layers: int):
    shape = (layout.kv_heads, tokens, layout.head_dim)
    out = []
    for _ in range(layers):
        k, offset = _take(raw, offset, shape, layout.kv_dtype)
        v, offset = _take(raw, offset, shape, layout.kv_dtype)
        out.append((k, v))
    return out, offset


def blob_tensors(view: torch.Tensor, layout: Layout, pos: int):
    """The raw bytes of a record's blob after `pos` tokens in a 1-D uint8 tensor -> views of
    them: (KV past the last whole block per chunked attention layer, the window's KV per
    windowed one, conv and recurrent per linear layer)."""
    kv, offset = _kv(view, 0, layout, pos % BLOCK, len(layout.chunked))
    window, offset = _kv(view, offset, layout, layout.window_tokens(pos), len(layout.windowed))
    conv, rec = [], []
    for _ in range(layout.num_linear):
        c, offset = _take(view, offset, layout.conv_shape, layout.conv_dtype)
        conv.append(c)
    for _ in range(layout.num_linear):
        r, offset = _take(view, offset, layout.rec_shape, "float32")
        rec.append(r)
    if offset != len(view):
        raise CorruptPayload("payload longer than its layout")
    return kv, window, conv, rec
