"""Options given on the command line that the command would not use (the mode or expert
placement chosen does not read them): usage errors that name them, never silently ignored."""

from __future__ import annotations

from collections.abc import Iterable

import click

# options the public contract lists for every command that opens a model (and serve's and
# cache's --state-dir; --eager, which "always works"): given where they do nothing, they are
# reported, not refused
KEPT = frozenset(
    ("--device", "--tokenizer", "--chat-template", "--vram-budget", "--offload", "--split")
    + ("--state-dir", "--json", "--eager")
)


def given(names: Iterable[str]) -> list[str]:
    """The options of the running command among the parameter `names` that were given on the
    command line (not defaults or the environment), as `--name`, in the command's order."""
    ctx, wanted = click.get_current_context(), set(names)
    return [
        _written(param, ctx.params.get(param.name))
        for param in ctx.command.params
        if param.name in wanted
        and ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE
    ]


def _written(param: click.Parameter, value) -> str:
    """How an option given on the command line was written (`--no-x` for an off switch)."""
    off = getattr(param, "secondary_opts", None)
    return off[0] if off and value is False else param.opts[0]


def only_with(names: Iterable[str], where: str) -> None:
    """A usage error naming the options among `names` given on the command line, which the
    command uses only `where` (e.g. "with --offload"): better than ignoring them."""
    refuse(given(names), f"used only {where}")


def refuse(found: list[str], why: str) -> None:
    """A usage error naming the options `found` (as written), which are `why`; none: nothing.
    The common options of docs/architecture.md §2 (`KEPT`) only get a warning: callers that
    pass them to every command keep working."""
    kept = [name for name in found if name in KEPT]
    if kept:
        they = "it is" if len(kept) == 1 else "they are"
        click.echo(f"agentrt: ignoring {', '.join(kept)}: {they} {why}", err=True)
    refused = [name for name in found if name not in KEPT]
    if refused:
        verb = "is" if len(refused) == 1 else "are"
        raise click.UsageError(f"{', '.join(refused)} {verb} {why}")


def refuse_unused(mode: str) -> None:
    """A usage error naming the placement options given that `mode` does not read."""
    if mode != "auto":
        auto_only = ["split", "prefetch", "prefill_plan", "expert_policy", "recalibrate"]
        only_with(auto_only, f"with --offload auto, not {mode}")
    for name, owner in (("cpu_moe_layers", "static"), ("cpu_layers", "layer")):
        if mode != owner:
            only_with([name], f"with --offload {owner}")
    if mode == "none":
        only_with(["cpu_kernel"], "where experts run on the CPU (--offload auto, static, layer)")
        only_with(["vram_budget"], "with offloaded experts (--offload auto, static, layer)")
