"""Options and helpers shared by the `agentrt` commands: the model and runtime options (defined
once, turned into `Runtime.open` arguments by `open_runtime`), expert-placement options,
comma-separated list parsing, `--json` output, and the group class that turns user errors into
one-line messages."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from agentrt.cli.unused import refuse_unused
from agentrt.cli.values import SEED, Finite, output_path
from agentrt.errors import AgentrtError, InvalidArgumentError
from agentrt.offload.config import (
    CPU_KERNELS,
    PREFILL_PLANS,
    OffloadConfig,
    offload_mode,
    parse_bytes,
)
from agentrt.offload.policy import HALF_LIFE

DEVICE_HELP = "cpu, cuda, or auto (cuda when available)."
MODEL_HELP = (
    "A HF-format directory, 'tiny' (embedded default), or 'synthetic:NAME' "
    "(e.g. synthetic:qwen3.5-35b-a3b)."
)


class AgentrtGroup(click.Group):
    """Turns agentrt's user errors, and click's usage errors, into one-line messages."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AgentrtError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except click.UsageError as exc:  # bad options or arguments: one line too, and where to look
            _usage_error(exc, ctx)
        except OSError as exc:  # a path the user gave that cannot be read, written or made
            where = f": {exc.filename}" if exc.filename else ""
            click.echo(f"error: {exc.strerror or exc}{where}", err=True)
            sys.exit(2)
        except Exception as exc:
            damage = sys.modules.get("agentrt.statecache.damage")  # (loaded with the store)
            if damage is None or not isinstance(exc, damage.CORRUPTION):
                raise
            click.echo(f"error: {damage.damaged(None, exc)}", err=True)  # (met past the open)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """The group's own options (`agentrt --bogus`): the same one-line usage errors."""
        try:
            return super().parse_args(ctx, args)
        except _NO_ARGS:  # (no command: the help is shown)
            raise
        except click.UsageError as exc:
            _usage_error(exc, ctx)


# click >= 8.2 shows the help through this usage error when no command is given
_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _usage_error(exc: click.UsageError, ctx: click.Context):
    """Print `exc` as one line naming the --help to read, and exit with its status (2)."""
    where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
    click.echo(f"error: {exc.format_message()} (see `{where} --help`)", err=True)
    sys.exit(exc.exit_code)


def prepare_cpu_threads(device: str, offloads: list[str]) -> None:
    """Before torch loads: spinning OpenMP workers for offloaded decode on a GPU, where the CPU
    computes experts in short bursts between GPU steps (see `agentrt.host.cputhreads`)."""
    from agentrt.host.cputhreads import spin_between_steps

    gpu = device == "cuda" or (device == "auto" and Path("/dev/nvidiactl").exists())
    spin_between_steps(gpu and any(mode != "none" for mode in offloads))


def resolve_device(device: str) -> str:
    """`auto`: CUDA where there is a GPU, else the CPU; any other device checked (a missing
    GPU is a one-line error, not torch's traceback)."""
    if device != "auto":
        from agentrt.session.options import check_device

        return check_device(device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def csv_items(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def csv_choice(*choices: str):
    """click callback: a comma-separated list whose items must be among `choices`."""

    def parse(ctx, param, value: str | None) -> list[str] | None:
        if value is None:  # an option without a default: not given
            return None
        items = csv_items(value)
        bad = [i for i in items if i not in choices]
        if bad or not items:
            raise click.BadParameter(
                f"expected a comma-separated list of {', '.join(choices)}, got {value!r}"
            )
        return items

    return parse


def csv_option(name: str, choices: tuple[str, ...], default: str | None, help: str):
    """A comma-separated list option whose items must be among `choices`."""
    return click.option(
        name,
        default=default,
        show_default=default is not None,
        callback=csv_choice(*choices),
        help=help,
    )


def one_of(*choices: str):
    def check(ctx, param, value: str) -> str:
        if value not in choices:
            raise click.BadParameter(f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def csv_ints(ctx, param, value: str) -> list[int]:
    try:
        items = [int(x) for x in csv_items(value)]
    except ValueError:
        items = []
    if not items or min(items) < 1:
        raise click.BadParameter(
            f"expected a comma-separated list of positive integers, got {value!r}"
        )
    return items


def csv_sizes_or_none(ctx, param, value: str | None) -> list[float] | None:
    """A comma-separated list of positive numbers (e.g. 0.5,1.5); empty or unset: None."""
    if value is None or not value.strip():
        return None
    try:
        items = [float(x) for x in csv_items(value)]
    except ValueError:
        items = []
    if not items or min(items) <= 0 or not all(x < float("inf") for x in items):
        raise click.BadParameter(
            f"expected a comma-separated list of positive numbers, got {value!r}"
        )
    return items


def size_text(ctx, param, value: str | None) -> str | None:
    """A size option (e.g. --vram-budget 16GiB) checked before any work; kept as written."""
    if value is not None:
        try:
            parse_bytes(value)
        except InvalidArgumentError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def csv_ints_or_empty(ctx, param, value: str) -> list[int]:
    """Like `csv_ints`, but an empty value is an empty list."""
    return csv_ints(ctx, param, value) if value.strip() else []


def model_options(fn=None, *, cache_list: bool = False):
    """Options shared by every command that opens a model (`cache_list`: --cache takes a
    comma-separated list of modes, for commands that compare them)."""
    if fn is None:
        return lambda f: model_options(f, cache_list=cache_list)
    cache_option = click.option(
        "--cache",
        default="semantic,prefix,off" if cache_list else "semantic",
        show_default=True,
        callback=csv_choice("semantic", "prefix", "off")
        if cache_list
        else one_of("semantic", "prefix", "off"),
        help="State reuse: semantic (checkpoints at boundaries, persisted), prefix (reuse the live "
        "state only when the prompt extends it), off."
        + (" Comma-separated list, each mode on an empty cache." if cache_list else ""),
    )
    options = [
        click.option("--model", "-m", default="tiny", show_default=True, help=MODEL_HELP),
        click.option("--device", default="auto", show_default=True, help=DEVICE_HELP),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "bfloat16", "float16"]),
            default=None,
            help="Weights/activations dtype (default: float32 on cpu, bfloat16 on cuda).",
        ),
        click.option(
            "--tokenizer",
            type=click.Path(file_okay=False),
            default=None,
            help="Tokenizer directory overriding the model's own.",
        ),
        click.option(
            "--chat-template",
            type=click.Path(dir_okay=False),
            default=None,
            help="Jinja chat template file overriding the tokenizer's.",
        ),
        click.option(
            "--reasoning-effort",
            type=click.Choice(["low", "medium", "high"]),
            default=None,
            help="Reasoning effort for requests that do not name one, for chat templates that "
            "take it (gpt-oss's; default: the template's own, medium).",
        ),
        click.option(
            "--chat-date",
            default=None,
            metavar="YYYY-MM-DD",
            help="The date chat templates that print today's date see (gpt-oss's does). "
            "Default: the day the runtime opened, so prompts keep their prefixes (and their "
            "cached states) past midnight.",
        ),
        cache_option,
        click.option(
            "--state-dir",
            type=click.Path(file_okay=False),
            default=None,
            help="Where each mode's fresh state cache directory is made (removed after the "
            "mode; default: the system's temporary directory)."
            if cache_list
            else "State cache directory (default: ~/.cache/agentrt/state).",
        ),
        click.option(
            "--state-max-gb",
            type=Finite(min=0, max=2**20, min_open=True),
            default=None,
            help="Cap on stored checkpoints in GiB; the least valuable are evicted (default 20).",
        ),
        click.option(
            "--boundary",
            "boundaries",
            multiple=True,
            help="Override a checkpoint boundary: KIND=TEXT (repeatable; TEXT may use \\n). "
            "Kinds: think_end, tool_call_end, tool_output_end, message_end, turn_start.",
        ),
        click.option(
            "--linear-attn",
            type=click.Choice(["auto", "torch", "fla"]),
            default="auto",
            show_default=True,
            help="Gated-delta-rule kernels: fla (CUDA + flash-linear-attention) or pure torch.",
        ),
        click.option(
            "--prefill-chunk",
            type=click.IntRange(min=1),
            default=None,
            help="Tokens per prefill chunk (default: 8192 with offloaded experts on CUDA, where "
            "each chunk streams the missing experts once, else 2048).",
        ),
        click.option(
            "--seed",
            type=SEED,
            default=0,
            show_default=True,
            help="Seed of synthetic weights and of sampling (a server draws the seeds of "
            "requests that name none from it, in arrival order).",
        ),
        click.option(
            "--eager", is_flag=True, help="Do not capture the decode step in a CUDA graph."
        ),
        click.option(
            "--prefill-graphs/--no-prefill-graphs",
            default=None,
            help="Run prompts and suffixes of up to 4096 tokens as CUDA-graph replays of padded "
            "lengths (64-3072), one launch instead of thousands (suffix prefill 2-2.5x faster "
            "on an H200). The graphs are captured when the model opens, on KV reserved for the "
            "model's whole context (or as much as a quarter of the free GPU memory holds), so "
            "no request captures them again.  [default: on for CUDA with the experts on the "
            "GPU, unless --eager; never used with offloaded experts]",
        ),
        *offload_options(lists=cache_list),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def on_off(name: str, help: str):
    """An on|off option, on by default."""
    return click.option(
        name, type=click.Choice(["on", "off"]), default="on", show_default=True, help=help
    )


def cpu_kernel_option(help: str):
    """--cpu-kernel auto|torch|native (auto by default)."""
    return click.option(
        "--cpu-kernel",
        type=click.Choice(list(CPU_KERNELS)),
        default="auto",
        show_default=True,
        help=help,
    )


def expert_format_option(help: str):
    """--expert-format auto|model|mxfp4 (auto by default: mxfp4 where the model's experts come
    as MXFP4)."""
    choices = click.Choice(["auto", "model", "mxfp4"])
    return click.option("--expert-format", type=choices, default="auto", show_default=True,
                        help=help)  # fmt: skip


def offload_options(lists: bool = False) -> list:
    """Expert placement options (docs/architecture.md §5); with `lists`, --offload and --split
    take comma-separated lists (for commands that compare settings)."""
    modes, listed = ("auto", "none", "static", "layer"), " Comma-separated list." if lists else ""
    return [
        click.option(
            "--offload",
            type=None if lists else click.Choice(modes),
            callback=csv_choice(*modes) if lists else None,
            default=None,
            help="Expert placement: auto (host store + GPU expert cache + CPU/GPU miss split), "
            "static (experts of the first --cpu-moe-layers layers on the CPU, like llama.cpp "
            "--n-cpu-moe), layer (the first --cpu-layers whole layers on the CPU, like Ollama), "
            "none (all on the device). Default: auto with --vram-budget or "
            "--expert-cache-slots, else none." + listed,
        ),
        click.option(
            "--vram-budget",
            default=None,
            callback=size_text,
            help="Cap on device memory, e.g. 16GiB (sizes the expert cache).",
        ),
        click.option(
            "--expert-cache-slots",
            type=click.IntRange(min=1),
            default=None,
            help="Explicit expert-cache size (overrides --vram-budget).",
        ),
        click.option(
            "--split",
            default="on",
            show_default=True,
            type=None if lists else click.Choice(["on", "off"]),
            callback=csv_choice("on", "off") if lists else None,
            help="off: every miss is copied (no CPU compute)." + listed,
        ),
        on_off(
            "--prefetch",
            "For --offload auto: while a layer computes, copy ahead the experts the next "
            "layer's router predicts from its input (CUDA-graph decode; eager decode on a GPU "
            "does not prefetch).",
        ),
        cpu_kernel_option(
            "A decode token's CPU experts: torch's kernels, agentrt's bf16 kernel (native, built "
            "with the system C compiler at first use; torch's without one), or auto: native "
            "where the CPU has AVX512-BF16 or AVX2 with FMA (nearly every x86-64 CPU since "
            "2013)."
        ),
        click.option(
            "--prefill-plan",
            type=click.Choice(list(PREFILL_PLANS)),
            default="auto",
            show_default=True,
            help="For --offload auto: how a prefill chunk's missing experts reach the GPU, per "
            "layer: stream (every missing expert, copied ahead while earlier layers compute), "
            "routed (only those the chunk routed to, with few-token ones on the CPU when "
            "--split is on), reserve (every missing expert copied ahead but a few left to "
            "the CPU, which computes those the chunk routed to once its routing is known; "
            "with --split off, stream or routed per layer by measured costs), predicted (the "
            "experts the next layer's router picks from this layer's input copied ahead, the "
            "rest as routed; experimental), or auto (per size of chunk, reserve or routed, "
            "whichever its own timed passes found faster, reserve unless routed is faster by "
            "more than 3%: a size's first passes try each; chunks of more than 2048 tokens "
            "always reserve). "
            "The staging ring takes half a layer of experts from the expert cache.",
        ),
        expert_format_option(
            "For --offload auto: how offloaded experts are kept in host memory, copied "
            "and cached on the GPU: model (the model's dtype; MXFP4 checkpoints are "
            "dequantized at load), mxfp4 (packed, 17/32 of a byte per weight; MXFP4 "
            "checkpoints load as they are, others are rounded to MXFP4; computed by Triton "
            "kernels on CUDA), or auto: mxfp4 for models whose experts come as MXFP4 "
            "(gpt-oss), model for the others."
        ),
        click.option(
            "--cpu-moe-layers",
            type=click.IntRange(min=0),
            default=None,
            help="For --offload static: MoE layers whose experts run on the CPU "
            "(default: the fewest that let the rest fit --vram-budget).",
        ),
        click.option(
            "--cpu-layers",
            type=click.IntRange(min=0),
            default=None,
            help="For --offload layer: leading layers run whole on the CPU "
            "(default: the fewest that let the rest fit --vram-budget).",
        ),
        click.option(
            "--expert-policy",
            type=click.Choice(["lru", "lfu"]),
            default=OffloadConfig.policy,
            show_default=True,
            help="Expert-cache replacement policy (--offload auto): lfu evicts the expert used "
            f"least often (counts fade with a half-life of {HALF_LIFE:,} uses, so favourites "
            "that fall out of use leave), lru the one used least recently.",
        ),
        click.option(
            "--recalibrate",
            is_flag=True,
            help="Measure copy / CPU bandwidths again (--offload auto's split between them).",
        ),
    ]


def open_runtime(opts: dict, require_tokenizer: bool = False, check_unused: bool = True):
    """`Runtime.open` with the command's model and runtime options (by `RuntimeConfig`'s field
    names; on/off switches, boundary overrides and the device resolved first). `check_unused`:
    placement options given on the command line that the placement would not use are usage
    errors (off for commands that run one setting per value of a list)."""
    mode = offload_mode(opts["offload"], opts["vram_budget"], opts["expert_cache_slots"])
    if mode != "auto" and opts["expert_cache_slots"] is not None:
        raise click.UsageError(f"--expert-cache-slots sizes --offload auto's cache, not {mode}'s")
    if check_unused:
        refuse_unused(mode)
    prepare_cpu_threads(opts["device"], [mode])
    from agentrt import Runtime, RuntimeConfig
    from agentrt.session.boundary_text import parse_overrides

    fields = {f.name for f in dataclasses.fields(RuntimeConfig)}
    given = {name: value for name, value in opts.items() if name in fields}
    given.update(
        device=resolve_device(opts["device"]),
        split=opts["split"] == "on",
        prefetch=opts["prefetch"] == "on",
        boundaries=parse_overrides(opts["boundaries"]) or None,
        require_tokenizer=require_tokenizer,
    )
    return Runtime.open(opts["model"], config=RuntimeConfig(**given))


json_option = click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False),
    default=None,
    callback=output_path,
    help="Also write the result as JSON to this file.",
)


def one_value(values: list[str], hint: str, where: str, only_auto: bool = False) -> str:
    """The one value of a list option that `where` runs with (auto alone if `only_auto`)."""
    if len(values) > 1 or (only_auto and values != ["auto"]):
        what = "only auto" if only_auto else "one value only"
        raise click.BadParameter(f"{what} {where}", param_hint=hint)
    return values[0]
