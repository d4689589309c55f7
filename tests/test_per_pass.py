"""What the attention layers of one forward pass share (`models/per_pass.py`): computed once
per pass from its position, again in the next pass, never outside one; and a static pass of a
whole model equal with and without the sharing."""

from __future__ import annotations

import pytest
import torch
from util import open_engine, random_ids

from agentrt.models import per_pass
from agentrt.models.rotary import Rotary


def test_a_pass_shares_the_cos_sin_of_its_device_position_and_the_next_recomputes():
    """Within one pass every attention layer reads the cos/sin the first computed for a
    device-tensor position (a captured step records the computation once); the next pass
    computes them again, though the same position tensor changed in place, and outside a pass
    nothing is shared."""
    first, second = Rotary(64, 1.0, 150000.0), Rotary(64, 1.0, 150000.0)
    start = torch.tensor([5])
    with per_pass.one_pass():
        cos, sin = first.cos_sin(start, 1, torch.float32)
        again = second.cos_sin(start, 1, torch.float32)
        assert again[0] is cos and again[1] is sin
    start.fill_(9)
    with per_pass.one_pass():
        cos9, _ = second.cos_sin(start, 1, torch.float32)
    want, _ = first.cos_sin(9, 1, torch.float32)
    torch.testing.assert_close(cos9, want)
    assert not torch.equal(cos9, cos)
    outside = first.cos_sin(start, 1, torch.float32)[0]
    assert outside is not first.cos_sin(start, 1, torch.float32)[0]


def test_positions_ends_and_bounds_are_shared_per_pass_and_keyed_by_their_inputs():
    start, other = torch.tensor([7]), torch.tensor([7])
    with per_pass.one_pass():
        pos = per_pass.positions(start, 3)
        assert pos.tolist() == [7, 8, 9] and per_pass.positions(start, 3) is pos
        assert per_pass.positions(other, 3) is not pos  # (another tensor, maybe another value)
        assert per_pass.positions(start, 2).tolist() == [7, 8]
        end = per_pass.end_int32(start, 3, start.device)
        assert end.dtype == torch.int32 and end.tolist() == [10]
        assert per_pass.end_int32(start, 3, start.device) is end
        assert per_pass.end_int32(4, 3, "cpu").tolist() == [7]
        bounds = per_pass.sequence_bounds(5, start.device)
        assert bounds.tolist() == [0, 5] and per_pass.sequence_bounds(5, start.device) is bounds
        with per_pass.one_pass():  # (a nested pass shares nothing with its outer one)
            assert per_pass.positions(start, 3) is not pos
        assert per_pass.positions(start, 3) is pos  # (the outer pass's, again)
        start.fill_(20)  # (within a pass the position holds: the shared value is read)
        assert per_pass.positions(start, 3).tolist() == [7, 8, 9]
    with per_pass.one_pass():
        assert per_pass.positions(start, 3).tolist() == [20, 21, 22]
    assert per_pass.positions(start, 3) is not per_pass.positions(start, 3)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "gpt_oss"])
def test_static_passes_give_the_same_logits_with_and_without_sharing(
    hf_checkpoints, monkeypatch, name
):
    """A prefill in static passes (device-tensor starts, the whole KV buffers; run eagerly on
    the CPU), with Qwen3.5's and gpt-oss's attention, equals the same prefill with every shared
    value computed afresh in each layer, bit for bit, and an eager prefill closely."""
    from agentrt.engine.cuda_graph import PrefillGraphs

    ids = random_ids(600, seed=5)  # (pieces of 256, 256 and 64: two alike)

    def prefill(static: bool) -> torch.Tensor:
        engine = open_engine(hf_checkpoints[name])
        if static:
            engine.prefill_graphs = PrefillGraphs(
                engine.model, torch.device("cpu"), (64, 256), capture=False, reserve=0,
                max_prompt=700,
            )  # fmt: skip
        return engine.prefill(engine.new_state(), ids, all_logits=True)

    shared = prefill(static=True)
    with monkeypatch.context() as patch:
        patch.setattr(per_pass, "shared", lambda key, make: make())
        fresh = prefill(static=True)
    assert torch.equal(shared, fresh)
    torch.testing.assert_close(shared, prefill(static=False), rtol=1e-4, atol=1e-4)
