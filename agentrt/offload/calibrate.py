"""Calibration of the bandwidths the q* rule needs (`agentrt bench bw`): B_P (expert-sized
host->device copies), B_H (the CPU expert kernel, one token per expert, in bytes of weights
read per second; torch's kernels or the native one of `cpu_kernel.py`, on its thread pool where
graph decode uses that), and both again while running at the same time (B_H', B_P') in the
arrangement decode uses: with the native kernel's thread pool (`pooled`), this thread posts each
CPU expert to the pool and issues a copy while it computes, as graph decode's host steps do;
otherwise the CPU experts run on this thread while a helper thread issues the copies. Profiles
are saved per GPU / CPU / dtype / expert size / CPU kernel and loaded at engine start."""

from __future__ import annotations

import json
import platform
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from agentrt.host.private import private_dir, write_private
from agentrt.offload.cpu_kernel import kernel_name
from agentrt.offload.store import ExpertStore

# torch's OpenMP workers spin about this long at most after a parallel region (GOMP_SPINCOUNT,
# KMP_BLOCKTIME as the CLI sets them: `cputhreads`); on the same cores they would slow the
# native kernel's pool down (on the H200 host, 4 GB/s instead of 50-70)
SPIN_SETTLE_S = 0.25
# 2: the overlapped pair measured as decode runs (the pool); 3: the native kernels' work items
# claimed, MXFP4 dot products in integers (profiles of older kernels understate the CPU)
PROFILE_VERSION = 3
ROUNDS = 3  # measurement rounds; each figure of a profile is the best of them


@dataclass
class Profile:
    copy: float  # B_P alone, bytes/s
    cpu: float  # B_H alone
    copy_overlapped: float  # B_P' while the CPU computes
    cpu_overlapped: float  # B_H' while copies run
    expert_bytes: int
    device: str
    cpu_model: str
    threads: int
    version: int = PROFILE_VERSION


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def profile_path(
    root: Path, device: torch.device, dtype: torch.dtype, expert_bytes: int, kernel: str = "torch"
) -> Path:
    """Where the profile of this GPU / CPU / dtype / expert size (/ CPU kernel, when not
    torch's: the name torch's profiles always had; `profile_kernel` gives it) is saved."""
    key = (
        f"{device_name(device)}__{cpu_model()}__{str(dtype).removeprefix('torch.')}__{expert_bytes}"
    )
    if kernel != "torch":
        key += f"__{kernel}"
    return root / (key.replace(" ", "_").replace("/", "_") + ".json")


def load_profile(path: Path) -> Profile | None:
    try:
        data = json.loads(path.read_text())
        profile = Profile(**data)
    except (OSError, ValueError, TypeError):
        return None
    return profile if profile.version == PROFILE_VERSION else None


def save_profile(profile: Profile, path: Path) -> None:
    private_dir(path.parent)
    write_private(path, json.dumps(asdict(profile), indent=2) + "\n")


def _time_copies(
    store: ExpertStore, layer: int, dest: torch.Tensor, count: int, offset: int = 0
) -> float:
    """Bytes/s of `count` expert copies into `dest`'s rows, from expert `offset` on."""
    device = dest.device
    rows = store.flat[layer]
    t0 = time.perf_counter()
    for i in range(count):
        dest[i % dest.shape[0]].copy_(rows[(i + offset) % store.num_experts], non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return count * store.expert_bytes / (time.perf_counter() - t0)


def _on_pool(kernel, gate_up, down, x, out) -> None:
    """Post one expert to the native kernel's pool and wait for it; the pool is free again
    whatever happens (an interrupt may land once the call is posted)."""
    try:
        kernel.start([gate_up], [down], [1.0], x, out)
    finally:
        if kernel.posted:
            kernel.finish()


def _packed_expert(kernel, layer: int, expert: int, x, out, post: bool = False) -> None:
    """One expert through packed rows' kernel: on its pool where decode uses that (`pooled`;
    with `post`, left running for the caller to `finish`), else on this thread."""
    if not kernel.pooled:
        kernel.run_experts(layer, [expert], [1.0], x, out)
        return
    try:
        kernel.start_experts(layer, [expert], [1.0], x, out)
    finally:
        if kernel.posted and not post:
            kernel.finish()


def _time_cpu(store: ExpertStore, layer: int, count: int, kernel=None) -> float:
    """Bytes/s of one-token CPU experts, through `kernel` (a `NativeExperts`: on its thread pool
    where decode uses that, `pooled`) or torch's."""
    x = torch.randn(1, store.hidden).to(store.dtype)
    if store.packed and kernel is not None:  # (packed rows' kernel: `PackedCPUExperts`)
        out = torch.empty(store.hidden, dtype=torch.float32)
        t0 = time.perf_counter()
        for i in range(count):
            _packed_expert(kernel, layer, i % store.num_experts, x[0], out)
        return count * store.expert_bytes / (time.perf_counter() - t0)
    _, gate_up, down = store.expert_views(layer)  # (packed: dequantized per expert)
    if kernel is not None:
        out = torch.empty(store.hidden, dtype=torch.float32)
        t0 = time.perf_counter()
        for i in range(count):
            e = i % store.num_experts
            if kernel.pooled:
                _on_pool(kernel, gate_up[e], down[e], x[0], out)
            else:
                kernel.run([gate_up[e]], [down[e]], [1.0], x[0], out)
        return count * store.expert_bytes / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(count):
            e = i % store.num_experts
            h = torch.nn.functional.linear(x, gate_up[e])
            g, u = h.chunk(2, dim=-1)
            torch.nn.functional.linear(torch.nn.functional.silu(g) * u, down[e])
    return count * store.expert_bytes / (time.perf_counter() - t0)


def _time_threaded_overlap(store: ExpertStore, layer: int, dest, count: int, kernel=None):
    """(B_P', B_H'): copies from a helper thread, CPU experts on this one, the thread that
    computes experts in decode (a second thread running torch CPU kernels would bring a second
    OpenMP team). The copies read other experts than the CPU computes, as in decode."""
    result: dict[str, float] = {}
    half = store.num_experts // 2
    thread = threading.Thread(
        target=lambda: result.__setitem__("copy", _time_copies(store, layer, dest, count, half))
    )
    thread.start()
    cpu = _time_cpu(store, layer, count, kernel)
    thread.join()
    return result["copy"], cpu


def _time_pooled_overlap(store: ExpertStore, layer: int, dest, count: int, kernel):
    """(B_P', B_H') as graph decode's host steps run them with the native kernel's pool: this
    thread posts one CPU expert at a time to the pool and, while it computes, issues a copy of
    another expert. Copies are timed by their own busy time (an event pair each on the device,
    wall time on the CPU), so a copy engine left waiting for the CPU does not count."""
    x = torch.randn(store.hidden).to(store.dtype)
    out = torch.empty(store.hidden, dtype=torch.float32)
    rows, gate_up, down = store.expert_views(layer)
    n, half = store.num_experts, store.num_experts // 2
    on_cuda = dest.device.type == "cuda"
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    copy_s, t_loop = 0.0, time.perf_counter()
    with torch.cuda.device(dest.device) if on_cuda else nullcontext():
        for i in range(count):
            e = i % n
            try:
                if store.packed:  # (packed rows' kernel: `PackedCPUExperts`)
                    _packed_expert(kernel, layer, e, x, out, post=True)
                else:
                    kernel.start([gate_up[e]], [down[e]], [1.0], x, out)
                t0 = time.perf_counter()
                if on_cuda:
                    marks.append(_event_pair())
                    marks[-1][0].record()
                dest[i % dest.shape[0]].copy_(rows[(e + half) % n], non_blocking=True)
                if on_cuda:
                    marks[-1][1].record()
                copy_s += time.perf_counter() - t0
            finally:
                if kernel.posted:
                    kernel.finish()
        cpu_s = time.perf_counter() - t_loop
        if on_cuda:
            torch.cuda.synchronize(dest.device)
            copy_s = sum(a.elapsed_time(b) for a, b in marks) / 1000
    num_bytes = count * store.expert_bytes
    return num_bytes / copy_s, num_bytes / cpu_s


def _event_pair() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def dram_read_bandwidth(num_bytes: int = 2**30, repeat: int = 5) -> float:
    """Bytes/s of a multi-threaded fp32 sum over a buffer far larger than the caches, the best
    of `repeat`: the memory bandwidth the CPU expert kernel is compared against."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()  # warm-up (page faults)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def calibrate(store: ExpertStore, device: torch.device, count: int = 64, kernel=None) -> Profile:
    """Measure in a few seconds (for a 6 MB expert, 64 copies and 64 CPU expert passes each);
    the CPU side through `kernel` (a `NativeExperts`) when given, else torch's kernels. Where
    the kernel's pool cannot start, the kernel runs on this thread, as decode's then does."""
    layer = store.layers[0]
    dest = torch.empty(min(count, 16), store.expert_numel, dtype=store.storage_dtype, device=device)
    _time_copies(store, layer, dest, 4)  # warm-up
    if kernel is not None and kernel.pooled:  # torch's OpenMP team may still spin (see above)
        time.sleep(SPIN_SETTLE_S)
    try:
        return _measure(store, layer, dest, count, kernel)
    except OSError:
        if kernel is None or kernel.pooled:  # (not the pool failing to start)
            raise
        return _measure(store, layer, dest, count, kernel)


def understates_cpu(profile: Profile, store: ExpertStore, kernel=None, count: int = 16) -> bool:
    """Whether a saved profile's CPU figure is less than half of what a quick measurement (a
    few milliseconds) gives now: it was then taken while something else held the host (seen:
    0.79 GB/s saved, 60 measured after), and the split, trusting it, would send the CPU nothing
    but single-expert probes, which on a sleeping pool measure slow again and never correct it.
    The other way (a host slower now) decode's own measurements correct."""
    layer = store.layers[0]
    try:
        _warm_up(store, layer, kernel)
    except OSError:  # (the pool could not start: measure again, on the caller's thread)
        return True
    if kernel is not None and kernel.pooled:
        time.sleep(SPIN_SETTLE_S)
    return _time_cpu(store, layer, count, kernel) > 2 * profile.cpu


def _warm_up(store: ExpertStore, layer: int, kernel) -> None:
    """A few CPU experts before any timing (first calls; the pool's threads start)."""
    _time_cpu(store, layer, 4, kernel)


def _measure(store: ExpertStore, layer: int, dest, count: int, kernel) -> Profile:
    """Each figure the best of `ROUNDS` rounds, `SPIN_SETTLE_S` apart: the profile is saved and
    used at every later start, so one round slowed by something else on the host (measured:
    the CPU side at 1/80 of its rate) must not become the engine's view of the machine."""
    _warm_up(store, layer, kernel)
    best = [0.0] * 4
    for i in range(ROUNDS):
        if i:
            time.sleep(SPIN_SETTLE_S)
        measured = _round(store, layer, dest, count, kernel)
        best = [max(a, b) for a, b in zip(best, measured, strict=True)]
    return Profile(
        *best,
        store.expert_bytes,
        device_name(dest.device),
        cpu_model(),
        torch.get_num_threads(),
    )


def _round(store: ExpertStore, layer: int, dest, count: int, kernel) -> tuple[float, ...]:
    """(B_P, B_H, B_P', B_H') measured once."""
    copy_alone = _time_copies(store, layer, dest, count)
    cpu_alone = _time_cpu(store, layer, count, kernel)
    if kernel is not None and kernel.pooled:
        both = _time_pooled_overlap(store, layer, dest, count, kernel)
    else:
        both = _time_threaded_overlap(store, layer, dest, count, kernel)
    return copy_alone, cpu_alone, *both


def profile_kernel(kernel) -> str:
    """The CPU kernel's part of a profile's key: its name, `-pool` where it runs on the native
    kernel's thread pool (measured differently from the same kernel on the caller's thread)."""
    pooled = kernel is not None and kernel.pooled
    return kernel_name(kernel) + ("-pool" if pooled else "")
