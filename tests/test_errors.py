"""Bad input: one-line CLI errors (no traceback, exit 2) and typed Python exceptions."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from util import invoke_cli, run_cli

from agentrt import Runtime
from agentrt.errors import (
    AgentrtError,
    InvalidArgumentError,
    ModelFormatError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedArchitectureError,
)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _bad_dir(tmp_path, hf_qwen3, case: str):
    """The model directory of `case`, the error type it must raise and words its message has."""
    cfg = json.loads((hf_qwen3 / "config.json").read_text())
    path = tmp_path / case if case == "missing" else _copy(hf_qwen3, tmp_path / case)
    if case == "no_config":
        (path / "config.json").unlink()
    elif case == "bad_json":
        (path / "config.json").write_text("{not json")
    elif case == "unknown_arch":
        (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama4"}))
    elif case == "no_weights":
        (path / "model.safetensors").unlink()
    elif case == "corrupt":
        (path / "model.safetensors").write_bytes(b"\x00" * 64)
    elif case == "wrong_shape":
        (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    elif case == "odd_dtype":
        (path / "config.json").write_text(json.dumps({**cfg, "dtype": "float64"}))
    elif case == "index_names":
        (path / "model.safetensors.index.json").write_text('{"weight_map": {"a": 1}}')
    return path, *{
        "missing": (ModelNotFoundError, "not found"),
        "no_config": (ModelFormatError, "config.json"),
        "bad_json": (ModelFormatError, "malformed"),
        "unknown_arch": (UnsupportedArchitectureError, "llama4"),
        "no_weights": (ModelFormatError, "safetensors"),
        "corrupt": (ModelFormatError, "cannot read"),
        "wrong_shape": (ModelFormatError, "shape"),
        "odd_dtype": (ModelFormatError, "dtype 'float64' is not one of"),
        "index_names": (ModelFormatError, "1 is no file name"),
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "no_config",
        "bad_json",
        "unknown_arch",
        "no_weights",
        "corrupt",
        "wrong_shape",
        "odd_dtype",
        "index_names",
    ],
)
def test_bad_model_dirs(tmp_path, hf_qwen3, case):
    path, exc_type, words = _bad_dir(tmp_path, hf_qwen3, case)
    with pytest.raises(exc_type, match=words):
        Runtime.open(model=str(path))
    # (one case as a user starts the command, the others in this process)
    cli = run_cli if case == "corrupt" else invoke_cli
    proc = cli("chat", "--model", str(path), "--device", "cpu", "hi", timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_prompt_longer_than_context(tmp_path, hf_qwen3):
    small = _copy(hf_qwen3, tmp_path / "small_ctx")
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    rt = Runtime.open(model=str(small))
    with pytest.raises(PromptTooLongError, match="context is 64 tokens"):
        rt.generate(list(range(100)), max_tokens=4)
    assert len(rt.generate(list(range(60)), max_tokens=10)) == 4  # stops at the context end


@pytest.mark.slow
def test_cli_prompt_too_long(tmp_path):
    from agentrt.models.tiny import ensure_tiny

    small = _copy(ensure_tiny(), tmp_path / "tiny_small_ctx")
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    proc = run_cli("chat", "--model", str(small), "--device", "cpu", "word " * 100, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: prompt has ") and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bad_options_are_named():
    with pytest.raises(InvalidArgumentError, match="cache must be"):
        Runtime.open(cache="bogus")
    with pytest.raises(InvalidArgumentError, match="offload must be"):
        Runtime.open(offload="ollama")
    with pytest.raises(InvalidArgumentError, match="as a size"):
        Runtime.open(vram_budget="lots")
    with pytest.raises(InvalidArgumentError, match="no room for experts"):
        Runtime.open(vram_budget="1MiB")
    proc = invoke_cli("chat", "--device", "cpu", "--vram-budget", "1MiB", "hi", timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "no room" in proc.stderr


def test_bad_arguments():
    rt = Runtime.open()
    with pytest.raises(InvalidArgumentError):
        rt.generate([1, 2, 10**9])
    with pytest.raises(InvalidArgumentError):
        rt.generate([1, 2], temperature=-1)
    with pytest.raises(InvalidArgumentError):
        rt.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidArgumentError):
        rt.chat([])
    assert issubclass(InvalidArgumentError, AgentrtError)


def test_cuda_requested_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidArgumentError, match="CUDA is not available"):
        Runtime.open(device="cuda")


def test_cli_json_into_missing_directory_is_a_usage_error(tmp_path):
    proc = invoke_cli("model", "info", "tiny", "--json", str(tmp_path / "no" / "x.json"))
    assert (
        proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    )


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_cli_output_where_no_file_can_be_created_is_a_usage_error(tmp_path):
    """An output in a directory that takes no new file fails before any work, as root too
    (permission bits do not stop root; /proc does); a device is written into, not probed."""
    proc = invoke_cli("model", "info", "tiny", "--json", "/proc/agentrt-x.json")
    assert proc.returncode == 2 and "cannot write" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = invoke_cli("model", "info", "tiny", "--json", "/dev/null")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_cli_chat_needs_a_tokenizer_before_loading(tmp_path):
    proc = invoke_cli(
        "chat", "--model", "synthetic:qwen3-30b-a3b", "--device", "cpu", "hi", timeout=120
    )
    assert proc.returncode == 2 and "has no tokenizer" in proc.stderr


def test_bench_scratch_state_dir_never_empties_a_users_directory(tmp_path):
    from agentrt.bench.engine import SCRATCH_MARK, scratch_dir

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    args = ["bench", "statecache", "--device", "cpu", "--lengths", "64", "--rounds", "1"]
    result = invoke_cli(*args, "--state-dir", str(victim))
    assert result.returncode == 2 and "is not empty and no benchmark made it" in result.stderr
    assert (victim / "notes.txt").read_text() == "precious"
    made = scratch_dir(tmp_path / "new")  # made, marked, and emptied again by a later run
    (made / "data.mdb").write_text("x")
    assert scratch_dir(made) == made and [p.name for p in made.iterdir()] == [SCRATCH_MARK]
    assert made.stat().st_mode & 0o777 == 0o700  # private: it holds conversations' state


def test_unusable_state_dirs_are_one_line_errors(tmp_path):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "data.mdb").write_text("not lmdb")
    result = invoke_cli("cache", "ls", "--state-dir", str(garbage))
    assert result.returncode == 2 and "is damaged" in result.stderr
    assert "agentrt cache clear --state-dir" in result.stderr
    (tmp_path / "file").write_text("")
    under_file = str(tmp_path / "file" / "state")
    result = invoke_cli("chat", "--device", "cpu", "--state-dir", under_file, "hi")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"error: Not a directory: {under_file}"


def test_a_truncated_state_database_never_kills_a_command_and_clear_removes_it(tmp_path):
    """A data.mdb cut off before its last page (a full disk, a partial copy) killed the process
    reading a page past its end (SIGBUS): it is filled out at open, so every command ends
    normally or with one line naming the fix, and `cache clear` deletes the damaged files."""
    from agentrt.statecache.store import Store

    state = tmp_path / "state"
    store = Store(state, 2**30)
    for n in range(4):
        store.put_checkpoint(*_record(b"k%d" % n), b"x" * 300_000)
    store.close()
    data = state / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    for args in (["cache", "gc", "--verify"], ["cache", "ls"], ["chat", "--device", "cpu", "hi"]):
        result = run_cli(*args, "--state-dir", str(state))  # (a crash: a signal's status)
        assert result.returncode in (0, 2), (args, result.returncode, result.stderr)
        assert "Traceback" not in result.stderr
        if result.returncode == 2:
            assert "damaged" in result.stderr and "agentrt cache clear" in result.stderr
    cleared = run_cli("cache", "clear", "--yes", "--state-dir", str(state))
    assert cleared.returncode == 0 and data.stat().st_size < 300_000, cleared.stderr
    Store(state, 2**30).close()


def test_errors_that_are_not_damage_do_not_advise_deleting_the_cache(tmp_path, monkeypatch):
    import lmdb

    from agentrt.errors import AgentrtError
    from agentrt.statecache.damage import DamagedStoreError
    from agentrt.statecache.store import Store

    def no_memory(*args, **kwargs):
        raise lmdb.MemoryError("Cannot allocate memory")

    monkeypatch.setattr(lmdb, "open", no_memory)
    with pytest.raises(AgentrtError) as info:
        Store(tmp_path / "state", 2**30)
    assert not isinstance(info.value, DamagedStoreError) and "clear" not in str(info.value)


def _record(key: bytes):
    from agentrt.statecache.codec import Record

    return key, Record(b"fp", "m", 8, "message_end", [], 300_000, 0, 0.0, 0.0), {}


_DECODE_OFFLOAD = ["bench", "decode", "--device", "cpu", "--offload", "none"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["chat", "--bogus", "x"], "No such option '--bogus'"),
        (["chat"], "Missing argument 'MESSAGE'"),
        (["serve", "--port", "0"], "'--port'"),
        (["nosuch"], "No such command 'nosuch'"),
        (["bench", "prefill", "--offload", "auto", "--vram-budget", "12XB"], "'12XB' as a size"),
        (_DECODE_OFFLOAD + ["--linear-attn", "torch"], "only auto with --offload"),
        (_DECODE_OFFLOAD + ["--graphs", "on,off"], "one value only with --offload"),
        (["bench", "statecache", "--linear-attn", "torch"], "only auto without --fidelity"),
        # options that would be ignored: usage errors naming them
        (["bench", "decode", "--prefetch", "off", "--repeat", "2"], "--prefetch, --repeat are"),
        (["bench", "prefill", "--suffixes", "64"], "--suffixes is used only with --offload auto"),
        (["bench", "prefill", "--no-resident"], "--no-resident is used only with --offload auto"),
        (["bench", "decode", "--offload", "static", "--prefetch", "off"], "--prefetch is used"),
        (["bench", "decode", "--eager", "--graphs", "on,off"], "--graphs is used only without"),
        (["bench", "statecache", "--suffix", "8"], "--suffix is used only with --fidelity"),
        (["bench", "statecache", "--fidelity", "--capture-every", "8"], "only without --fid"),
        (
            ["bench", "prefill", "--offload", "auto", "--linear-attn", "torch,auto"],
            "one value only with --offload auto",
        ),
        # numbers out of what the option can mean: refused before a model loads
        (["chat", "--seed", str(2**64), "hi"], "is not in the range"),
        (["chat", "--state-max-gb", "nan", "hi"], "'nan' is not a finite number"),
        (["chat", "--temperature", "inf", "hi"], "'--temperature'"),
        (["cache", "gc", "--max-gb", "inf"], "'--max-gb'"),
        (["serve", "--max-request-mb", "nan"], "is not a finite number"),
        (["chat", "--vram-budget", "1e400GiB", "hi"], "as a size"),
        (["chat", "--vram-budget", "-1GiB", "hi"], "a size cannot be negative"),
        (["serve", "--cors-origin", "http://x:99999"], "is not an origin"),
        (["bench", "prefill", "--lengths", "999999999"], "do not fit the model's context"),
        (["bench", "decode", "--tokens", "999999999"], "do not fit the model's context"),
        (["bench", "accuracy", "--length", "999999999"], "do not fit the model's context"),
        (["bench", "statecache", "--lengths", "999999999"], "do not fit the model's context"),
    ],
)
def test_usage_errors_are_one_line_before_any_work(args, words):
    result = invoke_cli(*args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: ") and words in result.stderr
    assert "--help`)" in result.stderr


def test_options_that_would_be_ignored_are_usage_errors(tmp_path):
    slots = invoke_cli(
        "chat", "--device", "cpu", "--offload", "none", "--expert-cache-slots", "2", "hi"
    )
    assert slots.returncode == 2 and "--expert-cache-slots sizes --offload auto's" in slots.stderr
    split = invoke_cli("chat", "--device", "cpu", "--split", "off", "--recalibrate", "hi")
    assert split.returncode == 2
    assert "--recalibrate is used only with --offload auto, not none" in split.stderr
    # an option of the public contract where it does nothing: a warning, and the command runs
    assert "ignoring --split: it is used only with --offload auto" in split.stderr
    layers = invoke_cli("chat", "--device", "cpu", "--offload", "static", "--cpu-layers", "2", "hi")
    assert layers.returncode == 2
    assert "--cpu-layers is used only with --offload layer" in layers.stderr
    eager = invoke_cli("bench", "prefill", "--device", "cpu", "--lengths", "16", "--eager")
    assert eager.returncode == 0 and "ignoring --eager" in eager.stderr  # (it "always works")
    kernel = invoke_cli("run", "--device", "cpu", "--cpu-kernel", "torch", "task")
    assert kernel.returncode == 2 and "--cpu-kernel is used only where experts" in kernel.stderr
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"agentrt_trace": 1}\n{"id": "a", "messages": [{"role": "user"}]}\n')
    remote = invoke_cli(
        "replay", str(trace), "--endpoint", "http://127.0.0.1:9/v1", "--cache", "off"
    )
    assert remote.returncode == 2 and "--cache is for local replays" in remote.stderr
    args = ["replay", str(trace), "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"]
    remote = invoke_cli(*args, "--device", "cpu", "--state-dir", str(tmp_path), "--seed", "1")
    assert remote.returncode == 2 and "--seed is for local replays" in remote.stderr
    assert "ignoring --device, --state-dir: they are for local replays" in remote.stderr


def test_tokenizer_problems_are_one_line_and_name_the_option(tmp_path):
    import shutil

    from agentrt.errors import ChatTemplateError
    from agentrt.models.tiny import ensure_tiny
    from agentrt.session.chat import render
    from agentrt.session.tokenizer import load_tokenizer

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError) as err:
        load_tokenizer(broken)
    assert "cannot load tokenizer" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ModelFormatError, match="--tokenizer DIR"):
        load_tokenizer(tmp_path)
    plain = shutil.copytree(ensure_tiny(), tmp_path / "plain")
    tok = load_tokenizer(plain)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="--chat-template FILE"):
        render(tok, [{"role": "user", "content": "hi"}], None)


def test_group_options_and_declined_clears_answer_in_one_line(tmp_path):
    from click.testing import CliRunner

    from agentrt.cli import main
    from agentrt.statecache.store import Store

    bogus = invoke_cli("--bogus")
    assert bogus.returncode == 2 and bogus.stderr.startswith("error: No such option '--bogus'")
    Store(tmp_path / "state", 2**30).close()
    args = ["cache", "clear", "--state-dir", str(tmp_path / "state")]
    declined = CliRunner().invoke(main, args, input="n\n")
    assert declined.exit_code == 1 and "nothing deleted" in declined.stderr
    ended = CliRunner().invoke(main, args, input="")  # (end of input, as Ctrl-C: click's Abort)
    assert ended.exit_code == 130 and "no answer: nothing deleted (--yes" in ended.stderr


def test_bench_commands_name_a_device_they_cannot_use_in_one_line():
    import torch

    for args in (["prefill", "--lengths", "8"], ["bw"]):
        result = invoke_cli("bench", *args, "--device", "gpu0")
        assert result.returncode == 2 and result.stderr.strip() == (
            "error: device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu0'"
        )
    if torch.cuda.is_available():
        return  # (below: a machine without CUDA)
    for args in (["prefill", "--lengths", "8"], ["decode", "--tokens", "2"], ["accuracy"]):
        result = invoke_cli("bench", *args, "--device", "cuda:1")
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == (
            "error: device 'cuda:1' requested but CUDA is not available on this machine"
        )


def test_bench_text_without_text_and_plots_of_unknown_formats_fail_early(tmp_path):
    """An empty --text (it looped for ever), and a --plot matplotlib cannot write (it failed
    after the whole replay)."""
    (tmp_path / "empty.txt").write_text("")
    args = ["bench", "decode", "--device", "cpu", "--offload", "auto", "--prompt-len", "16"]
    args += ["--tokens", "2", "--vram-budget", "1GiB", "--text", str(tmp_path / "empty.txt")]
    result = invoke_cli(*args)
    assert result.returncode == 2 and "no text in it" in result.stderr.splitlines()[-1]
    trace = tmp_path / "t.jsonl"
    assert invoke_cli("trace", "gen", "--tokens", "1000", "-o", str(trace)).returncode == 0
    plot = ["replay", "--device", "cpu", "--plot", str(tmp_path / "p.txt"), str(trace)]
    result = invoke_cli(*plot)
    assert result.returncode == 2 and "a plot is one of" in result.stderr


def test_traces_cut_short_renamed_or_without_requests_are_errors(tmp_path):
    """A .zst cut short is an error (it read as fewer requests, or none), a .zst under another
    name is read as one, and a replay of traces without requests says so."""
    from agentrt.replay.trace import TraceError, read_trace

    whole = tmp_path / "t.jsonl.zst"
    assert invoke_cli("trace", "gen", "--tokens", "3000", "-o", str(whole)).returncode == 0
    raw = whole.read_bytes()
    (tmp_path / "cut.jsonl.zst").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TraceError, match="cut short"):
        read_trace(tmp_path / "cut.jsonl.zst")
    (tmp_path / "renamed.jsonl").write_bytes(raw)
    assert read_trace(tmp_path / "renamed.jsonl").requests == read_trace(whole).requests
    header = tmp_path / "header.jsonl"
    header.write_text('{"agentrt_trace": 1, "source": "x"}\n')
    result = invoke_cli("replay", "--device", "cpu", str(header))
    assert result.returncode == 2 and "no requests in" in result.stderr.splitlines()[-1]
    keyed = invoke_cli("replay", "--device", "cpu", "--api-key", "k", str(whole))
    assert keyed.returncode == 2 and "--api-key is used only with --endpoint" in keyed.stderr
    waits = invoke_cli("replay", "--device", "cpu", "--endpoint-timeout", "5", str(whole))
    assert waits.returncode == 2 and "--endpoint-timeout is used only with" in waits.stderr


def test_multi_frame_traces_plots_without_a_suffix_and_the_largest_seed(tmp_path):
    import zstandard

    from agentrt.bench.engine import random_ids
    from agentrt.cli.traces import plot_path
    from agentrt.replay.trace import read_trace

    plain = tmp_path / "t.jsonl"
    assert invoke_cli("trace", "gen", "--tokens", "3000", "-o", str(plain)).returncode == 0
    lines = plain.read_bytes().splitlines(keepends=True)
    frames = b"".join(zstandard.ZstdCompressor().compress(line) for line in lines)
    (tmp_path / "multi.jsonl.zst").write_bytes(frames)
    assert read_trace(tmp_path / "multi.jsonl.zst").requests == read_trace(plain).requests
    assert plot_path(None, None, str(tmp_path / "plot")) == str(tmp_path / "plot")
    assert len(random_ids(100, 4, 2**64 - 1 + 64)) == 4  # (a derived seed past 64 bits)


def test_a_replay_against_a_server_that_never_answers_stops_at_its_timeout(tmp_path):
    import socket

    trace = tmp_path / "t.jsonl"
    assert invoke_cli("trace", "gen", "--tokens", "1000", "-o", str(trace)).returncode == 0
    with socket.create_server(("127.0.0.1", 0)) as silent:  # (connections queue, never answered)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        args = ["replay", "--endpoint", url, "--endpoint-timeout", "1", str(trace)]
        result = invoke_cli(*args)
    assert result.returncode == 2 and "timed out" in result.stderr.splitlines()[-1]
