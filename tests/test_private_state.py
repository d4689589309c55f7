"""Private state on disk: the state-cache directory and its LMDB files, trace files, the model
cache, calibration profiles and native kernels are owner-only (0700 directories, 0600 files)
whatever the umask; an existing state directory open to other users is reported once, with the
`chmod` that fixes it, and left as it is."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from conftest import SHARED

from agentrt.host.private import private_dir, private_output, write_private

TAU_BENCH = SHARED / "traces-dev" / "tau-bench" / "gpt-4o-airline.json"


@pytest.fixture(params=[0o000, 0o022], ids=["umask000", "umask022"])
def umask(request):
    """Run the test under a permissive umask (0) and the usual one: modes must not change."""
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _modes(root: Path) -> dict[str, int]:
    """Mode of `root` and everything under it, by path relative to `root`."""
    return {str(p.relative_to(root)): _mode(p) for p in [root, *root.rglob("*")]}


def _assert_private_tree(root: Path) -> None:
    for name, mode in _modes(root).items():
        expected = 0o700 if (root / name).is_dir() else 0o600
        assert mode == expected, f"{name}: {mode:o}"


def test_state_dir_and_lmdb_files_are_private(tmp_path, umask):
    from agentrt.statecache.store import Store

    state = tmp_path / "home" / "state"
    Store(state, 2**20).close()
    assert _mode(tmp_path / "home") == 0o700
    locks = {"mode.lock", "mode-map.lock", "mode-write.lock"}  # one LMDB commit mode per directory
    assert {p.name for p in state.iterdir()} == {"data.mdb", "lock.mdb", *locks}
    _assert_private_tree(state)


def test_runtime_default_state_dir_is_private(tmp_path, monkeypatch, umask):
    from agentrt.statecache.config import StateCacheConfig
    from agentrt.statecache.store import Store

    monkeypatch.setenv("AGENTRT_HOME", str(tmp_path / "agentrt"))
    config = StateCacheConfig()
    assert config.state_dir == tmp_path / "agentrt" / "state"
    Store(config.state_dir, config.max_bytes).close()
    _assert_private_tree(tmp_path / "agentrt")


def test_existing_open_state_dir_warns_once_and_keeps_its_mode(tmp_path, capsys):
    from agentrt.statecache.store import Store

    state = tmp_path / "shared-state"
    state.mkdir()
    state.chmod(0o755)
    for _ in range(2):
        Store(state, 2**20).close()
    err = capsys.readouterr().err
    assert err.count(f"chmod 700 {state.resolve()}") == 1
    assert len(err.strip().splitlines()) == 1 and "755" in err
    assert _mode(state) == 0o755  # reported, never changed
    private = tmp_path / "own-state"
    private.mkdir(mode=0o700)
    Store(private, 2**20).close()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.zst"])
def test_trace_files_are_private(tmp_path, umask, name):
    from agentrt.replay.trace import FORMAT, Header, Request, Trace, read_trace, write_trace

    trace = Trace(
        Header(FORMAT, "test"), [Request(id="r0", messages=[{"role": "user", "content": "hi"}])]
    )
    path = write_trace(trace, tmp_path / "out" / "nested" / name)
    _assert_private_tree(tmp_path / "out")
    assert read_trace(path).requests[0].messages[0]["content"] == "hi"
    path.chmod(0o644)  # a file written before is replaced by an owner-only one
    write_trace(trace, path)
    assert _mode(path) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == [name]  # no temporary left


@pytest.mark.skipif(not TAU_BENCH.is_file(), reason="needs the shared tau-bench sample")
def test_trace_import_writes_private_files(tmp_path, umask):
    from click.testing import CliRunner

    from agentrt.cli import main

    out = tmp_path / "imported"
    args = ["trace", "import", "--format", "tau-bench", str(TAU_BENCH), "-o", str(out)]
    result = CliRunner().invoke(main, [*args, "--limit", "2", "--zst"])
    assert result.exit_code == 0, result.output
    assert len(list(out.glob("*.jsonl.zst"))) == 2
    _assert_private_tree(out)


def test_model_cache_is_private(tmp_path, monkeypatch, umask):
    from agentrt.models.tiny import ensure_tiny

    monkeypatch.setenv("AGENTRT_HOME", str(tmp_path / "home"))
    model = ensure_tiny(quiet=True)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in model.iterdir()
    }
    _assert_private_tree(tmp_path / "home")


def test_sharded_checkpoint_is_private(tmp_path, umask):
    from agentrt.models.synthetic import write_checkpoint

    out = write_checkpoint("tiny-qwen3-moe", tmp_path / "m", max_single_bytes=0)
    assert (out / "model.safetensors.index.json").is_file()
    _assert_private_tree(out)


def test_profiles_are_private(tmp_path, umask):
    from agentrt.offload.calibrate import Profile, load_profile, save_profile

    profile = Profile(1.0, 2.0, 1.0, 2.0, 64, "cpu", "test", 2)
    path = tmp_path / "profiles" / "p.json"
    save_profile(profile, path)
    _assert_private_tree(tmp_path / "profiles")
    assert load_profile(path) == profile


def test_native_kernel_is_private(tmp_path, umask):
    from agentrt.offload import cpu_kernel

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    path = tmp_path / "kernels" / "k.so"
    cpu_kernel._build(compiler, path, cpu_kernel.SOURCE, "experts_bf16")
    _assert_private_tree(tmp_path / "kernels")


def test_private_helpers(tmp_path, umask):
    deep = private_dir(tmp_path / "a" / "b")
    assert _mode(tmp_path / "a") == _mode(deep) == 0o700
    write_private(deep / "f", "text")
    assert (deep / "f").read_text() == "text" and _mode(deep / "f") == 0o600
    with pytest.raises(RuntimeError), private_output(deep / "g") as tmp:
        assert _mode(tmp) == 0o600
        raise RuntimeError("writer failed")
    assert sorted(p.name for p in deep.iterdir()) == ["f"]  # nothing half-written left


def test_private_writes_keep_links_devices_and_pipes(tmp_path):
    """A link's target is the file replaced (the link stays); a character device or a pipe is
    written into, never replaced by a regular file (`-o /dev/null`, `-o /dev/stdout`); a
    directory, or a name without a file name, is refused before anything is written."""
    (tmp_path / "real").write_text("old")
    (tmp_path / "link").symlink_to("real")
    write_private(tmp_path / "link", "new")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real").read_text() == "new"
    with private_output(tmp_path / "link") as tmp:
        tmp.write_text("newer")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real").read_text() == "newer"
    os.mkfifo(tmp_path / "pipe")
    reader = os.open(tmp_path / "pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_private(tmp_path / "pipe", "through")
        assert os.read(reader, 100) == b"through"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)
    if Path("/dev/null").exists():
        write_private("/dev/null", "gone")
        assert stat.S_ISCHR(Path("/dev/null").stat().st_mode)
    for bad in (tmp_path, Path("."), tmp_path / "."):
        with pytest.raises(IsADirectoryError):
            write_private(bad, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "pipe", "real"]


def test_cli_outputs_refuse_directories_and_keep_links(tmp_path, monkeypatch):
    """`--json`, `trace gen -o`: an empty name or a directory fails before any work, a link
    keeps pointing at the file written, a name of another format is refused."""
    from click.testing import CliRunner

    from agentrt.cli import main

    monkeypatch.chdir(tmp_path)
    run = CliRunner().invoke
    for out in ("", ".", str(tmp_path), "x.jsonl.gz", "x.json"):
        result = run(main, ["trace", "gen", "--tokens", "1000", "-o", out])
        assert result.exit_code == 2 and "Traceback" not in result.output, (out, result.output)
    (tmp_path / "t.jsonl").symlink_to("real.jsonl")
    assert run(main, ["trace", "gen", "--tokens", "1000", "-o", "t.jsonl"]).exit_code == 0
    assert (tmp_path / "t.jsonl").is_symlink() and (tmp_path / "real.jsonl").stat().st_size > 0
    (tmp_path / "m.json").symlink_to("info.json")
    assert run(main, ["model", "info", "tiny", "--json", "m.json"]).exit_code == 0
    assert (tmp_path / "m.json").is_symlink() and (tmp_path / "info.json").stat().st_size > 0
    assert run(main, ["model", "info", "tiny", "--json", ""]).exit_code == 2


def test_stdout_as_an_output_is_written_as_the_shell_set_it_up(tmp_path):
    """`-o /dev/stdout >> log`: the trace is appended to the log through the descriptor (the
    name reopened would truncate it, or be replaced by a new 0600 file); status goes to
    stderr, not into the data."""
    import subprocess
    import sys

    log = tmp_path / "log.jsonl"
    log.write_text("earlier\n")
    os.chmod(log, 0o644)
    cmd = [sys.executable, "-m", "agentrt.cli", "trace", "gen", "--tokens", "1000"]
    with open(log, "a") as out:
        subprocess.run([*cmd, "-o", "/dev/stdout"], stdout=out, check=True, cwd=tmp_path)
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier" and '"agentrt_trace"' in lines[1] and _mode(log) == 0o644


def test_links_loops_and_links_of_others(tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    write_private(tmp_path / "loop", "x")  # (no traceback: the loop itself is replaced)
    assert (tmp_path / "loop").read_text() == "x"
    if os.getuid() == 0:
        other = tmp_path / "theirs"
        other.symlink_to(tmp_path / "target")
        os.lchown(other, 12345, 12345)  # a link someone else planted: not followed
        write_private(other, "y")
        assert not other.is_symlink() and not (tmp_path / "target").exists()
