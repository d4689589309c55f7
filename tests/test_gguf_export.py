"""GGUF export of synthetic models (`benchmarks/llamacpp/export_gguf.py`) against llama.cpp itself:
the file reads back with llama.cpp's `gguf` reader as its architecture, and llama.cpp's greedy
continuation of a prompt equals agentrt's on the same weights (fp32, CPU).

Opt-in: `AGENTRT_LLAMA_CPP` names a llama.cpp source tree (its `conversion/` and `gguf-py/`), and
`AGENTRT_LLAMA_SIMPLE` its built `llama-simple` for the greedy comparison; both need the real
tokenizers of `../shared/data`. Not run in CI (no llama.cpp there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED
from util import load_benchmark

LLAMA_CPP = os.environ.get("AGENTRT_LLAMA_CPP")
LLAMA_SIMPLE = os.environ.get("AGENTRT_LLAMA_SIMPLE")
pytestmark = pytest.mark.skipif(
    not LLAMA_CPP or not (SHARED / "tokenizers").is_dir(),
    reason="needs AGENTRT_LLAMA_CPP (a llama.cpp source tree) and ../shared/data",
)
PROMPT = "The quick brown fox jumps over the lazy dog."
CASES = {  # size -> (tokenizer, vocabulary size, llama.cpp architecture)
    "tiny": ("qwen3", 151936, "qwen35moe"),
    "tiny@skew=1": ("qwen3", 151936, "qwen35moe"),  # skewed routers (the decode comparison's)
    "tiny-gpt-oss": ("gpt-oss", 201088, "gpt-oss"),
}


def _exporter():
    return load_benchmark("llamacpp/export_gguf.py")


def _greedy_text(rt) -> str:
    """PROMPT and agentrt's greedy continuation of it (24 tokens)."""
    ids = rt.tokenizer.encode(PROMPT, add_special_tokens=False)
    return (PROMPT + rt.tokenizer.decode(rt.generate(ids, max_tokens=24, temperature=0.0))).strip()


def _llama_simple(gguf: Path | str) -> str:
    """PROMPT and llama.cpp's greedy continuation of it (`llama-simple`, 24 tokens)."""
    run = subprocess.run(
        [LLAMA_SIMPLE, "-m", str(gguf), "-n", "24", PROMPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return run.stdout.strip()


@pytest.mark.parametrize("size", sorted(CASES))
def test_an_exported_model_is_the_same_model_in_llama_cpp(size, tmp_path):
    from agentrt import Runtime
    from agentrt.models.synthetic import write_checkpoint

    tokenizer, vocab, arch = CASES[size]
    tok_dir = SHARED / "tokenizers" / tokenizer
    out = tmp_path / f"{size}.gguf"
    report = _exporter().export(
        Path(LLAMA_CPP), size, tok_dir, out, "f32", 0, {"vocab_size": vocab}
    )
    assert out.stat().st_size == report["bytes"] > 0
    sys.path.insert(0, str(Path(LLAMA_CPP) / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == arch
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.0.ffn_gate_inp.weight"} <= names
    if not LLAMA_SIMPLE:
        return
    path = write_checkpoint(size, tmp_path / "hf", seed=0, config_overrides={"vocab_size": vocab})
    rt = Runtime.open(model=str(path), device="cpu", tokenizer=str(tok_dir), cache="off")
    assert _llama_simple(out) == _greedy_text(rt)


def test_a_split_export_is_the_same_model_from_its_first_shard(tmp_path):
    """`split_max_size`: shards that together hold every tensor once, and llama.cpp loaded
    from the first shard continues a prompt as from the single file."""
    tok_dir = SHARED / "tokenizers" / "qwen3"
    exporter, overrides = _exporter(), {"vocab_size": CASES["tiny"][1]}
    whole = exporter.export(
        Path(LLAMA_CPP), "tiny", tok_dir, tmp_path / "one.gguf", "f32", 0, overrides
    )
    split = exporter.export(
        Path(LLAMA_CPP),
        "tiny",
        tok_dir,
        tmp_path / "sharded.gguf",
        "f32",
        0,
        overrides,
        split_max_size=whole["bytes"] // 3,
    )
    assert len(split["files"]) >= 3 and split["gguf"].endswith(
        f"-00001-of-{len(split['files']):05d}.gguf"
    )
    sys.path.insert(0, str(Path(LLAMA_CPP) / "gguf-py"))
    import gguf

    names = [t.name for f in split["files"] for t in gguf.GGUFReader(f).tensors]
    assert sorted(names) == sorted(t.name for t in gguf.GGUFReader(whole["gguf"]).tensors)
    if not LLAMA_SIMPLE:
        return
    outputs = [_llama_simple(path) for path in (whole["gguf"], split["gguf"])]
    assert outputs[0] == outputs[1] != ""


def test_packed_mxfp4_experts_are_llama_cpp_mxfp4_tensors_of_the_same_model(tmp_path, monkeypatch):
    """gpt-oss's routed experts exported in MXFP4, drawn as agentrt's packed expert store draws
    them (`synthetic_rows`): llama.cpp reads MXFP4 expert tensors, and its greedy continuation
    equals agentrt's on the in-memory `synthetic:` model with packed, offloaded experts."""
    from agentrt import Runtime
    from agentrt.models import synthetic

    tokenizer, vocab, arch = CASES["tiny-gpt-oss"]
    tok_dir = SHARED / "tokenizers" / tokenizer
    monkeypatch.setitem(synthetic.SIZES["tiny-gpt-oss"], "vocab_size", vocab)
    out = tmp_path / "packed.gguf"
    report = _exporter().export(
        Path(LLAMA_CPP),
        "tiny-gpt-oss",
        tok_dir,
        out,
        "f32",
        0,
        {"vocab_size": vocab},
        packed=True,
    )
    assert report["experts"] == "mxfp4"
    sys.path.insert(0, str(Path(LLAMA_CPP) / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == arch
    types = {t.name: t.tensor_type for t in reader.tensors}
    for kind in ("gate", "up", "down"):
        assert types[f"blk.0.ffn_{kind}_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F32
    if not LLAMA_SIMPLE:
        return
    rt = Runtime.open(
        model="synthetic:tiny-gpt-oss",
        device="cpu",
        tokenizer=str(tok_dir),
        cache="off",
        offload="auto",
        expert_cache_slots=8,
        expert_format="mxfp4",
    )
    assert _llama_simple(out) == _greedy_text(rt)
