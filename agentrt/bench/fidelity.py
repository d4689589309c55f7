"""`agentrt bench statecache --fidelity`: how far a turn that starts from a restored checkpoint is
from the same turn recomputed, next to the engine's own numerical noise.

Per prompt length and random prompt: a checkpoint is captured at the prompt's end, written to
LMDB and restored (nothing in the RAM tier: the durable path), and a suffix is prefilled after
it (`restored`). The baselines prefill the same prefix live and then the same suffix, split at
the same position as the restore (`recomputed`); with other prefill chunk sizes (`chunk N`: the
engine's noise floor; one size is off the delta rule's 64-token chunk grid, which moves where
its chunks start, as a turn resumed at an arbitrary position does); in one pass (`one pass`:
its last position and continuation only); and, for models small enough, in fp32 on the CPU
(`fp32 cpu`). Each is compared with `recomputed` over every suffix position: max and mean
|delta logit|, mean KL(recomputed || other), top-1 agreement; and over a greedy continuation of
`generate` tokens from each state: the tokens they share before the first difference.

Two capture designs are measured: `grid` (inside a prefill piece, the state at the delta rule's
last 64-token chunk start before the checkpoint, from the same pass, computed in fp32 like the
live state) and `split` (the piece split at the checkpoint, so the state is the pass's
own final state, at the live precision). On the CPU's torch kernels both are exact.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agentrt.bench.engine import machine, random_ids, scratch_dir
from agentrt.bench.statecache import bench_cache, prefill_capture, restore
from agentrt.engine import Engine
from agentrt.engine.config import EngineConfig
from agentrt.errors import AgentrtError
from agentrt.models import copy_model, torch_dtype
from agentrt.models.registry import open_model
from agentrt.statecache.config import StateCacheConfig

DESIGNS = {"grid": 64, "split": 0}  # capture design -> EngineConfig.capture_grid
REFERENCE_MAX_PARAMS = 2 * 10**9  # an fp32 CPU copy of larger models is not built
ROWS = 64  # logits rows compared at a time (a 512-token suffix of a 248K vocabulary is 0.5 GB)


def fidelity(
    spec: str,
    device: str,
    dtype: str | None,
    lengths: list[int],
    state_dir: str,
    seed: int,
    runs: int = 3,
    suffix: int = 512,
    generate: int = 64,
    chunk: int = 2048,
    linear_attn: str = "auto",
    note: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """The report (see the module docstring): per length, design and comparison, the worst or
    mean of each measure over `runs` random prompts."""
    root = scratch_dir(state_dir)  # (before the model loads)
    dtype = dtype or EngineConfig.default_dtype(device)
    model = open_model(spec, device, torch_dtype(dtype), seed=seed).model
    reference = _reference(model, device, dtype)

    def engine(prefill_chunk: int, grid: int) -> Engine:
        return Engine(
            model,
            EngineConfig(
                device=device,
                dtype=dtype,
                prefill_chunk=prefill_chunk,
                linear_attn=linear_attn,
                cuda_graphs=False,
                capture_grid=grid,
            ),
        )

    base = engine(chunk, 0)
    designs = {name: engine(chunk, grid) for name, grid in DESIGNS.items()}
    noise = {size: engine(size, 0) for size in _noise_chunks(chunk)}
    out = []
    for length in lengths:
        for design, capturing in designs.items():
            cache = _open_cache(capturing, spec, root / design)
            try:
                rows = []
                for r in range(runs):
                    note(f"fidelity: {length} tokens, {design} design, prompt {r + 1}/{runs}")
                    ids = random_ids(base.cfg.vocab_size - 1, length + suffix, seed + 7919 * r)
                    ids[length - 1] = base.cfg.vocab_size - 1  # the boundary it is found by
                    rows.append(
                        _one_prompt(capturing, cache, ids, length, noise, reference, generate)
                    )
            finally:
                cache.close()
            out.append({"prompt_tokens": length, "design": design, **_summary(rows, generate)})
    shutil.rmtree(root, ignore_errors=True)
    return {
        "bench": "statecache-fidelity",
        "model": spec,
        "device": device,
        "dtype": dtype,
        "linear_attn": base.linear_backend,
        "prefill_chunk": chunk,
        "suffix_tokens": suffix,
        "generated_tokens": generate,
        "prompts_per_length": runs,
        "baseline": "recomputed: the same prefix prefilled live, then the same suffix",
        "restored_from": "lmdb",
        "machine": machine(),
        "runs": out,
    }


def _noise_chunks(chunk: int) -> list[int]:
    """Prefill chunk sizes of the noise-floor baselines: half and twice `chunk` (multiples of the
    delta rule's 64-token chunks when `chunk` is: the same chunk grid, only other pieces), and one
    off that grid (pieces, so the delta rule's chunks, start at other positions)."""
    sizes = [chunk // 2, chunk * 2, chunk * 3 // 4 + 1]
    return [s for s in dict.fromkeys(sizes) if s >= 1 and s != chunk]


def _reference(model, device: str, dtype: str) -> Engine | None:
    """An fp32 CPU engine of a copy of `model` (torch kernels), where the model is small
    enough; the same engine where the bench runs in fp32 on the CPU already."""
    if sum(p.numel() for p in model.parameters()) > REFERENCE_MAX_PARAMS:
        return None
    if device != "cpu" or dtype != "float32":
        model = copy_model(model, "cpu", torch.float32)
    return Engine(model, EngineConfig(device="cpu", dtype="float32", linear_attn="torch"))


def _open_cache(engine: Engine, spec: str, root: Path):
    """A state cache of its own (nothing in RAM: restores read LMDB)."""
    config = StateCacheConfig(
        state_dir=root, max_bytes=64 * 2**30, ram_bytes=0, min_distance=0, queue_size=8
    )
    fingerprint = b"fidelity-" + spec.encode() + str(engine.capture_grid).encode()
    return bench_cache(engine, config, fingerprint, spec)


def _one_prompt(engine, cache, ids, length, noise, reference, generate) -> dict[str, dict]:
    """Every comparison for one prompt: `ids[:length]` the checkpointed prefix, the rest the
    suffix."""
    capacity = len(ids) + generate + 8
    state = engine.new_state(capacity=capacity)
    prefill_capture(engine, cache, state, ids[:length], [length])
    cache.flush()
    if restore(cache, state, ids) is None:
        raise AgentrtError("bench statecache --fidelity: the checkpoint was not restored")
    held = state.num_tokens
    restored = _continue(engine, state, ids[held:], generate)
    recomputed = _split_run(engine, ids, held, generate, capacity)
    others = {"restored": restored}
    for size, other in noise.items():
        others[f"chunk {size}"] = _split_run(other, ids, held, generate, capacity)
    result = {name: _compare(recomputed, got) for name, got in others.items()}
    one = engine.new_state(capacity=capacity)  # (its last position only: every position of a
    last = engine.prefill(one, ids)  # 64K-token prompt would be 64 GB of logits)
    one_pass = (last.view(1, -1), _greedy(engine, one, last, generate))
    result["one pass"] = _compare((recomputed[0][-1:], recomputed[1]), one_pass)
    if reference is not None:
        ref_state = reference.new_state(capacity=capacity)
        logits = reference.prefill(ref_state, ids, all_logits=True)[held:]
        ref = (logits, _greedy(reference, ref_state, logits[-1], generate))
        result["restored vs fp32 cpu"] = _compare(ref, restored)
        result["recomputed vs fp32 cpu"] = _compare(ref, recomputed)
    result["checkpoint"] = {"asked": length, "held": held}
    return result


def _split_run(engine, ids, held: int, generate: int, capacity: int):
    """Prefill `ids[:held]` live, then the rest: the suffix's logits and a greedy
    continuation."""
    state = engine.new_state(capacity=capacity)
    engine.prefill(state, ids[:held])
    return _continue(engine, state, ids[held:], generate)


def _continue(engine, state, suffix, generate: int):
    logits = engine.prefill(state, suffix, all_logits=True)
    return logits, _greedy(engine, state, logits[-1], generate)


def _greedy(engine, state, last: torch.Tensor, n: int) -> list[int]:
    tokens, token = [], int(last.argmax())
    for _ in range(n):
        tokens.append(token)
        token = int(engine.decode_step(state, token).argmax())
    return tokens


def _compare(base, other) -> dict[str, Any]:
    """`other` (logits, greedy tokens or None) against `base` over every suffix position."""
    a, b = base[0], other[0].to(base[0].device)
    max_abs = mean_abs = kl = top1 = 0.0
    for i in range(0, a.shape[0], ROWS):
        x, y = a[i : i + ROWS].float(), b[i : i + ROWS].float()
        diff = (x - y).abs()
        max_abs = max(max_abs, float(diff.max()))
        mean_abs += float(diff.mean(-1).sum())
        p, q = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
        kl += float((p.exp() * (p - q)).sum(-1).clamp_min(0).sum())
        top1 += float((x.argmax(-1) == y.argmax(-1)).sum())
    rows = a.shape[0]
    out = {
        "max_abs": max_abs,
        "mean_abs": mean_abs / rows,
        "mean_kl": kl / rows,
        "top1": top1 / rows,
        "max_abs_logit": float(a.abs().max()),
    }
    if other[1] is not None:
        same = next(
            (i for i, (x, y) in enumerate(zip(base[1], other[1], strict=True)) if x != y), None
        )
        out["greedy_shared"] = len(base[1]) if same is None else same
    return out


def _summary(rows: list[dict[str, dict]], generate: int) -> dict[str, Any]:
    """Per comparison over the prompts: the worst max |delta|, the means of the means and KL,
    the lowest top-1 agreement, and the share of prompts whose greedy tokens all agree."""
    names = [k for k in rows[0] if k != "checkpoint"]
    out: dict[str, Any] = {"checkpoints": [r["checkpoint"] for r in rows]}
    for name in names:
        got = [r[name] for r in rows]
        entry = {
            "max_abs": max(g["max_abs"] for g in got),
            "mean_abs": sum(g["mean_abs"] for g in got) / len(got),
            "mean_kl": sum(g["mean_kl"] for g in got) / len(got),
            "top1_min": min(g["top1"] for g in got),
            "max_abs_logit": max(g["max_abs_logit"] for g in got),
        }
        if "greedy_shared" in got[0]:
            entry["greedy_shared"] = [g["greedy_shared"] for g in got]
            same = sum(1 for g in got if g["greedy_shared"] == generate)
            entry["greedy_identical_share"] = same / len(got)
        out[name] = entry
    return out
