"""`agentrt bench statecache`: recompute against restore from LMDB and the RAM tier, and the
overhead of capturing checkpoints during prefill."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agentrt.bench.engine import machine, random_ids, scratch_dir, timed
from agentrt.engine import Engine
from agentrt.engine.config import EngineConfig
from agentrt.errors import AgentrtError
from agentrt.models import torch_dtype
from agentrt.models.registry import open_model
from agentrt.statecache.keys import BLOCK


def statecache(
    spec,
    device,
    dtype,
    lengths,
    state_dir,
    seed,
    capture_every: int = 2000,
    rounds: int | None = None,
    note: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Checkpoint sizes, writer throughput, restore latency (LMDB / RAM tier) vs recompute, and
    prefill overhead of capture, for one long random prompt per length. `rounds` of timings
    per length (default `default_rounds`); `note` hears of each round as it starts."""
    from agentrt.statecache import StateCache
    from agentrt.statecache.config import StateCacheConfig

    root = scratch_dir(state_dir)  # (before the model loads)
    dtype = dtype or EngineConfig.default_dtype(device)
    source = open_model(spec, device, torch_dtype(dtype), seed=seed)
    engine = Engine(source.model, EngineConfig(device=device, dtype=dtype))
    marker = engine.cfg.vocab_size - 1  # a token that ends a "message": checkpoints go after it
    config = StateCacheConfig(
        state_dir=root, max_bytes=64 * 2**30, ram_bytes=16 * 2**30, min_distance=0, queue_size=64
    )

    def open_cache(ram: int = config.ram_bytes) -> StateCache:
        cfg = StateCacheConfig(**{**config.__dict__, "ram_bytes": ram})
        return bench_cache(engine, cfg, b"bench-" + spec.encode(), spec)

    cache = open_cache()
    cache.wait_staging()  # as in a long-running server, whose ring was pinned at start-up
    runs = []
    for length in lengths:
        reps = rounds or default_rounds(length)
        args = (marker, length, seed, capture_every, device, reps, note)
        runs.append(_statecache_run(engine, cache, open_cache, *args))
    cache.close()
    info = {"bench": "statecache", "model": spec, "device": device, "dtype": dtype}
    return {**info, "machine": machine(), "capture_every": capture_every, "runs": runs}


def default_rounds(length: int) -> int:
    """Timing rounds of `bench statecache` per prompt length: each round writes every one of
    its checkpoints in full (about 1.7 GB at 32K tokens on qwen3.5-35b-a3b's shapes), so long
    prompts get fewer."""
    return 7 if length <= 8192 else 3 if length <= 32768 else 1


def _statecache_run(
    engine, cache, open_cache, marker, length, seed, every, device, reps, note
) -> dict[str, Any]:
    ids = random_ids(engine.cfg.vocab_size - 1, length, seed + length)
    ids[-2] = marker  # boundary: checkpoint at length-1, the last token stays to prefill
    many = list(range(every, length - 1, every))
    for p in many:
        ids[p - 1] = marker
    target = length - 1
    # other first tokens: prompts as long, with keys of their own (a capture of a stored
    # checkpoint would be skipped), so every capture timing does the full work
    variants = [_other_start(ids, r, marker) for r in range(3 * reps)]
    state = engine.new_state(capacity=length + 16)
    warm = random_ids(
        engine.cfg.vocab_size - 1, 2048, seed + 1
    )  # warm kernels and the capture path
    prefill_capture(engine, cache, _reset(state), warm, [2047])
    cache.flush()
    _, logits = timed(device, lambda: engine.prefill(_reset(state), ids))

    saves: list[float] = []  # the many-checkpoint runs' hand-over seconds

    def capture(prompt: list[int], positions: list[int], counted: bool = False) -> float:
        run = lambda: prefill_capture(engine, cache, _reset(state), prompt, positions)  # noqa: E731
        seconds, handed = timed(device, run)
        if counted:
            saves.append(handed)
        return seconds

    # plain, one checkpoint, many checkpoints: interleaved, each round on its own prompts, the
    # writer idle at each start; the overheads are medians of the per-round ratios, so a drift
    # of the host's speed over the run (prefill here is bound by host time) cancels out
    plain, t_end, t_many, write_s, write_raw, dropped0 = [], [], [], 0.0, 0, _dropped(cache)
    for r in range(reps):
        note(f"{length} tokens: round {r + 1}/{reps}")
        prompt = variants[3 * r]
        plain.append(timed(device, lambda p=prompt: engine.prefill(_reset(state), p))[0])
        t_end.append(capture(ids if r == 0 else variants[3 * r + 1], [target]))
        seconds0, raw0 = cache.stats["write_seconds"], cache.stats["raw_bytes_written"]
        t_write, _ = timed(device, cache.flush)
        write_s += cache.stats["write_seconds"] - seconds0
        write_raw += cache.stats["raw_bytes_written"] - raw0
        t_many.append(capture(variants[3 * r + 2], many + [target], counted=True))
        cache.flush()
    record = cache.store.get_record(_key(cache, ids, target))
    t_plain = _median(plain)
    t_ram, hit_ram = _median_timed(reps, device, lambda: restore(cache, state, ids))
    t_lmdb, hit_lmdb = _lmdb_restores(reps, device, open_cache, state, ids)
    restore(cache, state, ids)
    held = state.num_tokens  # the checkpoint's state: `target`, or up to 63 tokens before it
    if held == 0:  # not stored (the writer dropped it, counted in `dropped_many` / stats)
        raise AgentrtError(
            f"bench statecache: the checkpoint at {target} tokens was not stored (see the "
            "state cache's drop and error counts)"
        )
    restored = engine.prefill(state, ids[held:])
    engine.prefill(_reset(state), ids[:held])  # the same prefix recomputed, then the same suffix
    recomputed = engine.prefill(state, ids[held:])
    layout = cache.layout  # (the state it restores: every chunk and the record's blob)
    raw = (target // BLOCK) * BLOCK * layout.kv_token_bytes() + layout.blob_bytes(target)
    end_ratios = sorted(e / p for e, p in zip(t_end, plain, strict=True))
    many_ratios = sorted(m / p for m, p in zip(t_many, plain, strict=True))
    return {
        "prompt_tokens": length,
        "checkpoint_tokens": target,
        "checkpoint_state_tokens": held,  # less than target: taken on the capture grid
        "repeats": reps,
        "recompute_s": t_plain,
        "recompute_spread_s": [min(plain), max(plain)],
        "prefill_capture_end_s": _median(t_end),
        "capture_overhead_end": _median(end_ratios) - 1,
        "capture_overhead_end_range": [end_ratios[0] - 1, end_ratios[-1] - 1],
        "captures_many": len(many) + 1,
        "prefill_capture_many_s": _median(t_many),
        "capture_overhead_many": _median(many_ratios) - 1,
        "capture_overhead_many_range": [many_ratios[0] - 1, many_ratios[-1] - 1],
        # the part of it that is the checkpoints' hand-over to the writer (deterministic, where
        # the prefill's own time drifts with the host: prefill here is bound by host time)
        "save_handover_many_s": _median(saves),
        "save_handover_many_share": _median(saves) / t_plain,
        "dropped_many": _dropped(cache) - dropped0,  # writer behind: staging or queue full
        "writer_flush_s": t_write,
        "writer_busy_s": write_s,
        "writer_mib_s": write_raw / 2**20 / write_s if write_s > 0 else None,
        "snapshot_bytes": record.blob_bytes if record else None,
        "kv_chunk_bytes": record.chunk_bytes if record else None,
        "raw_bytes": raw,
        "restore_ram_s": t_ram,
        "restore_lmdb_s": t_lmdb,
        "restore_sources": [hit_ram, hit_lmdb],
        "speedup_ram": t_plain / t_ram,
        "speedup_lmdb": t_plain / t_lmdb,
        "restored_vs_recomputed_max_abs_diff": float((restored - recomputed).abs().max()),
        "restored_vs_one_pass_max_abs_diff": float((restored - logits).abs().max()),
        "max_abs_logit": float(logits.abs().max()),
    }


def _dropped(cache) -> int:
    return cache.stats["dropped_staging_full"] + cache.stats["dropped_queue_full"]


def _other_start(ids: list[int], index: int, marker: int) -> list[int]:
    out = list(ids)
    out[0] = (ids[0] + 1 + index) % marker  # never the marker itself
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _median_timed(reps: int, device: str, fn):
    runs = [timed(device, fn) for _ in range(reps)]
    return _median([t for t, _ in runs]), runs[0][1]


def _lmdb_restores(reps: int, device: str, open_cache, state, ids):
    """Median restore time of a new process's cache (nothing in RAM, everything from LMDB); its
    pinned ring is set up at start-up, as in a server, so that stays outside the timing."""
    times, hit = [], None
    for _ in range(reps):
        fresh = open_cache(0)
        fresh.wait_staging()
        seconds, source = timed(device, lambda fresh=fresh: restore(fresh, state, ids))
        fresh.close()
        times.append(seconds)
        hit = hit or source
    return _median(times), hit


def _reset(state):
    state.reset()
    return state


def _key(cache, ids, pos):
    from agentrt.statecache.keys import PrefixKeys

    return PrefixKeys(cache.fp, ids).key(pos)


def bench_cache(engine, config, fingerprint: bytes, label: str):
    """A state cache for the benchmarks' random prompts: checkpoints after the marker token (the
    vocabulary's last id, which `random_ids` never draws)."""
    from agentrt.statecache import Boundaries, StateCache
    from agentrt.statecache.manager import layout_for

    marker = engine.cfg.vocab_size - 1
    bounds = Boundaries({"message_end": ((marker,),)})
    layout = layout_for(engine.cfg, engine.dtype)
    return StateCache(
        config, fingerprint, label, layout, bounds, not engine.cfg.is_hybrid, engine.device
    )


def prefill_capture(engine, cache, state, ids, positions) -> float:
    """Prefill `ids` into `state` with checkpoints at `positions`, each handed to `cache`;
    returns the host seconds the hand-over took (device->host copies queued, not awaited)."""
    engine.prefill(state, ids, capture=positions)
    t0 = time.perf_counter()
    for pos in positions:
        at, conv, rec = state.capture_for(pos)  # eager fla prefill: on the 64-token grid
        cache.save(ids, pos, "message_end", state.kv_caches(), conv, rec, at=at)
    return time.perf_counter() - t0


def restore(cache, state, ids) -> str | None:
    """`state` from the longest checkpoint of `ids` in `cache`: its source, or None."""
    state.reset()
    hit = cache.restore_into(ids, 0, state.kv_caches(), state.linear_caches())
    if hit is None:
        return None
    state.adopt(ids[: hit.pos])
    return hit.source


# ----------------------------------------------------------------------------- TTFT over traces
