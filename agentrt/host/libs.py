"""The shared libraries this process has loaded (from `/proc/self/maps`): how agentrt finds the
OpenMP runtime and the CUDA runtime that torch loaded, whose C entry points it calls through
ctypes (`cputhreads`, `offload.copies`)."""

from __future__ import annotations

import sys


def loaded_libraries(needle: str) -> list[str]:
    """Paths of the loaded shared objects whose path contains `needle`, sorted (empty off Linux
    or where the process's maps cannot be read)."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if needle in line})
    except OSError:
        return []
