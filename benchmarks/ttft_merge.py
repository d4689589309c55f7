"""Merge `bench ttft` reports that each replayed part of the traces or cache modes (a replay
split over several runs to fit a time limit, e.g. `--cache semantic` over every trace in one,
`--cache off` over one trace at a time in others): per variant and mode, the TTFT table and
the off/semantic ratios over every request. Prints the table and the merged report as JSON.

    python benchmarks/ttft_merge.py semantic.json off-a.json off-b.json [--json merged.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentrt.bench.ttft import merge_reports
from agentrt.replay.replay import summary_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="also write the merged report here")
    args = parser.parse_args()
    try:
        merged = merge_reports([json.loads(path.read_text()) for path in args.reports])
    except (OSError, ValueError, KeyError, TypeError) as exc:  # (InvalidArgumentError too)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for variant, reports in merged["reports"].items():
        print(f"[{variant}]\n{summary_table(reports)}")
        for rep in reports:
            if rep["summary"]["missing_requests"]:
                print(
                    f"warning: {variant}/{rep['summary']['cache']} lacks "
                    f"{rep['summary']['missing_requests']} requests the other modes replayed",
                    file=sys.stderr,
                )
    print(json.dumps(merged["ratios"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(merged, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
