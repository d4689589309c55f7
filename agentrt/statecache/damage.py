"""A damaged state database: the error that names the fix, LMDB's errors that mean damage, and
filling out a data.mdb cut short before anything reads past its end."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import lmdb

from agentrt.errors import AgentrtError


class DamagedStoreError(AgentrtError):
    """The state directory's database is damaged (`agentrt cache clear` deletes it)."""


CORRUPTION = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError)


def damaged(path: Path | None, exc: Exception) -> DamagedStoreError:
    """The error naming the fix (`path` None: where the damage was met is not known)."""
    where = "[--state-dir DIR]" if path is None else f"--state-dir {shlex.quote(str(path))}"
    which = "" if path is None else f" in {path}"
    return DamagedStoreError(
        f"the state cache{which} is damaged ({exc}); `agentrt cache clear {where}` deletes it"
    )


def fill_out(path: Path, env: lmdb.Environment) -> None:
    """Make data.mdb reach its last page. A file cut short (a full disk, a partial copy) would
    kill the process reading a page past its end through the map (SIGBUS); filled out, such a
    page reads as zeros, which LMDB reports as corruption (or, in a few of its own checks,
    aborts on: dropping a damaged tree does, so `cache clear` removes files instead) and
    payload checksums refuse. A healthy file may be short too (pages allocated and freed in
    one transaction are never written): its filling is what LMDB's writemap mode does at open.
    Never shrinks the file."""
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    data = path / "data.mdb"
    if data.stat().st_size >= need:
        return
    try:
        fd = os.open(data, os.O_RDWR)
        try:
            if hasattr(os, "posix_fallocate"):  # (never shrinks; not on macOS)
                os.posix_fallocate(fd, 0, need)
            else:
                os.ftruncate(fd, max(need, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    except OSError as exc:
        raise lmdb.CorruptedError(
            f"data.mdb is cut short and cannot be filled out: {exc}"
        ) from None
