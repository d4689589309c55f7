"""The process environment: every environment variable agentrt reads or sets goes through here.

`setting(NAME)` reads `AGENTRT_<NAME>`; `home_dir()` is the root of agentrt's per-user files
(`AGENTRT_HOME`, else `$XDG_CACHE_HOME/agentrt`, else `~/.cache/agentrt`); `variable(name)` reads
another program's variable (a C compiler, OpenMP); `snapshot()` copies the whole environment for
child processes; `set_defaults` / `set_all` write variables that libraries read at import.
This module imports nothing of agentrt: every layer may use it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def setting(name: str, default: str | None = None) -> str | None:
    """`AGENTRT_<name>`, or `default`."""
    return os.environ.get(f"AGENTRT_{name}", default)


def bad_setting(name: str, value: str, expected: str, fallback: str) -> None:
    """Tell the user that `AGENTRT_<name>` holds `value`, not `expected`, and what runs instead."""
    print(f"agentrt: AGENTRT_{name}={value!r} is not {expected}; {fallback}", file=sys.stderr)


def switched_off(name: str) -> bool:
    """Whether `AGENTRT_<name>` is "0" (how agentrt's tunings are turned off)."""
    return setting(name) == "0"


def variable(name: str, default: str | None = None) -> str | None:
    """Another program's environment variable (CC, OMP_*, ...), or `default`."""
    return os.environ.get(name, default)


def snapshot() -> dict[str, str]:
    """A copy of the whole environment (for child processes, and reports)."""
    return dict(os.environ)


def set_defaults(values: dict[str, str]) -> None:
    """Set the variables not set yet (libraries that read them at import)."""
    for name, value in values.items():
        os.environ.setdefault(name, value)


def set_all(values: dict[str, str]) -> None:
    os.environ.update(values)


def home_dir() -> Path:
    """Root of agentrt's per-user files (models cache, state cache, calibration profiles)."""
    explicit = setting("HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = variable("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "agentrt"
