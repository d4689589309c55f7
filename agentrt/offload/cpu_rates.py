"""How fast offloaded prefill's CPU experts run, as the prefill plans' cost model needs it
(`planner.Costs.cpu_s`: an expert's weight bytes at a read rate, plus its rows' matmuls at a
FLOP rate), followed from the CPU side's own timings. Pure arithmetic (no torch, no device).

The read rate follows each layer's CPU side: its experts' bytes over the time beyond their rows'
matmuls at the FLOP rate. The FLOP rate stays where it was given (`prefill.CPU_FLOPS`). It
charges experts of 64-256 rows more than they take on a 16-core host (1.3-3.2x), so a `reserve`
plan sets aside fewer experts for the CPU than the best balance would; but a reserve sized on a
charge below the truth costs far more, as the CPU becomes the slower side (where a copy costs a
quarter of a CPU expert, charging half the true cost makes a layer's misses take about 1.7x
the balanced time, charging twice it about 1.1x). A least-squares fit of both rates to the
layers' timings swung between 6.6 and 129 GB/s and 0.7 and 9.9 TFLOP/s within one run on an
H100 host (the native kernel, for experts of a few rows, and torch's matmuls, for many, share
no one linear cost), and `auto` then took 1.02-1.11x the best fixed plan's time (over 1.03x on
four of six rows).

`PlanMeasures` keeps these rates, and what routed layers took beyond their plans, apart for each
plan of pass: each plan runs the CPU beside other copies (`reserve` beside most of a layer's,
`routed` beside a few) and for other numbers of experts, so `auto`'s passes of one strategy
plan as that fixed plan's engine would, not from where the other strategy left the figures."""

from __future__ import annotations

from dataclasses import dataclass

from agentrt.offload.planner import ema

FOLLOW = 0.3  # the read rate's step toward one layer's figure
OVERHEAD_FOLLOW = 0.3  # an overhead's step toward one routed layer's figure
# each streamed layer forgets this share of the overhead measured for plans that wait for the
# routing (chunks of its size), so a cost measured once (a first call's) does not keep auto from
# trying them again; a real overhead is measured again when it does
OVERHEAD_DECAY = 0.98


@dataclass
class CpuRates:
    """`read_bw` (bytes/s, followed by `observe`) and `flops` (FLOP/s) of the CPU experts."""

    read_bw: float
    flops: float
    expert_bytes: int
    token_flops: float

    def observe(self, experts: int, rows: int, seconds: float) -> None:
        """One layer's CPU side: `experts` experts over `rows` rows took `seconds`."""
        if experts <= 0 or seconds <= 0:
            return
        matmuls = rows * self.token_flops / self.flops
        rate = experts * self.expert_bytes / max(seconds - matmuls, seconds * 0.1)
        self.read_bw = (1 - FOLLOW) * self.read_bw + FOLLOW * rate


class PlanMeasures:
    """Per plan of pass: its `CpuRates` (each started from the calibrated read rate) and its
    routed layers' measured seconds beyond their plans', per size class of chunk."""

    def __init__(self, read_bw: float, flops: float, expert_bytes: int, token_flops: float) -> None:
        self.start = (read_bw, flops, expert_bytes, token_flops)
        self.rates: dict[str, CpuRates] = {}
        self.overheads: dict[tuple[str, int], float] = {}

    def cpu(self, plan: str) -> CpuRates:
        rates = self.rates.get(plan)
        if rates is None:
            rates = self.rates[plan] = CpuRates(*self.start)
        return rates

    def overhead(self, plan: str, size: int) -> float:
        return self.overheads.get((plan, size), 0.0)

    def follow_overhead(self, plan: str, size: int, seconds: float) -> None:
        key = (plan, size)
        self.overheads[key] = ema(self.overheads.get(key, 0.0), seconds, OVERHEAD_FOLLOW)

    def forget_overhead(self, plan: str, size: int) -> None:
        """A streamed layer: see OVERHEAD_DECAY."""
        if (plan, size) in self.overheads:
            self.overheads[plan, size] *= OVERHEAD_DECAY
