"""Boundaries: named kinds of token-id sequences after which checkpoints are taken.

Kinds: `think_end`, `tool_call_end`, `tool_output_end`, `message_end`, `turn_start`. Each kind has
one or more token-id sequences (resolved from text per tokenizer by the session layer). A
boundary at position p means "the state after the first p tokens", i.e. p is the index just past
the sequence's last token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

BOUNDARY_KINDS = ("think_end", "tool_call_end", "tool_output_end", "message_end", "turn_start")
DECODE_KINDS = ("think_end", "tool_call_end")  # captured when generated tokens complete them


@dataclass(frozen=True)
class Boundaries:
    """kind -> token-id sequences; `find` scans a token list once."""

    sequences: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.sequences) - set(BOUNDARY_KINDS)
        if unknown:
            raise ValueError(f"unknown boundary kinds: {sorted(unknown)}")
        by_last: dict[int, list[tuple[tuple[int, ...], str]]] = {}
        for kind, seqs in self.sequences.items():
            for seq in seqs:
                if seq:
                    by_last.setdefault(seq[-1], []).append((tuple(seq), kind))
        object.__setattr__(self, "_by_last", by_last)

    def find(self, ids: Sequence[int], start: int = 0) -> list[tuple[int, str]]:
        """(position, kind) for every boundary ending at index >= start, ascending."""
        found = []
        by_last = self._by_last  # type: ignore[attr-defined]
        for i in range(start, len(ids)):
            for seq, kind in by_last.get(ids[i], ()):
                n = len(seq)
                if i + 1 >= n and tuple(ids[i + 1 - n : i + 1]) == seq:
                    found.append((i + 1, kind))
                    break
        return found

    def first(self, ids: Sequence[int], kind: str) -> int | None:
        """The position of the first boundary of `kind` in `ids` (None: none): `ids.index`
        (`ids` a list or tuple) finds each occurrence of its sequences' first token in C, so
        only those occurrences are compared in Python."""
        best = None
        for seq in self.sequences.get(kind, ()):
            at = _first_match(ids, seq)
            if at is not None and (best is None or at < best):
                best = at
        return best

    def ends_with(self, ids: Sequence[int], kinds: Iterable[str] = DECODE_KINDS) -> str | None:
        """The kind (among `kinds`) of a sequence that `ids` ends with, if any."""
        if not ids:
            return None
        wanted = set(kinds)
        for seq, kind in self._by_last.get(ids[-1], ()):  # type: ignore[attr-defined]
            if kind in wanted and len(ids) >= len(seq) and tuple(ids[-len(seq) :]) == seq:
                return kind
        return None


def _first_match(ids: Sequence[int], seq: Sequence[int]) -> int | None:
    """The position just past the first occurrence of `seq` in `ids`, or None."""
    if not seq:
        return None
    head, n, at = seq[0], len(seq), 0
    while True:
        try:
            at = ids.index(head, at)
        except ValueError:
            return None
        if tuple(ids[at : at + n]) == tuple(seq):
            return at + n
        at += 1


def choose_captures(
    boundaries: Boundaries,
    ids: Sequence[int],
    start: int,
    min_distance: int,
    stored: Callable[[int], bool] = lambda pos: False,
) -> dict[int, str]:
    """The boundaries of ids[start:] worth a checkpoint in one prefill: the last one always,
    others at least `min_distance` tokens apart (from each other and from `start`), and the
    message ends before the prompt's first assistant turn (its system prompt and tools: what
    new sessions of one agent share) that far apart (from each other and from `start`) however
    near the others; none for which `stored(position)` (a checkpoint there exists)."""
    found = [(pos, kind) for pos, kind in boundaries.find(ids, start) if pos > start]
    chosen: dict[int, str] = {}
    last = None
    for pos, kind in reversed(found):
        if last is not None and (last - pos < min_distance or pos - start < min_distance):
            continue
        if stored(pos):
            continue
        chosen[pos] = kind
        last = pos
    last = start
    for pos in _leading_message_ends(boundaries, ids, found, chosen, stored):
        if pos - last < min_distance:
            continue
        if pos not in chosen and not stored(pos):
            chosen[pos] = "message_end"
        last = pos
    return dict(sorted(chosen.items()))


def _leading_message_ends(boundaries, ids, found, chosen, stored) -> list[int]:
    """The message ends of `found` (boundaries of `ids`) before the prompt's first assistant
    turn (`turn_start`), but the last where that turn is chosen or stored (only the turn's
    header lies between them); none in a prompt without one (no chat template's turns to tell
    them by)."""
    first_turn = boundaries.first(ids, "turn_start")
    if first_turn is None:
        return []
    ends = [pos for pos, kind in found if kind == "message_end" and pos < first_turn]
    if ends and (first_turn in chosen or stored(first_turn)):
        ends.pop()
    return ends
