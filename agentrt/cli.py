"""The `agentrt` command line (click). Every command has `--help`; user errors print one line
(`error: ...`) and exit with status 2, never a traceback.

Commands: `chat`, `serve`, `run`, `replay`, `trace ...`, `model make|info`,
`bench prefill|decode|accuracy|statecache|soak|ttft|bw`, `cache ls|stats|gc|clear`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from agentrt.config import CPU_KERNELS, PREFILL_PLANS, offload_mode
from agentrt.errors import AgentrtError

DEVICE_HELP = "cpu, cuda, or auto (cuda when available)."
MODEL_HELP = (
    "A HF-format directory, 'tiny' (embedded default), or 'synthetic:NAME' "
    "(e.g. synthetic:qwen3.5-35b-a3b)."
)


class _Group(click.Group):
    """Turns agentrt's user errors into one-line messages."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AgentrtError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


def prepare_cpu_threads(device: str, offloads: list[str]) -> None:
    """Before torch loads: spinning OpenMP workers for offloaded decode on a GPU, where the CPU
    computes experts in short bursts between GPU steps (see `agentrt.cputhreads`)."""
    from agentrt.cputhreads import spin_between_steps

    gpu = device == "cuda" or (device == "auto" and Path("/dev/nvidiactl").exists())
    spin_between_steps(gpu and any(mode != "none" for mode in offloads))


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _csv_choice(*choices: str):
    """click callback: a comma-separated list whose items must be among `choices`."""

    def parse(ctx, param, value: str | None) -> list[str] | None:
        if value is None:  # an option without a default: not given
            return None
        items = _csv(value)
        bad = [i for i in items if i not in choices]
        if bad or not items:
            raise click.BadParameter(
                f"expected a comma-separated list of {', '.join(choices)}, got {value!r}"
            )
        return items

    return parse


def _one_of(*choices: str):
    def check(ctx, param, value: str) -> str:
        if value not in choices:
            raise click.BadParameter(f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def _csv_ints(ctx, param, value: str) -> list[int]:
    try:
        items = [int(x) for x in _csv(value)]
    except ValueError:
        items = []
    if not items or min(items) < 1:
        raise click.BadParameter(
            f"expected a comma-separated list of positive integers, got {value!r}"
        )
    return items


def _csv_ints_or_empty(ctx, param, value: str) -> list[int]:
    """Like `_csv_ints`, but an empty value is an empty list."""
    return _csv_ints(ctx, param, value) if value.strip() else []


def model_options(fn=None, *, cache_list: bool = False):
    """Options shared by every command that opens a model (`cache_list`: --cache takes a
    comma-separated list of modes, for commands that compare them)."""
    if fn is None:
        return lambda f: model_options(f, cache_list=cache_list)
    cache_option = click.option(
        "--cache",
        default="semantic,prefix,off" if cache_list else "semantic",
        show_default=True,
        callback=_csv_choice("semantic", "prefix", "off")
        if cache_list
        else _one_of("semantic", "prefix", "off"),
        help="State reuse: semantic (checkpoints at boundaries, persisted), prefix (reuse the live "
        "state only when the prompt extends it), off."
        + (" Comma-separated list." if cache_list else ""),
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
        cache_option,
        click.option(
            "--state-dir",
            type=click.Path(file_okay=False),
            default=None,
            help="State cache directory (default: ~/.cache/agentrt/state).",
        ),
        click.option(
            "--state-max-gb",
            type=click.FloatRange(min=0, min_open=True),
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
            type=int,
            default=0,
            show_default=True,
            help="Sampling / synthetic-weights seed.",
        ),
        click.option(
            "--eager", is_flag=True, help="Do not capture the decode step in a CUDA graph."
        ),
        click.option(
            "--prefill-graphs",
            is_flag=True,
            help="CUDA, experts on the GPU: run prompts and suffixes of up to 4096 tokens as "
            "CUDA-graph replays of padded lengths (64-3072), one launch instead of thousands "
            "(suffix prefill 2-2.5x faster on an H200). The graphs are captured when the model "
            "opens, on KV reserved for the model's whole context (or as much as a quarter of "
            "the free GPU memory holds), so no request captures them again.",
        ),
        *offload_options(),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _on_off(name: str, help: str):
    """An on|off option, on by default."""
    return click.option(
        name, type=click.Choice(["on", "off"]), default="on", show_default=True, help=help
    )


def _cpu_kernel_option(help: str):
    """--cpu-kernel auto|torch|native (auto by default)."""
    return click.option(
        "--cpu-kernel",
        type=click.Choice(list(CPU_KERNELS)),
        default="auto",
        show_default=True,
        help=help,
    )


def offload_options() -> list:
    """Expert placement options (docs/architecture.md §5)."""
    return [
        click.option(
            "--offload",
            type=click.Choice(["auto", "none", "static", "layer"]),
            default=None,
            help="Expert placement: auto (host store + GPU expert cache + CPU/GPU miss split), "
            "static (experts of the first --cpu-moe-layers layers on the CPU, like llama.cpp "
            "--n-cpu-moe), layer (the first --cpu-layers whole layers on the CPU, like Ollama), "
            "none (all on the device). Default: auto with --vram-budget or "
            "--expert-cache-slots, else none.",
        ),
        click.option(
            "--vram-budget",
            default=None,
            help="Cap on device memory, e.g. 16GiB (sizes the expert cache).",
        ),
        click.option(
            "--expert-cache-slots",
            type=click.IntRange(min=1),
            default=None,
            help="Explicit expert-cache size (overrides --vram-budget).",
        ),
        _on_off("--split", "off: every miss is copied (no CPU compute)."),
        _on_off(
            "--prefetch",
            "For --offload auto: while a layer computes, copy ahead the experts the next "
            "layer's router predicts from its input (CUDA-graph decode; eager decode on a GPU "
            "does not prefetch).",
        ),
        _cpu_kernel_option(
            "A decode token's CPU experts: torch's kernels, agentrt's bf16 kernel (native, built "
            "with the system C compiler at first use; torch's without one), or auto: native "
            "where the CPU has AVX512-BF16."
        ),
        click.option(
            "--prefill-plan",
            type=click.Choice(list(PREFILL_PLANS)),
            default="auto",
            show_default=True,
            help="For --offload auto: how a prefill chunk's missing experts reach the GPU, per "
            "layer: stream (every missing expert, copied ahead while earlier layers compute), "
            "routed (only those the chunk routed to, with few-token ones on the CPU when "
            "--split is on), predicted (the experts the next layer's router picks from this "
            "layer's input copied ahead, the rest as routed; experimental), or auto (stream "
            "or routed, the cheaper by measured costs). The staging ring "
            "takes half a layer of experts from the expert cache.",
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
            default="lru",
            show_default=True,
            help="Expert-cache replacement policy.",
        ),
        click.option("--recalibrate", is_flag=True, help="Measure copy / CPU bandwidths again."),
    ]


def open_runtime(opts: dict, require_tokenizer: bool = False):
    mode = offload_mode(opts["offload"], opts["vram_budget"], opts["expert_cache_slots"])
    prepare_cpu_threads(opts["device"], [mode])
    from agentrt import Runtime
    from agentrt.session.boundaries import parse_overrides

    return Runtime.open(
        require_tokenizer=require_tokenizer,
        state_dir=opts["state_dir"],
        state_max_gb=opts["state_max_gb"],
        boundaries=parse_overrides(opts["boundaries"]) or None,
        model=opts["model"],
        device=resolve_device(opts["device"]),
        dtype=opts["dtype"],
        cache=opts["cache"],
        seed=opts["seed"],
        tokenizer=opts["tokenizer"],
        chat_template=opts["chat_template"],
        linear_attn=opts["linear_attn"],
        prefill_chunk=opts["prefill_chunk"],
        eager=opts["eager"],
        prefill_graphs=opts["prefill_graphs"],
        offload=opts["offload"],
        vram_budget=opts["vram_budget"],
        expert_cache_slots=opts["expert_cache_slots"],
        split=opts["split"] == "on",
        prefetch=opts["prefetch"] == "on",
        cpu_kernel=opts["cpu_kernel"],
        prefill_plan=opts["prefill_plan"],
        cpu_moe_layers=opts["cpu_moe_layers"],
        cpu_layers=opts["cpu_layers"],
        expert_policy=opts["expert_policy"],
        recalibrate=opts["recalibrate"],
    )


def write_json(path: str | None, data) -> None:
    if path:
        try:
            Path(path).write_text(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise AgentrtError(f"cannot write {path}: {exc.strerror}") from None


def _json_path(ctx, param, value: str | None) -> str | None:
    """Fail before any work when a --json file cannot be created."""
    if value is not None and not Path(value).expanduser().resolve().parent.is_dir():
        raise click.BadParameter(f"directory of {value!r} does not exist")
    return value


json_option = click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False),
    default=None,
    callback=_json_path,
    help="Also write the result as JSON to this file.",
)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="agentrt")
def main() -> None:
    """agentrt: fast tool-calling agents on Mixture-of-Experts models that do not fit in one GPU."""


# ----------------------------------------------------------------------------- chat


@main.command()
@model_options
@click.argument("message")
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-tokens", type=click.IntRange(min=0), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@json_option
def chat(message: str, system, max_tokens, temperature, top_p, stop, json_out, **opts) -> None:
    """Run one chat turn for MESSAGE and stream the reply to the terminal."""
    rt = open_runtime(opts, require_tokenizer=True)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": message}
    ]
    events = rt.chat(
        messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=list(stop),
        stream=True,
    )
    result = _print_stream(events)
    t, u = result.timings, result.usage
    rate = u["completion_tokens"] / t["decode_s"] if t["decode_s"] > 0 else 0.0
    click.echo(
        f"[{u['prompt_tokens']} prompt tokens, {u['completion_tokens']} generated, "
        f"{u['cached_tokens']} cached, ttft {t['ttft_s']:.3f}s, "
        f"{rate:.1f} tok/s, finish: {result.finish_reason}]",
        err=True,
    )
    rt.close()
    write_json(json_out, result.__dict__)


def _print_stream(events):
    last = None
    for ev in events:
        if ev.type == "done":
            if last is not None:
                click.echo()
            return ev.result
        if ev.type != last and last is not None:
            click.echo()
        if ev.type == "reasoning":
            click.secho(ev.text, nl=False, dim=True)
        elif ev.type == "content":
            click.echo(ev.text, nl=False)
        else:
            fn = ev.tool_call["function"]
            click.secho(f"-> tool call {fn['name']}({fn['arguments']})", nl=False, fg="cyan")
        last = ev.type
    raise AgentrtError("generation ended without a result")


# ----------------------------------------------------------------------------- model


@main.group()
def model() -> None:
    """Create synthetic checkpoints and inspect model directories."""


@model.command("make")
@click.option(
    "--arch",
    type=click.Choice(["qwen3_5_moe", "qwen3_moe"]),
    default=None,
    help="Architecture (implied by real size names).",
)
@click.option(
    "--size", required=True, help="tiny, or a real shape: qwen3.5-35b-a3b, qwen3-30b-a3b."
)
@click.option(
    "-o", "--out", required=True, type=click.Path(file_okay=False), help="Output directory."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default=None,
    help="Stored dtype (default: float32 for tiny sizes, bfloat16 for real sizes).",
)
@click.option("--force", is_flag=True, help="Write into a non-empty directory.")
def model_make(arch, size, out, seed, dtype, force) -> None:
    """Write a seeded random-weight checkpoint with exact shapes (HF format)."""
    from agentrt.models.synthetic import resolve_size, write_checkpoint
    from agentrt.models.tiny import build_tiny

    name = resolve_size(size, arch)
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise click.UsageError(f"{out_dir} is not empty (use --force to write into it)")
    if name.startswith("tiny"):
        build_tiny(out_dir, name)
    else:
        with click.progressbar(length=1, label=f"writing {name}", file=sys.stderr) as bar:

            def progress(done: int, total: int) -> None:
                bar.length = total
                bar.update(done - bar.pos)

            write_checkpoint(name, out_dir, seed=seed, dtype=dtype, progress=progress)
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


# ----------------------------------------------------------------------------- bench


@main.group()
def bench() -> None:
    """Benchmarks that print JSON (see BENCHMARKS.md)."""


def _bench_options(fn):
    options = [
        click.option("--model", "-m", default="tiny", show_default=True, help=MODEL_HELP),
        click.option("--device", default="auto", show_default=True, help=DEVICE_HELP),
        click.option(
            "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None
        ),
        click.option(
            "--linear-attn",
            default="auto",
            show_default=True,
            callback=_csv_choice("auto", "torch", "fla"),
            help="Comma-separated list of kernels to compare: auto, torch, fla.",
        ),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option(
            "--eager", is_flag=True, help="Do not capture the decode step in a CUDA graph."
        ),
        json_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _report(report: dict, json_out: str | None) -> None:
    click.echo(json.dumps(report, indent=2))
    write_json(json_out, report)


@bench.command("prefill")
@_bench_options
@click.option(
    "--lengths",
    default="2048,8192",
    show_default=True,
    callback=_csv_ints,
    help="Comma-separated prompt lengths.",
)
@click.option(
    "--prefill-chunk",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Tokens per prefill chunk (offloaded: each chunk streams the missing experts once).",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Timed runs per row (the median is reported).",
)
@click.option(
    "--offload",
    type=click.Choice(["none", "auto"]),
    default="none",
    show_default=True,
    help="auto: routed experts in host memory behind a device expert cache (with "
    "--vram-budget or --expert-cache-slots); each --prefill-plan is timed, and the same rows "
    "with every expert resident first (the floor's compute side).",
)
@click.option("--vram-budget", default=None, help="With --offload auto: e.g. 16GiB.")
@click.option(
    "--expert-cache-slots",
    type=click.IntRange(min=1),
    default=None,
    help="With --offload auto: the expert cache's size in experts (overrides --vram-budget).",
)
@click.option(
    "--prefill-plan",
    default="auto,stream,routed",
    show_default=True,
    callback=_csv_choice(*PREFILL_PLANS),
    help="With --offload auto: comma-separated plans to time (the fixed ones are the baselines).",
)
@click.option(
    "--suffixes",
    default="",
    callback=_csv_ints_or_empty,
    help="With --offload auto: comma-separated suffix lengths timed after a cached prefix.",
)
@click.option(
    "--prefix",
    "prefix_len",
    type=click.IntRange(min=1),
    default=32768,
    show_default=True,
    help="Tokens of the cached prefix before each suffix.",
)
@_on_off("--split", "off: no missing expert runs on the CPU.")
@click.option("--tokenizer", default=None, help="Tokenizer dir: prompts of real text.")
@click.option("--resident/--no-resident", default=True, help="Time the all-resident rows too.")
@click.option(
    "--profile",
    is_flag=True,
    help="With --offload auto: one more run of each offloaded row under cProfile; its "
    "costliest functions (host time) go into the row's JSON.",
)
@_cpu_kernel_option("CPU expert kernel (calibration).")
def bench_prefill(
    model,
    device,
    dtype,
    linear_attn,
    seed,
    eager,
    json_out,
    lengths,
    prefill_chunk,
    repeat,
    **offload,
) -> None:
    """Prefill throughput (tok/s) for each prompt length and linear-attention kernel; with
    --offload auto, offloaded prefill per plan against its floor
    max(missing expert bytes / B_P, resident compute time)."""
    from agentrt.bench import engine as b

    prepare_cpu_threads(device, [offload["offload"]])
    device = resolve_device(device)
    if offload["offload"] == "auto":
        offload["linear_attn"] = linear_attn[0]
        report = _offload_prefill(
            model, device, dtype, seed, lengths, prefill_chunk, repeat, offload
        )
        _report(report, json_out)
        return
    _report(
        b.prefill(model, device, dtype, linear_attn, lengths, prefill_chunk, repeat, seed),
        json_out,
    )


def _offload_prefill(model, device, dtype, seed, lengths, chunk, repeat, o: dict) -> dict:
    from agentrt.bench.prefill import offload_prefill

    if o["vram_budget"] is None and o["expert_cache_slots"] is None:
        raise click.UsageError("--offload auto needs --vram-budget or --expert-cache-slots")
    return offload_prefill(
        model,
        device,
        dtype,
        o["vram_budget"],
        o["prefill_plan"],
        lengths,
        o["suffixes"],
        o["prefix_len"],
        chunk,
        repeat=repeat,
        seed=seed,
        split=o["split"] == "on",
        slots=o["expert_cache_slots"],
        tokenizer_dir=o["tokenizer"],
        resident=o["resident"],
        cpu_kernel=o["cpu_kernel"],
        linear_attn=o["linear_attn"],
        profile=o["profile"],
    )


def _csv_option(name: str, choices: tuple[str, ...], default: str | None, help: str):
    """A comma-separated list option whose items must be among `choices`."""
    return click.option(
        name,
        default=default,
        show_default=default is not None,
        callback=_csv_choice(*choices),
        help=help,
    )


@bench.command("decode")
@_bench_options
@click.option("--prompt-len", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True)
@_csv_option("--graphs", ("on", "off"), "on", "Comma-separated CUDA-graph settings: on, off.")
@_csv_option(
    "--offload",
    ("auto", "none", "static", "layer"),
    None,
    "Comma-separated expert placements to compare (auto, none, static, layer): switches to "
    "the offload benchmark (hit rate, copies / CPU experts / PCIe bytes per token, the decode "
    "bound of docs/architecture.md §8, peak GPU memory). `none` keeps every expert on the "
    "device and gives t_gpu.",
)
@_csv_option(
    "--split",
    ("on", "off"),
    "on",
    "For --offload auto: comma-separated miss handling, on (copies + CPU) and/or off.",
)
@_csv_option(
    "--expert-policy",
    ("lru", "lfu"),
    "lru",
    "For --offload auto: comma-separated cache policies.",
)
@_csv_option(
    "--prefetch",
    ("on", "off"),
    "on",
    "For --offload auto: comma-separated next-layer prefetch settings, on and/or off.",
)
@click.option("--vram-budget", default=None, help="Device-memory budget, e.g. 16GiB.")
@click.option(
    "--text",
    type=click.Path(exists=True),
    default=None,
    help="Real text (file or directory) the offload benchmark feeds; default: agentrt's sources.",
)
@click.option("--tokenizer", default=None, help="Tokenizer directory for --text.")
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --offload: rounds of all settings, interleaved; each reports its median round.",
)
@_cpu_kernel_option(
    "With --offload: the CPU expert kernel of every setting, static's included (torch's, "
    "agentrt's bf16 kernel built at first use, or auto: native where the CPU has AVX512-BF16)."
)
@click.option(
    "--py-profile",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="With --offload: after each setting's timed tokens, decode 16 more under Python's "
    "cProfile (not timed) and write its costliest functions to this text file.",
)
def bench_decode(
    model,
    device,
    dtype,
    linear_attn,
    seed,
    eager,
    json_out,
    prompt_len,
    tokens,
    graphs,
    offload,
    split,
    expert_policy,
    prefetch,
    vram_budget,
    text,
    tokenizer,
    repeat,
    cpu_kernel,
    py_profile,
) -> None:
    """Decode throughput (tok/s) after a prompt, per kernel and CUDA-graph setting; with
    --offload, per expert placement (every combination of --offload/--split/--expert-policy),
    with each placement's bound (docs/architecture.md §8) and, at its hit rate, the ceilings
    against static: host memory (the missing experts' bytes at the fastest host read seen) and
    the layer chain (CPU experts between a token's GPU pieces, copies overlapping)."""
    modes = ["off"] if eager else graphs
    if py_profile and not offload:
        raise click.BadParameter("only with --offload", param_hint="--py-profile")
    if offload:
        prepare_cpu_threads(device, offload)
        from agentrt.bench import offload as bo

        runs = bo.settings(
            offload, [v == "on" for v in split], expert_policy, [v == "on" for v in prefetch]
        )
        report = bo.offload_decode(
            model,
            resolve_device(device),
            dtype,
            vram_budget,
            runs,
            prompt_len,
            tokens,
            seed,
            graphs=modes[0] == "on",
            text=text,
            tokenizer_dir=tokenizer,
            repeat=repeat,
            cpu_kernel=cpu_kernel,
            py_profile=py_profile,
        )
        _report(report, json_out)
        return
    from agentrt.bench import engine as b

    _report(
        b.decode(
            model, resolve_device(device), dtype, linear_attn, prompt_len, tokens, seed, modes
        ),
        json_out,
    )


@bench.command("accuracy")
@_bench_options
@click.option("--length", type=click.IntRange(min=2), default=300, show_default=True)
def bench_accuracy(model, device, dtype, linear_attn, seed, eager, json_out, length) -> None:
    """Logits of MODEL on DEVICE/DTYPE vs the fp32 CPU path (max-abs diff, top-1 agreement)."""
    from agentrt.bench import engine as b

    _report(
        b.accuracy(model, resolve_device(device), dtype, linear_attn, length, seed, eager), json_out
    )


@bench.command("statecache")
@_bench_options
@click.option(
    "--lengths",
    default="8192,32768,65536",
    show_default=True,
    callback=_csv_ints,
    help="Comma-separated prefix lengths.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default="bench-state",
    show_default=True,
    help="Scratch state directory (emptied first).",
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
def bench_statecache(
    model,
    device,
    dtype,
    linear_attn,
    seed,
    eager,
    json_out,
    lengths,
    state_dir,
    capture_every,
    rounds,
    fidelity,
    suffix,
    generate,
    prefill_chunk,
):
    """Checkpoint bytes, writer throughput, restore latency vs recompute, capture overhead;
    with --fidelity, how exactly a restored checkpoint continues."""
    dev = resolve_device(device)

    def note(text: str) -> None:
        click.echo(text, err=True)

    if fidelity:
        from agentrt.bench.fidelity import fidelity as run

        kwargs = dict(suffix=suffix, generate=generate, chunk=prefill_chunk, note=note)
        result = run(
            model,
            dev,
            dtype,
            lengths,
            state_dir,
            seed,
            runs=rounds or 3,
            linear_attn=linear_attn[0],
            **kwargs,
        )
    else:
        from agentrt.bench import statecache as b

        result = b.statecache(
            model, dev, dtype, lengths, state_dir, seed, capture_every, rounds, note
        )
    _report(result, json_out)


@bench.command("soak")
@click.option("--model", "-m", default="tiny", show_default=True, help=MODEL_HELP)
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--clients", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--seconds", type=click.FloatRange(min=1), default=30.0, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--disconnect",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Share of requests whose client leaves mid-stream.",
)
@click.option(
    "--turns",
    type=click.IntRange(min=1),
    default=6,
    show_default=True,
    help="Requests per conversation (each repeats the growing history).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
def bench_soak(json_out, **opts) -> None:
    """Concurrent streaming clients against `agentrt serve` for a while: errors, TTFT, RSS."""
    from agentrt.bench.soak import SoakConfig, soak

    _report(soak(SoakConfig(**opts), lambda text: click.echo(text, err=True)), json_out)


# ----------------------------------------------------------------------------- serve


def _origin(value: str) -> str:
    """`scheme://host[:port]` as browsers send it in `Origin` (or `*`, any origin)."""
    if value == "*":
        return value
    from urllib.parse import urlsplit

    url = urlsplit(value.strip())
    bare = url.path in ("", "/") and not (url.query or url.fragment or "@" in url.netloc)
    if url.scheme not in ("http", "https") or not url.netloc or not bare:
        raise click.BadParameter(f"{value!r} is not an origin like https://example.com:8443")
    return f"{url.scheme}://{url.netloc.lower()}"


def _origins(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_origin(v) for v in values)


@main.command()
@model_options
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface to bind (loopback by default; any other needs --api-key).",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--api-key", default=None, envvar="AGENTRT_API_KEY", help="Require 'Authorization: Bearer KEY'."
)
@click.option(
    "--insecure-no-auth",
    is_flag=True,
    help="Allow a non-loopback --host without --api-key (anyone who can reach it may use it).",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    callback=_origins,
    metavar="ORIGIN",
    help="A browser origin (https://host[:port]) allowed to call the API; repeatable. "
    "None: no CORS headers.",
)
@click.option(
    "--queue-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Requests waiting beyond this get HTTP 429.",
)
@click.option("--max-request-mb", type=click.FloatRange(min=0.001), default=32.0, show_default=True)
def serve(
    host, port, api_key, insecure_no_auth, cors_origins, queue_size, max_request_mb, **opts
) -> None:
    """Serve the OpenAI chat-completions API (point any OpenAI-compatible agent at it).

    Loopback only unless --api-key (or --insecure-no-auth) is given; no CORS unless --cors-origin.
    """
    from agentrt.server.app import ServerConfig, check_exposure
    from agentrt.server.app import serve as run_server

    config = ServerConfig(
        host,
        port,
        api_key,
        int(max_request_mb * 2**20),
        queue_size,
        insecure_no_auth=insecure_no_auth,
        cors_origins=cors_origins,
    )
    check_exposure(config)  # before the model loads
    rt = open_runtime(opts, require_tokenizer=True)
    click.echo(
        f"agentrt: serving {rt.model_name} (cache={rt.cache}) on http://{host}:{port}/v1", err=True
    )
    try:
        run_server(rt, config)
    finally:
        rt.close()


# ----------------------------------------------------------------------------- run


@main.command()
@model_options
@click.argument("task")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=".",
    show_default=True,
    help="Directory the tools work in: file tools stay inside it; run-command is a shell there.",
)
@click.option("--max-turns", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--command-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True)
@click.option(
    "--approve",
    type=click.Choice(["ask", "auto", "never"]),
    default="ask",
    show_default=True,
    help="Before each command: ask on the terminal (without one, refuse), run without asking "
    "(auto), or refuse every command (never).",
)
@click.option(
    "--sandbox",
    type=click.Choice(["auto", "bwrap", "none"]),
    default="auto",
    show_default=True,
    help="Run commands in bubblewrap (read-only system, only --workdir writable, private /tmp, "
    "no network): auto = where bwrap works; bwrap = required; none = straight on the host.",
)
@click.option("--allow-network", is_flag=True, help="Let sandboxed commands reach the network.")
@click.option(
    "--trace",
    "trace_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Save every request as a trace (.jsonl or .jsonl.zst).",
)
def run(
    task,
    workdir,
    max_turns,
    max_tokens,
    command_timeout,
    approve,
    sandbox,
    allow_network,
    trace_out,
    **opts,
) -> None:
    """Run the built-in tool-calling agent on TASK and print the transcript as it happens.
    Commands run in a clean environment (no secret-looking variables), each approved first."""
    from agentrt.session.agent import Tools, run_agent

    tools = Tools(workdir, command_timeout, approve, sandbox, allow_network)  # before loading
    rt = open_runtime(opts, require_tokenizer=True)
    result = run_agent(rt, task, tools, max_turns, max_tokens, _print_turn)
    if trace_out:
        _save_run_trace(result, task, trace_out)
    state = "finished" if result.finished else f"stopped at the turn limit ({max_turns})"
    click.echo(f"[{result.turns} turn(s), {state}]", err=True)
    rt.close()


def _print_turn(kind: str, payload) -> None:
    if kind == "assistant":
        if payload.reasoning_content:
            click.secho(payload.reasoning_content, dim=True)
        if payload.content:
            click.echo(payload.content)
        for call in payload.tool_calls:
            click.secho(
                f"-> {call['function']['name']}({call['function']['arguments']})", fg="cyan"
            )
        u = payload.usage
        click.secho(
            f"   [{u['prompt_tokens']} prompt, {u['cached_tokens']} cached, "
            f"{u['completion_tokens']} generated, ttft {payload.timings['ttft_s']:.2f}s]",
            dim=True,
            err=True,
        )
    else:
        call, output = payload
        lines = output.splitlines()
        preview = "\n".join(lines[:8]) + (
            f"\n   ... ({len(lines) - 8} more lines)" if len(lines) > 8 else ""
        )
        click.secho(preview, fg="yellow")


def _save_run_trace(result, task: str, path: str) -> None:
    import msgspec

    from agentrt.replay.trace import FORMAT, Header, Request, Trace, write_trace

    requests = [msgspec.convert(r, Request) for r in result.requests]
    write_trace(Trace(Header(FORMAT, "agentrt run", task[:200]), requests), path)
    click.echo(f"trace saved to {path}", err=True)


# ----------------------------------------------------------------------------- traces


@main.group()
def trace() -> None:
    """Import, generate and inspect agent traces (the replay format)."""


def _write_traces(traces, out: str, zst: bool) -> list[Path]:
    from agentrt.replay.trace import write_trace

    target = Path(out)
    if len(traces) == 1 and target.name.endswith((".jsonl", ".jsonl.zst")):
        return [write_trace(traces[0], target)]
    if target.suffix in (".jsonl", ".zst"):
        raise click.UsageError(f"{len(traces)} traces: -o must be a directory, not {out}")
    suffix = ".jsonl.zst" if zst else ".jsonl"
    return [write_trace(t, target / (t.name + suffix)) for t in traces]


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
    click.echo(f"wrote {len(paths)} trace(s), {total} request(s): {paths[0]}{more}")


@trace.command("gen")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--tokens",
    type=click.IntRange(min=1000),
    default=30000,
    show_default=True,
    help="Approximate size of the final request in tokens.",
)
@click.option("--max-turns", type=click.IntRange(min=1), default=80, show_default=True)
@click.option("-o", "--out", required=True, help="Output .jsonl or .jsonl.zst file.")
def trace_gen(seed, tokens, max_turns, out) -> None:
    """Generate a synthetic coding-agent session from files of this machine."""
    from agentrt.replay.generator import generate
    from agentrt.replay.trace import write_trace

    t = generate(seed, tokens, max_turns)
    path = write_trace(t, out)
    click.echo(f"wrote {path}: {len(t.requests)} requests")


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
    if max_requests:
        traces = [msgspec.structs.replace(t, requests=t.requests[:max_requests]) for t in traces]
    return _transform(traces, drop, truncate)


_max_requests_option = click.option(
    "--max-requests",
    type=click.IntRange(min=1),
    default=None,
    help="Replay only the first N requests of each trace.",
)


def _run_replay(traces, target, max_tokens: int, label: str) -> dict:
    from agentrt.replay.replay import replay, report

    total = sum(len(t.requests) for t in traces)
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        rows = replay(traces, target, max_tokens, progress=lambda row: bar.update(1))
    return report(rows, target)


@main.command("replay")
@model_options
@click.argument("traces", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--endpoint", default=None, help="Replay against this OpenAI-compatible URL instead of locally."
)
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="Bearer key for --endpoint.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG of TTFT per request."
)
@_drop_option
@_truncate_option
@_max_requests_option
@json_option
def replay_cmd(
    traces,
    endpoint,
    api_key,
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

    loaded = _load_traces(traces, drop_reasoning, truncate_tool_outputs, max_requests)
    if endpoint:
        target = endpoint_target(endpoint, opts["model"], api_key)
    else:
        target = local_target(open_runtime(opts, require_tokenizer=True))
    rep = _run_replay(loaded, target, max_tokens, f"replay ({target.cache})")
    click.echo(summary_table([rep]))
    write_json(json_out, rep)
    if plot:
        draw([rep], plot)


@bench.command("ttft")
@model_options(cache_list=True)
@click.argument("traces", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--variants",
    default="recorded",
    show_default=True,
    callback=_csv_choice("recorded", "dropped"),
    help="recorded, and/or dropped (earlier reasoning removed from histories).",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="PNG prefix: one plot per variant.",
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
    """Replay TRACES in every --cache mode with one loaded model; TTFT per mode and ratios."""
    from agentrt.bench import ttft as b

    rt = open_runtime({**opts, "cache": "off"}, require_tokenizer=True)
    result = b.ttft(
        rt,
        lambda drop: _load_traces(traces, drop, None, max_requests),
        opts["cache"],
        variants,
        max_tokens,
        lambda traces_, target, label: _run_replay(traces_, target, max_tokens, label),
        warmup,
    )
    for variant, reports in result["reports"].items():
        click.echo(f"\n[{variant}]")
        from agentrt.replay.replay import summary_table

        click.echo(summary_table(reports))
        if plot:
            from agentrt.replay.replay import plot as draw

            draw(
                reports,
                plot if len(result["reports"]) == 1 else plot.replace(".png", f"-{variant}.png"),
                variant,
            )
    click.echo(json.dumps(result["ratios"], indent=2))
    write_json(json_out, result)


@bench.command("bw")
@click.option("--model", "-m", default="tiny", show_default=True, help=MODEL_HELP)
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option(
    "--count",
    type=click.IntRange(min=4),
    default=64,
    show_default=True,
    help="Experts per measurement.",
)
@_cpu_kernel_option(
    "The CPU expert kernel measured (and whose profile is saved): torch, native, or auto (what "
    "offloaded decode would use here)."
)
@json_option
def bench_bw(model, device, dtype, count, cpu_kernel, json_out) -> None:
    """Calibrate B_P (expert copies) and B_H (CPU expert kernel), alone and overlapped."""
    prepare_cpu_threads(device, ["auto"])  # the CPU side as offloaded decode runs it
    from agentrt.bench import ttft as b

    _report(b.bandwidth(model, resolve_device(device), dtype, count, cpu_kernel), json_out)


# ----------------------------------------------------------------------------- cache


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
    from agentrt.config import StateCacheConfig, default_state_dir
    from agentrt.statecache.store import Store

    path = Path(state_dir).expanduser() if state_dir else default_state_dir()
    if must_exist and not (path / "data.mdb").is_file():
        raise AgentrtError(f"no state cache in {path}")
    return Store(path, StateCacheConfig().max_bytes)


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
@click.option(
    "--max-gb", type=click.FloatRange(min=0), default=None, help="Evict down to this size."
)
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
    """Delete every stored checkpoint."""
    store = _open_store(state_dir)
    if not yes and not click.confirm(f"delete all checkpoints in {store.path}?"):
        store.close()
        raise click.Abort()
    store.clear()
    store.close()
    click.echo("cleared")


if __name__ == "__main__":  # pragma: no cover
    main()
