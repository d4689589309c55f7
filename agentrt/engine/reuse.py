"""State reuse between requests: the three cache modes of docs/architecture.md §2.

- `off`: every request starts from an empty state.
- `prefix` (baseline, what most runtimes do for hybrid models): keep the single live state of the
  previous request and reuse it when the new prompt extends it exactly; attention-only models may
  also cut it back to the longest common prefix.
- `semantic`: the live state when it applies, else the longest checkpoint in the `StateCache`;
  checkpoints are captured at boundaries during prefill and after generated `</think>` /
  `</tool_call>` tokens.

The engine calls `begin` before prefill, `after_prefill`, `after_token` after each fed token, and
`after_generation` once the last token is out.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence

from agentrt.engine.state import SequenceState
from agentrt.statecache import StateCache
from agentrt.statecache.boundaries import BOUNDARY_KINDS


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, found by comparing blocks (list comparisons run in
    C; a loop over 20K ids cost ~0.6 ms per request on the 2-core machine)."""
    n = min(len(a), len(b))
    a, b = (x if isinstance(x, list) else list(x) for x in (a, b))  # list == list, in C
    lo, step = 0, 1024
    while lo < n:  # whole equal blocks first, then the mismatching block id by id
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo = hi
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo


def end_generation(reuse: NoReuse, state: SequenceState) -> None:
    """`reuse.after_generation`, best effort: the reply is complete by then, so a failure is
    reported, never raised."""
    try:
        reuse.after_generation(state)
    except Exception:  # noqa: BLE001 - a finished reply must not become an error
        traceback.print_exc()


class NoReuse:
    mode = "off"
    # where the last `begin` found its state: "live" (the live sequence extended), "device"
    # (cut back to a boundary captured in the last prefill), "ram" / "lmdb" (+"+live_kv")
    source: str | None = None

    def begin(self, state: SequenceState, prompt: Sequence[int]) -> tuple[int, str | None]:
        """Make `state` hold a prefix of `prompt`; return (its length, checkpoint kind)."""
        state.reset()
        return 0, None

    def capture_positions(self, prompt: Sequence[int], start: int) -> dict[int, str]:
        return {}

    def after_prefill(
        self, state: SequenceState, prompt: Sequence[int], positions: dict[int, str]
    ) -> None:
        pass

    def after_token(self, state: SequenceState) -> None:
        pass

    def after_generation(self, state: SequenceState) -> None:
        """The request's last token was produced (work that must not delay its first)."""

    def close(self) -> None:
        pass


class PrefixReuse(NoReuse):
    mode = "prefix"

    def live_length(
        self, state: SequenceState, prompt: Sequence[int], common: int | None = None
    ) -> int:
        """How much of the live state can serve `prompt` (at least one token is left to prefill);
        `common`: the common prefix of the two, when the caller has it already."""
        if common is None:
            common = common_prefix(state.token_ids, prompt)
        common = min(common, len(prompt) - 1)
        if common == state.num_tokens or (not state.linear_caches() and common >= state.floor):
            return max(common, 0)
        return 0  # hybrid state that is not an exact prefix (or a cut below a restored window)

    def begin(self, state: SequenceState, prompt: Sequence[int]) -> tuple[int, str | None]:
        return self._keep_live(state, self.live_length(state, prompt))

    def _keep_live(self, state: SequenceState, keep: int) -> tuple[int, str | None]:
        """Cut the live state back to `keep` tokens (0: reset it)."""
        if keep == 0:
            state.reset()
        else:
            state.truncate(keep)
        self.source = "live" if keep else None
        return keep, self.source


# longest the end of a request waits, in all, for the writer to take the checkpoints its prefill
# could not queue
DEFERRED_WAIT_S = 2.0


class SemanticReuse(PrefixReuse):
    mode = "semantic"

    def __init__(self, cache: StateCache) -> None:
        self.cache = cache
        # checkpoints of the last prefill the writer had no room for: (prompt, pos, kind)
        self.deferred: list[tuple[Sequence[int], int, str]] = []

    def begin(self, state: SequenceState, prompt: Sequence[int]) -> tuple[int, str | None]:
        self.cache.hold_writes()  # no checkpoint is started beside this request's prefill
        kv_valid = common_prefix(state.token_ids, prompt)  # KV there can be kept (cut back)
        live = self.live_length(state, prompt, kv_valid)
        # device tier: boundaries captured in the live sequence's last prefill are still in
        # device memory; cutting back to one costs a copy of the linear state, nothing more
        on_device = max(
            (p for p in state.captured_positions() if p <= min(kv_valid, len(prompt) - 1)),
            default=0,
        )
        hit = self.cache.restore_into(
            prompt,
            max(live, on_device),
            state.kv_caches(),
            state.linear_caches(),
            kv_valid,
            count_miss=False,
        )
        if hit is None:  # nothing stored beyond live / device: a miss unless those serve
            if self.cache.dirty:  # a corrupt candidate overwrote part of the live state
                state.reset()
                self.cache.stats["misses"] += 1
                return 0, None
            if on_device > live:
                state.truncate(on_device)
                self.source = "device"
                self.cache.stats["hits_device"] += 1
                kind = self.cache.boundaries.ends_with(prompt[:on_device], BOUNDARY_KINDS)
                return on_device, kind or "live"
            start, kind = self._keep_live(state, live)
            self.cache.stats["hits_live" if start else "misses"] += 1
            return start, kind
        state.adopt(prompt[: hit.pos])
        self.source = hit.source
        return hit.pos, hit.kind

    def capture_positions(self, prompt: Sequence[int], start: int) -> dict[int, str]:
        return self.cache.capture_positions(prompt, start)

    def after_prefill(
        self, state: SequenceState, prompt: Sequence[int], positions: dict[int, str]
    ) -> None:
        self._writes_during_decode()
        self.deferred = []
        for pos, kind in positions.items():
            at, conv, rec = state.capture_for(pos)  # the prefill may have taken it earlier
            self.cache.save(prompt, pos, kind, state.kv_caches(), conv, rec, at=at)
            if self.cache.last_full:  # the writer is behind: try again after the response
                self.deferred.append((prompt, pos, kind))

    def _writes_during_decode(self) -> None:
        """The writer works while the host is idle: this prefill's checkpoints wait until the
        response is out (decode steps run faster alone), unless checkpoints queued before this
        request are still pending: they found no idle time between the requests (a replay, an
        agent without tool time), so the writer catches up while this request decodes rather
        than beside the next one's prefill."""
        if self.cache.writes_pending:
            self.cache.resume_writes()
        else:
            self.cache.hold_writes()

    def after_token(self, state: SequenceState) -> None:
        kind = self.cache.boundaries.ends_with(state.token_ids)
        if kind is not None:
            conv, rec = state.linear_at(state.num_tokens)
            self.cache.save(state.token_ids, state.num_tokens, kind, state.kv_caches(), conv, rec)

    def after_generation(self, state: SequenceState) -> None:
        """Queue the checkpoints the prefill could not, waiting up to `DEFERRED_WAIT_S` in all
        for the writer to make room (the prompt's KV and the captured linear states are still
        in `state` until its next prefill): a later turn needs them more than this one's end
        needs those seconds. What still does not fit is dropped, counted."""
        self.cache.resume_writes()
        deadline = time.perf_counter() + DEFERRED_WAIT_S
        deferred, self.deferred = self.deferred, []
        for prompt, pos, kind in deferred:
            at, conv, rec = state.capture_for(pos)
            left = max(0.0, deadline - time.perf_counter())
            saved = self.cache.save(prompt, pos, kind, state.kv_caches(), conv, rec, at, left)
            self.cache.stats["deferred_saved" if saved else "deferred_dropped"] += 1

    def close(self) -> None:
        self.cache.close()
