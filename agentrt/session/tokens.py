"""Generated turns keep their exact token ids (DESIGN §7).

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

    def remember(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        text = self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if not text or "\ufffd" in text:
            return
        with self.lock:
            self.items[text] = tuple(ids)
            self.items.move_to_end(text)
            while len(self.items) > self.capacity:
                self.items.popitem(last=False)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of `prompt`, with remembered generations spliced in where they appear."""
        with self.lock:
            found = [(text, ids) for text, ids in self.items.items() if text in prompt]
        if not found:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        enc = self.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        starts = {o[0]: i for i, o in reversed(list(enumerate(offsets)))}
        ends = {o[1]: i + 1 for i, o in enumerate(offsets)}
        spans = []
        for text, gen in found:
            at = prompt.find(text)
            while at >= 0:
                a, b = starts.get(at), ends.get(at + len(text))
                if a is not None and b is not None and a < b:
                    spans.append((a, b, gen))
                at = prompt.find(text, at + 1)
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
