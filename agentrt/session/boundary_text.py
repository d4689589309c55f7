"""Boundary defaults per chat-template family, resolved to token ids with the tokenizer.

Families: the project's own `tiny` template (`</tool_output>`), ChatML/Qwen (`</tool_response>`),
harmony (gpt-oss: every message ends with `<|end|>`, tool outputs included; a tool call with
`<|call|>`).
Each kind maps to one or more strings; `--boundary KIND=TEXT` / `boundaries={...}` override a
kind. Strings that do not tokenize on their own the way they do in context simply match less.
"""

from __future__ import annotations

from collections.abc import Mapping

from agentrt.errors import InvalidArgumentError
from agentrt.statecache import BOUNDARY_KINDS, Boundaries

_COMMON = {
    "think_end": ["</think>"],
    "tool_call_end": ["</tool_call>"],
    "message_end": ["<|im_end|>"],
    "turn_start": ["<|im_start|>assistant\n"],
}
FAMILIES: dict[str, dict[str, list[str]]] = {
    "agentrt-tiny": {**_COMMON, "tool_output_end": ["</tool_output>"]},
    "chatml": {**_COMMON, "tool_output_end": ["</tool_response>"]},
    "harmony": {
        "message_end": ["<|end|>"],
        "tool_call_end": ["<|call|>"],
        "turn_start": ["<|start|>assistant"],
    },
    "none": {},
}


def detect_family(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    if "<tool_output>" in vocab:
        return "agentrt-tiny"
    if "<|im_start|>" in vocab:
        return "chatml"
    if "<|channel|>" in vocab and "<|end|>" in vocab:
        return "harmony"
    return "none"


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, list[str]]:
    """`KIND=TEXT` items (TEXT may use \\n escapes) -> {kind: [texts]}."""
    out: dict[str, list[str]] = {}
    for item in items:
        kind, sep, text = item.partition("=")
        if not sep or kind not in BOUNDARY_KINDS or not text:
            raise InvalidArgumentError(
                f"boundary must be KIND=TEXT with KIND in {', '.join(BOUNDARY_KINDS)}"
            )
        out.setdefault(kind, []).append(text.encode().decode("unicode_escape"))
    return out


def boundary_texts(
    tokenizer, overrides: Mapping[str, str | list[str]] | None = None
) -> dict[str, list[str]]:
    """kind -> strings for `tokenizer`: its family's defaults, `overrides` replacing kinds."""
    if tokenizer is None:
        return {}
    texts = dict(FAMILIES[detect_family(tokenizer)])
    for kind, value in (overrides or {}).items():
        if kind not in BOUNDARY_KINDS:
            known = ", ".join(BOUNDARY_KINDS)
            raise InvalidArgumentError(f"unknown boundary kind {kind!r}; known: {known}")
        texts[kind] = [value] if isinstance(value, str) else list(value)
    return texts


def resolve(tokenizer, overrides: Mapping[str, str | list[str]] | None = None) -> Boundaries:
    """Boundaries (token ids) for `tokenizer`: see `boundary_texts`."""
    seqs = {}
    for kind, strings in boundary_texts(tokenizer, overrides).items():
        ids = [tuple(tokenizer.encode(s, add_special_tokens=False)) for s in strings]
        seqs[kind] = tuple(i for i in ids if i)
    return Boundaries(seqs)
