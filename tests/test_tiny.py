"""The embedded `tiny` model: deterministic build, tokenizer, chat template, and the CLI on it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from util import run_cli

from agentrt.models.tiny import SPECIAL_TOKENS, build_tiny, ensure_tiny
from agentrt.session.tokenizer import load_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "list the files"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Use list_dir.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "list_dir", "arguments": '{"path": "."}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "description": "List a directory",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def _hashes(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def test_tiny_builds_byte_identically(tmp_path):
    first, second = build_tiny(tmp_path / "a"), build_tiny(tmp_path / "b")
    hashes = _hashes(first)
    assert set(hashes) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert hashes == _hashes(second)


def test_tiny_tokenizer_has_single_token_specials():
    tok = load_tokenizer(ensure_tiny())
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    text = "def main():\n    return read_file('a.py')  # ünïcode ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tiny_template_renders_tools_reasoning_and_outputs():
    tok = load_tokenizer(ensure_tiny())
    text = tok.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools")
    assert '"name": "list_dir"' in text
    assert (
        "<think>\nUse list_dir.\n</think>\n" in text
    )  # reasoning after the last user turn is kept
    assert (
        '<tool_call>{"name": "list_dir", "arguments": {"path": "."}}</tool_call><|im_end|>' in text
    )
    assert "<|im_start|>tool\n<tool_output>a.py\nb.py</tool_output><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    later = MESSAGES + [
        {"role": "assistant", "content": "Two files."},
        {"role": "user", "content": "ok"},
    ]
    text2 = tok.apply_chat_template(later, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<think>" not in text2  # earlier reasoning is dropped once a new user turn arrives


@pytest.mark.slow
def test_cli_chat_on_fresh_home(tmp_path):
    env = dict(os.environ, AGENTRT_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    proc = run_cli(
        "chat",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--max-tokens",
        "8",
        "hi",
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "building the embedded 'tiny' model" in proc.stderr
    assert "8 generated" in proc.stderr
    assert (tmp_path / "home" / "models" / "tiny-v1" / "model.safetensors").is_file()


def test_runtime_config_and_keywords_open_the_same_runtime():
    """`Runtime.open(model, config=RuntimeConfig(...))` and the keyword form are one option set:
    keywords override the config's fields, an unknown keyword is a TypeError, and both forms
    generate the same tokens."""
    from agentrt import Runtime, RuntimeConfig

    config = RuntimeConfig(cache="off", prefill_chunk=32, seed=5)
    by_config = Runtime.open("tiny", config=config)
    by_keywords = Runtime.open("tiny", "cpu", cache="off", prefill_chunk=32, seed=5)
    mixed = Runtime.open("tiny", config=config, prefill_chunk=16)
    assert by_config.engine.config == by_keywords.engine.config and by_config.seed == 5
    assert mixed.engine.config.prefill_chunk == 16 and mixed.seed == 5
    ids = list(range(10, 90))
    assert by_config.generate(ids, max_tokens=6) == by_keywords.generate(ids, max_tokens=6)
    with pytest.raises(TypeError, match="prefil_chunk"):
        Runtime.open("tiny", prefil_chunk=32)
    phases = by_config.startup  # seconds per start-up phase, and their sum
    assert set(phases) == {"total_s", "weights_s", "engine_s", "prefill_graphs_s", "warm_up_s"}
    assert all(v >= 0 for v in phases.values()) and phases["total_s"] > 0
    parts = sum(v for k, v in phases.items() if k != "total_s")
    assert abs(phases["total_s"] - parts) < 1e-3


def test_cpu_start_loads_no_compiler_machinery():
    """Opening a model and generating on the CPU never loads torch's compiler stack (its
    import is 2-3 s of every start, and of every CLI command, on 2 cores)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from agentrt import Runtime\n"
        "Runtime.open('tiny', 'cpu', cache='off').generate([5, 6, 7], max_tokens=2)\n"
        "print([m for m in ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes')"
        " if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
