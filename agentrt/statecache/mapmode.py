"""How LMDB commits a state directory's checkpoints (its shared map or write(2)), kept the same
for every process on one directory.

LMDB's rule is that processes with and without `MDB_WRITEMAP` must not share an environment
(it can defeat the durability of commits). Each process using a directory holds a shared
`flock` on `mode-map.lock` or `mode-write.lock` beside `data.mdb` for as long as it has the
environment open; a process that would use the other mode while one is held adopts the mode in
use and says so once on stderr. The check and the lock are taken under an exclusive lock on
`mode.lock`, so two processes starting together agree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    import fcntl
except ImportError:  # no flock (Windows): LMDB's rule is the user's to keep
    fcntl = None  # type: ignore[assignment]

from agentrt.env import setting
from agentrt.host.private import FILE_MODE

_NAMES = {True: "map", False: "write"}


def writemap() -> bool:
    """Whether LMDB writes checkpoints into its shared map (`AGENTRT_STATE_WRITEMAP=1`, for
    comparisons) instead of through its own pages and write(2), the default. Through the map,
    a commit's writeback write-protects every page the checkpoint touched, in a map that every
    thread of the process shares: the threads computing beside it (decode's CPU experts) ran
    about a fifth slower on the CPU (`benchmarks/writer_neighbour.py`), against a few percent
    through write(2), whose commits also took less time."""
    return setting("STATE_WRITEMAP") == "1"


class MapMode:
    """The mode this process uses on directory `path`, held (shared lock) until `release`."""

    def __init__(self, path: Path, wanted: bool) -> None:
        self.writemap = wanted
        self._fd: int | None = None
        if fcntl is None:
            return
        try:
            guard = _open(path / "mode.lock")
        except OSError:  # a read-only directory, say: LMDB's own open reports what it can
            return
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            if _held_by_others(path, not wanted):
                self.writemap = not wanted
                _say(path, wanted)
            self._fd = _open(_lock_path(path, self.writemap))
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        except OSError:  # a file system without flock: LMDB's rule is the user's to keep
            self.release()
        finally:
            os.close(guard)  # closing the descriptor releases its lock

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _lock_path(path: Path, mode: bool) -> Path:
    return path / f"mode-{_NAMES[mode]}.lock"


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)


def in_use(path: Path) -> bool:
    """Whether a process holds the directory's database open (either mode's lock)."""
    if fcntl is None:
        return False
    try:
        return _held_by_others(path, True) or _held_by_others(path, False)
    except OSError:
        return False


def _held_by_others(path: Path, mode: bool) -> bool:
    """Whether another process holds `mode`'s lock on `path` (an exclusive try fails)."""
    fd = _open(_lock_path(path, mode))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _say(path: Path, wanted: bool) -> None:
    print(
        f"agentrt: another process writes the state cache in {path} through "
        f"{'write(2)' if wanted else 'its shared map'}; this one does too (LMDB needs one mode "
        f"per directory; AGENTRT_STATE_WRITEMAP={'1' if wanted else '0'} is not applied)",
        file=sys.stderr,
    )
