"""How fast offloaded prefill's CPU experts run, as the prefill plans' cost model needs it
(`planner.Costs.cpu_s`: an expert's weight bytes at a read rate, plus its rows' matmuls at a
FLOP rate), followed from the CPU side's own timings. Pure arithmetic (no torch, no device).

Each layer's CPU side reports its experts, their rows and its seconds. Both rates follow a
least-squares fit of seconds = experts * a + rows * b over recent layers (weights fading by
`DECAY` per layer) once at least `MIN_LAYERS` of them weigh in and their rows per expert differ
enough to tell the two terms apart (short suffixes give an expert a few rows, long chunks a
hundred or more). A rate moves toward its fitted value by at most `STEP` times per layer, and
only where its term explains at least `MIN_SHARE` of the seconds (a term that explains little
is fitted mostly from noise). Until then the FLOP rate stays where it was and the read rate
alone follows each layer, as the time beyond its rows' matmuls."""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.995  # a layer's weight in the fit fades to half after about 140 later layers
MIN_LAYERS = 8.0  # the layers' summed weights the fit needs
# the fit is used once 1 - (uncentred correlation of experts and rows)^2 exceeds this: rows per
# expert spread enough across the layers it weighs
SPREAD = 0.02
MIN_SHARE = 0.05  # a term must explain this share of the fitted seconds to move its rate
STEP = 1.5  # the most a rate moves per layer toward its fitted value (times or divided by)
FOLLOW = 0.3  # the read rate's step toward one layer's figure when the fit cannot tell


@dataclass
class CpuRates:
    """`read_bw` (bytes/s) and `flops` (FLOP/s) of the CPU experts, followed by `observe`."""

    read_bw: float
    flops: float
    expert_bytes: int
    token_flops: float
    # decayed sums: layers, experts*experts, experts*rows, rows*rows, experts*seconds,
    # rows*seconds, experts, rows
    _sums: list[float] = field(default_factory=lambda: [0.0] * 8)

    def observe(self, experts: int, rows: int, seconds: float) -> None:
        """One layer's CPU side: `experts` experts over `rows` rows took `seconds`."""
        if experts <= 0 or seconds <= 0:
            return
        s = self._sums
        values = (1, experts * experts, experts * rows, rows * rows)
        values += (experts * seconds, rows * seconds, experts, rows)
        for i, value in enumerate(values):
            s[i] = DECAY * s[i] + value
        fitted = self.fit()
        moved_bw = False
        if fitted is not None:
            (read_bw, flops), (expert_share, row_share) = fitted, self._shares(*fitted)
            if row_share >= MIN_SHARE:
                self.flops = _toward(self.flops, flops)
            if expert_share >= MIN_SHARE:
                self.read_bw, moved_bw = _toward(self.read_bw, read_bw), True
        if not moved_bw:
            matmuls = rows * self.token_flops / self.flops
            rate = experts * self.expert_bytes / max(seconds - matmuls, seconds * 0.1)
            self.read_bw = (1 - FOLLOW) * self.read_bw + FOLLOW * rate

    def fit(self) -> tuple[float, float] | None:
        """(read rate, FLOP rate) from the weighted layers, or None where too few weigh in,
        they cannot tell the two terms apart, or a rate comes out not positive."""
        layers, ee, er, rr, es, rs = self._sums[:6]
        det = ee * rr - er * er
        if layers < MIN_LAYERS or ee <= 0 or rr <= 0 or det <= SPREAD * ee * rr:
            return None
        per_expert = (es * rr - rs * er) / det
        per_row = (rs * ee - es * er) / det
        if per_expert <= 0 or per_row <= 0:
            return None
        return self.expert_bytes / per_expert, self.token_flops / per_row

    def _shares(self, read_bw: float, flops: float) -> tuple[float, float]:
        """The shares of the weighted layers' fitted seconds the experts' reads and the rows'
        matmuls explain at these rates."""
        experts, rows = self._sums[6], self._sums[7]
        reads, matmuls = experts * self.expert_bytes / read_bw, rows * self.token_flops / flops
        total = reads + matmuls
        return reads / total, matmuls / total


def _toward(old: float, new: float) -> float:
    """`new`, or as near it as `STEP` lets `old` move in one layer."""
    return min(max(new, old / STEP), old * STEP)
