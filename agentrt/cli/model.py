"""`agentrt model make|info`: synthetic checkpoints and model inspection."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from agentrt.cli.main import main
from agentrt.cli.options import expert_format_option, json_option
from agentrt.cli.values import SEED, write_json


@main.group()
def model() -> None:
    """Create synthetic checkpoints and inspect model directories."""


@model.command("make")
@click.option(
    "--arch",
    type=click.Choice(["qwen3_5_moe", "qwen3_moe", "gpt_oss"]),
    default=None,
    help="Architecture (implied by real size names).",
)
@click.option(
    "--size",
    required=True,
    help="tiny, or a real shape: qwen3.5-35b-a3b, qwen3-30b-a3b, gpt-oss-20b, gpt-oss-120b.",
)
@click.option(
    "-o", "--out", required=True, type=click.Path(file_okay=False), help="Output directory."
)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default=None,
    help="Stored dtype (default: float32 for tiny sizes, bfloat16 for real sizes).",
)
@expert_format_option(
    "gpt-oss: routed experts in --dtype (model) or as the published checkpoints store them "
    "(mxfp4: `_blocks` / `_scales` pairs of random MXFP4 codes, 17/32 of a byte per weight); "
    "auto: mxfp4 for gpt-oss-20b and gpt-oss-120b, model for every other size."
)
@click.option("--force", is_flag=True, help="Write into a non-empty directory.")
def model_make(arch, size, out, seed, dtype, expert_format, force) -> None:
    """Write a seeded random-weight checkpoint with exact shapes (HF format)."""
    from agentrt.models.registry import SYNTHETIC_PREFIX
    from agentrt.models.synthetic import resolve_size, write_checkpoint
    from agentrt.models.tiny import build_tiny
    from agentrt.session.options import packed_experts

    name = resolve_size(size, arch)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise click.UsageError(f"{out_dir} is not empty (use --force to write into it)")
    mxfp4 = packed_experts(expert_format, SYNTHETIC_PREFIX + name)  # (auto: as published)
    if mxfp4 and "gpt-oss" not in name:
        raise click.UsageError("--expert-format mxfp4 is for gpt-oss sizes")
    if name.startswith("tiny"):
        build_tiny(out_dir, name, mxfp4=mxfp4, seed=seed, dtype=dtype)
    else:
        with click.progressbar(length=1, label=f"writing {name}", file=sys.stderr) as bar:

            def progress(done: int, total: int) -> None:
                bar.length = total
                bar.update(done - bar.pos)

            write_checkpoint(name, out_dir, seed, dtype, progress, mxfp4=mxfp4)
    click.echo(f"wrote {name} to {out_dir}")


@model.command("info")
@click.argument("model_spec")
@json_option
def model_info(model_spec: str, json_out) -> None:
    """Describe MODEL_SPEC (a directory, 'tiny' or 'synthetic:NAME') without loading weights."""
    from agentrt.models.info import describe

    info = describe(model_spec)
    for key, value in info.items():
        click.echo(f"{key:>24}: {value}")
    write_json(json_out, info)
