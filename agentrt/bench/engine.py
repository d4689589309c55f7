"""`agentrt bench prefill|decode|accuracy` (resident engine), and the helpers every benchmark
shares (`machine`, `timed`, `random_ids`): each loads the model once, runs every
requested configuration in the same invocation and returns a JSON-ready dict (machine, command
settings, figures, ratios). Timings synchronise the device; nothing here is a unit test.
Synthetic models carry random weights with real shapes: figures say nothing about model quality.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentrt.engine import Engine, SamplingParams
from agentrt.engine.config import EngineConfig
from agentrt.env import snapshot
from agentrt.errors import InvalidArgumentError
from agentrt.models import copy_model, torch_dtype
from agentrt.models.kernels import resolve_backend
from agentrt.models.registry import open_model

# the file that marks a directory as a benchmark's scratch state (which it may empty again)
SCRATCH_MARK = ".agentrt-bench-scratch"


def scratch_dir(path: str | Path) -> Path:
    """`path` emptied for a benchmark's scratch state: it must be new, empty, or one a benchmark
    made (marked); any other directory may hold a user's files or state cache, and is refused.
    Made private to the user (mode 700), as a state directory holds text of conversations."""
    root = Path(path)
    if root.exists():
        if not root.is_dir():
            raise InvalidArgumentError(f"--state-dir {root} is not a directory")
        if any(root.iterdir()) and not (root / SCRATCH_MARK).is_file():
            raise InvalidArgumentError(
                f"--state-dir {root} is not empty and no benchmark made it: give a new or empty "
                "directory (the benchmark empties it)"
            )
        shutil.rmtree(root)
    try:
        root.mkdir(parents=True, mode=0o700)
        root.chmod(0o700)  # (mkdir's mode is masked by the umask)
        (root / SCRATCH_MARK).touch()
    except OSError as exc:
        raise InvalidArgumentError(f"--state-dir {root}: {exc.strerror or exc}") from None
    return root


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # how idle OpenMP workers wait (agentrt.host.cputhreads sets them for offloaded decode)
        "omp_env": {k: v for k, v in snapshot().items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
    }
    if os.path.isdir("/proc/self/task"):  # more than one OpenMP team shows as extra threads
        info["process_threads"] = len(os.listdir("/proc/self/task"))
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import fla  # noqa: F401

        info["fla"] = getattr(fla, "__version__", "present")
    except Exception:  # noqa: BLE001
        info["fla"] = None
    return info


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engines(
    spec,
    device,
    dtype,
    kernels: Sequence[str],
    chunk: int,
    seed: int,
    graphs: Sequence[str] = ("on",),
):
    """Load once; yield (kernel, engine) for every kernel x CUDA-graph setting, sharing weights;
    a kernel that resolves to a backend already run (auto beside torch, say) runs once."""
    dtype = dtype or EngineConfig.default_dtype(device)
    source = open_model(spec, device, torch_dtype(dtype), seed=seed)
    for graph in graphs:
        backends = set()
        for kernel in kernels:
            cfg = EngineConfig(
                device=device,
                dtype=dtype,
                prefill_chunk=chunk,
                linear_attn=kernel,
                cuda_graphs=graph == "on",
            )
            backend = resolve_backend(kernel, torch.device(device))
            if backend not in backends:
                backends.add(backend)
                yield kernel, Engine(source.model, cfg)


def random_ids(vocab: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed & (2**64 - 1))  # (a derived seed: into 64 bits)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def _time_prefill(engine: Engine, ids: list[int], device: str) -> float:
    state = engine.new_state(capacity=len(ids))
    _sync(device)
    t0 = time.perf_counter()
    engine.prefill(state, ids)
    _sync(device)
    return time.perf_counter() - t0


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def prefill(
    spec, device, dtype, kernels, lengths, chunk, repeat, seed, note=lambda _: None
) -> dict[str, Any]:
    """Prefill tok/s per linear-attention kernel and prompt length (the median of `repeat`
    timed runs after one warm-up); `note` hears of each row as it starts."""
    runs = []
    for kernel, engine in _engines(spec, device, dtype, kernels, chunk, seed):
        for length in lengths:
            note(f"prefill: {length} tokens, {kernel} kernels, {repeat} run(s)")
            ids = random_ids(engine.cfg.vocab_size, length, seed)
            reset_peak(device)
            _time_prefill(engine, ids[: min(length, chunk)], device)  # warm-up (kernels, autotune)
            times = [_time_prefill(engine, ids, device) for _ in range(repeat)]
            best = statistics.median(times)
            runs.append(
                {
                    "linear_attn": kernel,
                    "backend": engine.linear_backend,
                    "prompt_tokens": length,
                    "median_s": best,
                    "tok_s": length / best,
                    "all_s": times,
                    "peak_gpu_gib": _peak_gib(device),
                }
            )
    return {
        "bench": "prefill",
        "model": spec,
        "device": device,
        "dtype": dtype or EngineConfig.default_dtype(device),
        "prefill_chunk": chunk,
        "machine": machine(),
        "runs": runs,
        "ratios": _ratios(runs, "prompt_tokens"),
    }


def decode(
    spec, device, dtype, kernels, prompt_len, tokens, seed, graphs=("on",)
) -> dict[str, Any]:
    """Greedy decode tok/s after a `prompt_len` prompt, per kernel and CUDA-graph setting."""
    runs = []
    for kernel, engine in _engines(spec, device, dtype, kernels, 2048, seed, graphs):
        runs.append(_decode_run(engine, kernel, prompt_len, tokens, seed, device))
        engine.decode_graph = None  # free the captured graph before the next configuration
    return {
        "bench": "decode",
        "model": spec,
        "device": device,
        "dtype": dtype or EngineConfig.default_dtype(device),
        "machine": machine(),
        "runs": runs,
        "ratios": _ratios(runs, "prompt_tokens"),
    }


def _decode_run(
    engine: Engine, kernel: str, prompt_len: int, tokens: int, seed: int, device: str
) -> dict:
    ids = random_ids(engine.cfg.vocab_size, prompt_len, seed)
    reset_peak(device)
    state = engine.new_state(capacity=prompt_len + tokens + 8)
    token = int(engine.prefill(state, ids).argmax())
    for _ in range(3):  # warm-up steps (and graph capture)
        token = int(engine.decode_step(state, token).argmax())
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = int(engine.decode_step(state, token).argmax())
    elapsed = time.perf_counter() - t0
    graph = engine.decode_graph is not None and engine.decode_graph.enabled
    return {
        "linear_attn": kernel,
        "backend": engine.linear_backend,
        "cuda_graph": graph,
        "prompt_tokens": prompt_len,
        "tokens": tokens,
        "tok_s": tokens / elapsed,
        "ms_per_token": 1000 * elapsed / tokens,
        "peak_gpu_gib": _peak_gib(device),
    }


def _ratios(runs: list[dict], key: str) -> dict[str, float]:
    """tok/s of every run relative to the torch-kernel run of the same `key` (and graph setting)."""
    out = {}
    label = lambda r: r["backend"] + ("" if r.get("cuda_graph", True) else "-eager")  # noqa: E731
    for run in runs:
        same = [
            r for r in runs if r[key] == run[key] and r.get("cuda_graph") == run.get("cuda_graph")
        ]
        base = next((r for r in same if r["backend"] == "torch"), None)
        if base is not None and run is not base:
            out[f"{label(run)}_vs_{label(base)}@{run[key]}"] = run["tok_s"] / base["tok_s"]
        eager = next(
            (
                r
                for r in runs
                if r[key] == run[key]
                and r["backend"] == run["backend"]
                and r.get("cuda_graph") is False
            ),
            None,
        )
        if run.get("cuda_graph") and eager is not None:
            out[f"{run['backend']}_graph_vs_eager@{run[key]}"] = run["tok_s"] / eager["tok_s"]
    return out


def accuracy(spec, device, dtype, kernels, length, seed, eager=False) -> dict[str, Any]:
    """Compare logits (one prefill of `length` random tokens) and 32 greedy tokens to fp32 CPU."""
    dtype = dtype or EngineConfig.default_dtype(device)
    ref_model = open_model(spec, "cpu", torch.float32, seed=seed).model
    ref = Engine(ref_model, EngineConfig(device="cpu", dtype="float32", linear_attn="torch"))
    ids = random_ids(ref.cfg.vocab_size, length, seed)
    ref_logits = ref.prefill(ref.new_state(), ids, all_logits=True)
    ref_greedy = ref.generate(ref.new_state(), ids, SamplingParams(max_tokens=32)).token_ids
    model = copy_model(ref_model, device, torch_dtype(dtype))
    runs = []
    for kernel in kernels:
        eng = Engine(
            model,
            EngineConfig(device=device, dtype=dtype, linear_attn=kernel, cuda_graphs=not eager),
        )
        logits = eng.prefill(eng.new_state(), ids, all_logits=True).float().cpu()
        greedy = eng.generate(eng.new_state(), ids, SamplingParams(max_tokens=32)).token_ids
        runs.append(_compare(kernel, eng.linear_backend, logits, ref_logits, greedy, ref_greedy))
    return {
        "bench": "accuracy",
        "model": spec,
        "device": device,
        "dtype": dtype,
        "prompt_tokens": length,
        "reference": "cpu float32, torch kernels",
        "machine": machine(),
        "runs": runs,
    }


def _compare(kernel, backend, logits, ref, greedy, ref_greedy) -> dict[str, Any]:
    diff = (logits - ref).abs()
    same = next(
        (i for i, (a, b) in enumerate(zip(greedy, ref_greedy, strict=False)) if a != b),
        len(ref_greedy),
    )
    return {
        "linear_attn": kernel,
        "backend": backend,
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "max_abs_ref": float(ref.abs().max()),
        "rel_max_diff": float(diff.max() / ref.abs().max()),
        "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
        "greedy_tokens_identical_prefix": same,
        "greedy_tokens": len(ref_greedy),
    }


# ----------------------------------------------------------------------------- state cache


def timed(device: str, fn):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out
