"""`agentrt cache ls|stats|gc|clear`: inspect and manage a state directory."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from agentrt.cli.main import main
from agentrt.cli.options import json_option
from agentrt.cli.values import Finite, write_json
from agentrt.errors import AgentrtError


@main.group()
def cache() -> None:
    """Inspect and manage the state cache (checkpoints of KV + recurrent state)."""


def _state_dir_option(fn):
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="State cache directory (default: ~/.cache/agentrt/state).",
    )(fn)


def _open_store(state_dir: str | None, must_exist: bool = True):
    from agentrt.statecache.config import StateCacheConfig
    from agentrt.statecache.store import Store

    return Store(_state_path(state_dir, must_exist), StateCacheConfig().max_bytes)


def _state_path(state_dir: str | None, must_exist: bool = True) -> Path:
    from agentrt.statecache.config import default_state_dir

    path = Path(state_dir).expanduser() if state_dir else default_state_dir()
    if must_exist and not (path / "data.mdb").is_file():
        raise AgentrtError(f"no state cache in {path}")
    return path


@cache.command("ls")
@_state_dir_option
@json_option
def cache_ls(state_dir, json_out) -> None:
    """List stored checkpoints, most recently used first."""
    from agentrt.statecache.report import list_rows

    store = _open_store(state_dir)
    rows = list_rows(store)
    store.close()
    for row in rows:
        click.echo(
            f"{row['key']}  {row['model'][:24]:<24} {row['tokens']:>8} tok  {row['kind']:<16}"
            f" {row['mib']:>9.2f} MiB  hits {row['hits']:>4}  used {row['last_used']}"
        )
    click.echo(f"{len(rows)} checkpoint(s)", err=True)
    write_json(json_out, rows)


@cache.command("stats")
@_state_dir_option
@json_option
def cache_stats(state_dir, json_out) -> None:
    """Totals: records, chunks, bytes, hits, per model."""
    from agentrt.statecache.report import stats

    store = _open_store(state_dir)
    info = stats(store)
    store.close()
    for key, value in info.items():
        click.echo(f"{key:>16}: {value}")
    write_json(json_out, info)


@cache.command("gc")
@_state_dir_option
@click.option("--max-gb", type=Finite(0, 2**20), default=None, help="Evict down to this size.")
@click.option("--verify", is_flag=True, help="Check every payload's checksum; delete bad records.")
def cache_gc(state_dir, max_gb, verify) -> None:
    """Evict to a size cap, drop unreferenced chunks, optionally verify payloads."""
    from agentrt.statecache.report import verify_all

    store = _open_store(state_dir)
    evicted = store.evict(int(max_gb * 2**30)) if max_gb is not None else 0
    orphans = store.collect_orphans()
    bad = verify_all(store) if verify else 0
    store.close()
    click.echo(
        f"evicted {evicted} record(s), removed {orphans} orphan chunk(s), {bad} corrupt deleted"
    )


@cache.command("clear")
@_state_dir_option
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(state_dir, yes) -> None:
    """Delete every stored checkpoint: the database's files, or, while another process (a
    server) has it open, its records through LMDB."""
    from agentrt.statecache.mapmode import in_use

    path = _state_path(state_dir)
    _confirm(yes, f"delete all checkpoints in {path}?")
    if in_use(path):  # (its files stay: the other process keeps writing to them)
        store = _open_store(state_dir)
        store.clear()
        store.close()
    else:  # (no LMDB walk: a damaged database would abort it)
        for name in ("data.mdb", "lock.mdb"):
            (path / name).unlink(missing_ok=True)
        _open_store(state_dir, must_exist=False).close()  # (an empty one in their place)
    click.echo("cleared")


def _confirm(yes: bool, question: str) -> None:
    """Exit unless `yes` or the user says yes (130 without an answer, 1 for no)."""
    try:
        sure = yes or click.confirm(question)
    except click.Abort:  # Ctrl-C (or the end of input) at the question
        sure = None
    if not sure:
        stopped = "no answer: nothing deleted (--yes deletes without asking)"
        click.echo(stopped if sure is None else "nothing deleted", err=True)
        sys.exit(130 if sure is None else 1)


if __name__ == "__main__":  # pragma: no cover
    main()
