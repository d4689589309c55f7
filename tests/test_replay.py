"""Traces: format round trip and line-numbered errors, importers on the real samples (skipped when
the shared data is absent), framework transforms, the synthetic generator, replay reports (schema,
identical outputs across cache modes), `agentrt replay` / `bench ttft` / `trace` commands."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from conftest import SHARED
from util import invoke_cli, run_cli

from agentrt.replay.generator import generate
from agentrt.replay.importers import import_traces
from agentrt.replay.trace import (
    TraceError,
    drop_reasoning,
    read_trace,
    truncate_tool_outputs,
    write_trace,
)

TRACES = SHARED / "traces-dev"
needs_data = pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data/traces-dev is absent")


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    return write_trace(
        generate(seed=7, target_tokens=2000, max_turns=6), tmp_path_factory.mktemp("t") / "s.jsonl"
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_trace_round_trip(tmp_path, suffix):
    trace = generate(seed=1, target_tokens=2000, max_turns=4)
    back = read_trace(write_trace(trace, tmp_path / f"x{suffix}"))
    assert back.header == trace.header and back.requests == trace.requests


@pytest.mark.parametrize(
    "lines, where",
    [
        (['{"agentrt_trace": 1}', '{"id": "a", "messages": "nope"}'], ":2:"),
        (['{"agentrt_trace": 1}', '{"id": "a", "messages": [{}]}', "{broken"], ":3:"),
        (['{"no_header": true}'], ":1:"),
        (['{"agentrt_trace": 9}'], "unsupported"),
    ],
)
def test_malformed_trace_lines_are_named(tmp_path, lines, where):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=where):
        read_trace(path)
    proc = invoke_cli("trace", "show", str(path))
    assert (
        proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
    )


def test_transforms_model_framework_edits():
    trace = generate(seed=2, target_tokens=6000, max_turns=8)
    dropped = drop_reasoning(trace)
    assert all("reasoning_content" not in m for r in dropped.requests for m in r.messages)
    assert any(
        "reasoning_content" in m for r in trace.requests for m in r.messages
    )  # original untouched
    cut = truncate_tool_outputs(trace, 50, keep_last=1)
    last = cut.requests[-1].messages
    tools = [m for m in last if m["role"] == "tool"]
    assert (
        all(len(m["content"]) <= 50 + 30 for m in tools[:-1])
        and tools[-1] == [m for m in trace.requests[-1].messages if m["role"] == "tool"][-1]
    )


def test_generator_is_seeded_and_sized():
    a, b = generate(seed=3, target_tokens=12000), generate(seed=3, target_tokens=12000)
    assert msgspec.json.encode(a.requests) == msgspec.json.encode(b.requests)
    assert msgspec.json.encode(a.requests) != msgspec.json.encode(
        generate(seed=4, target_tokens=12000).requests
    )
    final = a.requests[-1]
    assert len(a.requests) >= 5 and final.tools and final.messages[0]["role"] == "system"
    assert sum(len(json.dumps(m)) for m in final.messages) > 12000 * 2


@needs_data
def test_import_mini_swe_agent_reproduces_requests():
    raw = json.loads(
        (TRACES / "mini-swe-agent/marshmallow-code__marshmallow-1343.traj.json").read_text()
    )
    (trace,) = import_traces(
        "mini-swe-agent", [TRACES / "mini-swe-agent/marshmallow-code__marshmallow-1343.traj.json"]
    )
    assistants = [i for i, m in enumerate(raw["messages"]) if m["role"] == "assistant"]
    assert len(trace.requests) == len(assistants) == raw["info"]["model_stats"]["api_calls"]
    for req, i in zip(trace.requests, assistants, strict=True):
        assert [m["role"] for m in req.messages] == [m["role"] for m in raw["messages"][:i]]
    second = trace.requests[1]
    call_id = second.messages[2]["tool_calls"][0]["id"]
    assert second.messages[3]["tool_call_id"] == call_id
    assert trace.requests[0].tools[0]["function"]["name"] == "bash"
    assert "extra" not in second.messages[3]


@needs_data
def test_import_tau_bench_reproduces_requests():
    raw = json.loads((TRACES / "tau-bench/gpt-4o-airline.json").read_text())
    traces = import_traces("tau-bench", [TRACES / "tau-bench/gpt-4o-airline.json"])
    assert len(traces) == len(raw)
    traj = raw[0]["traj"]
    assistants = [i for i, m in enumerate(traj) if m["role"] == "assistant"]
    assert len(traces[0].requests) == len(assistants)
    for req, i in zip(traces[0].requests, assistants, strict=True):
        assert [m["role"] for m in req.messages] == [m["role"] for m in traj[:i]]
        ids = [c["id"] for m in req.messages for c in m.get("tool_calls", [])]
        assert [m["tool_call_id"] for m in req.messages if m["role"] == "tool"] == ids[: len(ids)]
    names = {t["function"]["name"] for t in traces[0].requests[0].tools}
    assert {"get_user_details", "search_direct_flight"} <= names


@needs_data
def test_import_openhands_orders_calls_by_time():
    traces = import_traces(
        "openhands",
        [TRACES / "openhands-llm-logs/llm-logs", TRACES / "openhands-llm-logs/nonfncall-llm-logs"],
    )
    counts = sorted(len(t.requests) for t in traces)
    files = sorted(
        len(list((TRACES / "openhands-llm-logs" / d).glob("*.json")))
        for d in ("llm-logs", "nonfncall-llm-logs")
    )
    assert counts == files
    fn = next(t for t in traces if "nonfncall" not in t.name)
    assert [len(r.messages) for r in fn.requests] == sorted(len(r.messages) for r in fn.requests)
    assert fn.requests[0].t == 0 and all(
        a.t <= b.t for a, b in zip(fn.requests, fn.requests[1:], strict=False)
    )
    assert (
        fn.requests[1].messages[2]["tool_calls"][0]["id"]
        == fn.requests[1].messages[3]["tool_call_id"]
    )


@needs_data
def test_trace_import_cli(tmp_path):
    out = tmp_path / "out"
    proc = invoke_cli(
        "trace",
        "import",
        "--format",
        "tau-bench",
        str(TRACES / "tau-bench/gpt-4o-airline.json"),
        "-o",
        str(out),
        "--limit",
        "3",
        "--zst",
    )
    assert proc.returncode == 0, proc.stderr
    files = sorted(out.glob("*.jsonl.zst"))
    assert len(files) == 3 and read_trace(files[0]).requests


REPORT_SCHEMA = {
    "summary": {
        "requests",
        "ttft_s",
        "prompt_tokens",
        "cached_tokens",
        "prefilled_tokens",
        "decode_tok_s",
        "model",
        "cache",
        "device",
    },
    "request": {
        "index",
        "prompt_tokens",
        "cached_tokens",
        "ttft_s",
        "completion_tokens",
        "checkpoint",
        "output_token_ids",
    },
}


def _check_report(report: dict, n: int) -> None:
    assert REPORT_SCHEMA["summary"] <= set(report["summary"])
    assert set(report["summary"]["ttft_s"]) == {"p50", "p90", "p99", "max"}
    assert len(report["requests"]) == n
    for i, row in enumerate(report["requests"]):
        assert REPORT_SCHEMA["request"] <= set(row) and row["index"] == i
        assert row["checkpoint"] is None or isinstance(row["checkpoint"], str)
        assert row["ttft_s"] > 0 and 0 <= row["cached_tokens"] < row["prompt_tokens"]
        assert row["decode_s"] >= 0  # (beside the contract's fields: the decode's seconds)
    s = report["summary"]
    assert s["prefilled_tokens"] == s["prompt_tokens"] - s["cached_tokens"]


@pytest.mark.slow
def test_replay_outputs_identical_across_cache_modes(small_trace, tmp_path):
    n = len(read_trace(small_trace).requests)
    reports = {}
    for mode in ("semantic", "prefix", "off"):
        out = tmp_path / f"{mode}.json"
        proc = invoke_cli(
            "replay",
            str(small_trace),
            "--device",
            "cpu",
            "--cache",
            mode,
            "--max-tokens",
            "6",
            "--state-dir",
            str(tmp_path / "state"),
            "--json",
            str(out),
        )
        assert proc.returncode == 0, proc.stderr
        assert "p99 s" in proc.stdout
        reports[mode] = json.loads(out.read_text())
        _check_report(reports[mode], n)
    ids = {mode: [r["output_token_ids"] for r in rep["requests"]] for mode, rep in reports.items()}
    assert ids["semantic"] == ids["prefix"] == ids["off"]
    assert (
        reports["semantic"]["summary"]["cached_tokens"] > 0
        and reports["off"]["summary"]["cached_tokens"] == 0
    )
    assert any(r["checkpoint"] for r in reports["semantic"]["requests"])


@pytest.mark.slow
def test_bench_ttft_and_plot(small_trace, tmp_path):
    pytest.importorskip("matplotlib", reason="plotting is an optional extra")
    out, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    proc = invoke_cli(
        "bench",
        "ttft",
        str(small_trace),
        "--device",
        "cpu",
        "--max-tokens",
        "2",
        "--variants",
        "recorded,dropped",
        "--json",
        str(out),
        "--plot",
        str(png),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert set(result["reports"]) == {"recorded", "dropped"}
    assert [r["summary"]["cache"] for r in result["reports"]["recorded"]] == [
        "semantic",
        "prefix",
        "off",
    ]
    assert "recorded:off/semantic:max" in result["ratios"]
    assert (tmp_path / "ttft-recorded.png").stat().st_size > 1000
    assert result["warmup_requests"] == 8
    stats = result["reports"]["recorded"][0]["state_cache_stats"]
    assert stats["write_written"] > 0 and "misses" in stats
    semantic = result["reports"]["recorded"][0]["requests"]
    for row in semantic:  # where each TTFT went, and where reused state came from
        t = row["timings"]
        assert 0 <= t["restore_s"] <= t["prefill_s"] <= row["ttft_s"]
        assert 0 <= t["capture_s"] <= t["prefill_s"] and t["capture_gpu_s"] == 0  # CPU run
        assert 0 <= t["restore_wait_s"] <= t["restore_s"]
        assert 0 < t["prepare_s"] and t["prepare_s"] + t["prefill_s"] <= row["ttft_s"]
        # what ran beside it: checkpoint writes (none offloaded: no prefill counters)
        assert t["writes_pending"] >= 0 and t["writer_s"] >= 0 and "offload" not in t
        # no CUDA graph on the CPU: each decode step but the last sampled token's ran eagerly
        assert t["eager_decode_steps"] == row["completion_tokens"] - 1
        assert t["decode_captures"] == 0 and t["decode_capture_s"] == 0
        assert "decode_offload" not in t
        if row["cached_tokens"] == 0:
            assert t["restore_source"] is None
    sources = {r["timings"]["restore_source"] for r in semantic if r["cached_tokens"]}
    assert sources <= {"ram", "lmdb", "live", "device", "ram+live_kv", "lmdb+live_kv"}
    # the next request carries the recorded reply, not the generated one: the live sequence
    # agrees up to a boundary its last prefill captured, so the state is cut back on the device
    assert "device" in sources
    # the stats (the warm-up ran on a cache of its own) count one outcome per request: a hit of
    # some tier (the device and live tiers included) or a miss (nothing reused)
    device_rows = sum(r["timings"]["restore_source"] == "device" for r in semantic)
    assert stats["hits_device"] == device_rows
    outcomes = sum(v for k, v in stats.items() if k.startswith("hits_") or k == "misses")
    assert outcomes == len(semantic)
    assert stats["misses"] == sum(r["cached_tokens"] == 0 for r in semantic)


@pytest.mark.slow
def test_replay_against_an_endpoint(small_trace, tmp_path):
    """`agentrt replay --endpoint` drives our own server; the report matches local replay."""
    import threading
    import time

    import uvicorn

    from agentrt import Runtime
    from agentrt.server.app import ServerConfig, build_app

    rt = Runtime.open("tiny", cache="off")
    app, chat = build_app(rt, ServerConfig())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    out = tmp_path / "remote.json"
    proc = run_cli(
        "replay",
        str(small_trace),
        "--endpoint",
        f"http://127.0.0.1:{port}/v1",
        "--model",
        "tiny",
        "--max-tokens",
        "3",
        "--json",
        str(out),
    )
    server.should_exit = True
    thread.join(timeout=10)
    chat.worker.stop()
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["summary"]["requests"] == len(read_trace(small_trace).requests)
    assert all(r["completion_tokens"] == 3 and r["ttft_s"] > 0 for r in report["requests"])


def test_line_separators_inside_strings_round_trip(tmp_path):
    from agentrt.replay.trace import FORMAT, Header, Request, Trace

    trace = Trace(
        Header(FORMAT, "t"), [Request("a", [{"role": "user", "content": "a\u2028b\u2029c\u0085d"}])]
    )
    back = read_trace(write_trace(trace, tmp_path / "sep.jsonl"))
    assert back.requests[0].messages[0]["content"] == "a\u2028b\u2029c\u0085d"


def test_importer_tolerates_odd_fields(tmp_path):
    traj = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
    ]
    path = tmp_path / "tau.json"
    path.write_text(json.dumps([{"task_id": 1, "trial": 0, "traj": traj}]))
    (trace,) = import_traces("tau-bench", [path])
    assert trace.requests[0].response.tool_calls[0]["function"]["arguments"] == '{"x": 1}'


def test_bench_ttft_reports_each_finished_mode_as_it_goes():
    """`bench ttft` hands over the report after every mode (the CLI writes it to --json), so a
    run that a time limit cuts short keeps the modes it finished; the last one is complete."""
    from agentrt import Runtime
    from agentrt.bench.ttft import ttft

    rt = Runtime.open("tiny", cache="off")
    modes, seen = ["semantic", "off"], []

    def run(traces, target, label):
        return {"summary": {"cache": label.split("/")[1], "ttft_s": {"p50": 1, "p99": 1, "max": 1}}}

    final = ttft(rt, lambda drop: [], modes, ["recorded"], 4, run, warmup=0, partial=seen.append)
    assert [len(r["reports"]["recorded"]) for r in seen] == [1, 2]
    assert [r["complete"] for r in seen] == [False, False] and final["complete"]
    assert [r["summary"]["cache"] for r in final["reports"]["recorded"]] == modes
    assert final["ratios"]["recorded:off/semantic:max"] == 1.0


def test_endpoint_ttft_counts_reasoning_under_either_name():
    from agentrt.replay.replay import _has_delta

    for key in ("content", "reasoning_content", "reasoning", "tool_calls"):
        assert _has_delta({"choices": [{"delta": {key: "x" if key != "tool_calls" else [{}]}}]})
    assert not _has_delta({"choices": [{"delta": {"role": "assistant", "content": ""}}]})


def test_traces_of_one_name_are_all_written(tmp_path):
    from agentrt.cli.traces import _write_traces

    trace = generate(seed=1, target_tokens=1000, max_turns=2)
    paths = _write_traces([trace, trace, trace], str(tmp_path / "out"), zst=False)
    assert [p.name for p in paths] == [f"{trace.name}{s}.jsonl" for s in ("", "-2", "-3")]
    assert all(p.is_file() for p in paths)


def test_truncation_cuts_tool_outputs_given_as_content_parts():
    from agentrt.replay.trace import FORMAT, Header, Request, Trace

    parts = [{"type": "text", "text": "a" * 30}, {"type": "text", "text": "b" * 30}]
    msgs = [{"role": "user", "content": "go"}]
    msgs += [{"role": "tool", "tool_call_id": str(i), "content": list(parts)} for i in range(3)]
    trace = Trace(Header(FORMAT, "t"), [Request("r", msgs)])
    out = truncate_tool_outputs(trace, 40, keep_last=1).requests[0].messages
    assert out[1]["content"] == [
        {"type": "text", "text": "a" * 30},
        {"type": "text", "text": "b" * 10 + "\n[... output truncated]"},
    ]
    assert out[3]["content"] == parts  # the last one is kept whole
    assert trace.requests[0].messages[1]["content"] == parts  # the input is untouched


def test_generated_sessions_reach_their_size_or_say_why(tmp_path):
    from agentrt.replay.generator import estimated_tokens

    assert estimated_tokens(generate(seed=2, target_tokens=20000)) >= 20000
    out = tmp_path / "g.jsonl"
    short = invoke_cli("trace", "gen", "--tokens", "20000", "--max-turns", "3", "-o", str(out))
    assert short.returncode == 0 and "--max-turns 3 ended the session" in short.stderr


@pytest.mark.parametrize("where", ["dir", "under_file"])
def test_trace_output_that_cannot_be_written_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("")
    out = tmp_path if where == "dir" else tmp_path / "file" / "x.jsonl"
    result = invoke_cli("trace", "gen", "--tokens", "1000", "-o", str(out))
    assert result.returncode == 2 and result.stderr.startswith("error: Invalid value for '-o'")
    assert len(result.stderr.strip().splitlines()) == 1 and str(out) in result.stderr


def test_plots_of_variants_get_their_own_files():
    from agentrt.cli.traces import _variant_path

    assert _variant_path("ttft.png", "dropped") == "ttft-dropped.png"
    assert _variant_path("out/TTFT.PNG", "recorded") == "out/TTFT-recorded.PNG"
    assert _variant_path("plot", "recorded") == "plot-recorded.png"


def test_a_request_without_messages_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    good = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}
    lines = [{"agentrt_trace": 1}, good, {"id": "b", "messages": []}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(TraceError, match=":3: a request needs at least one message"):
        read_trace(path)


def test_a_replay_stopped_by_a_request_keeps_the_report_before_it(tmp_path):
    from agentrt.cli.traces import _run_replay
    from agentrt.errors import AgentrtError, PromptTooLongError
    from agentrt.replay.replay import Target

    def send(req, max_tokens):
        if req.id.endswith("-2"):
            raise PromptTooLongError("prompt of 90000 tokens does not fit")
        row = dict(prompt_tokens=10, cached_tokens=0, ttft_s=0.1, completion_tokens=1)
        return row | dict(decode_s=0.0, checkpoint=None)

    trace = generate(seed=1, target_tokens=3000)
    out = tmp_path / "r.json"
    with pytest.raises(AgentrtError, match="request gen1-2 .* does not fit .* 2 request"):
        _run_replay([trace], Target("fake", "off", "cpu", send), 4, "replay", str(out))
    assert json.loads(out.read_text())["summary"]["requests"] == 2


@needs_data
def test_tau_bench_traces_offer_the_tools_of_the_whole_file():
    traces = import_traces("tau-bench", [TRACES / "tau-bench/gpt-4o-airline.json"])
    tools = {json.dumps(t.requests[0].tools) for t in traces if t.requests}
    assert len(tools) == 1 and len(json.loads(tools.pop())) > 9


@pytest.mark.parametrize("url", ["notaurl", "http://[::1", "ftp://host/v1", "http://"])
def test_a_bad_endpoint_url_is_named(url):
    from agentrt.errors import InvalidArgumentError
    from agentrt.replay.replay import endpoint_target

    with pytest.raises(InvalidArgumentError, match="must be an http"):
        endpoint_target(url, "m")


def test_bench_ttft_makes_each_modes_state_directory_inside_state_dir(tmp_path, monkeypatch):
    """--state-dir and --state-max-gb reach every mode's (and the warm-up's) state cache: a
    fresh directory inside --state-dir, removed after the mode, with the size cap given."""
    from agentrt.bench import ttft as b
    from agentrt.cli import traces

    seen = []

    class Rt:
        reuse, model_name, cache = None, "tiny", "off"
        engine = SimpleNamespace(device="cpu")

        def set_cache(self, mode, config=None):
            if config is not None:
                seen.append((mode, config.state_dir, config.max_bytes, config.state_dir.is_dir()))

        def close(self):
            pass

    trace = generate(seed=3, target_tokens=1000, max_turns=2)
    monkeypatch.setattr(traces, "open_runtime", lambda opts, **kw: Rt())
    monkeypatch.setattr(traces, "_load_traces", lambda paths, drop, truncate, n: [trace])
    monkeypatch.setattr(traces, "_run_replay", lambda *a: {})
    monkeypatch.setattr(b, "_report", lambda *a, **k: {"reports": {}, "ratios": {}})
    root = tmp_path / "states"
    args = ["bench", "ttft", str(tmp_path), "--cache", "semantic,off", "--state-dir", str(root)]
    assert invoke_cli(*args, "--state-max-gb", "3", "--warmup", "1").returncode == 0
    assert [mode for mode, *_ in seen] == ["semantic", "semantic", "off"]  # warm-up first
    assert all(d.parent == root and cap == 3 * 2**30 and made for _, d, cap, made in seen)
    assert len({d for _, d, *_ in seen}) == 3 and not any(root.iterdir())
    assert oct(root.stat().st_mode & 0o777) == "0o700"


def test_bench_ttft_runs_every_offload_and_split_setting(small_trace, tmp_path):
    out = tmp_path / "ttft.json"
    args = ["bench", "ttft", str(small_trace), "--device", "cpu", "--max-tokens", "2"]
    args += ["--cache", "off", "--variants", "recorded", "--warmup", "0", "--max-requests", "2"]
    args += ["--offload", "none,auto", "--split", "on,off", "--expert-cache-slots", "10"]
    result = invoke_cli(*args, "--json", str(out))
    assert result.returncode == 0, result.stderr
    settings = json.loads(out.read_text())["settings"]
    assert list(settings) == ["none", "auto", "auto/no-split"]
    assert all(len(s["reports"]["recorded"][0]["requests"]) == 2 for s in settings.values())
    rows = {k: s["reports"]["recorded"][0]["requests"] for k, s in settings.items()}
    assert not any("offload" in r["timings"] for r in rows["none"])
    for row in rows["auto"]:  # what each offloaded prefill copied and ran on the CPU
        seen = row["timings"]["offload"]
        assert sum(seen["plans"].values()) > 0  # one plan per MoE layer and chunk
        assert seen["copy_gb"] >= 0 and seen["routed_missing"] >= seen["cpu_experts"] >= 0
        assert set(seen["host_s"]) == {"wait", "cpu", "cpu_input", "host"}
        assert "writes_pending" not in row["timings"]  # (cache off: no writer)
        steps = row["timings"]["decode_offload"]  # its decode steps' experts
        assert {"copied", "cpu", "cpu_seconds", "host_steps"} <= set(steps)
        assert min(steps.values()) >= 0  # (counted over the request: never negative)
        assert row["timings"]["eager_decode_steps"] == row["completion_tokens"] - 1
        assert row["timings"]["cache_resizes"] >= 0 and row["timings"]["experts_refilled"] >= 0


def test_bench_ttft_keeps_finished_settings_when_a_later_one_is_cut(monkeypatch, tmp_path):
    """With several settings, every save holds the settings already finished: a time limit
    that cuts the second one short leaves the first one's result, labelled, in --json."""
    from agentrt.cli import traces

    out = tmp_path / "ttft.json"

    def setting(traces_, variants, tokens, plot, requests, warmup, save, opts):
        result = {"complete": True, "setting": traces.setting_of(opts)}
        if opts["offload"] == "auto":
            save({"complete": False, "setting": traces.setting_of(opts)})
            raise KeyboardInterrupt
        save(result)
        return result

    monkeypatch.setattr(traces, "_ttft_setting", setting)
    args = ["bench", "ttft", str(tmp_path), "--device", "cpu", "--offload", "none,auto"]
    invoke_cli(*args, "--expert-cache-slots", "10", "--json", str(out))
    settings = json.loads(out.read_text())["settings"]
    assert settings["none"] == {"complete": True, "setting": settings["none"]["setting"]}
    assert settings["none"]["setting"]["offload"] == "none"
    assert settings["auto"]["complete"] is False


def test_bench_ttft_runs_a_split_list_once_without_a_budget(monkeypatch, tmp_path):
    """--split on,off changes nothing for the default placement without a budget: one run."""
    from agentrt.cli import traces

    ran = []
    monkeypatch.setattr(traces, "_ttft_setting", lambda *a: ran.append(a[-1]["split"]) or {})
    assert invoke_cli("bench", "ttft", str(tmp_path), "--split", "on,off").returncode == 0
    assert ran == ["on"]
    ran.clear()
    budget = ["--vram-budget", "1GiB"]
    assert invoke_cli("bench", "ttft", str(tmp_path), "--split", "on,off", *budget).returncode == 0
    assert ran == ["on", "off"]


def _ttft_run(mode: str, rows: list[tuple[str, str, float]], complete: bool = True) -> dict:
    """A `bench ttft` report of one mode over `rows` (trace, request id, TTFT)."""
    requests = [
        {"trace": t, "id": i, "ttft_s": s, "prompt_tokens": 100, "cached_tokens": 0}
        for t, i, s in rows
    ]
    summary = {"cache": mode, "model": "m", "ttft_s": {"max": max(s for *_, s in rows)}}
    report = {"summary": summary, "requests": requests}
    return {
        "bench": "ttft",
        "complete": complete,
        "max_tokens": 8,
        "reports": {"dropped": [report]},
    }


def test_ttft_reports_split_over_runs_merge_into_one():
    from agentrt.bench.ttft import merge_reports
    from agentrt.errors import InvalidArgumentError

    semantic = _ttft_run("semantic", [("a", "1", 1.0), ("a", "2", 0.5), ("b", "1", 0.4)])
    off_a = _ttft_run("off", [("a", "1", 1.0), ("a", "2", 4.0)])
    off_b = _ttft_run("off", [("b", "1", 2.0)], complete=False)
    again = _ttft_run("off", [("b", "1", 3.0)])  # (a request replayed again: the later counts)
    merged = merge_reports([semantic, off_a, off_b, again])
    by_mode = {r["summary"]["cache"]: r["summary"] for r in merged["reports"]["dropped"]}
    assert by_mode["off"]["requests"] == 3 and by_mode["off"]["ttft_s"]["max"] == 4.0
    assert by_mode["off"]["ttft_s"]["p50"] == 3.0 and by_mode["semantic"]["ttft_s"]["p50"] == 0.5
    assert merged["ratios"]["dropped:off/semantic:max"] == 4.0
    assert merged["ratios"]["dropped:off/semantic:p50"] == 6.0
    assert not merged["complete"] and merged["merged_from"] == 4
    assert [r["index"] for r in merged["reports"]["dropped"][1]["requests"]] == [0, 1, 2]
    assert by_mode["off"]["missing_requests"] == 0 and by_mode["off"]["model"] == "m"
    # an off run left out: its summary says what it lacks; runs of other settings do not merge
    partial = merge_reports([semantic, off_a])
    assert [r["summary"]["missing_requests"] for r in partial["reports"]["dropped"]] == [0, 1]
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        merge_reports([semantic, {**off_a, "max_tokens": 16}])
    with pytest.raises(InvalidArgumentError, match="bench ttft"):
        merge_reports([semantic, {"reports": {}}])
