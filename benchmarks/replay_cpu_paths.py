"""`agentrt bench ttft` with more about each replayed request's offloaded-prefill CPU experts
than its row's `timings.offload.cpu_paths` (seconds and rows in the native kernel and in torch's
matmuls): how many experts took torch's path, and the host's runnable threads
(`procs_running`) sampled as each layer's CPU side starts (about 1 when nothing else runs and
the OpenMP team's workers sleep). Each request's `timings.cpu_probe` holds them.

Chooses how idle OpenMP workers wait before torch loads, as the CLI does for offloaded runs on a
GPU (`AGENTRT_OMP_SPIN=0` keeps them sleeping between parallel regions). Arguments are
`agentrt`'s, e.g.

    python benchmarks/replay_cpu_paths.py bench ttft .traces-dev/msa/*.zst \
        --model synthetic:qwen3.5-35b-a3b --device cuda --tokenizer .tok/qwen3 \
        --chat-template .tok/qwen3/chat_template.qwen3-hybrid-thinking.jinja \
        --variants dropped --max-tokens 8 --max-requests 45 --vram-budget 16GiB \
        --cache semantic --json out.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())
from agentrt.host.cputhreads import spin_between_steps  # noqa: E402

spin_between_steps(True)  # (before torch loads; a no-op under AGENTRT_OMP_SPIN=0)

from agentrt.offload import prefill, prefill_cpu  # noqa: E402
from agentrt.replay import replay  # noqa: E402

COUNTS = {"torch_experts": 0, "runnable_sum": 0, "runnable_n": 0}


def _running() -> int:
    """Threads running or runnable on the host now."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running"):
                return int(line.split()[1])
    return 0


def _counted_torch(real):
    def rows_of(store, layer, experts, begins, counts, x, scale, out):
        COUNTS["torch_experts"] += len(experts)
        return real(store, layer, experts, begins, counts, x, scale, out)

    return rows_of


def _sampled(real):
    def run_cpu_experts(*args, **kwargs):
        COUNTS["runnable_sum"] += _running()
        COUNTS["runnable_n"] += 1
        return real(*args, **kwargs)

    return run_cpu_experts


def _watching(init, seen):
    def watch_init(self, rt):
        init(self, rt)
        self.probe = dict(COUNTS)

    def watch_seen(self):
        out = seen(self)
        diff = {k: COUNTS[k] - self.probe[k] for k in COUNTS}
        diff["runnable_mean"] = diff.pop("runnable_sum") / max(1, diff.pop("runnable_n"))
        out["cpu_probe"] = diff
        return out

    return watch_init, watch_seen


def main() -> None:
    prefill_cpu._rows_of = _counted_torch(prefill_cpu._rows_of)
    prefill.run_cpu_experts = _sampled(prefill.run_cpu_experts)
    watch = replay._Watch
    watch.__init__, watch.seen = _watching(watch.__init__, watch.seen)
    from agentrt.cli import main as cli

    cli()


if __name__ == "__main__":
    main()
