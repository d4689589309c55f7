"""Operators one eager decode step dispatches, by layer kind: a proxy for the kernels a decode
step launches (each compute operator is a kernel on a GPU; views and aliases are not counted).
Runs on the CPU with torch's kernels (on CUDA, fla fuses some of them further). Prints JSON: the
total, per layer of each kind, and the costliest operators.

    python benchmarks/decode_ops.py [--model tiny] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agentrt.engine import Engine
from agentrt.engine.config import EngineConfig
from agentrt.models.registry import open_model


class Count(TorchDispatchMode):
    """Counts the compute operators dispatched (views, aliases and detaches left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.__name__.startswith(("detach", "alias", "lift"))):
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="decode steps counted")
    args = parser.parse_args()
    model = open_model(args.model, "cpu", torch.float32).model
    engine = Engine(model, EngineConfig(device="cpu", dtype="float32", linear_attn="torch"))
    state = engine.new_state()
    engine.prefill(state, list(range(5, 37)))
    with torch.inference_mode():
        engine.decode_step(state, 40)
        with Count() as count:
            for step in range(args.steps):
                engine.decode_step(state, 41 + step)
    cfg = model.config
    total = sum(count.ops.values()) / args.steps
    print(
        json.dumps(
            {
                "model": args.model,
                "layers": cfg.num_layers,
                "layer_types": dict(Counter(cfg.layer_types)),
                "ops_per_step": total,
                "ops_per_layer": round(total / cfg.num_layers, 1),
                "top": {k: v / args.steps for k, v in count.ops.most_common(25)},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
