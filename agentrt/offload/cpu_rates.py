"""How fast offloaded prefill's CPU experts run, as the prefill plans' cost model needs it
(`planner.Costs.cpu_s`: an expert's weight bytes at a read rate, plus its rows' matmuls at a
FLOP rate), followed from the CPU side's own timings. Pure arithmetic (no torch, no device).

Each layer's CPU side reports its experts, their rows and its seconds. Both rates follow from a
least-squares fit of seconds = experts * a + rows * b over recent layers (weights fading by
`DECAY` per layer) once their rows per expert differ enough to tell the two terms apart (short
suffixes give an expert a few rows, long chunks a hundred or more); until then, and whenever
recent layers all had about the same rows per expert, the FLOP rate stays where it was and the
read rate alone follows each layer, as the time beyond its rows' matmuls."""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.995  # a layer's weight in the fit fades to half after about 140 later layers
# the fit is used once 1 - (uncentred correlation of experts and rows)^2 exceeds this: rows per
# expert spread enough across the layers it weighs
SPREAD = 0.02
FOLLOW = 0.3  # the read rate's step toward one layer's figure when the fit cannot tell


@dataclass
class CpuRates:
    """`read_bw` (bytes/s) and `flops` (FLOP/s) of the CPU experts, followed by `observe`."""

    read_bw: float
    flops: float
    expert_bytes: int
    token_flops: float
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # ee, er, rr, es, rs

    def observe(self, experts: int, rows: int, seconds: float) -> None:
        """One layer's CPU side: `experts` experts over `rows` rows took `seconds`."""
        if experts <= 0 or seconds <= 0:
            return
        s = self._sums
        for i, value in enumerate(
            (experts * experts, experts * rows, rows * rows, experts * seconds, rows * seconds)
        ):
            s[i] = DECAY * s[i] + value
        fitted = self.fit()
        if fitted is not None:
            self.read_bw, self.flops = fitted
            return
        matmuls = rows * self.token_flops / self.flops
        rate = experts * self.expert_bytes / max(seconds - matmuls, seconds * 0.1)
        self.read_bw = (1 - FOLLOW) * self.read_bw + FOLLOW * rate

    def fit(self) -> tuple[float, float] | None:
        """(read rate, FLOP rate) from the weighted layers, or None where they cannot tell the
        two terms apart or give a rate that is not positive."""
        ee, er, rr, es, rs = self._sums
        det = ee * rr - er * er
        if ee <= 0 or rr <= 0 or det <= SPREAD * ee * rr:
            return None
        per_expert = (es * rr - rs * er) / det
        per_row = (rs * ee - es * er) / det
        if per_expert <= 0 or per_row <= 0:
            return None
        return self.expert_bytes / per_expert, self.token_flops / per_row
