"""The `agentrt` command line (click). Every command has `--help`; user errors print one line
(`error: ...`) and exit with status 2, never a traceback.

Commands: `chat`, `serve`, `run`, `replay`, `trace import|gen|show`, `model make|info`,
`bench prefill|decode|accuracy|statecache|soak|ttft|bw`, `cache ls|stats|gc|clear`; one module
per group (`chat.py` also holds `run`, `traces.py` also `replay` and `bench ttft`, `bench_state.py`
`bench statecache`), the options they share in `options.py`.
"""

from __future__ import annotations

from agentrt.cli import (  # noqa: F401 (they register)
    bench,
    bench_state,
    cache,
    chat,
    model,
    serve,
    traces,
)
from agentrt.cli.main import main
from agentrt.cli.options import open_runtime, prepare_cpu_threads

__all__ = ["main", "open_runtime", "prepare_cpu_threads"]
