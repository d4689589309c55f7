"""`agentrt bench statecache`: the state cache's checkpoint sizes, writer throughput, restores
against recompute and capture overhead, or (--fidelity) how exactly a restored turn continues."""

from __future__ import annotations

import click

from agentrt.cli.bench import bench, model_bench_options
from agentrt.cli.options import csv_ints, one_value, resolve_device
from agentrt.cli.tables import print_report as _report
from agentrt.cli.unused import only_with
from agentrt.cli.values import fits_context


@bench.command("statecache")
@model_bench_options
@click.option(
    "--lengths",
    default="8192,32768,65536",
    show_default=True,
    callback=csv_ints,
    help="Comma-separated prefix lengths.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default="bench-state",
    show_default=True,
    help="Scratch state directory: new, empty, or made by an earlier run (emptied first; any "
    "other is refused).",
)
@click.option(
    "--capture-every",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    help="Spacing of the boundaries in the many-checkpoints prefill.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    help="Timing rounds per length (default: 7 up to 8K tokens, 3 up to 32K, then 1); with "
    "--fidelity, random prompts per length (default 3).",
)
@click.option(
    "--fidelity",
    is_flag=True,
    help="Instead of timings: a turn from a restored checkpoint against the same turn "
    "recomputed, beside the engine's own noise (other chunk sizes), one pass and, for small "
    "models, fp32 on the CPU: |delta logit|, KL, top-1 and greedy agreement, per capture design.",
)
@click.option(
    "--suffix",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="With --fidelity: tokens prefilled after the checkpoint.",
)
@click.option(
    "--generate",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="With --fidelity: greedy tokens generated from each state.",
)
@click.option(
    "--prefill-chunk",
    type=click.IntRange(min=2),
    default=2048,
    show_default=True,
    help="With --fidelity: the engine's chunk (the noise floor runs half and twice this).",
)
def bench_statecache(model, device, dtype, linear_attn, seed, eager, json_out, lengths, **o):
    """Checkpoint bytes, writer throughput, restore latency vs recompute, capture overhead;
    with --fidelity, how exactly a restored checkpoint continues."""
    extra = o["suffix"] + o["generate"] if o["fidelity"] else 0
    fits_context(model, max(lengths) + extra, "--lengths")
    dev, state_dir, rounds = resolve_device(device), o["state_dir"], o["rounds"]

    def note(text: str) -> None:
        click.echo(text, err=True)

    only_with(["eager"], "where a benchmark decodes")
    if o["fidelity"]:
        only_with(["capture_every"], "without --fidelity")
        from agentrt.bench.fidelity import fidelity as run

        kwargs = dict(suffix=o["suffix"], generate=o["generate"], chunk=o["prefill_chunk"])
        kwargs |= dict(note=note, runs=rounds or 3)
        kwargs["linear_attn"] = one_value(linear_attn, "--linear-attn", "with --fidelity")
        result = run(model, dev, dtype, lengths, state_dir, seed, **kwargs)
    else:
        from agentrt.bench import statecache as b

        only_with(["suffix", "generate", "prefill_chunk"], "with --fidelity")
        one_value(linear_attn, "--linear-attn", "without --fidelity", only_auto=True)
        every = o["capture_every"]
        result = b.statecache(model, dev, dtype, lengths, state_dir, seed, every, rounds, note)
    _report(result, json_out)
