"""The llama.cpp side of the side-by-side table, from what `llamacpp.sh bench` wrote into a
folder: per configuration (`--n-cpu-moe N`, every expert on the CPU, or `-ngl N` layers) its
peak GPU memory and llama-bench's tokens/s for each prompt length (pp) and for generation
(tg); which N is the fewest within the budget and which is the fastest there.

    python benchmarks/llamacpp/summarize.py OUT_DIR [--budget-mib 16384]

Prints a Markdown table, then a JSON line with the same rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _peak(path: Path) -> int | None:
    if not path.is_file():
        return None
    values = [int(v) for v in path.read_text().split() if v.strip().isdigit()]
    return max(values) if values else None


def rows(folder: Path) -> list[dict]:
    """One row per llama-bench run found in `folder`."""
    out = []
    for file in sorted(folder.glob("llama_bench_*.json")):
        config = file.stem[len("llama_bench_") :]
        try:
            runs = json.loads(file.read_text() or "[]")
        except json.JSONDecodeError:
            runs = []
        row: dict = {"config": config, "peak_mib": _peak(folder / f"mem_{config}.txt")}
        layers = int(config[3:]) if config.startswith("ngl") and config[3:].isdigit() else None
        for run in runs:
            if layers is not None and run.get("n_gpu_layers") != layers:
                continue  # (llama-bench runs every -ngl it is given: only the config's own)
            kind = f"pp{run['n_prompt']}" if run.get("n_prompt") else f"tg{run.get('n_gen')}"
            row[kind] = round(float(run["avg_ts"]), 1)
            row.setdefault("build_commit", run.get("build_commit"))
        out.append(row)
    return out


def choose(table: list[dict], budget_mib: int) -> dict:
    """The fewest CPU-expert layers whose peak stays within the budget, and the fastest
    generation among those within it."""
    fitting = [r for r in table if r["config"].isdigit() and (r["peak_mib"] or 0) <= budget_mib]
    tg = [k for r in table for k in r if k.startswith("tg")]
    fewest = min(fitting, key=lambda r: int(r["config"]), default=None)
    best = max(fitting, key=lambda r: r.get(tg[0], 0.0), default=None) if tg else None
    return {
        "fewest_fitting": fewest["config"] if fewest else None,
        "fastest_fitting": best["config"] if best else None,
    }


def markdown(table: list[dict]) -> str:
    keys = sorted({k for r in table for k in r if k.startswith(("pp", "tg"))}, key=_order)
    head = ["config", "peak GPU MiB", *keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        name = _name(r["config"])
        cells = [name, str(r["peak_mib"])] + [str(r.get(k, "")) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _name(config: str) -> str:
    if config == "all":
        return "-ot exps=CPU"
    if config.startswith("ngl"):
        return f"-ngl {config[3:]} (layer split)"
    return f"--n-cpu-moe {config}"


def _order(key: str) -> tuple:
    return (key.startswith("tg"), int(key[2:]) if key[2:].isdigit() else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--budget-mib", type=int, default=16384)
    args = parser.parse_args()
    table = rows(args.folder)
    print(markdown(table))
    print(json.dumps({"rows": table, **choose(table, args.budget_mib)}))


if __name__ == "__main__":
    main()
