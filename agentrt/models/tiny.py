"""The embedded default model `tiny`: a small random-weight hybrid `qwen3_5_moe` with a tokenizer
and chat template of the project's own, built on first use into the user cache directory
(owner-only: 0700 directories, 0600 files).

The tokenizer is a byte-level BPE trained with the `tokenizers` library on a corpus generated here
from fixed word lists by a counter-based PRNG (splitmix64), so the corpus, the tokenizer and the
weights are identical bytes on every machine and Python version. Special tokens: `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_output>`,
`</tool_output>`. The chat template (ChatML-style, `tiny_template.jinja`) renders tools, reasoning
and tool outputs. Bump `TINY_VERSION` whenever anything here changes the built bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from agentrt.env import home_dir
from agentrt.host.private import private_dir, write_private

TINY_VERSION = 1
VOCAB_SIZE = 2048
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_output>",
    "</tool_output>",
)
TEMPLATE_FILE = Path(__file__).with_name("tiny_template.jinja")

_WORDS = """the a an of to in and is it that for on with as this be are was by at from or not have
but you they we can will file files code test tests run read write list find search open close line
lines error errors value values function class module package import return true false none null
should would could need needs make makes change changes fix fixed bug issue issues check checks
data string number result results output input call calls tool tools agent model user system
assistant task step steps first next then last now here there what which when where why how all
some each more most other new old same different because if else while loop path directory
repository project build install command commands shell python json text message messages name
names argument arguments type types field fields schema config settings option options default
look looks looking see seen show shows found missing add added remove removed update updated
use used using works working failed failing pass passes passed expected actual line
number""".split()
_CODE = """def class return import from self None True False if elif else for while in not and or
try except finally raise with as lambda yield async await print len range dict list set tuple str
int float bool open os sys json re path main init __init__ args kwargs assert pytest test_ np
torch self. () [] {} == != <= >= += -> : ; , . = + - * / % # " ' \\n \\t src/ tests/ README.md
setup.py pyproject.toml utils.py main.py app.py config.py models.py views.py schema.py fields.py
git diff grep ls cat sed echo pip install python3 -m cd mkdir rm cp mv""".split()
_TOOLS = ["read_file", "list_dir", "grep", "run_command", "write_file", "search", "get_weather"]
_KEYS = ["path", "pattern", "command", "timeout", "query", "content", "limit", "cwd"]


def _splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return state, z ^ (z >> 31)


class _Rng:
    """Tiny deterministic PRNG (integer arithmetic only: same on every platform)."""

    def __init__(self, seed: int) -> None:
        self.state = seed

    def below(self, n: int) -> int:
        self.state, value = _splitmix64(self.state)
        return value % n

    def pick(self, seq):
        return seq[self.below(len(seq))]


def _sentence(rng: _Rng) -> str:
    words = [rng.pick(_WORDS) for _ in range(4 + rng.below(12))]
    return " ".join(words).capitalize() + rng.pick([".", ".", "?", ":", "!"])


def _code_line(rng: _Rng) -> str:
    indent = "    " * rng.below(3)
    return indent + " ".join(rng.pick(_CODE) for _ in range(2 + rng.below(8)))


def _tool_call(rng: _Rng) -> str:
    args = {rng.pick(_KEYS): rng.pick(_WORDS + _CODE) for _ in range(1 + rng.below(2))}
    body = json.dumps({"name": rng.pick(_TOOLS), "arguments": args})
    return f"<tool_call>{body}</tool_call>"


def corpus(num_lines: int = 6000, seed: int = 20261130) -> Iterator[str]:
    """The deterministic training corpus: prose, code lines, tool calls and numbers."""
    rng = _Rng(seed)
    makers = (_sentence, _sentence, _code_line, _tool_call)
    for _ in range(num_lines):
        line = rng.pick(makers)(rng)
        if rng.below(5) == 0:
            line += f" {rng.below(10000)}"
        yield line


def train_tokenizer():
    """Train the byte-level BPE tokenizer (a `tokenizers.Tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATE_FILE.read_text(),
    }


def write_tokenizer(out: Path) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; return the special token ids."""
    tok = train_tokenizer()
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError("tiny tokenizer outgrew the model vocabulary")
    write_private(out / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    write_private(out / "tokenizer_config.json", json.dumps(tokenizer_config(), indent=2) + "\n")
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def build_tiny(
    out: Path, size: str = "tiny", mxfp4: bool = False, seed: int = 0, dtype: str | None = None
) -> Path:
    """Build the tiny model (weights + tokenizer + template) into `out` (`mxfp4`: gpt-oss
    experts as MXFP4 pairs; `seed` and `dtype` as `write_checkpoint` takes them)."""
    from agentrt.models.synthetic import write_checkpoint

    private_dir(out)
    ids = write_tokenizer(out)
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    overrides = {"eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"]}
    write_checkpoint(size, out, seed, dtype, config_overrides=overrides, mxfp4=mxfp4)
    return out


def tiny_dir() -> Path:
    return home_dir() / "models" / f"tiny-v{TINY_VERSION}"


def ensure_tiny(quiet: bool = False) -> Path:
    """Path of the built tiny model, building it atomically on first use."""
    final = tiny_dir()
    if (final / "config.json").is_file():
        return final
    private_dir(final.parent)
    if not quiet:
        print(
            f"agentrt: building the embedded 'tiny' model in {final} (first use) ...",
            file=sys.stderr,
        )
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=final.parent))
    try:
        build_tiny(tmp)
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():  # lost a race only if someone else finished
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
