"""How well the next MoE layer's router, applied to this layer's MoE input, predicts the next
layer's experts (what offloaded decode prefetches on), on the synthetic qwen3.5-35b-a3b shapes
with fewer layers, fp32 on the CPU. Each layer keeps 256 routers' worth of experts but computes
with 16 random experts (expert e runs expert e % 16), so the hidden states grow as in the full
model at a fraction of the memory. Prints, per guess size k, the share of each layer's 8 routed
experts found in the previous layer's top-k guess, layer by layer.

    python scripts/prefetch_probe.py [layers]      # default 12; ~20 s on 2 cores
"""

from __future__ import annotations

import sys

import torch

from agentrt.engine import Engine
from agentrt.engine.config import EngineConfig
from agentrt.models import build_empty
from agentrt.models import synthetic as syn
from agentrt.models.moe import RoutedExperts

PHYSICAL = 16  # experts computed per layer


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    syn.SIZES["probe"] = dict(syn.SIZES["qwen3.5-35b-a3b"], num_hidden_layers=layers)
    syn.SIZES["probe"]["vocab_size"] = 32000
    cfg = syn.model_config("probe")
    inner = RoutedExperts.empty(
        range(layers), PHYSICAL, cfg.hidden_size, cfg.moe_intermediate_size, "cpu", torch.float32
    )
    model = build_empty(cfg, "cpu", torch.float32, inner)
    with torch.inference_mode():
        for name, tensor in syn.named_tensors(model):
            syn.init_value(name, tensor, 0, True)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def experts(layer, x, ids, weights):
        seen[layer] = (x.clone(), ids.clone())
        return inner(layer, x, ids % PHYSICAL, weights)

    model.set_experts(experts)
    engine = Engine(model, EngineConfig(device="cpu", dtype="float32"))
    state = engine.new_state(capacity=200)
    ids = torch.randint(0, 32000, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.prefill(state, ids)
    routers = {i: block.mlp.gate.weight for i, block in enumerate(model.layers)}
    for k in (8, 12, 16):
        shares = []
        for layer in range(layers - 1):
            x, _ = seen[layer]
            routed = seen[layer + 1][1]
            guess = torch.topk(x @ routers[layer + 1].T, k, dim=-1).indices
            pairs = zip(guess.tolist(), routed.tolist(), strict=True)
            found = [len(set(g) & set(r)) / 8 for g, r in pairs]
            shares.append(sum(found) / len(found))
        print(
            f"top-{k}: " + " ".join(f"{v:.2f}" for v in shares),
            f"mean {sum(shares) / len(shares):.3f}",
        )


if __name__ == "__main__":
    main()
