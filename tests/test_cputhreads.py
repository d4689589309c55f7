"""Helper threads run torch's CPU kernels on themselves alone (one OpenMP team per process)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from agentrt.host.cputhreads import _omp_set_num_threads, single_threaded

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _omp_set_num_threads() is None,
    reason="needs torch's OpenMP runtime on Linux",
)


def test_single_threaded_changes_only_the_calling_thread():
    main = torch.get_num_threads()

    def worker() -> int:
        single_threaded()
        x = torch.ones(1 << 20)
        assert float(x.sum()) == 1 << 20  # kernels still run
        return torch.get_num_threads()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(worker).result() == 1
    with ThreadPoolExecutor(1) as pool:  # a new thread starts from the process default
        assert pool.submit(torch.get_num_threads).result() == main
    assert torch.get_num_threads() == main


def test_state_cache_helpers_are_single_threaded(tmp_path):
    from agentrt import Runtime
    from agentrt.statecache.config import StateCacheConfig

    if torch.get_num_threads() < 2:
        pytest.skip("one CPU thread: nothing to tell apart")
    rt = Runtime.open("tiny", cache="semantic", state_cache=StateCacheConfig(state_dir=tmp_path))
    cache = rt.reuse.cache
    assert cache._pool.submit(torch.get_num_threads).result() == 1
    rt.close()


def _spin_env(code: str, **env: str) -> dict:
    """Runs `code` in a fresh interpreter (torch not yet imported) and returns its OpenMP
    environment afterwards."""
    import json
    import os
    import subprocess
    import sys

    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMP_", "GOMP_", "KMP_", "AGENTRT_"))
    }
    script = code + "\nimport json, os\nprint(json.dumps({k: v for k, v in os.environ.items()"
    script += " if k.startswith(('OMP_', 'GOMP_', 'KMP_'))}))"
    out = subprocess.run(
        [sys.executable, "-c", script], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_spinning_workers_are_chosen_before_torch_loads_and_never_override_the_user():
    from agentrt.host.cputhreads import SPIN_ENV

    enable = "from agentrt.host.cputhreads import spin_between_steps as s; assert s(True)"
    assert _spin_env(enable) == SPIN_ENV
    keep = "from agentrt.host.cputhreads import spin_between_steps as s; assert not s(True)"
    assert _spin_env(keep, OMP_WAIT_POLICY="PASSIVE") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert _spin_env(keep, AGENTRT_OMP_SPIN="0") == {}
    assert _spin_env("import torch\n" + keep) == {}  # too late: libgomp has read its environment
    # the CLI asks for them only for offloaded decode on a GPU
    cli = "from agentrt.cli import prepare_cpu_threads as p; "
    assert _spin_env(cli + "p('cpu', ['auto']); p('cuda', ['none'])") == {}
    assert _spin_env(cli + "p('cuda', ['auto'])") == SPIN_ENV


def test_loaded_libraries_lists_what_this_process_mapped():
    """`loaded_libraries` finds torch's own shared library among this process's mappings (the
    way agentrt finds the OpenMP and CUDA runtimes torch loaded), and nothing for a name no
    library has."""
    from agentrt.host.libs import loaded_libraries

    found = loaded_libraries("libtorch")
    assert found and all("libtorch" in path for path in found) and found == sorted(found)
    assert loaded_libraries("no-such-library-name") == []


def test_helper_pool_counts_its_running_tasks_and_the_cpu_kernels_pool_yields_to_them(
    monkeypatch,
):
    """`HelperPool` tasks (the state-cache writer's compression) count as busy helpers while
    they run, and the native kernels' pool then takes one thread fewer per busy helper."""
    import threading

    from agentrt.host.cputhreads import HelperPool, busy_helpers, helpers_yield
    from agentrt.offload.cpu_kernel import PoolCalls

    calls = PoolCalls()
    calls.pool_threads = 5
    started, release = threading.Barrier(3), threading.Event()

    def work() -> None:
        started.wait()
        release.wait()

    with HelperPool(max_workers=2) as pool:
        before = busy_helpers()
        futures = [pool.submit(work) for _ in range(2)]
        started.wait()
        assert busy_helpers() == before + 2 and calls.active_threads() == max(1, 3 - before)
        monkeypatch.setenv("AGENTRT_HELPERS_YIELD", "0")  # (for comparisons: all of them)
        helpers_yield.cache_clear()
        assert calls.active_threads() == 5
        monkeypatch.delenv("AGENTRT_HELPERS_YIELD")
        helpers_yield.cache_clear()
        release.set()
        for future in futures:
            future.result()
    assert busy_helpers() == before
    calls.pool_threads = 1
    assert calls.active_threads() == 1


def test_a_busy_thread_counts_once_and_not_while_it_waits_on_other_helpers():
    """`busy` counts a thread once however deeply nested; inside it, `waiting` (the writer
    waiting on its compression threads, which count themselves) uncounts it; outside any
    `busy`, `waiting` changes nothing."""
    from agentrt.host.cputhreads import busy, busy_helpers, waiting

    before = busy_helpers()
    with waiting():
        assert busy_helpers() == before
    with busy():
        assert busy_helpers() == before + 1
        with busy():
            assert busy_helpers() == before + 1
            with waiting():
                assert busy_helpers() == before
            assert busy_helpers() == before + 1
        assert busy_helpers() == before + 1
    assert busy_helpers() == before


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "ttft", "{trace}", "--cache", "off", "--max-requests", "1", "--warmup", "0"],
        ["bench", "prefill", "--lengths", "16", "--repeat", "1"],
        ["chat", "--max-tokens", "1", "hi"],
    ],
    ids=["bench-ttft", "bench-prefill", "chat"],
)
def test_commands_choose_how_openmp_workers_wait_before_torch_loads(args, tmp_path):
    """Benchmarks run the threading users get: every command that opens a model makes its
    first `prepare_cpu_threads` call before anything imports torch (after, libgomp has read
    its environment and the choice is lost)."""
    import json
    import subprocess

    from agentrt.replay.generator import generate
    from agentrt.replay.trace import write_trace

    trace = write_trace(generate(seed=3, target_tokens=300, max_turns=2), tmp_path / "t.jsonl")
    probe = tmp_path / "probe.json"
    script = f"""
import json, os, sys
import agentrt.host.cputhreads as c
real, probe = c.spin_between_steps, {str(probe)!r}
def spy(enable):
    seen = json.load(open(probe)) if os.path.exists(probe) else []
    json.dump(seen + ["torch" in sys.modules], open(probe, "w"))
    return real(enable)
c.spin_between_steps = spy
from agentrt.cli import main
main()
"""
    argv = [a.format(trace=trace) for a in args] + ["--device", "cpu"]
    out = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(probe.read_text())[0] is False  # (a later call may follow the import)


def test_the_state_cache_writer_counts_as_a_busy_helper_while_it_commits(tmp_path, monkeypatch):
    """The writer thread's own CPU work (host copies, framing, the LMDB commit) counts among
    `busy_helpers`, as its compression threads do: the native kernels' pool leaves it a core."""
    from agentrt import Runtime
    from agentrt.host.cputhreads import busy_helpers
    from agentrt.statecache.config import StateCacheConfig
    from agentrt.statecache.store import Store

    seen: list[int] = []
    put = Store.put_checkpoint

    def counted_put(self, *args, **kwargs):
        seen.append(busy_helpers())
        return put(self, *args, **kwargs)

    monkeypatch.setattr(Store, "put_checkpoint", counted_put)
    config = StateCacheConfig(state_dir=tmp_path / "state", min_distance=0)
    rt = Runtime.open("tiny", cache="semantic", state_cache=config)
    try:
        rt.chat([{"role": "user", "content": "hello there " * 40}], max_tokens=2)
        rt.reuse.cache.flush()
    finally:
        rt.close()
    assert seen and min(seen) >= 1
    assert busy_helpers() == 0


def test_helpers_nice_lowers_only_the_calling_threads_priority(monkeypatch):
    """`AGENTRT_HELPERS_NICE=N`: a thread that runs `background_helper` runs N nice levels
    lower; the thread that started it keeps its own; 0 (the default) changes nothing."""
    import os
    import threading

    from agentrt.host import cputhreads

    if not hasattr(os, "setpriority"):
        pytest.skip("no per-thread priorities on this platform")
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def helper(label: str) -> None:
        cputhreads.background_helper()
        seen[label] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    for label, value in (("default", None), ("nice", "5"), ("bad", "x")):
        cputhreads.helpers_nice.cache_clear()
        if value is None:
            monkeypatch.delenv("AGENTRT_HELPERS_NICE", raising=False)
        else:
            monkeypatch.setenv("AGENTRT_HELPERS_NICE", value)
        thread = threading.Thread(target=helper, args=(label,))
        thread.start()
        thread.join()
    cputhreads.helpers_nice.cache_clear()
    assert seen == {"default": own, "nice": min(own + 5, 19), "bad": own}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
