"""The figures `bench decode --offload` derives from its runs (agentrt.bench.offload's docstring
explains them): each run's decode bound and host-memory and layer-chain ceilings, ratios between
the settings of one invocation, decode after a long prompt against after a short one, and the
summary table."""

from __future__ import annotations

from collections import OrderedDict

from agentrt.offload.calibrate import Profile


def lru_counts(
    log: list[tuple[int, list[int]]], slots: int, count_from: int = 0
) -> dict[int, list[int]]:
    """Each layer's [hits, uses] in a plain LRU cache of `slots` experts shared by the layers,
    replaying `log` ((layer, routed experts) per layer step, in order); steps before
    `count_from` only warm it."""
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    counts: dict[int, list[int]] = {}
    for step, (layer, experts) in enumerate(log):
        counted = step >= count_from
        tally = counts.setdefault(layer, [0, 0])
        for expert in experts:
            key = (layer, expert)
            tally[1] += counted
            if key in cache:
                cache.move_to_end(key)
                tally[0] += counted
                continue
            cache[key] = None
            if len(cache) > slots:
                cache.popitem(last=False)
    return counts


def policy_step(policy, resident: set, layer: int, experts: list[int], slots: int) -> int:
    """One decode layer step through a cache of `slots` experts (`resident`, updated) under
    `policy` (an `agentrt.offload.policy` object), used as the engine's expert cache uses it:
    the misses, in the policy's rank, admitted in place of its victims outside the layer's own
    experts, then every routed expert touched. Returns the hits."""
    keys = [(layer, e) for e in experts]
    misses = [k for k in keys if k not in resident]
    for key in policy.rank(misses):
        if len(resident) >= slots:
            victim = policy.victim(set(keys))
            if victim is None:  # (every slot holds this layer's experts: the CPU's share)
                continue
            resident.discard(victim)
            policy.remove(victim)
        resident.add(key)
        policy.insert(key)
    for key in keys:
        policy.touch(key)
    return len(keys) - len(misses)


def lru_replay(log: list[tuple[int, list[int]]], slots: int, count_from: int = 0) -> float | None:
    """The hit rate of `lru_counts`' cache over all layers: the routing's regime, whatever
    policy, prefetch and split the run used."""
    counts = lru_counts(log, slots, count_from).values()
    looked = sum(c[1] for c in counts)
    return sum(c[0] for c in counts) / looked if looked else None


def add_bounds(runs: list[dict], profile: Profile, expert_bytes: int) -> None:
    """The decode bound of docs/architecture.md §8: 1 / (t_gpu + misses/token * S / B_miss);
    t_gpu from the `none` run."""
    resident = next((r for r in runs if r["offload"] == "none"), None)
    t_gpu = resident["ms_per_token"] / 1000 if resident else None
    for run in runs:
        if run["offload"] == "auto":
            b_miss = (
                profile.copy_overlapped + profile.cpu_overlapped if run["split"] else profile.copy
            )
            # the experts missing when their layer came, whether they missed or a prefetch
            # brought them (a prefetch hides its copy behind compute; the bound does not)
            slow = (run["misses_per_token"] + run["prefetch_hits_per_token"]) * expert_bytes
        else:
            b_miss = profile.cpu
            slow = run["cpu_expert_bytes_per_token"]
        run["t_gpu_ms"] = None if t_gpu is None else 1000 * t_gpu
        run["b_miss_gb_s"] = b_miss / 1e9
        if t_gpu is None or run["offload"] == "none":
            run["bound_tok_s"] = run["measured_over_bound"] = None
            continue
        run["bound_tok_s"] = 1 / (t_gpu + slow / b_miss)
        run["measured_over_bound"] = run["tok_s"] / run["bound_tok_s"]
        seen = _measured_b_miss(run)
        run["bound_at_measured_bandwidths_tok_s"] = 1 / (t_gpu + slow / seen) if seen else None


def add_ceilings(runs: list[dict], dram: float, expert_bytes: int) -> None:
    """The host-memory ceiling of each offloaded run (see the module docstring): the bytes of
    the experts missing from the device when their layer came (`auto`: misses and the experts a
    prefetch brought in time; static/layer: the CPU's experts) read once at `dram` bytes/s."""
    static = next((r["tok_s"] for r in runs if r["offload"] == "static"), None)
    resident = next((r for r in runs if r["offload"] == "none"), None)
    t_gpu = resident["ms_per_token"] / 1000 if resident else None
    for run in runs:
        if run["offload"] == "none":
            continue
        if run["offload"] == "auto":
            missing = run["misses_per_token"] + run["prefetch_hits_per_token"]
        else:
            missing = run["cpu_experts_per_token"]
        run["host_read_bytes_per_token"] = needed = missing * expert_bytes
        run["host_memory_ceiling_tok_s"] = dram / needed if needed else None
        if run["offload"] != "auto" or not needed:
            continue
        if t_gpu is not None and run["measured_copy_gb_s"]:
            cpu = run["measured_cpu_gb_s"] if run["split"] else None
            run["chain_ceiling_tok_s"] = 1 / chain_seconds(
                needed, t_gpu, run["measured_copy_gb_s"] * 1e9, cpu and cpu * 1e9, dram
            )
        if static:
            run["ceiling_vs_static"] = run["host_memory_ceiling_tok_s"] / static
            if "chain_ceiling_tok_s" in run:
                run["chain_ceiling_vs_static"] = run["chain_ceiling_tok_s"] / static


def chain_seconds(
    needed: float, t_gpu: float, copy: float, cpu: float | None, dram: float
) -> float:
    """The least seconds per token of the layer chain (module docstring): `needed` bytes of
    missing experts, copied at `copy` bytes/s behind everything and (with the split) computed
    at `cpu` bytes/s on the chain, all read from host memory at `dram` at most."""
    least = max(needed / dram, t_gpu)
    if cpu:
        return max(least, (t_gpu * cpu + needed) / (copy + cpu))
    return max(least, needed / copy)


def ceiling_lines(runs: list[dict], dram: float) -> str:
    """One line per offloaded run: the bytes it must read from host memory and its ceilings."""
    rows = [r for r in runs if r.get("host_memory_ceiling_tok_s") is not None]
    if not rows:
        return ""
    lines = [f"host-memory ceiling (DRAM read {dram / 1e9:.1f} GB/s):"]
    for r in rows:
        # (no leading space: scripts drop indented lines, the JSON, from the output)
        line = f"- {r['label']:<30}{r['host_read_bytes_per_token'] / 1e6:>8.0f} MB/token"
        line += f"  <= {r['host_memory_ceiling_tok_s']:.1f} tok/s"
        if "ceiling_vs_static" in r:
            line += f" ({r['ceiling_vs_static']:.2f}x static)"
        if "chain_ceiling_tok_s" in r:
            line += f"; layer chain <= {r['chain_ceiling_tok_s']:.1f} tok/s"
        if "chain_ceiling_vs_static" in r:
            line += f" ({r['chain_ceiling_vs_static']:.2f}x static)"
        lines.append(line)
    return "\n".join(lines)


def _measured_b_miss(run: dict) -> float | None:
    """B_miss from the bandwidths decode itself measured (the engine's real arrangement)."""
    copy, cpu = run["measured_copy_gb_s"], run["measured_cpu_gb_s"]
    if run["offload"] == "auto":
        sides = [copy] + ([cpu] if run["split"] else [])
    else:
        sides = [cpu]
    return sum(sides) * 1e9 if all(sides) else None


def ratios(runs: list[dict]) -> dict[str, float]:
    """tok/s ratios between settings of the same invocation."""
    by = {r["label"]: r["tok_s"] for r in runs}
    out = {}
    autos = [r["label"] for r in runs if r["offload"] == "auto"]
    for name in autos:
        for base in ("static", "layer", "none"):
            if base in by:
                out[f"{name}_vs_{base}"] = by[name] / by[base]
        if "/split/" in name and name.replace("/split/", "/copy-only/") in by:
            out[f"{name}_vs_copy-only"] = by[name] / by[name.replace("/split/", "/copy-only/")]
        if "/lfu" in name and name.replace("/lfu", "/lru") in by:
            out[f"{name}_vs_lru"] = by[name] / by[name.replace("/lfu", "/lru")]
        if name + "/no-prefetch" in by:
            out[f"{name}_vs_no-prefetch"] = by[name] / by[name + "/no-prefetch"]
    return out


def after_prompt(groups: dict[int, list[dict]]) -> dict[str, dict[str, float | None]]:
    """Per setting and prompt length after the first listed: its tok/s and hit rate over the
    same setting's after the first prompt length, e.g. decode right after a 32K-token prefill
    against decode after a 512-token one (labels already carry `@LENGTH`)."""
    first, *rest = groups
    base = {r["label"].rsplit("@", 1)[0]: r for r in groups[first]}
    out: dict[str, dict[str, float | None]] = {}
    for n in rest:
        for run in groups[n]:
            ref = base.get(run["label"].rsplit("@", 1)[0])
            if ref is None:
                continue
            hits = (run["hit_rate"], ref["hit_rate"])
            out[run["label"]] = {
                "tok_s_ratio": run["tok_s"] / ref["tok_s"],
                "hit_rate_ratio": hits[0] / hits[1] if None not in hits and hits[1] else None,
                "versus_prompt_tokens": first,
            }
    return out


def summary_table(runs: list[dict]) -> str:
    width = max([30, *(len(r["label"]) + 2 for r in runs)])
    head = (
        f"{'setting':<{width}}{'tok/s':>8}{'hit':>7}{'lru':>6}{'copied':>8}{'cpu':>7}{'ahead':>7}"
    )
    head += f"{'MB/tok':>8}{'bound':>8}{'meas/bd':>9}{'peak GiB':>10}"
    lines = [head]
    for r in runs:
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        lru = "-" if r.get("lru_hit_rate") is None else f"{r['lru_hit_rate']:.2f}"
        bound = "-" if r["bound_tok_s"] is None else f"{r['bound_tok_s']:.1f}"
        ratio = "-" if r["measured_over_bound"] is None else f"{r['measured_over_bound']:.2f}"
        peak = "-" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.1f}"
        lines.append(
            f"{r['label']:<{width}}{r['tok_s']:>8.2f}{hit:>7}{lru:>6}{r['copied_per_token']:>8.1f}"
            f"{r['cpu_experts_per_token']:>7.1f}{r['prefetched_per_token']:>7.1f}"
            f"{r['pcie_bytes_per_token'] / 1e6:>8.1f}"
            f"{bound:>8}{ratio:>9}{peak:>10}"
        )
    return "\n".join(lines)
