"""How the agent's `run_command` tool runs a shell command: the user's approval first (`ask`,
`auto`, `never`), then `/bin/sh -c` with an allow-listed environment (names that look like
secrets never pass), inside bubblewrap where it works (read-only system directories, the working
directory the only writable one, a private /tmp, fresh /proc and /dev, no capabilities, no
network unless allowed), with the output kept in memory capped and the whole process group
killed on timeout.

A refusal is returned as the tool result, never raised. This module knows nothing of models,
chat or the tool registry.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from agentrt.env import snapshot
from agentrt.errors import InvalidArgumentError

APPROVE_MODES = ("ask", "auto", "never")
SANDBOX_MODES = ("auto", "bwrap", "none")
ENV_ALLOW = frozenset(
    "PATH HOME LANG LANGUAGE TERM COLORTERM NO_COLOR TZ USER LOGNAME SHELL TMPDIR "
    "COLUMNS LINES PAGER EDITOR".split()
)
ENV_ALLOW_PREFIXES = ("LC_",)
SECRET_NAME = re.compile(
    r"KEY|TOKEN|SECRET|PASS|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE", re.IGNORECASE
)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
MAX_OUTPUT = 8000  # characters of a tool's output the model sees
# bytes kept from each end of a command's output: at least MAX_OUTPUT / 2 characters
CAPTURE_BYTES = 2 * MAX_OUTPUT

NEVER = "[not run: running commands is turned off (--approve never).]"
NO_TERMINAL = (
    "[not run: no one could approve this command (agentrt has no terminal to ask on). "
    "The user can allow commands with `agentrt run --approve auto`.]"
)
DECLINED = "[not run: the user declined this command.]"

# characters a terminal does not print as themselves: C0/C1 controls but newline and tab (a
# carriage return or an escape sequence can overwrite what the approval prompt shows), and
# Unicode's invisible and bidirectional formatting characters (which can reorder it)
HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
# seconds a command's output may stay open after the command exits (a background process
# holding it): then the process group is killed
EXIT_GRACE_S = 1.0


def truncate(text: str, limit: int = MAX_OUTPUT, dropped: int = 0) -> str:
    """`text` cut to its first and last `limit / 2` characters; `dropped` more characters are
    known to be missing from its middle already."""
    if len(text) + dropped <= limit:
        return text
    omitted = len(text) + dropped - limit
    return text[: limit // 2] + f"\n[... {omitted} characters omitted ...]\n" + text[-limit // 2 :]


def clean_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed variables of `environ`, minus any whose name looks like a secret."""
    return {
        name: value
        for name, value in environ.items()
        if (name in ENV_ALLOW or name.startswith(ENV_ALLOW_PREFIXES))
        and not SECRET_NAME.search(name)
    }


def check_mode(kind: str, value: str, modes: tuple[str, ...]) -> str:
    if value not in modes:
        raise InvalidArgumentError(f"{kind} must be one of {', '.join(modes)}, not {value!r}")
    return value


# ----------------------------------------------------------------------------- approval


@dataclass
class Approver:
    """Asks the user on the terminal before each command, unless `auto` or told `always`."""

    mode: str = "ask"
    always: bool = False

    def __post_init__(self) -> None:
        check_mode("approve", self.mode, APPROVE_MODES)

    def refusal(self, command: str, where: str) -> str | None:
        """None when `command` may run, else the tool result saying why it did not."""
        if self.mode == "auto" or self.always:
            return None
        if self.mode == "never":
            return NEVER
        if not sys.stdin.isatty():
            return NO_TERMINAL
        return self._ask(command, where)

    def _ask(self, command: str, where: str) -> str | None:
        shown = visible(command)
        print(f"\nagentrt: the model wants to run ({where}):\n  $ {shown}", file=sys.stderr)
        if shown != command:
            print("  (characters a terminal would not show are escaped)", file=sys.stderr)
        print("Run it? [y]es / [N]o / [a]lways for this run: ", end="", file=sys.stderr)
        sys.stderr.flush()
        try:
            answer = input().strip().lower()
        except EOFError:
            answer = ""
        if answer in ("a", "always"):
            self.always = True
        return None if answer in ("y", "yes", "a", "always") else DECLINED


def visible(command: str) -> str:
    """`command` with the characters a terminal would not print as themselves escaped."""
    return HIDDEN.sub(lambda m: ascii(m.group())[1:-1], command)


# ----------------------------------------------------------------------------- sandbox


def bwrap_args(workdir: Path, allow_network: bool) -> list[str]:
    """bubblewrap options: new namespaces (the network's too unless `allow_network`), no
    capabilities, system directories read-only, private /tmp, `workdir` the only writable one."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if allow_network:
        args += ["--share-net", "--ro-bind-try", "/run/systemd/resolve", "/run/systemd/resolve"]
    for path in map(Path, SYSTEM_DIRS):
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    args += ["--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
    return args + ["--bind", str(workdir), str(workdir), "--chdir", str(workdir)]


@functools.cache
def bwrap_problem() -> str | None:
    """None when bubblewrap can build the sandbox here, else why not (one line)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap (bubblewrap) is not installed"
    with tempfile.TemporaryDirectory() as tmp:
        argv = [bwrap, *bwrap_args(Path(tmp), False), "/bin/sh", "-c", "true"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap is installed but cannot create a sandbox here ({exc})"
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return f"bwrap is installed but cannot create a sandbox here ({reason})"
    return None


@functools.cache
def notice(text: str) -> None:
    """Print `text` on stderr once per process."""
    print(f"agentrt: {text}", file=sys.stderr)


@dataclass(frozen=True)
class Sandbox:
    """Where commands run: inside bubblewrap (`bwrap` set) or straight on the host."""

    bwrap: str | None = None
    allow_network: bool = False

    @classmethod
    def open(cls, mode: str = "auto", allow_network: bool = False, quiet: bool = False) -> Sandbox:
        """`auto`: bwrap where it works (else say once that commands are not sandboxed);
        `bwrap`: bwrap or an error; `none`: no sandbox."""
        check_mode("sandbox", mode, SANDBOX_MODES)
        if mode == "none":
            return cls(None, allow_network)
        problem = bwrap_problem()
        if problem is None:
            return cls(shutil.which("bwrap"), allow_network)
        if mode == "bwrap":
            raise InvalidArgumentError(
                f"--sandbox bwrap: {problem}; use --sandbox none to run without"
            )
        if not quiet:
            notice(f"{problem}; the agent's commands are NOT sandboxed")
        return cls(None, allow_network)

    def describe(self, workdir: Path) -> str:
        if self.bwrap is None:
            return f"in {workdir}, not sandboxed"
        net = "with network" if self.allow_network else "no network"
        return f"in {workdir}, sandboxed: only this directory writable, {net}"

    def argv(self, command: str, workdir: Path) -> list[str]:
        shell = ["/bin/sh", "-c", command]
        if self.bwrap is None:
            return shell
        return [self.bwrap, *bwrap_args(workdir, self.allow_network), *shell]

    def env(self, environ: Mapping[str, str]) -> dict[str, str]:
        env = clean_env(environ)
        if self.bwrap is not None:
            env.update(HOME="/tmp", TMPDIR="/tmp")  # the sandbox's private /tmp
        return env

    def run(self, command: str, workdir: Path, timeout: float) -> str:
        """Run `command` in `workdir`; its exit code and capped output, or a timeout note."""
        return run_capped(self.argv(command, workdir), workdir, self.env(snapshot()), timeout)


# ----------------------------------------------------------------------------- running


@dataclass
class CappedOutput:
    """Reads a pipe to its end on a thread, keeping only its first and last `limit` bytes."""

    stream: IO[bytes]
    limit: int = CAPTURE_BYTES
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    total: int = 0

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for chunk in iter(lambda: self.stream.read1(65536), b""):
            self.total += len(chunk)
            room = max(self.limit - len(self.head), 0)
            self.head += chunk[:room]
            self.tail += chunk[room:]
            del self.tail[: -self.limit]

    def text(self) -> str:
        """The output as the model sees it: at most `MAX_OUTPUT` characters."""
        head = bytes(self.head).decode(errors="replace")
        tail = bytes(self.tail).decode(errors="replace")
        return truncate(head + tail, dropped=self.total - len(self.head) - len(self.tail))


def run_capped(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Run `argv` with no stdin in its own process group; kill the group after `timeout` s,
    when the caller is interrupted, or `EXIT_GRACE_S` after the command exits with processes
    it left in the background still holding its output."""
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out = CappedOutput(proc.stdout)
    try:
        try:
            proc.wait(timeout=timeout)
            out.thread.join(min(max(deadline - time.monotonic(), 0.0), EXIT_GRACE_S))
        except subprocess.TimeoutExpired:
            pass
    except BaseException:  # e.g. Ctrl-C: its own session never got the signal
        _kill_group(proc)
        raise
    if proc.returncode is not None and not out.thread.is_alive():
        proc.stdout.close()
        return f"[exit code {proc.returncode}]\n{out.text()}"
    exited = proc.returncode  # (before the kill: None when the command itself timed out)
    _kill_group(proc)
    out.thread.join(1.0)
    if exited is not None:
        return f"[exit code {exited}; the processes it left running were killed]\n{out.text()}"
    return f"[timed out after {timeout:g} s]\n{out.text()}"


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # (the group may be gone already)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
