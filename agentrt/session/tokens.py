"""Generated turns keep their exact token ids (docs/architecture.md §7).

A model may emit a tokenization of its text that re-tokenizing the same text would not produce.
When a later request's history contains a message this runtime generated, re-tokenizing it would
break the exact-prefix match with the live state and the checkpoints taken while generating.
`GeneratedIds` remembers recent generations (decoded text -> ids) and, when encoding a prompt,
replaces every occurrence of such text that sits on token boundaries by the original ids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


class GeneratedIds:
    def __init__(self, tokenizer, capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.items: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.spliced = 0  # how many spans were replaced (for tests and stats)
        self.lock = threading.Lock()  # requests are prepared while the worker remembers
        self.prefix = PrefixEncoder(tokenizer)
        # remembered texts that contain a split token's text (see `encode`)
        self.crossing: set[str] = set()

    def remember(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        text = self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if not text or "\ufffd" in text:
            return
        crossing = any(split in text for split in self.prefix.splits)
        with self.lock:
            self.items[text] = tuple(ids)
            self.items.move_to_end(text)
            if crossing:
                self.crossing.add(text)
            while len(self.items) > self.capacity:
                self.crossing.discard(self.items.popitem(last=False)[0])

    def encode(self, prompt: str) -> list[int]:
        """Token ids of `prompt`, with remembered generations spliced in where they appear. The
        part shared with the previous prompt (up to a special token) keeps the previous ids,
        splices included; only the rest is tokenized and searched. A transcript that carries
        this runtime's replies used to be re-tokenized in full, with offsets, every turn.

        Not when the prompt holds a generation that spells a split token's text (say, the model
        wrote `<|im_start|>` while editing a chat template): its ids do not contain that token,
        so counting the token's text would no longer find its ids (the reuse relies on that),
        and a cut could fall inside it. Such prompts are encoded whole and leave nothing to
        reuse."""
        with self.lock:
            crossing = any(text in prompt for text in self.crossing)
        cut, head = (0, []) if crossing else self.prefix.reusable(prompt)
        tail = prompt[cut:]
        with self.lock:
            found = [(text, ids) for text, ids in self.items.items() if text in tail]
        ids = head + (self._spliced(tail, found) if found else self.prefix.tokenize(tail))
        self.prefix.last = None if crossing else (prompt, ids)
        return ids

    def _spliced(self, text: str, found: list[tuple[str, tuple[int, ...]]]) -> list[int]:
        """`text` tokenized, with each remembered generation in `found` that sits on token
        boundaries replaced by its own ids."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        starts = {o[0]: i for i, o in reversed(list(enumerate(offsets)))}
        ends = {o[1]: i + 1 for i, o in enumerate(offsets)}
        spans = []
        for generated, gen in found:
            at = text.find(generated)
            while at >= 0:
                a, b = starts.get(at), ends.get(at + len(generated))
                if a is not None and b is not None and a < b:
                    spans.append((a, b, gen))
                at = text.find(generated, at + 1)
        for a, b, gen in sorted(_disjoint(spans), reverse=True):
            if tuple(ids[a:b]) != gen:
                ids[a:b] = gen
                self.spliced += 1
        return ids


def _disjoint(
    spans: list[tuple[int, int, tuple[int, ...]]],
) -> list[tuple[int, int, tuple[int, ...]]]:
    """Longest spans first, dropping any that overlap one already kept."""
    kept: list[tuple[int, int, tuple[int, ...]]] = []
    for span in sorted(spans, key=lambda s: s[0] - s[1]):
        if all(span[1] <= k[0] or span[0] >= k[1] for k in kept):
            kept.append(span)
    return kept


class PrefixEncoder:
    """Encodes prompts that mostly extend the previous one without re-tokenizing the shared part.

    Tokenizers split their input at added special tokens first and tokenize the pieces apart, so
    the ids of the text before a special token (one that strips no neighbouring whitespace) do
    not depend on what follows it. The longest common prefix with the previous prompt is cut back
    to the start of the last such token inside it; the previous ids up to that token are reused
    and only the rest is encoded. Agent turns resend the whole transcript: on a 17K-token prompt
    this was 19 of 35 ms of request preparation on a 2-core CPU."""

    MIN_REUSE = 2048  # characters: below this, encoding it all is as cheap

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.splits = _split_tokens(tokenizer)  # text -> id
        self.last: tuple[str, list[int]] | None = None
        self.reused = 0  # characters not re-encoded (tests, stats)

    def encode(self, prompt: str) -> list[int]:
        cut, head = self.reusable(prompt)
        ids = head + self.tokenize(prompt[cut:])
        self.last = (prompt, ids)
        return ids

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def reusable(self, prompt: str) -> tuple[int, list[int]]:
        """(cut, ids): the previous prompt's ids of `prompt[:cut]`, which the ids of the rest,
        encoded alone, extend; (0, []) when nothing worth reusing is shared."""
        if self.last is None or not self.splits:
            return 0, []
        prev, prev_ids = self.last
        common = _common_prefix(prev, prompt)
        if common < self.MIN_REUSE:
            return 0, []
        cut, token = max((prompt.rfind(text, 0, common), text) for text in self.splits)
        if cut < self.MIN_REUSE:
            return 0, []
        index = _nth(prev_ids, self.splits[token], prev.count(token, 0, cut))
        if index is None:  # the token's text did not encode to the token: no reuse
            return 0, []
        self.reused += cut
        return cut, prev_ids[:index]


def _split_tokens(tokenizer) -> dict[str, int]:
    """Added special tokens whose text always becomes that token, whatever surrounds it: no
    stripping of neighbouring text, no whole-word or normalized matching, not part of another
    added token's text (there, the text before the token would not be tokenized on its own)."""
    if getattr(tokenizer, "split_special_tokens", False):
        return {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = [tok.content for tok in decoder.values() if tok.content]
    return {
        tok.content: int(i)
        for i, tok in decoder.items()
        if tok.content
        and getattr(tok, "special", False)
        and not any(getattr(tok, flag, True) for flag in ("lstrip", "rstrip", "single_word"))
        and not getattr(tok, "normalized", True)
        and sum(tok.content in other for other in texts) == 1
    }


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (slice comparisons: C speed on long strings)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _nth(ids: list[int], token: int, n: int) -> int | None:
    """Index of the n-th (from 0) occurrence of `token` in ids, or None."""
    at = -1
    for _ in range(n + 1):
        try:
            at = ids.index(token, at + 1)
        except ValueError:
            return None
    return at
