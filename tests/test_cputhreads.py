"""Helper threads run torch's CPU kernels on themselves alone (one OpenMP team per process)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from agentrt.cputhreads import _omp_set_num_threads, single_threaded

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
    from agentrt.config import StateCacheConfig

    if torch.get_num_threads() < 2:
        pytest.skip("one CPU thread: nothing to tell apart")
    rt = Runtime.open("tiny", cache="semantic", state_cache=StateCacheConfig(state_dir=tmp_path))
    cache = rt.reuse.cache
    assert cache._pool.submit(torch.get_num_threads).result() == 1
    rt.close()
