"""Synthetic checkpoints: real shapes, HF-loadable files, sharded == single file, in-memory == disk,
fused and per-expert names both load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from util import invoke_cli, open_engine, random_ids

from agentrt import Runtime
from agentrt.models.loader import load_model
from agentrt.models.synthetic import (
    build_in_memory,
    model_config,
    parameter_counts,
    write_checkpoint,
)


def test_real_shapes():
    q35 = model_config("qwen3.5-35b-a3b")
    assert (q35.num_layers, len(q35.linear_layers), q35.num_experts, q35.num_experts_per_tok) == (
        40,
        30,
        256,
        8,
    )
    counts = parameter_counts(q35)
    assert 34e9 < counts["total"] < 36e9 and 3e9 < counts["active_per_token"] < 4e9
    q3 = model_config("qwen3-30b-a3b")
    assert (q3.num_layers, q3.num_experts, q3.is_hybrid) == (48, 128, False)
    assert 30e9 < parameter_counts(q3)["total"] < 31.5e9


@pytest.mark.parametrize("size", ["tiny", "tiny-qwen3-moe", "tiny-gpt-oss"])
def test_written_checkpoint_loads_in_transformers(tmp_path, size):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(size, tmp_path / size)
    ids = random_ids(90, vocab=2048, seed=3)
    with torch.no_grad():
        ref = (
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            .eval()(torch.tensor([ids]))
            .logits[0]
        )
    eng = open_engine(path)
    assert (eng.prefill(eng.new_state(), ids, all_logits=True) - ref).abs().max().item() < 1e-4


def test_sharded_equals_single_and_in_memory(tmp_path):
    single = write_checkpoint("tiny-qwen3-moe", tmp_path / "single", seed=5)
    sharded = write_checkpoint("tiny-qwen3-moe", tmp_path / "sharded", seed=5, max_single_bytes=0)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) == 5  # base + 4 layers
    a, b = load_model(single, "cpu", torch.float32), load_model(sharded, "cpu", torch.float32)
    c = build_in_memory("tiny-qwen3-moe", "cpu", torch.float32, seed=5)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]) and torch.equal(
            tensor, c.state_dict()[name]
        ), name
    for layer in a.experts.gate_up:
        assert torch.equal(a.experts.gate_up[layer], c.experts.gate_up[layer])


def test_gpt_oss_written_in_transformers_layout_equals_in_memory(tmp_path):
    """gpt-oss checkpoints store experts `[E, in, out]` with gate and up interleaved; written
    that way and loaded back, they equal the in-memory build (biases included)."""
    from safetensors.torch import load_file

    path = write_checkpoint("tiny-gpt-oss", tmp_path / "g", seed=4)
    stored = load_file(str(path / "model.safetensors"))
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (16, 128, 128)
    loaded = load_model(path, "cpu", torch.float32)
    built = build_in_memory("tiny-gpt-oss", "cpu", torch.float32, seed=4)
    for name in ("gate_up", "down", "gate_up_bias", "down_bias"):
        for layer, tensor in getattr(loaded.experts, name).items():
            assert torch.equal(tensor, getattr(built.experts, name)[layer]), (name, layer)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, built.state_dict()[name]), name
    for size, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
        cfg = model_config(size)
        assert (cfg.num_layers, cfg.num_experts, len(cfg.sliding_layers)) == (
            layers,
            experts,
            layers // 2,
        )
    assert 116e9 < parameter_counts(model_config("gpt-oss-120b"))["total"] < 118e9
    assert 20e9 < parameter_counts(model_config("gpt-oss-20b"))["total"] < 22e9


def test_different_seed_gives_different_weights(tmp_path):
    a = build_in_memory("tiny", "cpu", torch.float32, seed=0)
    b = build_in_memory("tiny", "cpu", torch.float32, seed=1)
    assert not torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)


@pytest.mark.slow
def test_model_make_and_info_cli(tmp_path):
    out = tmp_path / "made"
    run = invoke_cli
    made = run("model", "make", "--arch", "qwen3_moe", "--size", "tiny", "-o", str(out))
    assert made.returncode == 0, made.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    again = run("model", "make", "--size", "tiny", "-o", str(out))
    assert again.returncode == 2 and "not empty" in again.stderr
    wrong = run(
        "model",
        "make",
        "--arch",
        "qwen3_moe",
        "--size",
        "qwen3.5-35b-a3b",
        "-o",
        str(tmp_path / "x"),
    )
    assert wrong.returncode == 2 and "error:" in wrong.stderr
    info = run("model", "info", str(out), "--json", str(tmp_path / "info.json"))
    assert info.returncode == 0, info.stderr
    data = json.loads((tmp_path / "info.json").read_text())
    assert (
        data["architecture"] == "qwen3_moe"
        and data["tokenizer"] is True
        and data["chat_template"] is True
    )
    chat = run("chat", "--model", str(out), "--device", "cpu", "--max-tokens", "4", "hi")
    assert chat.returncode == 0 and "4 generated" in chat.stderr, chat.stderr


@pytest.mark.slow
def test_bench_prefill_cli_prints_json(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "agentrt.cli",
        "bench",
        "prefill",
        "--device",
        "cpu",
        "--lengths",
        "64,130",
        "--repeat",
        "1",
        "--prefill-chunk",
        "50",
        "--json",
        str(tmp_path / "p.json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "p.json").read_text())
    assert [r["prompt_tokens"] for r in report["runs"]] == [64, 130]
    assert all(r["tok_s"] > 0 and r["backend"] == "torch" for r in report["runs"])
    header = next(line for line in proc.stderr.splitlines() if "tok_s" in line)  # the table
    assert header.split()[:3] == ["linear_attn", "backend", "prompt_tokens"]
    assert "agentrt: prefill: 130 tokens" in proc.stderr  # (its progress)


def test_summary_tables_show_each_rows_scalars_and_each_setting():
    from agentrt.cli.tables import summary_tables

    rows = [{"plan": "stream", "tok_s": 1234.5678, "all_s": [1.0], "gb": None}, {"plan": "x"}]
    assert summary_tables({"runs": rows}).splitlines() == [
        "  plan  tok_s  gb",
        "-----------------",
        "stream   1235   -",
        "     x      -   -",
    ]
    both = summary_tables({"runs": {"split=on": {"runs": rows}, "split=off": {"rows": []}}})
    assert both.startswith("[split=on]\n  plan") and "split=off" not in both
    assert summary_tables({"bench": "bw", "cpu_gb_s": 40.0}) == ""
    later = summary_tables({"runs": [{"plan": "resident"}, {"plan": "auto", "vs_floor": 1.5}]})
    assert later.splitlines()[0].split() == ["plan", "vs_floor"]  # (a column the first lacks)


def _top_share(size: str) -> float:
    """The share of routings that go to the most popular 15% of a synthetic model's first
    router's experts, over random near-isotropic inputs."""
    import math

    from agentrt.models.synthetic import build_in_memory, named_tensors, resolve_size

    model = build_in_memory(resolve_size(size), "cpu", torch.float32)
    router = next(t for n, t in named_tensors(model) if n.endswith(".mlp.gate.weight"))
    x = torch.randn(8192, router.shape[1], generator=torch.Generator().manual_seed(0))
    ids = (x @ router.T).topk(model.config.num_experts_per_tok, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=router.shape[0]).float().sort(descending=True).values
    return float(counts[: math.ceil(0.15 * router.shape[0])].sum() / counts.sum())


def test_router_skew_makes_expert_popularity_heavy_tailed():
    """`synthetic:NAME@skew=S` scales each router row by exp(S * z): the most popular experts
    take a growing share of the routings, `@skew=0` is the plain model, and a bad skew is a
    one-line error."""
    from agentrt.errors import InvalidArgumentError
    from agentrt.models.synthetic import resolve_size

    plain, mild, strong = (_top_share(s) for s in ("tiny", "tiny@skew=0.5", "tiny@skew=2"))
    assert plain < 0.25 and mild > plain + 0.05 and strong > mild
    assert resolve_size("tiny@skew=0") == "tiny"
    for bad in ("tiny@skew=-1", "tiny@skew=x", "nope@skew=1"):
        with pytest.raises(InvalidArgumentError):
            resolve_size(bad)
    rt = Runtime.open("synthetic:tiny@skew=1.5", cache="off")  # (the tiny tokenizer comes along)
    assert rt.tokenizer is not None and len(rt.generate([10, 11, 12], max_tokens=3)) == 3


def test_views_of_a_host_block_go_down_in_one_copy_with_the_same_values():
    """A synthetic model built for a host expert store draws on the device and copies down: the
    views of one block (gate_up and down rows per expert) are gathered in a device copy of the
    block and copied once; other targets, and a block left partly covered, get their own copies;
    the host holds the same values either way."""
    from agentrt.models.synthetic import _Staged

    def block_views(base):
        return base[:, :8].view(4, 2, 4), base[:, 8:].view(4, 1, 4)

    sources = [torch.randn(4, 2, 4), torch.randn(4, 1, 4)]
    whole, part = torch.zeros(4, 12), torch.full((4, 12), 7.0)
    other, staged = torch.zeros(3), _Staged(torch.device("cpu"))
    for target, source in zip(block_views(whole), sources, strict=True):
        staged.copy(target, source)
    assert not whole.any()  # (gathered, not yet down)
    staged.copy(block_views(part)[0], sources[0])  # the next block: the first goes down
    staged.copy(other, torch.ones(3))  # contiguous: at once
    staged.flush()
    assert torch.equal(whole, torch.cat([s.reshape(4, -1) for s in sources], dim=1))
    assert torch.equal(part[:, :8], sources[0].reshape(4, 8)) and (part[:, 8:] == 7).all()
    assert torch.equal(other, torch.ones(3)) and staged.host is None


def test_model_make_writes_gpt_oss_experts_as_mxfp4_pairs(tmp_path):
    """`model make --expert-format mxfp4`: gpt-oss experts as `_blocks` / `_scales` uint8 pairs
    with a `quantization_config`, as the published checkpoints; weights of about the synthetic
    spread; the checkpoint opens dequantized and offloaded with its experts still packed, to
    the same logits. Other sizes refuse the format."""
    from safetensors import safe_open

    from agentrt.models.synthetic import INIT_STD
    from agentrt.offload.config import OffloadConfig

    out = tmp_path / "gpt-oss"
    result = invoke_cli("model", "make", "--size", "tiny-gpt-oss", "--expert-format", "mxfp4",
                     "-o", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {
        "quant_method": "mxfp4"
    }
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        blocks = handle.get_tensor("model.layers.1.mlp.experts.down_proj_blocks")
    assert "model.layers.1.mlp.experts.down_proj" not in names and blocks.dtype == torch.uint8
    assert "model.layers.1.mlp.experts.gate_up_proj_scales" in names
    dense = Runtime.open(str(out), cache="off")
    spread = dense.engine.model.experts.down[1].float().std().item()
    assert 0.5 * INIT_STD < spread < 2 * INIT_STD
    offload = OffloadConfig(mode="auto", expert_cache_slots=10, packed_mxfp4=True,
                            copy_bandwidth=1.0, cpu_bandwidth=1.0)  # fmt: skip
    packed = Runtime.open(str(out), cache="off", offload=offload)
    ids = random_ids(40, seed=5)
    want = dense.engine.prefill(dense.engine.new_state(), ids, all_logits=True)
    got = packed.engine.prefill(packed.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    info = invoke_cli("model", "info", str(out))
    assert info.returncode == 0 and "routed_mxfp4_bytes" in info.stdout
    bad = invoke_cli("model", "make", "--size", "tiny", "--expert-format", "mxfp4", "-o",
                  str(tmp_path / "bad"))  # fmt: skip
    assert bad.returncode == 2 and "gpt-oss sizes" in bad.stderr


def test_model_make_tiny_takes_its_seed_and_dtype(tmp_path):
    from safetensors import safe_open

    def made(*args: str) -> dict:
        out = tmp_path / "-".join(args or ("default",))
        assert invoke_cli("model", "make", "--size", "tiny", *args, "-o", str(out)).returncode == 0
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    base, seeded, half = made(), made("--seed", "9"), made("--dtype", "bfloat16")
    name = next(k for k in base if k.endswith("embed_tokens.weight"))
    assert not torch.equal(base[name], seeded[name])
    assert base[name].dtype == torch.float32 and half[name].dtype == torch.bfloat16
