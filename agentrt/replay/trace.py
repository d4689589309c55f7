"""The trace format: `.jsonl` (optionally `.jsonl.zst`), a header line then one request per line,
each exactly as the agent framework sent it (docs/architecture.md §2). msgspec schemas; malformed
lines raise `TraceError` naming the file and line. Also the transforms that model what frameworks do
to context: drop earlier reasoning, truncate old tool outputs. Trace files are written owner-only
(0600), atomically."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from agentrt.errors import AgentrtError
from agentrt.host.private import private_dir, write_private

FORMAT = 1


class TraceError(AgentrtError):
    """A trace file is missing or malformed."""


class Header(msgspec.Struct, omit_defaults=True):
    agentrt_trace: int
    source: str = ""
    description: str = ""


class Response(msgspec.Struct, omit_defaults=True):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    usage: dict[str, Any] | None = None


class Request(msgspec.Struct, omit_defaults=True):
    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    t: float | None = None
    response: Response | None = None


class Trace(msgspec.Struct):
    header: Header
    requests: list[Request]
    path: str = ""

    @property
    def name(self) -> str:
        base = Path(self.path).name
        return base.removesuffix(".zst").removesuffix(".jsonl") or self.header.source or "trace"


# ----------------------------------------------------------------------------- reading / writing

_header_decoder = msgspec.json.Decoder(Header)
_request_decoder = msgspec.json.Decoder(Request)


def _open_text(path: Path) -> Iterable[str]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    if not raw:
        raise TraceError(f"{path}: empty trace")
    if path.name.endswith(".zst") or raw.startswith(_ZSTD_MAGIC):  # (a .zst by another name)
        raw = _unzstd(path, raw)
    try:
        return raw.decode("utf-8").split("\n")  # not splitlines(): U+2028 may sit inside strings
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text: {exc}") from None


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _unzstd(path: Path, raw: bytes) -> bytes:
    """Every frame in `raw` (concatenated files, parallel compressors), each whole: a file cut
    short is an error, not fewer requests."""
    import zstandard

    parts = []
    while raw:
        reader = zstandard.ZstdDecompressor().decompressobj()
        try:
            parts.append(reader.decompress(raw))
        except zstandard.ZstdError as exc:
            raise TraceError(f"{path}: not a valid zstd file: {exc}") from None
        if not reader.eof:
            raise TraceError(f"{path}: the zstd file is cut short (truncated)")
        raw = reader.unused_data
    return b"".join(parts)


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    lines = [(i, line) for i, line in enumerate(_open_text(path), 1) if line.strip()]
    if not lines:
        raise TraceError(f"{path}: empty trace")
    first_no, first = lines[0]
    try:
        header = _header_decoder.decode(first)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise TraceError(
            f'{path}:{first_no}: bad header ({exc}); expected {{"agentrt_trace": 1, ...}}'
        ) from None
    if header.agentrt_trace != FORMAT:
        raise TraceError(f"{path}:{first_no}: unsupported trace format {header.agentrt_trace}")
    requests = []
    for number, line in lines[1:]:
        try:
            requests.append(_request_decoder.decode(line))
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise TraceError(f"{path}:{number}: {exc}") from None
        if not requests[-1].messages:
            raise TraceError(f"{path}:{number}: a request needs at least one message")
        if requests[-1].max_tokens is not None and requests[-1].max_tokens < 0:
            raise TraceError(f"{path}:{number}: max_tokens must not be negative")
    return Trace(header, requests, str(path))


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write `trace` (zstd-compressed for a `.zst` name) as an owner-only 0600 file, atomically;
    missing directories are created 0700 (traces hold users' conversations)."""
    path = Path(path)
    body = b"\n".join(msgspec.json.encode(x) for x in [trace.header, *trace.requests]) + b"\n"
    if path.name.endswith(".zst"):
        import zstandard

        body = zstandard.ZstdCompressor(level=10).compress(body)
    try:
        private_dir(path.parent)
        return write_private(path, body)
    except OSError as exc:
        raise TraceError(f"cannot write trace {path}: {exc.strerror or exc}") from None


# ----------------------------------------------------------------------------- transforms

_CUT = "\n[... output truncated]"


def _cut(content: Any, max_chars: int) -> Any:
    """`content` (a string or a list of content parts) cut to `max_chars` characters of text."""
    if isinstance(content, str):
        return content[:max_chars] + _CUT if len(content) > max_chars else content
    if not isinstance(content, list):
        return content
    out, left = [], max_chars
    for part in content:
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            out.append(part)
        elif left > 0 or not text:
            out.append({**part, "text": _cut(text, left)})
            left -= len(text)
        elif left == 0:  # (the first part past the limit says so; later ones go)
            out.append({**part, "text": _CUT.lstrip()})
            left = -1
    return out


def drop_reasoning(trace: Trace) -> Trace:
    """Frameworks that do not send reasoning back: remove `reasoning_content` from history."""
    requests = []
    for req in trace.requests:
        msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in req.messages]
        requests.append(msgspec.structs.replace(req, messages=msgs))
    header = msgspec.structs.replace(
        trace.header, description=f"{trace.header.description} [reasoning dropped]"
    )
    return Trace(header, requests, trace.path)


def truncate_tool_outputs(trace: Trace, max_chars: int, keep_last: int = 2) -> Trace:
    """Truncate tool outputs older than the last `keep_last` ones to `max_chars` characters
    (a string, or the text parts of a list of content parts, counted together)."""
    requests = []
    for req in trace.requests:
        msgs = copy.deepcopy(req.messages)
        tools = [m for m in msgs if m.get("role") == "tool"]
        for m in tools[: max(len(tools) - keep_last, 0)]:
            m["content"] = _cut(m.get("content"), max_chars)
        requests.append(msgspec.structs.replace(req, messages=msgs))
    header = msgspec.structs.replace(
        trace.header, description=f"{trace.header.description} [tool outputs truncated]"
    )
    return Trace(header, requests, trace.path)
