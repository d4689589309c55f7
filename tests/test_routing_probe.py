"""The routing probe (`benchmarks/routing_probe.py`): a synthetic model cut to its first layers
routes them as the whole model does, and its LRU replay counts hits as an LRU cache would."""

from __future__ import annotations

import pytest
import torch
from util import load_benchmark

probe = load_benchmark("routing_probe.py")


@pytest.mark.parametrize("size", ["tiny", "tiny@skew=1", "tiny-gpt-oss"])
def test_a_cut_model_routes_its_layers_as_the_whole_model(size):
    whole = probe.hf_config(size)["num_hidden_layers"]
    ids = list(range(3, 67))
    full = probe.routing(size, probe.cut_config(size, whole), ids, torch.float32)
    cut = probe.routing(size, probe.cut_config(size, 2), ids, torch.float32)
    assert cut and set(cut) < set(full)
    for layer, routes in cut.items():
        assert torch.equal(routes, full[layer])


def test_lru_replay_counts_hits_of_one_cache_shared_by_the_layers():
    routes = {  # tokens x top-2 experts, two layers
        0: torch.tensor([[0, 1], [0, 2], [1, 0]]),
        1: torch.tensor([[5, 6], [5, 6], [7, 5]]),
    }
    # 4 slots, LRU order after token 0: (0,0) (0,1) (1,5) (1,6)
    # token 1: (0,0) hit, (0,2) miss evicts (0,1), (1,5) hit, (1,6) hit
    # token 2: (0,1) miss evicts (0,0), (0,0) miss evicts (0,2), (1,7) miss evicts (1,5),
    # (1,5) miss
    report = probe.lru_hits(routes, slots=4, warmup=1)
    assert report["per_layer"] == {0: 0.25, 1: 0.5}
    assert report["lru_hit_rate"] == 0.375


def test_top_share_is_the_pairs_the_most_popular_experts_receive():
    routes = {0: torch.tensor([[0], [0], [0], [1]])}
    assert probe.top_share(routes, experts=4, share=0.25) == 0.75
