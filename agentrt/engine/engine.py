"""The inference engine for one loaded model: chunked prefill with boundary capture in one pass,
single-token decode, and the generation loop (sampling, stop token ids, length limits, timings).

Prefill splits the prompt into `prefill_chunk`-token chunks; for each chunk it passes the capture
offsets inside it to the model, whose linear-attention layers record their state there while
attention and MoE process the whole chunk at once. The engine knows token ids only, never text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from agentrt.engine.config import EngineConfig
from agentrt.engine.cuda_graph import DecodeGraph, PrefillGraphs, graph_kv_tokens
from agentrt.engine.elastic import give_back_kv_room, grow_ahead, make_kv_room
from agentrt.engine.generation import Cancelled, Generation
from agentrt.engine.placement import kv_bytes_per_token
from agentrt.engine.reuse import NoReuse, end_generation
from agentrt.engine.sampling import SamplingParams, make_generator, sample
from agentrt.engine.state import SequenceState, new_layer_caches
from agentrt.errors import InvalidArgumentError, PromptTooLongError
from agentrt.models import set_linear_backend
from agentrt.models.fusion import derive
from agentrt.models.kernels import CHUNK, resolve_backend
from agentrt.models.layers import CausalLM

# the scratch prompt `Engine.warm_up` runs, as pieces (tokens, captures at these offsets into
# the piece): past fla's recurrent bound (64) with captures inside and at the end (the chunked
# pass that keeps chunk-start states), a multiple of 16 tokens (Triton compiles separate variants
# for lengths divisible by 16), two without captures (fla's own chunked pass, autotuned on its
# first call), and a short one (the recurrent kernels)
WARM_UP_PIECES = ((200, (100, 200)), (128, (100,)), (100, ()), (128, ()), (16, ()))
WARM_UP_TOKENS = sum(n for n, _ in WARM_UP_PIECES)


class Engine:
    """Runs one model on one device for sequences held in `SequenceState`s."""

    def __init__(self, model: CausalLM, config: EngineConfig, offload=None) -> None:
        self.model = model
        self.config = config
        self.cfg = model.config
        self.device = torch.device(config.device)
        self.dtype = model.embed_tokens.weight.dtype
        self.linear_backend = resolve_backend(config.linear_attn, self.device)
        set_linear_backend(model, self.linear_backend)
        derive(model)  # (once the weights are loaded: see `models.fusion`)
        # the OffloadedExperts the model runs when its routed experts live in a host store
        # (`engine.placement.install` put it there), whose cache gives KV room under a budget
        self.offload = offload
        use_graphs = config.cuda_graphs and self.device.type == "cuda"
        self.decode_graph = DecodeGraph(model, self.device) if use_graphs else None
        self.eager_decode_steps = 0  # decode steps run without the graph (CUDA: graphs failed)
        self.prefill_graphs = None  # (offloaded experts: prefill streams them, never replays)
        if config.prefill_graphs and self.device.type == "cuda" and offload is None:
            self.prefill_graphs = PrefillGraphs(model, self.device, reserve=self._graph_kv())

    @property
    def max_context(self) -> int:
        return self.cfg.max_position_embeddings

    def _graph_kv(self) -> int:
        """KV positions the prefill graphs are captured with (see `graph_kv_tokens`)."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return graph_kv_tokens(self.max_context, kv_bytes_per_token(self.model), free)

    def live_capacity(self) -> int:
        """KV positions to allocate the live sequence with: under a VRAM budget its KV
        reservation (which costs the expert cache nothing), so the buffers the decode graph is
        captured on at start-up last that long; else 0 (grown as needed)."""
        reserved = self.offload.kv_reserved if self.offload is not None else 0
        return min(reserved, self.max_context)

    def new_state(self, capacity: int = 0) -> SequenceState:
        host = frozenset(
            i for i, layer in enumerate(self.model.layers) if getattr(layer, "on_host", False)
        )
        caches = new_layer_caches(
            self.cfg, self.device, self.dtype, capacity, self.config.kv_grow_tokens, host
        )
        return SequenceState(self.cfg, caches)

    def _event(self) -> torch.cuda.Event | None:
        """A timing event on the current stream (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check_fits(self, num_tokens: int) -> None:
        if num_tokens >= self.max_context:
            raise PromptTooLongError(
                f"prompt has {num_tokens} tokens but the model's context is "
                f"{self.max_context} tokens"
            )

    @torch.inference_mode()  # (as a request's steps: the same kind of tensors and graphs)
    def prepare_ahead(self, state: SequenceState, horizon: int | None = None) -> bool:
        """Between requests (the server when its queue is empty, an agent loop before running
        tools): KV with fewer than `horizon` (default: one prefill chunk) positions left past
        `state`'s tokens grows now, under a budget taking its room from the expert cache, whose
        experts then come back, and on CUDA the decode graph (and the prefill graphs) are
        captured for the new buffers, so the next request, if it fits the horizon, pays for
        none of it. True if it grew."""
        horizon = horizon or self.config.prefill_chunk
        need = min(state.num_tokens + horizon, self.max_context)
        if not state.num_tokens:
            return False
        grew = grow_ahead(self.offload, state, need)
        pending = self.offload is not None and bool(self.offload.cache.pending)
        if not grew and not pending:
            return False
        if pending:  # (this growth's resize, or the last request's that ran no decode step)
            self.offload.cache.refill()
        if self.decode_graph is not None:
            self.decode_graph.prepare(state)
        self.prepare_prefill_graphs(state)
        self.synchronize()
        return grew

    def _check_ids(self, ids: Sequence[int]) -> None:
        if (
            ids
            and set(map(type, ids)) == {int}
            and 0 <= min(ids)
            and max(ids) < self.cfg.vocab_size
        ):
            return  # the common case, at C speed (prompts of 10K+ ids on every request)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size:
                raise InvalidArgumentError(
                    f"token ids must be integers in [0, {self.cfg.vocab_size}), got {t!r}"
                )

    def _tensor(self, ids: Sequence[int]) -> torch.Tensor:
        """Token ids (the caller has checked them: `_check_ids`) as a device tensor."""
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        capture: Iterable[int] = (),
        all_logits: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Append `token_ids` to `state`; record linear states at absolute positions in `capture`
        (a piece may take one up to 63 tokens earlier, see `capture_grid`: the position
        taken is `state.capture_position(pos)`).

        Returns fp32 logits of the last token `[V]` (or of every token `[T, V]` with `all_logits`).
        `should_stop` is polled between chunks; when it answers True, `Cancelled` is raised.
        """
        if not token_ids:
            raise InvalidArgumentError("prefill needs at least one token")
        start = state.num_tokens
        self.check_fits(start + len(token_ids))
        self._check_ids(token_ids)
        state.clear_captures()
        wanted = sorted({int(p) for p in capture if start < p <= start + len(token_ids)})
        with state.passes(keep=Cancelled):  # (polled between pieces: those that ran stay)
            return self._prefill(state, token_ids, wanted, all_logits, should_stop)

    def _prefill(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        wanted: list[int],
        all_logits: bool,
        should_stop: Callable[[], bool] | None,
    ) -> torch.Tensor:
        """`prefill`'s pieces: graph replays where they serve, then eager chunks."""
        start = state.num_tokens
        graphs = self.prefill_graphs
        if graphs is not None and len(token_ids) <= graphs.max_prompt and not all_logits:
            done, logits = self._prefill_graphed(state, token_ids, wanted, should_stop)
            if done == len(token_ids):
                return logits
            token_ids, start = token_ids[done:], state.num_tokens  # the rest runs eagerly
        make_kv_room(self.offload, state, start + len(token_ids))
        ids = self._tensor(token_ids)
        chunk, outputs = self.config.prefill_chunk, []
        for offset in range(0, len(token_ids), chunk):
            if should_stop is not None and should_stop():
                raise Cancelled("generation cancelled during prefill")
            part = ids[offset : offset + chunk]
            begin = start + offset
            cuts = [p - begin for p in wanted if begin < p <= begin + part.numel()]
            cuts = self._on_grid(state, begin, cuts, part.numel())
            if self.offload is not None:
                self.offload.chunk_at(begin)
            hidden = self.model(part, state.caches, begin, cuts)
            state.token_ids.extend(token_ids[offset : offset + chunk])
            outputs.append(self.model.logits(hidden) if all_logits else hidden[-1:])
        if all_logits:
            return torch.cat(outputs)
        return self.model.logits(outputs[-1])[0]

    @property
    def capture_grid(self) -> int:
        """Eager prefill takes a capture inside a piece at the last multiple of this many tokens
        from the piece's start at or before the asked position (0: exactly where asked).

        The linear layers' chunked pass computes the state at every 64-token chunk start anyway;
        a state between two starts needs one more (recurrent) pass over a 64-token window per
        layer. With fla's kernels on a GPU that window was most of the cost of a checkpoint: on
        the H200, a prefill of 8K tokens with a checkpoint every 2000 tokens took 17% longer
        than without (`benchmarks/profile_capture.py 8192 40 2000`). A checkpoint taken up to 63
        tokens early is as valid (`StateCache.save(at=...)`): a later turn prefills those
        tokens again. Default: 64 with fla, 0 with torch's kernels (CPU: the oracle path)."""
        if not self.cfg.is_hybrid:  # KV alone: any position is as cheap
            return 0
        grid = self.config.capture_grid
        if grid is None:
            grid = CHUNK if self.linear_backend == "fla" else 0
        return grid

    def _on_grid(self, state: SequenceState, begin: int, cuts: list[int], length: int) -> list[int]:
        """`cuts` (offsets in a piece of `length` tokens from `begin`) moved onto the capture
        grid; the moves are noted in `state.moved`. A cut at the piece's end moves too (then a
        turn restored from it resumes on the grid, as a prefill of the whole prompt runs, and
        continues exactly as that prefill would), but not one in the first grid step (no chunk
        start before it but the piece's own)."""
        grid = self.capture_grid
        if not grid:
            return cuts
        out = set()
        for cut in cuts:
            at = cut if cut < grid else cut - cut % grid
            if at != cut:
                state.moved[begin + cut] = begin + at
            out.add(at)
        return sorted(out)

    def _prefill_graphed(
        self, state: SequenceState, token_ids: Sequence[int], wanted: list[int], should_stop
    ) -> tuple[int, torch.Tensor | None]:
        """Run a prompt of at most `max_prompt` tokens as CUDA-graph replays, one per piece (see
        `_pieces`): capture positions inside a piece are the replay's cuts (moved onto the
        capture grid of the piece, as in eager pieces), one at its end is its final state.
        Stops at the first piece no graph takes. Returns how many tokens ran and the logits
        after them."""
        graphs = self.prefill_graphs
        start, done, logits = state.num_tokens, 0, None
        for end, inner in _pieces(len(token_ids), [p - start for p in wanted], graphs):
            if should_stop is not None and should_stop():
                raise Cancelled("generation cancelled during prefill")
            piece = list(token_ids[done:end])
            cuts = self._on_grid(state, start + done, [p - done for p in inner], end - done)
            out = graphs.run(state, piece, cuts)
            if out is None:
                break
            logits, slots = out
            state.token_ids.extend(piece)
            for j, cut in enumerate(cuts):
                state.record_slot(start + done + cut, slots, j)
            if start + end in wanted:
                state.record_capture(start + end)
            done = end
        return done, logits

    @torch.inference_mode()
    def prepare_prefill_graphs(self, state: SequenceState) -> None:
        """Capture the prefill graphs for `state`'s buffers now (no-op without them: offloaded
        experts' prefill never takes them)."""
        if self.prefill_graphs is not None:
            self.prefill_graphs.prepare(state)

    @torch.inference_mode()
    def warm_up(self, state: SequenceState) -> None:
        """On CUDA, before the first request: compile and tune what a request runs on a
        scratch prompt (chunked and short pieces, captures inside a piece, the decode step,
        whose CUDA graph is captured for `state`'s buffers), then empty `state`. First one
        eager piece of the whole prefill chunk (the kernels only long pieces take, the norms'
        larger size class), offloaded too: one pass over the missing experts (about 1 s at
        16 GiB) against 4-12 s of tuning in the first request past 1K, 2K or 4K tokens. With
        prefill graphs the scratch prompt runs eagerly first (longer prompts run eagerly).
        Elsewhere nothing (there is nothing to compile)."""
        if self.device.type == "cuda":
            self._warm_up_run(state)

    def _warm_up_run(self, state: SequenceState) -> None:
        short = min(WARM_UP_TOKENS, self.max_context - 2)  # (a model of a short context)
        if short < 2:
            return
        vocab = self.cfg.vocab_size - 1
        ids = [(7 + 31 * i) % vocab for i in range(short + 2)]
        graphs = self.prefill_graphs
        self.prefill_graphs = None
        try:
            full = min(self.config.prefill_chunk, self.max_context - 2)
            self.prefill(state, [(11 + 37 * i) % vocab for i in range(full)])
            state.reset()
            if graphs is not None:
                self._warm_up_prompt(state, ids[:short])
                state.reset()
        finally:
            self.prefill_graphs = graphs
        self._warm_up_prompt(state, ids[:short])
        for token in ids[short:]:
            self.decode_step(state, token)
        self.synchronize()
        state.reset()

    def _warm_up_prompt(self, state: SequenceState, ids: list[int]) -> None:
        """The scratch prompt in the pieces of `WARM_UP_PIECES`, as far as `ids` reaches. A
        piece without captures runs fla's own chunked pass: left out here, its autotuning (15 s
        on an H200) would land in the first request with such a piece."""
        at = 0
        for length, offsets in WARM_UP_PIECES:
            piece = ids[at : at + length]
            if not piece:
                return
            capture = [at + o for o in offsets if o <= len(piece)]
            self.prefill(state, piece, capture=capture)
            at += len(piece)

    @torch.inference_mode()
    def decode_step(self, state: SequenceState, token_id: int) -> torch.Tensor:
        """Feed one token; return the next-token fp32 logits `[V]`."""
        self.check_fits(state.num_tokens + 1)
        self._check_ids([token_id])
        make_kv_room(self.offload, state, state.num_tokens + 1)
        if self.offload is not None and self.offload.cache.pending:
            self.offload.cache.refill()  # the experts a KV growth made room from, back in
        logits = None
        with state.passes():
            if self.decode_graph is not None:
                for cache in state.kv_caches():
                    cache.reserve(state.num_tokens + 1, state.num_tokens)
                logits = self.decode_graph.step(state, token_id)
            if logits is None:
                self.eager_decode_steps += 1
                hidden = self.model(self._tensor([token_id]), state.caches, state.num_tokens)
                logits = self.model.logits(hidden)[0]
        state.token_ids.append(token_id)
        return logits

    def stream(
        self,
        state: SequenceState,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        gen: Generation | None = None,
        reuse: NoReuse | None = None,
    ) -> Iterator[int]:
        """Run `prompt_ids` (the whole prompt) on `state`, reusing what `reuse` can, then yield
        sampled tokens one by one. `gen` (if given) is filled in as generation proceeds."""
        gen = gen if gen is not None else Generation()
        reuse = reuse or NoReuse()
        if not prompt_ids:
            raise InvalidArgumentError("generation needs a non-empty prompt")
        gen.prompt_tokens = len(prompt_ids)
        self.check_fits(gen.prompt_tokens)
        self._check_ids(prompt_ids)
        rng = make_generator(params.seed, self.device)
        # (a much shorter context: sized for the prompt and up to a chunk of generation, beyond
        # which the KV grows again: a server request's default limit is the whole context)
        ahead = min(params.max_tokens, self.config.prefill_chunk)
        give_back_kv_room(self.offload, state, gen.prompt_tokens + ahead, prompt_ids)
        make_kv_room(self.offload, state, gen.prompt_tokens)  # before a restore grows the KV
        t0 = time.perf_counter()
        gen.timings.prepare_s = t0 - gen.started_at if gen.started_at is not None else 0.0
        try:  # (also when the caller stops reading or the request fails: held writes resume)
            start, gen.checkpoint = reuse.begin(state, prompt_ids)
            logits = self._prefill_turn(state, prompt_ids, start, gen, reuse, t0)
            began = gen.started_at or t0
            yield from self._decode_loop(state, logits, params, rng, gen, began, reuse)
        finally:
            end_generation(reuse, state)

    def _prefill_turn(
        self,
        state: SequenceState,
        prompt_ids: Sequence[int],
        start: int,
        gen: Generation,
        reuse: NoReuse,
        t0: float,
    ) -> torch.Tensor:
        """Prefill the prompt from `start` (what `reuse.begin` restored), hand its checkpoints
        to `reuse`, and fill in the turn's restore and prefill timings; returns the logits."""
        gen.cached_tokens, gen.restore_source = start, reuse.source if start else None
        waited = time.perf_counter()
        self.synchronize()
        gen.timings.restore_s = time.perf_counter() - t0
        gen.timings.restore_wait_s = time.perf_counter() - waited
        positions = reuse.capture_positions(prompt_ids, start)
        logits = self.prefill(
            state, prompt_ids[start:], capture=positions, should_stop=gen.should_stop
        )
        t1, prefill_end = time.perf_counter(), self._event()
        reuse.after_prefill(state, prompt_ids, positions)
        capture_end, gen.timings.capture_s = self._event(), time.perf_counter() - t1
        self.synchronize()
        gen.timings.prefill_s = time.perf_counter() - t0
        if prefill_end is not None:
            gen.timings.capture_gpu_s = prefill_end.elapsed_time(capture_end) / 1000
        return logits

    def _decode_loop(
        self, state, logits, params, rng, gen: Generation, t0: float, reuse
    ) -> Iterator[int]:
        stops = set(params.stop_token_ids)
        t_first = None
        while len(gen.token_ids) < params.max_tokens:
            if gen.should_stop is not None and gen.should_stop():
                gen.finish_reason = "cancelled"
                return
            token = sample(logits, params, rng)
            now = time.perf_counter()
            if t_first is None:
                t_first, gen.timings.ttft_s = now, now - t0
            gen.timings.decode_s = now - t_first  # kept current: the caller may stop consuming
            gen.token_ids.append(token)
            if token in stops:
                gen.finish_reason = "stop"
                yield token
                return
            yield token
            if len(gen.token_ids) >= params.max_tokens or state.num_tokens + 1 >= self.max_context:
                break  # the last sampled token is never fed: no wasted forward pass
            logits = self.decode_step(state, token)
            reuse.after_token(state)
        gen.finish_reason = "length"

    def generate(
        self,
        state: SequenceState,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        reuse: NoReuse | None = None,
    ) -> Generation:
        gen = Generation()
        for _ in self.stream(state, prompt_ids, params, gen, reuse):
            pass
        return gen


def _pieces(length: int, wanted: list[int], graphs: PrefillGraphs) -> list[tuple[int, list[int]]]:
    """The pieces a prompt of `length` tokens runs in as graph replays: (end offset, capture
    offsets strictly inside the piece). None is longer than the largest bucket or holds more
    inside captures than the graphs' cut slots (the next capture then ends the piece)."""
    longest, slots = graphs.buckets[-1], graphs.cut_slots
    wanted = sorted(p for p in wanted if 0 < p <= length)
    pieces, begin = [], 0
    while begin < length:
        end = min(begin + longest, length)
        inner = [p for p in wanted if begin < p < end]
        if len(inner) > slots:
            end, inner = inner[slots], inner[:slots]
        pieces.append((end, inner))
        begin = end
    return pieces
