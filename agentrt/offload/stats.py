"""Counters of the offloaded experts, read by benchmarks: `Totals` for decode steps,
`PrefillTotals` for prefill steps (per-layer hit counts live with the cache: `cache.LayerStats`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Totals:
    """Counters of offloaded steps (read by benchmarks): decode's, but `streamed`, `cpu` and
    `bytes_copied` also count the layer plans of prefill steps."""

    copied: int = 0
    cpu: int = 0
    streamed: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0  # measured by CUDA events around decode copies
    copy_timed_bytes: int = 0
    # decode-step CPU expert work: wall time, or the native kernel pool's own clock from the
    # call's post to its end (its host step meanwhile prefetches and fills the inputs)
    cpu_seconds: float = 0.0
    cpu_timed_bytes: int = 0
    host_steps: int = 0  # graph-decode host steps (one per offloaded layer and token)
    host_seconds: float = 0.0  # their wall time, all of it
    # of which planning and issuing the copies and filling the next piece's inputs
    # (overlapping the CPU experts when the native kernel's pool runs them)
    plan_seconds: float = 0.0
    # their bookkeeping and the next layer's prefetch, once the next piece is launched (while
    # the GPU runs it: off the layer chain)
    after_seconds: float = 0.0
    # of the host steps that posted CPU experts to the native kernel's pool: from the step's
    # start to the post (the chain's serial part before the CPU starts), and the time the
    # step then waited for the pool once its own work was done
    cpu_start_seconds: float = 0.0
    cpu_wait_seconds: float = 0.0
    prefetched: int = 0  # experts copied ahead for the next layer (see `_prefetch_after`)
    prefetch_hits: int = 0  # of which the next layer did route to
    # experts read into the CPU's caches ahead of the next layer (`_warm_next`), and of which
    # that layer then computed on the CPU
    warmed: int = 0
    warm_used: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def since(self, before: dict) -> dict:
        """Each counter's growth since `before` (an earlier `as_dict()`)."""
        return {k: v - before[k] for k, v in self.__dict__.items()}


@dataclass
class PrefillTotals:
    """Counters of offloaded prefill steps (read by benchmarks)."""

    layers: int = 0
    copied: int = 0  # experts copied into staging
    copy_bytes: int = 0
    cpu: int = 0  # missing experts run on the CPU
    cpu_pairs: int = 0  # (token, expert) pairs they computed
    pairs: int = 0  # every (token, expert) pair
    routed_missing: int = 0  # missing experts the chunks routed to (the floor's bytes)
    admitted: int = 0  # copied experts also put into free slots of the expert cache
    cpu_seconds: float = 0.0  # host time in the CPU experts (their inputs' arrival included)
    cpu_input_seconds: float = 0.0  # of which waiting for their inputs to arrive from the device
    wait_seconds: float = 0.0  # host time blocked at the layers' one sync (the routing)
    host_seconds: float = 0.0  # host time in the layers besides those two (plans, dispatch)
    # the CPU experts by path: the native kernel's rows call, torch's matmuls (prefill_cpu)
    native_seconds: float = 0.0
    native_rows: int = 0
    torch_seconds: float = 0.0
    torch_rows: int = 0
    plans: Counter = field(default_factory=Counter)  # plan kind -> layers

    def add_layer(self, kind: str, copied: int, cpu: int, pairs: int, routed_missing: int) -> None:
        """Count one layer's plan (its kind, experts copied and on the CPU) and pairs."""
        self.layers += 1
        self.plans[kind] += 1
        self.copied += copied
        self.cpu += cpu
        self.pairs += pairs
        self.routed_missing += routed_missing

    def add_cpu_path(self, path: str, seconds: float, rows: int) -> None:
        """Count CPU experts run by `path` ("native" or "torch"): their seconds and rows."""
        setattr(self, f"{path}_seconds", getattr(self, f"{path}_seconds") + seconds)
        setattr(self, f"{path}_rows", getattr(self, f"{path}_rows") + rows)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "plans"}
        out["plans"] = dict(self.plans)
        return out

    def since(self, before: dict, runs: int = 1) -> dict:
        """What the prefills since `before` (an earlier `as_dict()`) did, per run of `runs`:
        GB copied, experts run on the CPU and their share of the pairs, missing experts
        routed to, layers per plan kind, and the host's seconds by part."""
        now = self.as_dict()
        diff = {k: (now[k] - before[k]) / runs for k in now if k != "plans"}
        plans = {k: (v - before["plans"].get(k, 0)) // runs for k, v in self.plans.items()}
        return {
            "copy_gb": diff["copy_bytes"] / 1e9,
            "cpu_experts": diff["cpu"],
            "cpu_pair_share": diff["cpu_pairs"] / (diff["pairs"] or 1),
            "routed_missing": diff["routed_missing"],
            "plans": {k: v for k, v in plans.items() if v},
            "host_s": {k: diff[f"{k}_seconds"] for k in ("wait", "cpu", "cpu_input", "host")},
            "cpu_paths": {
                f"{path}_{unit}": diff[f"{path}_{key}"]
                for path in ("native", "torch")
                for unit, key in (("s", "seconds"), ("rows", "rows"))
            },
        }
