"""Private files and directories: what agentrt keeps per user (state cache, model cache,
calibration profiles, native kernels, traces) is created owner-only, 0700 directories and 0600
files, whatever the umask.

Directories that already exist keep their mode; `private_dir(..., warn_open=True)` says once per
process, on stderr, when one is readable or writable by group or others, with the `chmod` that
fixes it. Files are written to a temporary name beside their target and renamed into place, so a
reader never sees half a file; a symbolic link's target is the file replaced (the link stays),
and a target that is a character device or a pipe (`/dev/null`, `/dev/stdout`) is written as it
is, never replaced. This module imports nothing of agentrt: every layer may use it.
"""

from __future__ import annotations

import functools
import os
import shlex
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
_OPEN_BITS = stat.S_IRWXG | stat.S_IRWXO


def private_dir(path: str | Path, warn_open: bool = False) -> Path:
    """Create `path` and its missing parents as 0700 directories; return it. An existing
    directory is left as it is (with `warn_open`, a group/other-accessible one is reported)."""
    path = Path(path).expanduser()
    missing = _missing(path)
    for part in reversed(missing):
        _make_dir(part)
    if warn_open and not missing:
        check_private(path)
    return path


def _missing(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _make_dir(path: Path) -> None:
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:  # another process made it first: its mode is not ours to change
        return
    os.chmod(path, DIR_MODE)  # the umask may have taken bits off (never added any)


def check_private(path: str | Path) -> None:
    """Warn once (stderr) when directory `path` is readable or writable by group/others."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode) and mode & _OPEN_BITS:  # (not a device: its own error follows)
        _warn_open(str(Path(path).resolve()), stat.S_IMODE(mode))


@functools.cache
def _warn_open(path: str, mode: int) -> None:
    print(
        f"agentrt: warning: {path} (mode {mode:o}) is accessible to other users and holds "
        f"state derived from conversations; restrict it with: chmod 700 {shlex.quote(path)}",
        file=sys.stderr,
    )


@contextmanager
def private_output(path: str | Path) -> Iterator[Path]:
    """A new empty 0600 file beside `path` for a writer that takes a file name (it truncates,
    so the mode stays); renamed onto `path` when the block ends, removed if it raises. A device
    or pipe `path` is handed over as it is."""
    target = replaced_file(path)
    if target is None:
        yield Path(path)
        return
    fd, tmp = _temp_beside(target)
    os.close(fd)
    with _replacing(tmp, target):
        yield tmp


def write_private(path: str | Path, data: bytes | str) -> Path:
    """Write `data` (str as UTF-8) to `path` as a 0600 file, atomically; return the path. A
    symbolic link's target is replaced, a device or pipe written into (module docstring); a
    directory raises `IsADirectoryError`."""
    return write_file(path, data, private=True)


def write_file(path: str | Path, data: bytes | str, private: bool = False) -> Path:
    """`write_private`, or with the umask's mode (not `private`)."""
    path, data = Path(path), data.encode() if isinstance(data, str) else data
    if (fd := _fd_of(path)) is not None:  # (/dev/stdout: the descriptor as the shell set it up)
        _write_all(fd, data)
        return path
    if _stream(path):
        with open(path, "wb") as out:
            out.write(data)
        return path
    target = _target(path)
    fd, tmp = _temp_beside(target, private)
    with _replacing(tmp, target), os.fdopen(fd, "wb") as out:
        out.write(data)
    return path


def replaced_file(path: str | Path) -> Path | None:
    """The file a `write_file` to `path` creates or replaces (its temporary file is made beside
    it); None where the write goes into an open descriptor, a device or a pipe."""
    path = Path(path)
    if _fd_of(path) is not None or _stream(path):
        return None
    return _target(path)


_FD_NAMES = {"/dev/stdout": 1, "/dev/stderr": 2}


def _fd_of(path: Path) -> int | None:
    """The open descriptor `path` names (`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`): written
    as it is (a `>>` redirection appends; reopening the name would truncate or replace it)."""
    name = str(path)
    if name in _FD_NAMES:
        return _FD_NAMES[name]
    for prefix in ("/dev/fd/", "/proc/self/fd/"):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            return int(name[len(prefix) :])
    return None


def _write_all(fd: int, data: bytes) -> None:
    if fd in (1, 2):  # (what Python buffered for it goes first)
        (sys.stdout if fd == 1 else sys.stderr).flush()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _target(path: Path) -> Path:
    """The file a write to `path` replaces: the target of a link the user owns (a link someone
    else planted, in /tmp say, is replaced itself, as the kernel's protected_symlinks would
    have it); a directory (or a name without one: `.`, `/`, empty) raises `IsADirectoryError`."""
    own = path.is_symlink() and path.lstat().st_uid == os.getuid()
    target = Path(os.path.realpath(path)) if own else path  # (realpath: loops stay as named)
    if target.is_dir() or not target.name or target.name in (".", ".."):
        raise IsADirectoryError(21, "is a directory", str(path))
    return target


def _stream(path: Path) -> bool:
    """Whether `path` (or what its links lead to) is a character device or a pipe (written
    into, never replaced)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _temp_beside(path: Path, private: bool = True) -> tuple[int, Path]:
    """A new file next to `path`, opened for writing, mode exactly 0600 (`private`, else
    0666 less the umask)."""
    tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, FILE_MODE if private else 0o666)
    if private:
        os.fchmod(fd, FILE_MODE)  # the umask may have taken bits off (never added any)
    return fd, tmp


@contextmanager
def _replacing(tmp: Path, path: Path) -> Iterator[None]:
    """Move `tmp` onto `path` when the block succeeds; remove it when it raises."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
