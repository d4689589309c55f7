"""Loading tokenizers (with an optional chat-template override) for the session layer.

Tokenizers whose `tokenizer_config.json` names the generic `TokenizersBackend` /
`PreTrainedTokenizerFast` class (the embedded `tiny`) are loaded with that class directly:
`AutoTokenizer` would otherwise pick a model-specific class from `config.json` and replace the
trained pre-tokenizer. Everything else goes through `AutoTokenizer`, offline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from agentrt.env import set_defaults
from agentrt.errors import ChatTemplateError, ModelFormatError

_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _declared_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(path: str | os.PathLike, chat_template: str | os.PathLike | None = None):
    """Load the tokenizer in `path`; `chat_template`: a Jinja file overriding its template."""
    set_defaults({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelFormatError(f"tokenizer directory {path} does not exist")
    known = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((path / name).is_file() for name in known):
        raise ModelFormatError(
            f"{path} has no tokenizer (tokenizer.json or tokenizer.model): give one with "
            "--tokenizer DIR (Runtime.open(tokenizer=DIR))"
        )
    try:
        if _declared_class(path) in _GENERIC:
            from transformers import PreTrainedTokenizerFast as cls
        else:
            from transformers import AutoTokenizer as cls
        tokenizer = cls.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure here is a malformed tokenizer dir
        first = (str(exc).strip().splitlines() or [""])[0]  # (transformers' advice follows)
        raise ModelFormatError(
            f"cannot load tokenizer from {path}: {type(exc).__name__}: {first}"
        ) from None
    if chat_template is not None:
        tokenizer.chat_template = _read_template(Path(chat_template))
    return tokenizer


def _read_template(path: Path) -> str:
    try:
        return path.expanduser().read_text()
    except OSError as exc:
        raise ChatTemplateError(f"cannot read chat template {path}: {exc.strerror}") from None


def stop_token_ids(tokenizer, model_eos: tuple[int, ...]) -> tuple[int, ...]:
    """End-of-turn ids for chat: the model's EOS ids, the tokenizer's EOS, `<|im_end|>`, and
    harmony's `<|return|>` and `<|call|>` (a reply's end, a tool call's end)."""
    ids = set(model_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for token in ("<|im_end|>", "<|endoftext|>", "<|return|>", "<|call|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) and tid >= 0:
            ids.add(tid)
    return tuple(sorted(ids))
