"""What a benchmark prints: its JSON report on stdout (and in `--json`), and a summary table on
stderr, one line per row of the report's `runs` (or `rows`) with its scalar fields as columns; a
report of several reports (`runs` keyed by setting) prints one table per setting."""

from __future__ import annotations

import json
from typing import Any

import click

from agentrt.cli.values import write_json

MAX_COLUMNS = 10
SCALARS = (str, int, float, bool, type(None))
OWN_TABLES = ("decode-offload", "prefill-offload")


def print_report(report: dict[str, Any], json_out: str | None) -> None:
    """The JSON on stdout (and in `json_out`), a summary table on stderr (offloaded decode and
    prefill print their own)."""
    click.echo(json.dumps(report, indent=2))
    write_json(json_out, report)
    if report.get("bench") in OWN_TABLES or _of_own(report):
        return
    if table := summary_tables(report):
        click.echo(table, err=True)


def _of_own(report: dict[str, Any]) -> bool:
    """A report of several reports that each printed their own table."""
    runs = report.get("runs")
    return isinstance(runs, dict) and all(
        isinstance(r, dict) and r.get("bench") in OWN_TABLES for r in runs.values()
    )


def summary_tables(report: dict[str, Any]) -> str:
    """The tables of `report` ("" when it has no rows to show)."""
    rows = report.get("runs", report.get("rows"))
    if isinstance(rows, dict):  # several reports, by setting
        parts = [(name, summary_tables(sub)) for name, sub in rows.items() if isinstance(sub, dict)]
        return "\n\n".join(f"[{name}]\n{table}" for name, table in parts if table)
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return ""
    keys = dict.fromkeys(k for row in rows for k, v in row.items() if isinstance(v, SCALARS))
    columns = list(keys)[:MAX_COLUMNS]
    cells = [columns] + [[_cell(row.get(k)) for k in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = [
        "  ".join(text.rjust(w) for text, w in zip(line, widths, strict=True)) for line in cells
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
