"""`agentrt trace import|gen|show`, `agentrt replay` and `agentrt bench ttft`: traces, their
replay, and worst-case TTFT over them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from agentrt.cli.bench import bench
from agentrt.cli.main import main
from agentrt.cli.options import (
    csv_choice,
    json_option,
    model_options,
    open_runtime,
    prepare_cpu_threads,
)
from agentrt.cli.unused import given, refuse
from agentrt.cli.values import SEED, Finite, output_path, write_json
from agentrt.errors import AgentrtError
from agentrt.offload.config import offload_mode


@main.group()
def trace() -> None:
    """Import, generate and inspect agent traces (the replay format)."""


def plot_path(ctx, param, value: str | None) -> str | None:
    """An output path (`output_path`) whose suffix matplotlib can write, checked before the
    replay rather than after it."""
    value = output_path(ctx, param, value)
    if value is not None:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise click.BadParameter("needs matplotlib: pip install 'agentrt[plot]'") from None
        formats = Figure().canvas.get_supported_filetypes()
        suffix = Path(value).suffix.lstrip(".").lower()
        if suffix and suffix not in formats:  # (none: PNG, `_variant_path`)
            raise click.BadParameter(f"{value!r}: a plot is one of .{', .'.join(sorted(formats))}")
    return value


TRACE_NAMES = (".jsonl", ".jsonl.zst")
_OTHER_FORMATS = (".json", ".zst", ".gz", ".bz2", ".xz", ".zip", ".tar")


def _check_trace_name(path: Path) -> None:
    """A name that looks like a file of another format is a mistake, not a directory to make
    or a plain-text trace to write under a compressed name."""
    if path.name.endswith(_OTHER_FORMATS) and not path.name.endswith(TRACE_NAMES):
        raise click.UsageError(f"-o: a trace file is .jsonl or .jsonl.zst, not {path.name}")


def _write_traces(traces, out: str, zst: bool) -> list[Path]:
    from agentrt.replay.trace import write_trace

    target = Path(out)
    if len(traces) == 1 and target.name.endswith(TRACE_NAMES):
        return [write_trace(traces[0], target)]
    if target.name.endswith(TRACE_NAMES):
        raise click.UsageError(f"{len(traces)} traces: -o must be a directory, not {out}")
    _check_trace_name(target)
    suffix = ".jsonl.zst" if zst else ".jsonl"
    names = _unique(traces)
    return [write_trace(t, target / (n + suffix)) for t, n in zip(traces, names, strict=True)]


def _unique(traces) -> list[str]:
    """The traces' file names, a repeated one numbered (`-2`, `-3`, ...) so none overwrites
    another (e.g. the same task run by two agents)."""
    names, seen = [], set()
    for t in traces:
        name, n = t.name, 1
        while name in seen:
            n += 1
            name = f"{t.name}-{n}"
        seen.add(name)
        names.append(name)
    return names


def _transform(traces, drop: bool, truncate: int | None):
    from agentrt.replay.trace import drop_reasoning, truncate_tool_outputs

    if drop:
        traces = [drop_reasoning(t) for t in traces]
    if truncate:
        traces = [truncate_tool_outputs(t, truncate) for t in traces]
    return traces


_drop_option = click.option(
    "--drop-reasoning", is_flag=True, help="Remove reasoning_content from every history."
)
_truncate_option = click.option(
    "--truncate-tool-outputs",
    type=click.IntRange(min=1),
    default=None,
    metavar="CHARS",
    help="Truncate tool outputs older than the last two to CHARS characters.",
)


@trace.command("import")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["tau-bench", "openhands", "mini-swe-agent"]),
    required=True,
)
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--out", required=True, help="A .jsonl[.zst] file (one trace) or a directory.")
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Keep only the first N sessions."
)
@click.option("--zst", is_flag=True, help="Write .jsonl.zst files when -o is a directory.")
@_drop_option
@_truncate_option
def trace_import(fmt, inputs, out, limit, zst, drop_reasoning, truncate_tool_outputs) -> None:
    """Convert recorded agent sessions (tau-bench, OpenHands, mini-swe-agent) into traces."""
    from agentrt.replay.importers import import_traces

    traces = import_traces(fmt, list(inputs))[:limit]
    if not traces:
        raise AgentrtError("no sessions found in the inputs")
    paths = _write_traces(_transform(traces, drop_reasoning, truncate_tool_outputs), out, zst)
    total = sum(len(t.requests) for t in traces)
    more = " ..." if len(paths) > 1 else ""
    click.echo(f"wrote {len(paths)} trace(s), {total} request(s): {paths[0]}{more}", err=True)


@trace.command("gen")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option(
    "--tokens",
    type=click.IntRange(min=1000),
    default=30000,
    show_default=True,
    help="Approximate size of the final request in tokens.",
)
@click.option("--max-turns", type=click.IntRange(min=1), default=150, show_default=True)
@click.option(
    "-o", "--out", required=True, callback=output_path, help="Output .jsonl or .jsonl.zst file."
)
def trace_gen(seed, tokens, max_turns, out) -> None:
    """Generate a synthetic coding-agent session from files of this machine."""
    from agentrt.replay.generator import estimated_tokens, generate
    from agentrt.replay.trace import write_trace

    _check_trace_name(Path(out))
    t = generate(seed, tokens, max_turns)
    path = write_trace(t, out)
    click.echo(f"wrote {path}: {len(t.requests)} requests", err=True)  # (-o /dev/stdout)
    if (reached := estimated_tokens(t)) < tokens:
        click.echo(
            f"note: --max-turns {max_turns} ended the session at about {reached} "
            f"tokens, short of --tokens {tokens}",
            err=True,
        )


@trace.command("show")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--requests", "show_requests", is_flag=True, help="One line per request.")
def trace_show(path, show_requests) -> None:
    """Summarise a trace file."""
    from agentrt.replay.trace import read_trace

    t = read_trace(path)
    click.echo(f"{path}: source={t.header.source!r} {t.header.description}")
    chars = [sum(len(json.dumps(m)) for m in r.messages) for r in t.requests]
    lo, hi = min(chars, default=0), max(chars, default=0)
    click.echo(f"{len(t.requests)} requests; history size {lo}..{hi} chars")
    if show_requests:
        for r, c in zip(t.requests, chars, strict=True):
            roles = "".join(str(m.get("role") or "?")[0] for m in r.messages)
            when = r.t if r.t is not None else "-"
            click.echo(
                f"  {r.id:<32} t={when:<8} msgs={len(r.messages):<4} {c:>8} chars  {roles[-24:]}"
            )


# ----------------------------------------------------------------------------- replay


def _load_traces(paths, drop: bool, truncate: int | None, max_requests: int | None = None):
    import msgspec

    from agentrt.replay.trace import read_trace

    traces = [read_trace(p) for p in paths]
    if not any(t.requests for t in traces):  # (a header alone: nothing to time)
        raise AgentrtError(f"no requests in {', '.join(str(p) for p in paths)}")
    if max_requests:
        traces = [msgspec.structs.replace(t, requests=t.requests[:max_requests]) for t in traces]
    return _transform(traces, drop, truncate)


_max_requests_option = click.option(
    "--max-requests",
    type=click.IntRange(min=1),
    default=None,
    help="Replay only the first N requests of each trace.",
)


def _run_replay(traces, target, max_tokens: int, label: str, json_out: str | None = None) -> dict:
    """Replay with a progress bar; the report. A request that cannot be replayed stops it:
    the report of the requests before it is still written to `json_out`, then the error."""
    from agentrt.replay.replay import ReplayStopped, replay, report

    total = sum(len(t.requests) for t in traces)
    try:
        with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
            rows = replay(traces, target, max_tokens, progress=lambda row: bar.update(1))
    except ReplayStopped as exc:
        if not json_out or not exc.rows:
            raise
        write_json(json_out, report(exc.rows, target))
        raise AgentrtError(
            f"{exc} (the report of the {len(exc.rows)} request(s) before it is in {json_out})"
        ) from None
    return report(rows, target)


@main.command("replay")
@model_options
@click.argument("traces", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--endpoint",
    default=None,
    help="Replay against this OpenAI-compatible URL instead of locally (--model is then the "
    "model name sent; the server's own settings apply).",
)
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="Bearer key for --endpoint.")
@click.option(
    "--endpoint-timeout",
    type=Finite(min=1),
    default=3600.0,
    show_default=True,
    help="With --endpoint: seconds to wait for the server's next bytes before the replay stops "
    "with an error.",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    callback=plot_path,
    help="Write a plot of TTFT per request (PNG, or another format matplotlib writes: .svg, .pdf).",
)
@_drop_option
@_truncate_option
@_max_requests_option
@json_option
def replay_cmd(
    traces,
    endpoint,
    api_key,
    endpoint_timeout,
    max_tokens,
    plot,
    drop_reasoning,
    truncate_tool_outputs,
    max_requests,
    json_out,
    **opts,
):
    """Replay TRACES and report TTFT (p50/p90/p99/max) and cached vs prefilled tokens."""
    from agentrt.replay.replay import endpoint_target, local_target, summary_table
    from agentrt.replay.replay import plot as draw

    if endpoint:
        _refuse_local_options(opts)
    else:
        refuse(given(["api_key", "endpoint_timeout"]), "used only with --endpoint")
    loaded = _load_traces(traces, drop_reasoning, truncate_tool_outputs, max_requests)
    if endpoint:
        target = endpoint_target(endpoint, opts["model"], api_key, endpoint_timeout)
    else:
        target = local_target(open_runtime(opts, require_tokenizer=True))
    rep = _run_replay(loaded, target, max_tokens, f"replay ({target.cache})", json_out)
    click.echo(summary_table([rep]))
    write_json(json_out, rep)
    if plot:
        draw([rep], plot)


def _refuse_local_options(opts: dict) -> None:
    """With --endpoint the server's model and settings answer: options of a local runtime given
    on the command line (all of `model_options` but --model, the name sent) would be ignored."""
    local = given(name for name in opts if name != "model")
    why = "for local replays: with --endpoint the server's settings apply (--model is the model "
    refuse(local, why + "name sent to it)")


@bench.command("ttft")
@model_options(cache_list=True)
@click.argument("traces", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--variants",
    default="recorded",
    show_default=True,
    callback=csv_choice("recorded", "dropped"),
    help="recorded, and/or dropped (earlier reasoning removed from histories).",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    callback=plot_path,
    help="PNG file (or .svg, .pdf, ...); with several variants one per variant, named "
    "FILE-VARIANT.png.",
)
@_max_requests_option
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Requests of the first trace run once, untimed, before any mode (compilation, "
    "autotuning and graph capture then count in no mode's figures); 0 turns it off.",
)
@json_option
def bench_ttft(traces, variants, max_tokens, plot, max_requests, warmup, json_out, **opts) -> None:
    """Replay TRACES in every --cache mode with one loaded model per --offload/--split setting;
    TTFT per mode and ratios (several settings: one result each, under `settings`).

    Every mode starts from an empty state cache: a fresh directory, made inside --state-dir
    when given (else in the system's temporary directory) and removed after the mode."""
    offloads, splits = opts.pop("offload") or [None], opts.pop("split")
    budgeted = opts.get("vram_budget") or opts.get("expert_cache_slots")
    settings = [  # (--split changes only what auto does, or a budget's default)
        (offload, split)
        for offload in offloads
        for split in splits
        if split == splits[0] or offload == "auto" or (offload is None and budgeted)
    ]
    budget, slots = opts.get("vram_budget"), opts.get("expert_cache_slots")
    modes = [offload_mode(offload, budget, slots) for offload, _ in settings]
    prepare_cpu_threads(opts["device"], modes)  # (before anything imports torch)
    results, one_setting = {}, len(settings) == 1
    for offload, split in settings:
        parts = (offload, None if split == "on" else "no-split")
        label = "/".join(filter(None, parts)) or "default"
        if len(settings) > 1:
            click.echo(f"\n== {label} ==", err=True)
        setting = {**opts, "offload": offload, "split": split}
        if offload not in (None, "auto"):  # (the slots size auto's cache)
            setting["expert_cache_slots"] = None
        one = one_setting or not plot
        stem = plot if one else _variant_path(plot, label.replace("/", "-"))
        done = dict(results)  # (each save holds every finished setting and this one's part)
        save = lambda report, label=label, done=done: write_json(  # noqa: E731
            json_out, report if one_setting else {"settings": {**done, label: report}}
        )
        results[label] = _ttft_setting(
            traces, variants, max_tokens, stem, max_requests, warmup, save, setting
        )


def _ttft_setting(traces, variants, max_tokens, plot, max_requests, warmup, save, opts) -> dict:
    """`bench ttft` for one expert placement: its result, passed to `save` after every mode and
    at the end."""
    from agentrt.bench import ttft as b
    from agentrt.session.options import cache_config

    rt = open_runtime({**opts, "cache": "off"}, require_tokenizer=True, check_unused=False)
    placement = setting_of(opts)
    result = b.ttft(
        rt,
        lambda drop: _load_traces(traces, drop, None, max_requests),
        opts["cache"],
        variants,
        max_tokens,
        lambda traces_, target, label: _run_replay(traces_, target, max_tokens, label),
        warmup,
        partial=lambda report: save({**report, "setting": placement}),  # (kept if cut)
        state=cache_config(None, None, opts.get("state_max_gb")),
        state_root=opts.get("state_dir"),
    )
    result["setting"] = placement
    for variant, reports in result["reports"].items():
        click.echo(f"\n[{variant}]")
        from agentrt.replay.replay import summary_table

        click.echo(summary_table(reports))
        if plot:
            from agentrt.replay.replay import plot as draw

            draw(
                reports,
                plot if len(result["reports"]) == 1 else _variant_path(plot, variant),
                variant,
            )
    click.echo(json.dumps(result["ratios"], indent=2))
    save(result)
    rt.close()
    return result


def setting_of(opts: dict) -> dict:
    """The expert placement a `bench ttft` result was measured with."""
    keys = ("offload", "split", "vram_budget", "expert_cache_slots")
    return {k: opts.get(k) for k in keys}


def _variant_path(plot: str, variant: str) -> str:
    """`ttft.png` -> `ttft-VARIANT.png` (any suffix, or none: `.png` added)."""
    path = Path(plot)
    return str(path.with_name(f"{path.stem}-{variant}{path.suffix or '.png'}"))
