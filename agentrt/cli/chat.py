"""`agentrt chat` (one turn, streamed to the terminal) and `agentrt run` (the built-in agent
loop)."""

from __future__ import annotations

from pathlib import Path

import click

from agentrt.cli.main import main
from agentrt.cli.options import json_option, model_options, open_runtime
from agentrt.cli.values import Finite, output_path, write_json
from agentrt.errors import AgentrtError


@main.command()
@model_options
@click.argument("message")
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-tokens", type=click.IntRange(min=0), default=256, show_default=True)
@click.option("--temperature", type=Finite(0, 2), default=0.0, show_default=True)
@click.option("--top-p", type=Finite(0, 1, min_open=True), default=1.0, show_default=True)
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
        kind = "tool_call" if ev.type.startswith("tool_call") else ev.type
        if kind != last and last is not None and ev.type != "tool_call_args":
            click.echo()
        if ev.type == "reasoning":
            click.secho(ev.text, nl=False, dim=True)
        elif ev.type == "content":
            click.echo(ev.text, nl=False)
        elif ev.type == "tool_call_start":
            click.secho(f"-> tool call {ev.tool_call['function']['name']}(", nl=False, fg="cyan")
        elif ev.type == "tool_call_args":
            click.secho(ev.text, nl=False, fg="cyan")
        elif ev.streamed:
            click.secho(")", nl=False, fg="cyan")
        else:
            fn = ev.tool_call["function"]
            click.secho(f"-> tool call {fn['name']}({fn['arguments']})", nl=False, fg="cyan")
        last = kind
    raise AgentrtError("generation ended without a result")


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
@click.option("--command-timeout", type=Finite(min=0.1), default=30.0, show_default=True)
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
    callback=output_path,
    help="Save every request as a trace (.jsonl or .jsonl.zst), also when the run stops early.",
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
    from agentrt.session.agent import AgentRun, Tools, run_agent

    tools = Tools(workdir, command_timeout, approve, sandbox, allow_network)  # before loading
    rt = open_runtime(opts, require_tokenizer=True)
    result = AgentRun([])
    try:
        run_agent(rt, task, tools, max_turns, max_tokens, _print_turn, into=result)
    finally:  # (an error or Ctrl-C keeps the turns that ran)
        if trace_out and result.requests:
            _save_run_trace(result, task, trace_out)
    if result.finished:
        state = "finished"
    elif result.cut:
        state = f"stopped: the reply reached --max-tokens ({max_tokens}) without a tool call"
    else:
        state = f"stopped at the turn limit ({max_turns})"
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
    write_trace(Trace(Header(FORMAT, "agentrt run", task[:200]), requests), path)  # (TraceError)
    click.echo(f"trace saved to {path} ({len(requests)} request(s))", err=True)
