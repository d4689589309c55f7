"""Decode right after each replayed turn, per cache mode, from `bench ttft` reports: decode
tok/s over every request but the first (a cold prompt), the offloaded decode's host step and
its parts per step (from each row's `timings.decode_offload`), the CPU experts' bytes per step,
TTFT mean / p50 / max, the restore's share of it, the writer's seconds per request, and the
state cache's counters. Prints one JSON line per report and mode.

    python benchmarks/ttft_decode_rows.py a.json [b.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

COUNTERS = ("waited_for_writer", "hold_overrun", "write_written", "write_errors", "dropped")


def _timing(row: dict[str, Any], name: str) -> Any:
    return (row.get("timings") or {}).get(name)


def decode_rows(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Decode rate and host-step figures over `rows` (the first request already left out)."""
    tokens = sum(max(r["completion_tokens"] - 1, 0) for r in rows)
    seconds = sum(r["decode_s"] for r in rows)
    steps: dict[str, float] = {}
    for row in rows:
        for key, value in (_timing(row, "decode_offload") or {}).items():
            steps[key] = steps.get(key, 0) + value
    n = steps.get("host_steps", 0)
    per_step = {
        f"{name}_ms": round(1e3 * steps.get(key, 0.0) / n, 3) if n else 0.0
        for name, key in (("host", "host_seconds"), ("plan", "plan_seconds"),
                          ("cpu_wait", "cpu_wait_seconds"))
    }  # fmt: skip
    return {
        "decode_tok_s": round(tokens / seconds, 2) if seconds else 0.0,
        **per_step,
        "cpu_MB_per_step": round(steps.get("cpu_timed_bytes", 0) / n / 1e6, 2) if n else 0.0,
    }


def summary(report: dict[str, Any]) -> dict[str, Any]:
    rows = report["requests"]
    ttft = [r["ttft_s"] for r in rows]
    restore = [_timing(r, "restore_s") or 0.0 for r in rows[1:]]
    writer = [_timing(r, "writer_s") or 0.0 for r in rows]
    stats = report.get("state_cache_stats") or {}
    return {
        "cache": report["summary"]["cache"],
        "requests": len(rows),
        **decode_rows(rows[1:]),
        "ttft_mean_s": round(statistics.mean(ttft), 3),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_max_s": round(max(ttft), 3),
        "restore_s_range": [round(min(restore), 3), round(max(restore), 3)] if restore else [],
        "writer_s_mean": round(statistics.mean(writer), 3),
        "counters": {k: v for k, v in stats.items() if k.startswith(COUNTERS)},
    }


def main(paths: list[str]) -> int:
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 2
        for variant, reports in data["reports"].items():
            for report in reports:
                print(json.dumps({"file": path, "variant": variant, **summary(report)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
