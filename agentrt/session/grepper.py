"""The agent's `grep` tool as a process of its own (`python -I grepper.py PATTERN ROOT CWD`), so
that a search that never ends (a pattern with catastrophic backtracking) can be stopped: the
lines matching PATTERN in ROOT (a file, or the files under a directory; links and files of 2 MB
or more skipped, and anything outside CWD) as `path:line: text`, at most `MAX_HITS`. Standard
library only: it imports nothing of agentrt (it starts in tens of milliseconds)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

MAX_HITS = 200
MAX_FILE_BYTES = 2_000_000


def _files(root: Path, cwd: Path):
    for file in [root] if root.is_file() else sorted(root.rglob("*")):
        real = file.resolve()
        if file.is_symlink() or cwd not in (real, *real.parents):
            continue  # never follow links out of the working directory
        if file.is_file() and file.stat().st_size < MAX_FILE_BYTES:
            yield file


def search(pattern: str, root: Path, cwd: Path) -> None:
    """Print the matching lines (or "(no matches)")."""
    regex, hits = re.compile(pattern), 0
    for file in _files(root, cwd):
        try:
            lines = file.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for number, line in enumerate(lines, 1):
            if regex.search(line):
                if hits == MAX_HITS:
                    print(f"[stopped at {MAX_HITS} matching lines]")
                    return
                print(f"{file.relative_to(cwd)}:{number}: {line[:200]}", flush=hits % 20 == 0)
                hits += 1
    if not hits:
        print("(no matches)")


if __name__ == "__main__":
    sys.stdout.reconfigure(encoding="utf-8", errors="replace")
    search(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
