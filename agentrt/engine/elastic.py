"""Elastic VRAM under a budget (docs/architecture.md §5): KV that outgrows the budget's KV
reservation takes its room from the expert cache, gives it back when a shorter session comes,
and can grow ahead of need between requests. Functions of the offloaded experts (`OffloadedExperts`,
or None: no offload, nothing to do) and a `SequenceState`."""

from __future__ import annotations

from collections.abc import Sequence

from agentrt.engine.reuse import common_prefix
from agentrt.engine.state import SequenceState
from agentrt.errors import InvalidArgumentError, PromptTooLongError


def _budgeted(experts) -> bool:
    return experts is not None and experts.slots_for_kv is not None


def _slots_left(experts, caches, fallback: int) -> int:
    """The slots the budget leaves beside the KV `caches` hold now (after a growth or a shrink
    that failed part-way); `fallback` where even that does not fit."""
    try:
        return experts.slots_for_kv(sum(cache.bytes_at(cache.capacity) for cache in caches))
    except InvalidArgumentError:
        return fallback


def make_kv_room(experts, state: SequenceState, num_tokens: int) -> None:
    """KV about to outgrow the budget's KV reservation takes its room from the expert cache.
    The pool is freed, the KV grown, then a smaller pool made, between steps; the most valuable
    cached experts that fit the smaller pool are copied back at the next decode step (after the
    request's first token), the others come back as misses. The KV grows to the first size
    the budget allows of: double (fewer regrowths), `num_tokens` in whole growth steps,
    `num_tokens`; none is `PromptTooLongError`, before anything changes."""
    if not _budgeted(experts):
        return
    caches = state.kv_caches()
    if all(cache.capacity >= num_tokens for cache in caches):
        return
    capacity, slots = _fitting_size(experts, caches, num_tokens)

    def grow() -> None:
        for cache in caches:
            cache.reserve(num_tokens, state.num_tokens, capacity)

    if slots >= experts.cache.num_slots:
        grow()  # within the reservation (at the size chosen: a later doubling might not be)
        return

    # (its experts come back at the next decode step; a growth that fails, out of memory say,
    # leaves the pool what the KV it left allows)
    experts.cache.rebuild(slots, grow, lambda: _slots_left(experts, caches, slots))


def _fitting_size(experts, caches, num_tokens: int) -> tuple[int, int]:
    """(KV capacity, expert slots the budget leaves beside it) for `make_kv_room`."""
    step = max(caches[0].grow_tokens, 1)
    sizes = (caches[0].grown_capacity(num_tokens), -(-num_tokens // step) * step, num_tokens)
    for capacity in dict.fromkeys(sizes):
        try:
            return capacity, experts.slots_for_kv(sum(c.bytes_at(capacity) for c in caches))
        except InvalidArgumentError as exc:
            short = exc
    raise PromptTooLongError(f"{num_tokens} tokens do not fit the VRAM budget: {short}") from None


def give_back_kv_room(
    experts, state: SequenceState, num_tokens: int, prompt_ids: Sequence[int] = ()
) -> None:
    """KV that grew past its reservation goes back to the expert cache when a request of
    `num_tokens` tokens (prompt and generation) is shorter than the live sequence and needs
    less than half of the KV, unless its prompt `prompt_ids` shares more than half of itself
    with the live sequence (a continuing session cut back, its earlier reasoning dropped, say:
    its KV is reused, not given back; a new, shorter session gives it). The KV shrinks to
    the request's size in whole growth steps, never below the reservation (which costs the
    cache nothing: smaller buffers would gain no slot and only be grown again), the live
    sequence is emptied if it was longer, the pool is rebuilt larger, and its experts are
    copied back at the next decode step."""
    caches = state.kv_caches()
    if not _budgeted(experts) or not caches:
        return
    if num_tokens > caches[0].capacity // 2 or num_tokens >= state.num_tokens:
        return  # (a session that grows on keeps its KV, and what was grown ahead for it)
    if 2 * common_prefix(state.token_ids, prompt_ids) > len(prompt_ids) > 0:
        return  # (the same session, cut back)
    step = max(caches[0].grow_tokens, 1)
    target = max(-(-num_tokens // step) * step, step, experts.kv_reserved)
    if target >= caches[0].capacity:
        return
    slots = experts.slots_for_kv(sum(cache.bytes_at(target) for cache in caches))
    if slots <= experts.cache.num_slots:
        return
    if state.num_tokens > target:
        state.reset()  # (its KV past `target` goes; a restore or a prefill refills it)

    def shrink() -> None:
        for cache in caches:
            cache.shrink(target, state.num_tokens)

    before = experts.cache.num_slots
    experts.cache.rebuild(slots, shrink, lambda: _slots_left(experts, caches, before))


def grow_ahead(experts, state: SequenceState, num_tokens: int) -> bool:
    """Between requests: KV buffers that cannot hold `num_tokens` positions grow now (under a
    budget taking their room from the expert cache, whose experts the caller refills), so the
    next request that stays within them needs no new buffers (and no new decode graph for
    them). False when they hold it already, or when the budget cannot (that request will say
    so itself)."""
    caches = state.kv_caches()
    if not caches or all(cache.capacity >= num_tokens for cache in caches):
        return False
    try:
        make_kv_room(experts, state, num_tokens)
    except PromptTooLongError:
        return False
    for cache in caches:  # (within the reservation, or without a budget: the buffers alone)
        cache.reserve(num_tokens, state.num_tokens)
    return True  # (the caller brings the pool's experts back)
