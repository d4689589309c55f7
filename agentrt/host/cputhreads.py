"""Keeps torch's CPU parallelism to one OpenMP team per process: helper threads (the state-cache
writer and restore workers) run their tensor copies on themselves alone. Also chooses, before torch
loads, how that team's idle workers wait (`spin_between_steps`), and keeps helper threads' freed
buffers in the C heap (`keep_freed_buffers`), counts the cores this process may use
(`usable_cores`) and the helper threads busy with CPU work (`busy_helpers`).

Every thread that runs a parallel torch CPU kernel gets an OpenMP team of its own, of
`torch.get_num_threads()` threads. Sixteen restore workers copying at once would run sixteen
teams (256 threads on 16 cores) that thrash; single-threaded workers copy faster (on 2 cores,
64 chunk copies from 2 workers: 30 ms with their teams, 13 ms without), and a writer without a
team leaves the cores to the thread that launches the model's kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from agentrt.env import bad_setting, set_all, setting, switched_off, variable
from agentrt.host.libs import loaded_libraries


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """`omp_set_num_threads` of the OpenMP runtime torch loaded (libgomp or Intel's), if any."""
    # torch's own copy first (a process may also have loaded another, e.g. through numpy)
    for path in sorted(loaded_libraries("/lib"), key=lambda path: "/torch/" not in path):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libgomp", "libiomp5")):
            try:
                return ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
    return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's CPU set
    limits; `os.cpu_count()` counts the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity call on this platform)
        return os.cpu_count() or 1


_busy_helpers = [0]  # helper threads in CPU-heavy work now (`HelperPool` tasks)
_busy_lock = threading.Lock()
_busy_depth = threading.local()  # per thread: how deep inside `busy` (0: not counted)


def busy_helpers() -> int:
    """How many helper threads do CPU-heavy work right now (the state-cache writer committing
    a checkpoint, its compression threads): the CPU kernels' thread pool leaves them their
    cores meanwhile."""
    return _busy_helpers[0]


@functools.cache
def helpers_yield() -> bool:
    """Whether the CPU kernels' pool leaves busy helpers their cores (`AGENTRT_HELPERS_YIELD=0`:
    not, for comparisons); read once, as every offloaded decode host step asks."""
    return not switched_off("HELPERS_YIELD")


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Counts the calling thread among `busy_helpers` while inside (a helper thread's CPU work:
    copies, checksums, a commit)."""
    depth = getattr(_busy_depth, "n", 0)
    _busy_depth.n = depth + 1
    if depth == 0:
        _count(1)
    try:
        yield
    finally:
        _busy_depth.n = depth
        if depth == 0:
            _count(-1)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Inside `busy`: the calling thread waits (on other helpers' results) and is not counted
    meanwhile; elsewhere a no-op."""
    counted = getattr(_busy_depth, "n", 0) > 0
    if counted:
        _count(-1)
    try:
        yield
    finally:
        if counted:
            _count(1)


def _count(delta: int) -> None:
    with _busy_lock:
        _busy_helpers[0] += delta


def _counted(fn: Callable, *args, **kwargs):
    with busy():
        return fn(*args, **kwargs)


class HelperPool(ThreadPoolExecutor):
    """A thread pool for background CPU work whose running tasks `busy_helpers` counts."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_counted, fn, *args, **kwargs)


def single_threaded() -> None:
    """Make torch's CPU kernels called from this thread run on it alone. Changes only this
    thread's OpenMP setting (`torch.set_num_threads` would also change the default every new
    thread starts from); a no-op where the OpenMP runtime cannot be found."""
    import torch

    torch.get_num_threads()  # torch's per-thread lazy setup first: it would overwrite ours
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


@functools.cache
def helpers_nice() -> int:
    """`AGENTRT_HELPERS_NICE=N`: how many nice levels below the rest of the process the
    state-cache writer's threads run (0, the default: the same; for comparisons)."""
    value = setting("HELPERS_NICE", "0")
    try:
        return max(0, min(19, int(value)))
    except ValueError:
        bad_setting("HELPERS_NICE", value, "a whole number", "the writer's threads run as the rest")
        return 0


def background_helper() -> None:
    """A state-cache writer thread's setup: `single_threaded`, and with `helpers_nice` its own
    nice level raised (Linux schedules threads one by one; elsewhere no change)."""
    single_threaded()
    nice = helpers_nice()
    if nice and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


# Offloaded decode computes a token's CPU experts in bursts of well under a millisecond, one per
# MoE layer, separated by GPU work of a similar length. OpenMP workers that fall asleep between
# bursts must be woken for every parallel region (on the H200 machine: CPU experts at 18 GB/s with
# libgomp's default waiting against 27 GB/s with spinning workers). Workers that spin a bounded
# while (about 2 million pause loops: a fraction of a second) stay awake through a decode and
# still go to sleep when the process idles. GOMP_SPINCOUNT bounds it in libgomp (what torch's
# wheels use); Intel's and LLVM's OpenMP read ACTIVE as spinning for ever unless KMP_BLOCKTIME
# (milliseconds) bounds it.
SPIN_ENV = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "2000000", "KMP_BLOCKTIME": "200"}


def spin_between_steps(enable: bool) -> bool:
    """Before torch is imported: let idle OpenMP workers spin (bounded) instead of sleeping.
    Leaves alone a process that already imported torch (too late: libgomp reads its environment
    once) or whose environment sets either variable, or `AGENTRT_OMP_SPIN=0`. Returns whether it
    set them."""
    if not enable or "torch" in sys.modules or switched_off("OMP_SPIN"):
        return False
    if any(variable(name) is not None for name in SPIN_ENV):
        return False
    set_all(SPIN_ENV)
    return True


# glibc serves allocations above its mmap threshold (128 KiB, rising adaptively to at most
# 32 MiB) with mmap and frees them with munmap, whose page-table teardown runs under the GIL
# when Python frees the object. The state-cache writer frees several 4-5 MiB payload buffers
# per checkpoint: on the 2-core machine that stalled the other threads (request preparation, a
# prefill's host side) by ~5.8 ms per 66 MB checkpoint packed, against 0.6 ms with buffers up
# to 32 MiB kept in the heap (`benchmarks/writer_stall.py`). Freed memory at the top of the main
# heap is returned to the system only beyond 256 MiB, and a thread's arena (heaps of at most
# 64 MiB) keeps what it held at its peak: the helper threads allocate payload-sized buffers
# (a few MiB each), so that stays small against the state cache's own RAM tier.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 256 << 20


@functools.cache
def keep_freed_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process; `AGENTRT_MALLOC_TUNE=0` leaves
    them alone, as does a libc other than glibc). Returns whether both were set."""
    if not sys.platform.startswith("linux") or switched_off("MALLOC_TUNE"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
