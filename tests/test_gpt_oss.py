"""gpt-oss beyond the shared parity tests (`test_parity.py`): MXFP4 weights against transformers'
own dequantizer, an MXFP4 checkpoint against the oracle given the same dequantized experts, the
real model's config.json. Offloaded gpt-oss experts: `test_offload.py`,
`test_prefill_offload.py`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from util import check_under_triton_interpreter, open_engine, random_ids

from agentrt.models import mxfp4
from agentrt.models.config import ModelConfig
from agentrt.session.runtime import Runtime

# config.json of openai/gpt-oss-120b (as published; the fields this runtime reads)
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "eos_token_id": 200002,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_mxfp4_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 137, (3, 64, 4), generator=gen, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, torch.float32, rows_per_step=100)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert ours.shape == (3, 64, 128)
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_mxfp4_quantize_is_exact_on_the_grid_and_rejects_bad_input():
    gen = torch.Generator().manual_seed(1)
    codes = torch.tensor(mxfp4.FP4_VALUES)[torch.randint(0, 16, (5, 8, 32), generator=gen)]
    codes[..., 0] = 6.0  # each block's peak on the grid's top: its exponent is exact
    exps = torch.randint(-6, 6, (5, 8, 1), generator=gen).float()
    values = (codes * torch.exp2(exps)).reshape(5, 256)
    blocks, scales = mxfp4.quantize(values)
    assert blocks.shape == (5, 8, 16) and scales.shape == (5, 8)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float32), values)
    rough = torch.randn(4, 64, generator=gen)
    back = mxfp4.dequantize(*mxfp4.quantize(rough), torch.float32)
    assert (back - rough).abs().max() <= rough.abs().max() / 6  # half a step at the top
    from agentrt.errors import ModelFormatError

    with pytest.raises(ModelFormatError):
        mxfp4.dequantize(blocks.int(), scales, torch.float32)
    with pytest.raises(ModelFormatError):
        mxfp4.dequantize(blocks, scales[..., :4], torch.float32)


def _packed_checkpoint(src, dst) -> dict[str, torch.Tensor]:
    """`src` with its experts stored MXFP4-packed, as the published gpt-oss checkpoints are;
    returns the dequantized expert weights in transformers' layout."""
    tensors = load_file(str(src / "model.safetensors"))
    dequantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name)  # [E, in, out]
        blocks, scales = mxfp4.quantize(weight.transpose(1, 2).contiguous())
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantized[name] = mxfp4.dequantize(blocks, scales, torch.float32).transpose(1, 2)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dequantized


def test_an_mxfp4_checkpoint_matches_transformers_on_its_dequantized_experts(hf_gpt_oss, tmp_path):
    from transformers import AutoModelForCausalLM

    dequantized = _packed_checkpoint(hf_gpt_oss, tmp_path / "mxfp4")
    ref = AutoModelForCausalLM.from_pretrained(hf_gpt_oss, dtype=torch.float32).eval()
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, weight in dequantized.items():
            assert not torch.equal(params[name], weight)  # the packing rounded them
            params[name].copy_(weight)
    ids = random_ids(90, seed=11)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    engine = open_engine(tmp_path / "mxfp4")
    got = engine.prefill(engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4


def test_an_mxfp4_checkpoint_loads_still_packed_into_an_offloaded_store(hf_gpt_oss, tmp_path):
    """With `packed_mxfp4`, the checkpoint's MXFP4 pairs go into the host store's rows as they
    are (no unpacked stacks on the way), and the offloaded model equals the one that loaded
    them dequantized."""
    from agentrt import Runtime
    from agentrt.offload.config import OffloadConfig

    _packed_checkpoint(hf_gpt_oss, tmp_path / "mxfp4")
    path = str(tmp_path / "mxfp4")
    dense = Runtime.open(path, cache="off", dtype="float32", tokenizer=None)
    ids = random_ids(60, seed=3)
    want = dense.engine.prefill(dense.engine.new_state(), ids, all_logits=True)
    config = OffloadConfig(
        mode="auto", expert_cache_slots=6, copy_bandwidth=1.0, cpu_bandwidth=1.0,
        packed_mxfp4=True,
    )  # fmt: skip
    rt = Runtime.open(path, cache="off", dtype="float32", tokenizer=None, offload=config)
    store = rt.engine.offload.store
    tensors = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    down = tensors["model.layers.2.mlp.experts.down_proj_blocks"]
    part = store.layout.down
    assert torch.equal(store.flat[2][:, part.codes : part.scales], down.reshape(down.shape[0], -1))
    got = rt.engine.prefill(rt.engine.new_state(), ids, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4


def test_an_mxfp4_checkpoint_without_its_scales_is_refused(hf_gpt_oss, tmp_path):
    from agentrt.errors import ModelFormatError

    _packed_checkpoint(hf_gpt_oss, tmp_path / "mxfp4")
    path = tmp_path / "mxfp4" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(path))
    with pytest.raises(ModelFormatError, match="MXFP4 pair of layers.1.mlp.experts.down_proj"):
        open_engine(tmp_path / "mxfp4")


def test_the_published_gpt_oss_config_reads_as_its_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_120B))
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.arch == "gpt_oss" and cfg.num_experts == 128 and cfg.num_experts_per_tok == 4
    assert cfg.moe_intermediate_size == 2880 and cfg.expert_bias and cfg.swiglu_limit == 7.0
    assert cfg.sliding_window == 128 and cfg.sliding_layers == tuple(range(0, 36, 2))
    assert cfg.rope_theta == 150000.0 and dict(cfg.rope_scaling)["factor"] == 32.0
    assert dict(cfg.rope_scaling)["truncate"] == 0.0 and not cfg.plain_experts
    assert "rope_scaling" in cfg.canonical()


def test_models_without_the_new_fields_keep_their_fingerprint_fields(hf_qwen3):
    """Fields a model does not use stay out of `canonical()`, so state caches written before
    they existed still match."""
    data = ModelConfig.from_hf(hf_qwen3).canonical()
    for name in ("sliding_window", "sliding_layers", "rope_scaling", "expert_bias", "swiglu_limit"):
        assert name not in data


def test_yarn_frequencies_match_transformers():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from agentrt.models.rotary import rope_frequencies

    for truncate in (False, True):
        scaling = {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": truncate,
            "original_max_position_embeddings": 4096,
        }
        cfg = GptOssConfig(head_dim=64, rope_parameters=scaling)
        want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        pairs = {k: float(v) for k, v in scaling.items() if k not in ("rope_type", "rope_theta")}
        got, factor = rope_frequencies(64, 150000.0, pairs)
        assert torch.allclose(got, want, rtol=1e-6) and factor == pytest.approx(want_factor)


def test_a_sink_scales_plain_attention_by_the_sigmoid_of_logsumexp_minus_sink():
    """The identity the CUDA fast path rests on (`flash_sink_attention`): attention with a sink
    equals attention without it times sigmoid(logsumexp - sink), per head and query (here with
    torch's CPU flash kernel, which also returns the logsumexp)."""
    from agentrt.models.gpt_oss import sink_attention

    gen = torch.Generator().manual_seed(7)
    heads, length, dim = 4, 33, 16
    q, k, v = (torch.randn(1, heads, length, dim, generator=gen) for _ in range(3))
    sinks = torch.randn(heads, generator=gen)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, True, scale=dim**-0.5
    )
    got = out[0] * torch.sigmoid(lse[0] - sinks[:, None])[..., None]
    want = sink_attention(q[0], k[0], v[0], torch.arange(length), sinks, 0, dim**-0.5)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "case, words",
    [
        ("extra_layer", "layer 99, which has none"),
        ("float_blocks", "expected 4-d uint8"),
        ("flat_scales", "expected 3-d uint8"),
        ("flat_bias", "1-d in checkpoint, expected 2-d"),
        ("int_weight", "dtype torch.int32 is not one agentrt loads"),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_malformed_mxfp4_checkpoints_are_refused_by_name(hf_gpt_oss, tmp_path, case, words, packed):
    """Tensors of the wrong kind become a ModelFormatError naming them, whether the experts are
    dequantized or stay packed (they were garbage weights, or an IndexError/KeyError)."""
    from agentrt.errors import ModelFormatError
    from agentrt.offload.config import OffloadConfig

    _packed_checkpoint(hf_gpt_oss, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    experts = "model.layers.1.mlp.experts."
    if case == "extra_layer":
        for part in ("blocks", "scales"):
            extra = tensors[f"{experts}down_proj_{part}"].clone()
            tensors[f"model.layers.99.mlp.experts.down_proj_{part}"] = extra
    elif case == "float_blocks":
        tensors[experts + "down_proj_blocks"] = tensors[experts + "down_proj_blocks"].float()
    elif case == "flat_scales":
        tensors[experts + "down_proj_scales"] = tensors[experts + "down_proj_scales"].flatten()
    elif case == "flat_bias":
        tensors[experts + "gate_up_proj_bias"] = tensors[experts + "gate_up_proj_bias"].flatten()
    else:
        tensors["model.norm.weight"] = tensors["model.norm.weight"].int()
    save_file(tensors, str(path))
    offload = OffloadConfig(mode="auto", expert_cache_slots=6, packed_mxfp4=True)
    with pytest.raises(ModelFormatError, match=words):
        Runtime.open(
            str(tmp_path / "m"), cache="off", tokenizer=None, offload=offload if packed else None
        )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_grouped_mxfp4_tile_fits_sm90_shared_memory(dtype):
    """The grouped MXFP4 kernel at the tile for its activations' dtype, compiled for sm_90 (no
    GPU needed; skipped without Triton), uses no more shared memory than an H100 / H200 has
    per block (232,448 bytes): Triton refuses to launch a kernel over it."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from agentrt.offload.mxfp4_rows import RowLayout, grouped_tile
    from agentrt.offload.mxfp4_triton import grouped_kernel

    block_m, block_n, block_b, warps = grouped_tile(
        torch.float32 if dtype == "fp32" else torch.bfloat16
    )
    layout = RowLayout(2880, 2880)  # (gpt-oss-20b and -120b)
    for part in (layout.gate_up, layout.down):
        consts = dict(n_rows=part.rows, n_bytes=part.cols // 2, n_groups=part.groups)
        consts.update(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=block_b)
        consts["PRECISION"] = "ieee" if dtype == "fp32" else "tf32"
        pointers = dict(rows_ptr="*u8", tiles_ptr="*i64", x_ptr=f"*{dtype}", out_ptr="*fp32")
        scalars = dict(row_stride="i64", codes_at="i64", scales_at="i64", n_tiles="i32")
        signature = {**pointers, **scalars, **dict.fromkeys(consts, "constexpr")}
        try:
            kernel = triton.compile(
                ASTSource(grouped_kernel, signature, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": warps},
            )
        except Exception as exc:  # (a Triton without its CUDA toolchain)
            pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")
        assert kernel.metadata.shared <= 232448, (part, kernel.metadata.shared)


def matvec_cases(device: str) -> float:
    """Worst relative error of the packed MXFP4 matvec against its plain-torch reference over
    small shapes (rows whose byte steps end inside a tile), every option: one x per row (fp32)
    or one for all (bf16, read as it is), sums kept per lane or reduced each step, bias rows,
    outputs rounded and weighted, the fused activation (plain and gpt-oss's clamped SwiGLU, in
    fp32 or rounded to fp16; the interpreter truncates bf16 casts where CUDA rounds them, so a
    bf16 activation is left to the GPU test). Run under Triton's interpreter by the test
    below."""
    from agentrt.models.moe import PLAIN, SwiGLU
    from agentrt.offload.mxfp4_rows import RowLayout, matvec, matvec_reference, pack_row

    g = torch.Generator().manual_seed(0)
    layout = RowLayout(hidden=320, inter=192)
    weights = [
        (torch.randn(384, 320, generator=g), torch.randn(320, 192, generator=g)) for _ in "abc"
    ]
    rows = torch.stack([pack_row(layout, *pair) for pair in weights]).to(device)
    slots = torch.tensor([2, 0, 2, 1], device=device)
    ids = torch.tensor([4, 0, 3, 1], device=device)
    worst = 0.0

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal worst
        worst = max(worst, ((got - want).norm() / want.norm()).item())

    for part in (layout.gate_up, layout.down):
        for shape, dtype in (((4, part.cols), torch.float32), ((part.cols,), torch.bfloat16)):
            x = torch.randn(*shape, generator=g).to(device, dtype)
            bias = (torch.randn(5, part.rows, generator=g).to(device, torch.bfloat16), ids)
            for tile in ((16, 128, 4), (8, 64, 2), (32, 16, 4), (8, 64, 2, 1), (4, 128, 4, 1)):
                check(
                    matvec(rows, slots, part, x, tile=tile), matvec_reference(rows, slots, part, x)
                )
                got = matvec(rows, slots, part, x, bias, tile=tile)
                check(got, matvec_reference(rows, slots, part, x, bias))
    for act in (PLAIN, SwiGLU(7.0, 1.702)):
        h = (torch.randn(4, 2 * layout.down.cols, generator=g) * 3).to(device)
        for dtype in (torch.float32, torch.float16):
            got = matvec(rows, slots, layout.down, h, None, (act, dtype))
            fused = act(h.to(dtype).float()).to(dtype)  # (the kernel's rounding)
            check(got, matvec_reference(rows, slots, layout.down, fused))
            # outputs rounded to dtype and weighted in the kernel (a weight 0 over an inf row)
            scale = (torch.tensor([0.5, 0.0, 1.5, -0.25], device=device), dtype)
            bias = (torch.randn(5, layout.down.rows, generator=g).to(device), ids)
            bias[0][0, 0] = float("inf")  # (ids[1]'s row: under weight 0)
            got = matvec(rows, slots, layout.down, h, bias, (act, dtype), scale=scale)
            want = matvec_reference(rows, slots, layout.down, fused, bias, scale=scale)
            assert not got[1].any() and torch.isfinite(got).all()
            check(got, want)
    return worst


def test_the_mxfp4_matvec_matches_its_reference_under_the_triton_interpreter():
    check_under_triton_interpreter("test_gpt_oss", "matvec_cases", 1e-5)


@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_rotate_turns_q_and_k_in_one_pass_as_rotate_half_does(partial):
    """`Rotary.rotate` (sin's negation folded into its table, q's and k's heads in one apply,
    read in place where k follows q in a fused projection) equals plain rotate-half applied to q
    and k one by one, bit for bit, with YaRN scaling and a partial rotary dimension."""
    from agentrt.models.rotary import Rotary, _heads_of_both

    scaling = (("factor", 32.0), ("beta_fast", 32.0), ("beta_slow", 1.0))
    scaling += (("original_max_position_embeddings", 4096), ("truncate", False))
    rotary = Rotary(64, partial, 150000.0, scaling)
    rd, half = rotary.rotary_dim, rotary.rotary_dim // 2
    heads, kv_heads = 8, 2
    g = torch.Generator().manual_seed(0)
    for t, dtype in ((5, torch.float32), (5, torch.bfloat16), (1, torch.bfloat16)):
        freqs = torch.arange(7, 7 + t).float()[:, None] * rotary.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * rotary.attention_factor).to(dtype)[:, None, :]
        sin = (emb.sin() * rotary.attention_factor).to(dtype)[:, None, :]

        def rotate_half(x: torch.Tensor, cos=cos, sin=sin) -> torch.Tensor:
            rot, rest = x[..., :rd], x[..., rd:]
            turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
            return torch.cat([rot * cos + turned * sin, rest], dim=-1)

        fused = torch.randn(t, (heads + 2 * kv_heads) * 64, generator=g).to(dtype)
        q, k, _ = fused.split([heads * 64, kv_heads * 64, kv_heads * 64], dim=-1)
        q, k = q.reshape(t, heads, 64), k.reshape(t, kv_heads, 64)
        assert _heads_of_both(q, k).data_ptr() == fused.data_ptr()  # (read in place)
        apart = q.clone(), k.clone()
        assert _heads_of_both(*apart).data_ptr() != apart[0].data_ptr()  # (joined)
        for pair in ((q, k), apart):
            got_q, got_k = rotary.rotate(*pair, 7)
            assert torch.equal(got_q, rotate_half(q)) and torch.equal(got_k, rotate_half(k))


def test_exported_mxfp4_pairs_load_into_the_rows_the_packed_store_draws():
    """The GGUF exporter's `_blocks` / `_scales` (gate and up rows interleaved, as published
    checkpoints hold them), put through the loader's layout into a packed store, are the rows
    `fill_synthetic` draws for the in-memory model: llama.cpp is given agentrt's weights."""
    from util import load_benchmark

    from agentrt.models import gpt_oss
    from agentrt.models.synthetic import INIT_STD, model_config
    from agentrt.offload.packed_load import PackedSink
    from agentrt.offload.store import ExpertStore

    cfg = model_config("tiny-gpt-oss")
    pairs = load_benchmark("llamacpp/export_gguf.py")._PackedPairs(cfg, 3, "cpu")
    loaded, drawn = (ExpertStore.for_config(cfg, torch.float32, False, True) for _ in "ab")
    PackedSink(drawn).fill_synthetic(3, INIT_STD, "cpu")
    sink = PackedSink(loaded)
    for layer in loaded.layers:
        for kind in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{kind}"
            pair = []
            for suffix in ("_blocks", "_scales"):
                shape, draw = pairs.tensor(name, suffix)
                pair.append(draw())
                assert tuple(pair[-1].shape) == shape
            sink.put_mxfp4(layer, kind, *(gpt_oss.expert_layout(kind, t, True) for t in pair))
        assert torch.equal(loaded.flat[layer], drawn.flat[layer])
    gate_up = pairs.tensor("model.layers.0.mlp.experts.gate_up_proj", "_blocks")[1]()
    assert not torch.equal(gate_up, gpt_oss.expert_layout("gate_up_proj", gate_up, True))
