"""Option values of the command line checked before any work: finite numbers, seeds, lengths
within a model's context, output paths (and the JSON written to them)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import click

from agentrt.errors import AgentrtError
from agentrt.host.private import replaced_file, write_file


class Finite(click.FloatRange):
    """click's FloatRange without NaN and infinity (which pass its bounds: NaN compares false)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def fits_context(model: str, tokens: int, hint: str) -> None:
    """Refuse a benchmark of `tokens` positions past `model`'s context before anything is
    allocated for it."""
    from agentrt.models.registry import config_of

    context = config_of(model).max_position_embeddings
    if tokens >= context:
        raise click.BadParameter(
            f"{tokens:,} tokens do not fit the model's context of {context:,}", param_hint=hint
        )


SEED = click.IntRange(-(2**63), 2**64 - 1)  # (what torch's generators take: 64 bits)


def write_json(path: str | None, data) -> None:
    """Write `data` as JSON to `path` (if given) whole or not at all: a command stopped during
    the write leaves the previous file (a link's target written, a device, pipe or
    `/dev/stdout` written into: `host.private.write_file`)."""
    if path:
        try:
            write_file(Path(path).expanduser(), json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise AgentrtError(f"cannot write {path}: {exc.strerror or exc}") from None


def output_path(ctx, param, value: str | None) -> str | None:
    """Fail before any work when an output file (--json, --trace) cannot be created: an empty
    name, a directory, a missing directory, a directory that takes no new file (an output is
    written beside itself first, then moved onto it; a descriptor, device or pipe is written
    into instead, and not probed)."""
    if value is None:
        return value
    path = Path(value).expanduser()
    try:
        if not value or path.is_dir():
            raise IsADirectoryError
        replaced = replaced_file(path)
    except IsADirectoryError:  # (`replaced_file`: a name without a file's, `nodir/..`)
        raise click.BadParameter(f"{value!r} is not a file name") from None
    if replaced is not None:
        if not replaced.parent.is_dir():
            raise click.BadParameter(f"directory of {value!r} does not exist")
        _probe(replaced.parent, value)
    return str(path)


def _probe(directory: Path, value: str) -> None:
    """Create and remove a file in `directory` (permission bits alone do not tell: root
    ignores them, /proc or a read-only mount still refuse)."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".agentrt-probe-")
    except OSError as exc:
        raise click.BadParameter(f"cannot write {value!r}: {exc.strerror}") from None
    os.close(fd)
    os.unlink(name)
