"""One decode token's experts in two kernels (`models/expert_gemv`) against the plain-torch
reference: plain and clamped SwiGLU, biases at their own rows, slot views of a flat pool, the
CPU's row added, zero-weight experts skipped even where their weights are not finite. The
kernels run under Triton's interpreter on the CPU (in a subprocess: the interpreter is chosen
at import) and on CUDA (marked `gpu`)."""

from __future__ import annotations

import pytest
import torch
from util import check_under_triton_interpreter

from agentrt.models import expert_gemv
from agentrt.models.moe import PLAIN, RoutedExperts, SwiGLU


def compare_cases(device: str, shapes=((6, 64, 48, 4),), dtypes=(torch.float32, torch.bfloat16)):
    """Worst difference of `token_moe` from the reference, relative to the largest output, over
    every case on `device` (shapes: experts E, hidden H, intermediate I, top-k k)."""
    worst = 0.0
    g = torch.Generator().manual_seed(0)
    for experts, hidden, inter, top_k in shapes:
        for dtype in dtypes:
            for act, biased in ((None, False), (PLAIN, True), (SwiGLU(7.0, 1.702), True)):
                flat = torch.randn(experts, 3 * inter * hidden, generator=g) / hidden**0.5
                flat[1] = float("inf")  # under weight 0 below: never read
                flat = flat.to(device, dtype)
                gate_up = flat[:, : 2 * inter * hidden].view(experts, 2 * inter, hidden)
                down = flat[:, 2 * inter * hidden :].view(experts, hidden, inter)
                bias_rows = experts + 3
                biases = None
                if biased:
                    biases = tuple(
                        torch.randn(bias_rows, n, generator=g).to(device, dtype)
                        for n in (2 * inter, hidden)
                    )
                ids = torch.tensor([3, 1, 5, 0, 2, 4, 3, 5][:top_k], device=device)
                bias_ids = torch.randperm(bias_rows, generator=g)[:top_k].to(device)
                weights = torch.rand(top_k, generator=g).to(device)
                weights[1] = 0.0
                x = torch.randn(hidden, 2, generator=g).to(device, dtype)[:, 0]  # (strided)
                add = torch.randn(hidden, generator=g).to(device)
                args = (x, ids, weights, gate_up, down, biases, act, add, bias_ids)
                got = expert_gemv.token_moe(*args)
                want = expert_gemv.token_moe_reference(*args)
                assert torch.isfinite(got).all()
                worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def test_kernels_match_the_reference_under_the_triton_interpreter():
    check_under_triton_interpreter("test_expert_gemv", "compare_cases", 1e-5)


def test_stacks_the_kernels_cannot_read_are_told_apart():
    """Stacks whose rows are not contiguous (a transposed view) or whose shapes disagree are
    refused by `fits` (the model then takes torch's path) and by `token_moe`."""
    gate_up, down = torch.zeros(4, 8, 16), torch.zeros(4, 16, 4)
    assert expert_gemv.fits(gate_up, down)
    assert not expert_gemv.fits(gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)
    assert not expert_gemv.fits(gate_up, torch.zeros(4, 16, 5))
    assert not expert_gemv.fits(gate_up[0], down)
    with pytest.raises(ValueError, match="contiguous rows"):
        expert_gemv._check_stacks(gate_up, torch.zeros(4, 4, 16).transpose(1, 2))


def test_the_kernels_are_for_cuda_and_can_be_turned_off(monkeypatch):
    assert not expert_gemv.available(torch.zeros(4))
    if torch.cuda.is_available():
        x = torch.zeros(4, device="cuda")
        assert expert_gemv.available(x) == expert_gemv._has_triton()
        monkeypatch.setenv("AGENTRT_EXPERT_GEMV", "0")
        assert not expert_gemv.available(x)


@pytest.mark.parametrize("shapes", [(6, 64, 48, 4), (16, 2048, 512, 8), (8, 2880, 2880, 4)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_the_reference_on_cuda(shapes):
    assert compare_cases("cuda", (shapes,)) < 2e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_resident_decode_token_runs_the_kernels_like_the_grouped_path(monkeypatch):
    experts = RoutedExperts.empty([0], 16, 256, 128, "cuda", torch.bfloat16)
    for stack in (experts.gate_up[0], experts.down[0]):
        stack.normal_(std=0.05)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[4, 9, 0, 15]], device="cuda")
    weights = torch.softmax(torch.randn(1, 4, device="cuda"), -1)
    fast = experts(0, x, ids, weights)
    monkeypatch.setenv("AGENTRT_EXPERT_GEMV", "0")
    plain = experts(0, x, ids, weights)
    assert (fast.float() - plain.float()).abs().max() < 0.02 * plain.float().abs().max()


def test_the_kernels_compile_for_sm90_at_the_default_tiles():
    """Both kernels, plain and clamped SwiGLU with biases, compiled for sm_90 at the default
    tiles (no GPU needed; skipped without Triton or its CUDA toolchain): the interpreter does
    not lower them, so what only the compiler refuses shows here."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from agentrt.models.expert_gemv_triton import down_kernel, gate_up_kernel

    pointers = ("x", "ids", "weights", "gate_up", "bias_ids", "bias", "act")
    gate_up_sig = {f"{p}_ptr": "*i64" if "ids" in p else "*bf16" for p in pointers}
    gate_up_sig.update(weights_ptr="*fp32", act_ptr="*fp32", expert_stride="i64")
    pointers = ("act", "ids", "weights", "down", "bias_ids", "bias", "add", "out")
    down_sig = {f"{p}_ptr": "*i64" if "ids" in p else "*fp32" for p in pointers}
    down_sig.update(down_ptr="*bf16", bias_ptr="*bf16", expert_stride="i64")
    (n, k, warps, stages), down_tile = expert_gemv.tiles()
    for limit in (0.0, 7.0):
        consts = dict(H=2048, INTER=512, HAS_BIAS=bool(limit), LIMIT=limit, ALPHA=1.702)
        consts.update(BLOCK_N=n, BLOCK_K=k)
        jobs = [(gate_up_kernel, gate_up_sig, consts, warps, stages)]
        consts = dict(H=2048, INTER=512, TOP_K=8, HAS_BIAS=bool(limit), HAS_ADD=True)
        consts.update(BLOCK_N=down_tile[0], BLOCK_K=down_tile[1])
        jobs.append((down_kernel, down_sig, consts, *down_tile[2:]))
        for kernel, signature, constexprs, num_warps, num_stages in jobs:
            signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
            source = ASTSource(kernel, signature, constexprs=constexprs)
            try:
                triton.compile(
                    source,
                    target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": num_warps, "num_stages": num_stages},
                )
            except RuntimeError as exc:  # (a Triton without its CUDA toolchain)
                if "ptxas" in str(exc).lower():
                    pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")
                raise
