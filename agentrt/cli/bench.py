"""`agentrt bench prefill|decode|accuracy|soak|bw` (JSON reports; `bench ttft` is in `traces.py`,
beside replay, and `bench statecache` in `bench_state.py`)."""

from __future__ import annotations

import click

from agentrt.cli.main import main
from agentrt.cli.options import (
    DEVICE_HELP,
    MODEL_HELP,
    cpu_kernel_option,
    csv_choice,
    csv_ints,
    csv_ints_or_empty,
    csv_option,
    csv_sizes_or_none,
    expert_format_option,
    json_option,
    one_value,
    prepare_cpu_threads,
    resolve_device,
    size_text,
)
from agentrt.cli.tables import print_report as _report
from agentrt.cli.unused import given, only_with
from agentrt.cli.values import SEED, Finite, fits_context
from agentrt.offload.config import PREFILL_PLANS, OffloadConfig


@main.group()
def bench() -> None:
    """Benchmarks that print JSON (see BENCHMARKS.md)."""


def model_bench_options(fn):
    """The options every model benchmark takes (--eager matters only to those that decode)."""
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
            callback=csv_choice("auto", "torch", "fla"),
            help="Comma-separated list of kernels to compare: auto, torch, fla.",
        ),
        click.option("--seed", type=SEED, default=0, show_default=True),
        click.option(
            "--eager", is_flag=True, help="Do not capture the decode step in a CUDA graph."
        ),
        json_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


_expert_format_option = expert_format_option(
    "With --offload: offloaded experts in the model's dtype, or kept MXFP4-packed (host "
    "store, copies, GPU slots; drawn packed for synthetic models); auto: packed for models "
    "whose experts come as MXFP4 (gpt-oss)."
)


@bench.command("prefill")
@model_bench_options
@click.option(
    "--lengths",
    default="2048,8192",
    show_default=True,
    callback=csv_ints,
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
@csv_option(
    "--offload",
    ("none", "auto"),
    "none",
    "none, auto, or both (none,auto). auto: routed experts in host memory behind a device "
    "expert cache (with --vram-budget or --expert-cache-slots); each --prefill-plan is timed, "
    "and the same rows with every expert resident first (the floor's compute side; "
    "--no-resident leaves them out unless none is listed).",
)
@click.option(
    "--vram-budget",
    default=None,
    callback=size_text,
    help="With --offload auto (its default then): e.g. 16GiB.",
)
@click.option(
    "--expert-cache-slots",
    type=click.IntRange(min=1),
    default=None,
    help="With --offload auto (its default then): the expert cache's size in experts "
    "(overrides --vram-budget).",
)
@click.option(
    "--prefill-plan",
    default="auto,stream,routed",
    show_default=True,
    callback=csv_choice(*PREFILL_PLANS),
    help="With --offload auto: comma-separated plans to time, in order (the fixed ones are the "
    "baselines); a plan listed again is timed again in its own engine, its rows named PLAN#2, "
    "to tell a plan's time from its place in the order.",
)
@click.option(
    "--suffixes",
    default="",
    callback=csv_ints_or_empty,
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
@csv_option(
    "--split",
    ("on", "off"),
    "on",
    "With --offload auto: off: no missing expert runs on the CPU; on,off: both (`runs`).",
)
@click.option(
    "--staging",
    default=None,
    callback=csv_sizes_or_none,
    help="With --offload auto: comma-separated staging ring sizes in layers of experts (e.g. "
    "0.5,1,1.5), each plan timed with each (default: the engine's ring, half a layer).",
)
@click.option(
    "--interleave",
    is_flag=True,
    help="With --offload auto: every plan in one engine, each row's passes timed round by "
    "round (each round starting one plan further on), so that no plan pays for its engine's "
    "place in the order; the plans then share the engine's measured costs (auto's `routed` "
    "passes follow the CPU rate the fixed `routed` passes measure too). Without it each plan "
    "runs in its own engine, one after another.",
)
@click.option("--tokenizer", default=None, help="Tokenizer dir: prompts of real text.")
@click.option("--resident/--no-resident", default=True, help="Time the all-resident rows too.")
@click.option(
    "--profile",
    is_flag=True,
    help="With --offload auto: one more run of each offloaded row under cProfile; its "
    "costliest functions (host time) go into the row's JSON.",
)
@cpu_kernel_option("CPU expert kernel (calibration).")
@_expert_format_option
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
    only_with(["eager"], "where a benchmark decodes")
    offloads = offload.pop("offload")
    if not given(["offload"]) and (offload["vram_budget"] or offload["expert_cache_slots"]):
        offloads = ["auto"]  # (as the runtime's default)
    if "auto" not in offloads:
        only_with(list(offload), "with --offload auto")
    prepare_cpu_threads(device, offloads)  # (before anything imports torch)
    fits_context(model, max(lengths), "--lengths")
    if offload.get("suffixes"):
        fits_context(model, offload["prefix_len"] + max(offload["suffixes"]), "--suffixes")
    from agentrt.bench import engine as b

    device = resolve_device(device)
    if "auto" in offloads:
        offload["linear_attn"] = one_value(linear_attn, "--linear-attn", "with --offload auto")
        offload["resident"] = offload["resident"] or "none" in offloads
        runs = {}
        for split in offload.pop("split"):
            args = (model, device, dtype, seed, lengths, prefill_chunk, repeat)
            run = runs[f"split={split}"] = _offload_prefill(*args, {**offload, "split": split})
            offload["resident"] = [r for r in run["runs"] if r["plan"] == "resident"]  # (once)
        report = runs.popitem()[1] if len(runs) == 1 else {"bench": "prefill", "runs": runs}
        _report(report, json_out)
        return
    note = lambda text: click.echo(f"agentrt: {text}", err=True)  # noqa: E731
    _report(
        b.prefill(model, device, dtype, linear_attn, lengths, prefill_chunk, repeat, seed, note),
        json_out,
    )


def _offload_prefill(model, device, dtype, seed, lengths, chunk, repeat, o: dict) -> dict:
    from agentrt.bench.prefill import offload_prefill_options

    if o["vram_budget"] is None and o["expert_cache_slots"] is None:
        raise click.UsageError("--offload auto needs --vram-budget or --expert-cache-slots")
    return offload_prefill_options(model, device, dtype, seed, lengths, chunk, repeat, o)


_DECODE_OFFLOAD_ONLY = (
    "split", "expert_policy", "prefetch", "cpu_warm", "overlap", "prefetch_pace", "text",
    "tokenizer", "repeat", "cpu_kernel", "expert_format", "py_profile",
)  # fmt: skip


@bench.command("decode")
@model_bench_options
@click.option(
    "--prompt-len",
    default="512",
    show_default=True,
    callback=csv_ints,
    help="Tokens prefilled before decoding. With --offload a comma-separated list: every "
    "setting decodes after each (e.g. 512,32768: decode right after a long prefill against "
    "after a short one, rounds interleaved).",
)
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True)
@csv_option("--graphs", ("on", "off"), "on", "Comma-separated CUDA-graph settings: on, off.")
@csv_option(
    "--offload",
    ("auto", "none", "static", "layer"),
    None,
    "Comma-separated expert placements to compare (auto, none, static, layer): switches to "
    "the offload benchmark (hit rate, copies / CPU experts / PCIe bytes per token, the decode "
    "bound of docs/architecture.md §8, peak GPU memory). `none` keeps every expert on the "
    "device and gives t_gpu.",
)
@csv_option(
    "--split",
    ("on", "off"),
    "on",
    "For --offload auto: comma-separated miss handling, on (copies + CPU) and/or off.",
)
@csv_option(
    "--expert-policy",
    ("lru", "lfu"),
    OffloadConfig.policy,
    "For --offload auto: comma-separated cache policies, lru and/or lfu (default "
    f"{OffloadConfig.policy}, the runtime's).",
)
@csv_option(
    "--prefetch",
    ("on", "off"),
    "on",
    "For --offload auto: comma-separated next-layer prefetch settings, on and/or off.",
)
@csv_option(
    "--cpu-warm",
    ("on", "off"),
    None,
    "For --offload auto with prefetch: comma-separated settings of the CPU experts' warm-up "
    "(the next layer's likely CPU experts read into the CPU's caches while the GPU works), "
    "on and/or off; default: on for bf16 experts, off for packed MXFP4 ones.",
)
@csv_option(
    "--overlap",
    ("on", "off"),
    "on" if OffloadConfig.overlap else "off",
    "For --offload auto: comma-separated settings of captured decode's overlap (a layer's "
    "device experts computed while the CPU computes its share, not after it), on and/or off.",
)
@csv_option(
    "--prefetch-pace",
    ("on", "off"),
    None,
    "For --offload auto with prefetch: comma-separated settings of the prefetch pacing (fewer "
    "experts copied ahead while they arrive after the piece that reads them is launched), on "
    "and/or off; default: as AGENTRT_PREFETCH_PACE says.",
)
@click.option(
    "--vram-budget",
    default=None,
    callback=size_text,
    help="Device-memory budget, e.g. 16GiB (without --offload: --offload auto).",
)
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
@cpu_kernel_option(
    "With --offload: the CPU expert kernel of every setting, static's included (torch's, "
    "agentrt's bf16 kernel built at first use, or auto: native where the CPU has AVX512-BF16 "
    "or AVX2 with FMA)."
)
@_expert_format_option
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
    cpu_warm,
    overlap,
    prefetch_pace,
    vram_budget,
    text,
    tokenizer,
    repeat,
    cpu_kernel,
    expert_format,
    py_profile,
) -> None:
    """Decode throughput (tok/s) after a prompt, per kernel and CUDA-graph setting; with
    --offload, per expert placement (every combination of --offload/--split/--expert-policy),
    with each placement's bound (docs/architecture.md §8) and, at its hit rate, the ceilings
    against static: host memory (the missing experts' bytes at the fastest host read seen) and
    the layer chain (CPU experts between a token's GPU pieces, copies overlapping)."""
    if eager:
        only_with(["graphs"], "without --eager")
    modes = ["off"] if eager else graphs
    offload = offload or (["auto"] if vram_budget else None)  # (a budget: as the runtime's)
    if not offload:
        only_with(_DECODE_OFFLOAD_ONLY, "with --offload")
    elif "auto" not in offload:
        only_with(
            ["split", "expert_policy", "prefetch", "cpu_warm", "overlap", "prefetch_pace"],
            "with --offload auto",
        )
    if len(prompt_len) > 1 and not offload:
        raise click.BadParameter("a list only with --offload", param_hint="--prompt-len")
    if offload:
        one_value(linear_attn, "--linear-attn", "with --offload", only_auto=True)
        one_value(modes, "--graphs", "with --offload")
        prepare_cpu_threads(device, offload)
        fits_context(model, max(prompt_len) + tokens, "--prompt-len, --tokens")
        from agentrt.bench import offload as bo
        from agentrt.session.options import packed_experts

        runs = bo.settings(
            offload,
            [v == "on" for v in split],
            expert_policy,
            [v == "on" for v in prefetch],
            [v == "on" for v in cpu_warm] if cpu_warm else [None],
            [v == "on" for v in overlap],
            [v == "on" for v in prefetch_pace] if prefetch_pace else [None],
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
            packed=packed_experts(expert_format, model),
        )
        _report(report, json_out)
        return
    fits_context(model, prompt_len[0] + tokens, "--prompt-len, --tokens")
    from agentrt.bench import engine as b

    _report(
        b.decode(
            model, resolve_device(device), dtype, linear_attn, prompt_len[0], tokens, seed, modes
        ),
        json_out,
    )


@bench.command("accuracy")
@model_bench_options
@click.option("--length", type=click.IntRange(min=2), default=300, show_default=True)
def bench_accuracy(model, device, dtype, linear_attn, seed, eager, json_out, length) -> None:
    """Logits of MODEL on DEVICE/DTYPE vs the fp32 CPU path (max-abs diff, top-1 agreement)."""
    fits_context(model, length, "--length")
    from agentrt.bench import engine as b

    _report(
        b.accuracy(model, resolve_device(device), dtype, linear_attn, length, seed, eager), json_out
    )


@bench.command("soak")
@click.option("--model", "-m", default="tiny", show_default=True, help=MODEL_HELP)
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--clients", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--seconds", type=Finite(min=1), default=30.0, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--disconnect",
    type=Finite(0, 1),
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
@click.option("--seed", type=SEED, default=0, show_default=True)
@json_option
def bench_soak(json_out, **opts) -> None:
    """Concurrent streaming clients against `agentrt serve` for a while: errors, TTFT, RSS."""
    from agentrt.bench.soak import SoakConfig, soak

    _report(soak(SoakConfig(**opts), lambda text: click.echo(text, err=True)), json_out)


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
@cpu_kernel_option(
    "The CPU expert kernel measured (and whose profile is saved): torch, native, or auto (what "
    "offloaded decode would use here)."
)
@json_option
def bench_bw(model, device, dtype, count, cpu_kernel, json_out) -> None:
    """Calibrate B_P (expert copies) and B_H (CPU expert kernel), alone and overlapped."""
    prepare_cpu_threads(device, ["auto"])  # the CPU side as offloaded decode runs it
    from agentrt.bench import ttft as b

    _report(b.bandwidth(model, resolve_device(device), dtype, count, cpu_kernel), json_out)
