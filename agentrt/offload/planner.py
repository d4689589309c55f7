"""Prefill plans for one MoE layer and chunk: a pure function of token counts per expert, which
experts the device cache holds, and measured costs (no torch, no device).

A chunk's tokens need every expert they were routed to. Those the cache holds run in place; the
missing ones reach them one of these ways:
- `stream`: copy every missing expert of the layer, routed or not. The copies need no routing, so
  they are issued before the layer runs and travel while earlier layers compute.
- `routed`: copy only the missing experts the chunk routed to. Fewer bytes, but the copies start
  once the layer's routing is known: the copy engine idles through the layer's attention
  (`Costs.exposed_s`).
- `predicted`: before the layer runs, copy the missing experts its router picks from the previous
  layer's input (the residual stream changes little from one layer to the next), those
  predicted the most tokens (with `split`, the fewest-token ones are left to the CPU); once its
  routing is known, the experts it routed to beyond them come as in `split` / `routed`.
- `split`: `routed`, with the missing experts that received the fewest tokens computed on the
  CPU meanwhile (the q* idea per expert: a CPU expert reads its weights once and pays for each
  of its tokens; a copy costs the same whatever its tokens), as many as lower the slower side.
- `reserve`: stream every missing expert but a few set aside for the CPU before the routing is
  known (a chunk of a few hundred tokens reaches nearly every expert of a layer, so which ones
  hardly matters): the copies never wait for the routing, and the CPU computes the reserved
  experts the chunk routed to once it is known (`reserve_plan` sizes the reserve).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

PLANS = ("auto", "stream", "routed", "predicted", "reserve")


@dataclass(frozen=True)
class Costs:
    """Measured rates: `copy_bw` host->device bytes/s, `cpu_bw` CPU expert weight reads in bytes/s
    (next to running copies), `cpu_flops` the CPU experts' matmul rate, `token_flops` one token
    through one expert, `exposed_s` the device time from one layer's experts to the next's
    routing (what a routed plan cannot hide), `dispatch_s` the host time a layer takes to
    dispatch the device's work, before this thread can run CPU experts."""

    expert_bytes: int
    copy_bw: float
    cpu_bw: float
    cpu_flops: float
    token_flops: float
    exposed_s: float = 0.0
    dispatch_s: float = 0.0

    def copy_s(self, num_experts: int) -> float:
        return num_experts * self.expert_bytes / self.copy_bw if num_experts else 0.0

    def cpu_s(self, tokens: int) -> float:
        """One expert on the CPU for `tokens` tokens."""
        if self.cpu_bw <= 0 or self.cpu_flops <= 0:
            return float("inf")
        return self.expert_bytes / self.cpu_bw + tokens * self.token_flops / self.cpu_flops


@dataclass(frozen=True)
class LayerPlan:
    """`copy`: missing experts copied to the device; `cpu`: missing experts run on the CPU;
    `seconds`: the predicted time the layer's misses add (the slower side, plus what a routed
    plan leaves exposed)."""

    kind: str
    copy: tuple[int, ...]
    cpu: tuple[int, ...] = ()
    seconds: float = 0.0


def stream_plan(missing: Sequence[int], costs: Costs) -> LayerPlan:
    """Copy every missing expert of the layer (routed or not)."""
    return LayerPlan("stream", tuple(missing), (), costs.copy_s(len(missing)))


def routed_plan(
    routed_missing: Mapping[int, int], costs: Costs, split: bool, queued_s: float = 0.0
) -> LayerPlan:
    """Copy the routed missing experts (`expert -> tokens`); with `split`, move those with the
    fewest tokens to the CPU while that lowers max(copy time, dispatch + CPU time) (the CPU
    experts run once the layer's device work is dispatched). `queued_s`: copies already ahead
    of these on the copy engine (the layer's experts copied before its routing)."""
    num_copy, cpu_time, on_cpu = len(routed_missing), costs.dispatch_s, []
    if split and costs.cpu_s(0) < float("inf"):
        per_copy = costs.copy_s(1)  # (the loop runs per layer and chunk: its costs as numbers)
        read, per_token = costs.cpu_s(0), costs.token_flops / costs.cpu_flops
        for count, expert in sorted((c, e) for e, c in routed_missing.items()):
            moved = cpu_time + read + count * per_token
            before = max(queued_s + num_copy * per_copy, cpu_time)
            if max(queued_s + (num_copy - 1) * per_copy, moved) >= before:
                break
            num_copy, cpu_time = num_copy - 1, moved
            on_cpu.append(expert)
    cpu = set(on_cpu)
    copy = tuple(sorted(e for e in routed_missing if e not in cpu))
    seconds = costs.exposed_s + max(queued_s + costs.copy_s(len(copy)), cpu_time)
    return LayerPlan("split" if on_cpu else "routed", copy, tuple(sorted(on_cpu)), seconds)


def choose(
    plan: str,
    missing: Sequence[int],
    routed_missing: Mapping[int, int],
    costs: Costs,
    split: bool,
    routed: LayerPlan | None = None,
) -> LayerPlan:
    """The plan `plan` asks for (`auto`, or any other: the cheaper of stream and routed, stream
    on a tie; `predicted`, with nothing copied ahead: routed); `routed`: the routed plan, where the
    caller has it already."""
    if plan == "stream":
        return stream_plan(missing, costs)
    routed = routed or routed_plan(routed_missing, costs, split)
    if plan in ("routed", "predicted"):
        return routed
    stream = stream_plan(missing, costs)
    return stream if stream.seconds <= routed.seconds else routed


def predicted_plan(
    predicted: Mapping[int, int], num_late: float, costs: Costs, split: bool
) -> tuple[tuple[int, ...], float]:
    """What to copy ahead for a layer whose router, applied to the previous layer's input,
    predicts `predicted` (missing expert -> tokens): those the CPU would take longest over
    (the most tokens), balanced against the fewest-token ones left to the CPU once the routing
    is known (as `routed_plan` balances them; all of them copy-only). Returns (the experts
    copied ahead, the predicted seconds: the ahead copies, which travel during the exposed time,
    against the exposed time plus the CPU's share; then the `num_late` unpredicted experts'
    copies)."""
    plan = routed_plan(predicted, replace(costs, exposed_s=0.0), split)
    cpu = sum(costs.cpu_s(predicted[e]) for e in plan.cpu)
    ahead = max(costs.copy_s(len(plan.copy)), costs.exposed_s + costs.dispatch_s + cpu)
    return plan.copy, ahead + costs.copy_s(round(num_late))


def reserve_plan(num_missing: int, pairs: int, num_experts: int, costs: Costs) -> tuple[int, float]:
    """How many of a layer's `num_missing` missing experts to set aside for the CPU before its
    routing is known (the rest stream), for a chunk of `pairs` (token, expert) pairs over
    `num_experts` experts, routed about evenly: a reserved expert receives a token with
    probability p = 1 - exp(-pairs / num_experts), and then pairs / num_experts / p tokens on
    average. Balances the copies, max(0, M - K) experts, which do not wait for the routing,
    against the CPU side, which does: the exposed time, the dispatch, then K experts times p.
    Returns (K, the predicted seconds); K = 0 where no reserve beats streaming."""
    if num_missing <= 0 or pairs <= 0 or costs.cpu_s(0) == float("inf"):
        return 0, costs.copy_s(num_missing)
    mean = pairs / num_experts
    hit = 1.0 - math.exp(-mean)
    per_cpu = hit * costs.cpu_s(round(mean / hit))
    per_copy, wait = costs.copy_s(1), costs.exposed_s + costs.dispatch_s
    best = (costs.copy_s(num_missing), 0)
    ideal = (num_missing * per_copy - wait) / (per_copy + per_cpu)
    for k in {math.floor(ideal), math.ceil(ideal)}:
        if 0 < k <= num_missing:
            best = min(best, (max((num_missing - k) * per_copy, wait + k * per_cpu), k))
    return best[1], best[0]


def plan_ahead(num_missing: int, predicted_s: float | None, routed_s: float, costs: Costs) -> str:
    """What to copy for the next layer before its routing is known: `stream` (its
    `num_missing` missing experts), `predicted` (what `predicted_plan` picks, taking
    `predicted_s`; None: no prediction), or `none` (everything waits for the routing:
    `routed_s`, the routed plan's time, CPU share included)."""
    if num_missing == 0:
        return "none"
    options = {"stream": costs.copy_s(num_missing), "none": routed_s}
    if predicted_s is not None:
        options["predicted"] = predicted_s
    return min(options, key=lambda k: (options[k], k != "stream"))


# what `auto` chooses between for each size of chunk, by the passes it measured: the reserve
# plan (which streams where no reserve helps; without the split, stream or routed per layer by
# cost) and the routed one (copies wait for the routing, unrouted experts are never copied:
# short suffixes)
STRATEGIES = ("reserve", "routed")
# chunks of more tokens than this run `reserve` without trying `routed`: a chunk of over 1,024
# tokens routes 32 or more pairs to each expert on average, so `routed` copies nearly the same
# experts later (it waits for the routing) and gains little on the CPU side. Timed on H100
# hosts it was 5-15% slower than `reserve` for every 4K and 8K chunk measured and 6-13% for
# 2K-token suffixes, and in a replay of agent turns its trials on 1.4-1.5K-token suffixes were
# the session's slowest turns (1.12 s and 1.62 s, about 1.5x a `reserve` turn of that size): a
# trial costs a user's request, so sizes where it has never won are not tried
ROUTED_MAX_TOKENS = 1024
EXPLORE_EVERY = 16  # every this many passes of a size, auto takes the runner-up once
# another strategy displaces the first (reserve: its copies never wait for the routing, so it
# suffers least where conditions change) only when measured this much faster: one pass of each
# differs by a few percent from the next in the same setting
MARGIN = 0.03


def pick_strategy(
    measured: Mapping[str, float], passes: int, candidates: Sequence[str], unread=()
) -> str:
    """The plan `auto` takes for its next pass of a size of chunk: a candidate neither measured
    nor `unread` (run to its end, its time not read yet) first, in order; then the fastest
    measured (`measured`: seconds per pass; the first candidate unless another beats it by
    more than `MARGIN`), and every `EXPLORE_EVERY`-th of the `passes` so far the runner-up, so
    that a host whose costs changed is noticed."""
    for candidate in candidates:
        if candidate not in measured and candidate not in unread:
            return candidate
    first = candidates[0]
    time_of = {c: measured[c] * (1 - MARGIN if c == first else 1) for c in measured}
    ranked = sorted((c for c in candidates if c in measured), key=lambda c: time_of[c])
    if not ranked:
        return first
    if len(ranked) > 1 and passes % EXPLORE_EVERY == EXPLORE_EVERY - 1:
        return ranked[1]
    return ranked[0]


def strategies_for(size: int) -> tuple[str, ...]:
    """The strategies `auto` times and chooses between for chunks of size class `size`."""
    return STRATEGIES if size <= size_class(ROUTED_MAX_TOKENS) else STRATEGIES[:1]


def size_class(tokens: int) -> int:
    """The size class of a chunk of `tokens` tokens (powers of two), which measured costs are
    kept per."""
    return max(0, tokens - 1).bit_length()


def ema(old: float, new: float, weight: float) -> float:
    """An exponential moving average's next value (the first sample as it is)."""
    return new if old == 0 else (1 - weight) * old + weight * new
