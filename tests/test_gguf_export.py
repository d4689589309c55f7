"""GGUF export of synthetic models (`benchmarks/llamacpp/export_gguf.py`) against llama.cpp itself:
the file reads back with llama.cpp's `gguf` reader as its architecture, and llama.cpp's greedy
continuation of a prompt equals agentrt's on the same weights (fp32, CPU).

Opt-in: `AGENTRT_LLAMA_CPP` names a llama.cpp source tree (its `conversion/` and `gguf-py/`), and
`AGENTRT_LLAMA_SIMPLE` its built `llama-simple` for the greedy comparison; both need the real
tokenizers of `../shared/data`. Not run in CI (no llama.cpp there)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED

ROOT = Path(__file__).resolve().parents[1]
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
    spec = importlib.util.spec_from_file_location(
        "export_gguf", ROOT / "benchmarks" / "llamacpp" / "export_gguf.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    ids = rt.tokenizer.encode(PROMPT, add_special_tokens=False)
    ours = PROMPT + rt.tokenizer.decode(rt.generate(ids, max_tokens=24, temperature=0.0))
    run = subprocess.run(
        [LLAMA_SIMPLE, "-m", str(out), "-n", "24", PROMPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert run.stdout.strip() == ours.strip()


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
    outputs = [
        subprocess.run(
            [LLAMA_SIMPLE, "-m", path, "-n", "24", PROMPT],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
        for path in (whole["gguf"], split["gguf"])
    ]
    assert outputs[0].strip() == outputs[1].strip() != ""
