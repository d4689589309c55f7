"""`Runtime`: the public Python API (docs/architecture.md §2). Opens a model on a device, owns its
engine and tokenizer, and serves `generate` (token ids in, token ids out) and `chat` (OpenAI-shaped
messages in, content / reasoning / tool calls out, optionally streamed).

State reuse between calls follows `cache=`: `semantic` (the state cache, default), `prefix`
(live-state reuse only) or `off`.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from agentrt.engine import Cancelled, Engine, Generation, SamplingParams
from agentrt.engine.reuse import NoReuse, PrefixReuse, SemanticReuse
from agentrt.errors import ChatTemplateError, InvalidArgumentError
from agentrt.offload.packed_load import finish_loading, load_sink
from agentrt.session.chat import (
    ChatEvent,
    ChatResult,
    Detokenizer,
    OutputParser,
    check_effort,
    forced_tool_text,
    generation_suffix,
    normalize_messages,
    opens_in_reasoning,
    render,
)
from agentrt.session.harmony import HarmonyParser, harmony_forced, is_harmony, template_messages
from agentrt.session.options import (
    RuntimeConfig,
    cache_config,
    check_cache,
    check_device,
    engine_config,
    expert_store,
    offload_config,
    static_prefill,
)
from agentrt.session.tokens import GeneratedIds
from agentrt.statecache.config import StateCacheConfig


@dataclass(frozen=True)
class PreparedChat:
    """A rendered, tokenized chat request that fits the context (see `Runtime.prepare`)."""

    prompt_ids: list[int]
    reasoning: bool  # the generation prompt leaves <think> open
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    forced: str  # text appended to force a tool call
    started: float  # perf_counter when the request arrived (TTFT origin)
    harmony: bool = False  # the reply comes in harmony's channels (gpt-oss)


class Runtime:
    """A model ready to generate: `Runtime.open(...)`, then `generate` / `chat`, then `close`."""

    def __init__(self, engine: Engine, tokenizer, source, seed: int, boundaries=None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = source.name
        self.seed = seed
        self._source = source
        self._boundaries = boundaries  # user overrides of boundary strings
        self._stop_ids: tuple[int, ...] | None = None
        self._state = None  # one live sequence, reused so its buffers (and CUDA graph) persist
        self.reuse: NoReuse = NoReuse()
        self.generated = GeneratedIds(tokenizer) if tokenizer is not None else None
        self.today = datetime.date.today()  # what chat templates see as today (see chat_date)
        self.harmony = tokenizer is not None and is_harmony(tokenizer)
        self.reasoning_effort: str | None = None  # for requests that name none
        # seconds `open` spent per phase after the tokenizer: weights_s, engine_s (engine and
        # state cache), prefill_graphs_s, warm_up_s, and total_s (empty when built directly)
        self.startup: dict[str, float] = {}

    @property
    def cache(self) -> str:
        return self.reuse.mode

    def set_cache(self, mode: str, state_cache: StateCacheConfig | None = None) -> None:
        """Switch the reuse mode (closing the previous state cache); the live state is emptied
        (its buffers, and the CUDA graphs captured on them, are kept)."""
        check_cache(mode)
        self.reuse.close()
        if self._state is not None:
            self._state.reset()
        config = state_cache or StateCacheConfig()
        self.reuse = _make_reuse(
            mode, self.engine, self._source, self.tokenizer, self._boundaries, config
        )

    def checkpoint_label(self, kind: str | None) -> str | None:
        """How a reused checkpoint is reported: its boundary text, or "live" / "block"."""
        from agentrt.session.boundary_text import boundary_texts

        if kind is None:
            return None
        texts = boundary_texts(self.tokenizer, self._boundaries).get(kind)
        return texts[0] if texts else kind

    @classmethod
    def open(
        cls,
        model: str = "tiny",
        device: str | None = None,
        *,
        config: RuntimeConfig | None = None,
        **options: Any,
    ) -> Runtime:
        """Load `model` ("tiny", "synthetic:NAME" or a HF directory) on `device`; every other
        option as a keyword (the fields of `RuntimeConfig`) or in `config` (keywords win).

        The tokenizer is loaded first (`require_tokenizer` fails fast, before any weights load).
        """
        if device is not None:
            options["device"] = device
        known = {f.name for f in dataclasses.fields(RuntimeConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"Runtime.open() got unexpected keyword arguments: {unknown}")
        return cls._open(model, dataclasses.replace(config or RuntimeConfig(), **options))

    @classmethod
    def _open(cls, model: str, c: RuntimeConfig) -> Runtime:
        from agentrt.models import torch_dtype
        from agentrt.models.registry import check_spec, open_model, tokenizer_dir_of
        from agentrt.session.tokenizer import load_tokenizer

        check_cache(c.cache)
        device = check_device(c.device)
        placement = offload_config(c, model)
        check_spec(model)
        config = engine_config(c, device, placement, static_prefill(model))
        today = chat_date(c.chat_date) if c.chat_date is not None else None
        check_effort(c.reasoning_effort)
        tok_dir = c.tokenizer or tokenizer_dir_of(model)
        if tok_dir is None and c.require_tokenizer:
            raise ChatTemplateError(f"model {model!r} has no tokenizer; pass --tokenizer DIR")
        tok = load_tokenizer(tok_dir, c.chat_template) if tok_dir else None
        dtype = torch_dtype(config.dtype)
        clock = _Clock()
        store = None
        if placement.mode != "none":
            store = expert_store(model, device, dtype, placement.packed_mxfp4)
        experts = load_sink(store) if store is not None else None
        source = open_model(model, device, dtype, seed=c.seed, experts=experts)
        offload = None
        if store is not None:
            finish_loading(experts)
            from agentrt.engine.placement import install

            offload = install(source.model, store, device, placement, c.recalibrate)
        clock.lap("weights_s")
        engine = Engine(source.model, config, offload)
        rt = cls(engine, tok, source, c.seed, c.boundaries)
        rt.today = today or rt.today
        rt.reasoning_effort = c.reasoning_effort
        rt.set_cache(c.cache, cache_config(c.state_cache, c.state_dir, c.state_max_gb))
        clock.lap("engine_s")
        if engine.prefill_graphs is not None:  # captured now, not inside the first request
            engine.prepare_prefill_graphs(rt._live_state())
        clock.lap("prefill_graphs_s")
        engine.warm_up(rt._live_state())  # (CUDA: kernels compiled, decode graph captured)
        clock.lap("warm_up_s")
        rt.startup = clock.laps
        return rt

    # ------------------------------------------------------------------ token level

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Generate up to `max_tokens` new token ids after `prompt_token_ids`."""
        params = _params(
            max_tokens, temperature, top_p, self._seed(seed), tuple(stop_token_ids or ())
        )
        gen = self.engine.generate(self._live_state(), list(prompt_token_ids), params, self.reuse)
        return gen.token_ids

    def _live_state(self):
        """The runtime's one live sequence (buffers and CUDA graph persist across requests)."""
        if self._state is None:
            self._state = self.engine.new_state(self.engine.live_capacity())
        return self._state

    def prepare_ahead(self) -> bool:
        """`Engine.prepare_ahead` on the live sequence, between requests; True if it grew. A
        failure is reported on stderr, never raised (the next request grows its KV itself)."""
        try:
            return self._state is not None and self.engine.prepare_ahead(self._state)
        except Exception:  # noqa: BLE001 - preparation must never cost a turn
            traceback.print_exc()
            return False

    def _seed(self, seed: int | None) -> int:
        return self.seed if seed is None else seed

    # ------------------------------------------------------------------ chat level

    @property
    def chat_stop_ids(self) -> tuple[int, ...]:
        from agentrt.session.tokenizer import stop_token_ids

        if self._stop_ids is None:
            self._stop_ids = stop_token_ids(
                self._require_tokenizer(), self.engine.cfg.eos_token_ids
            )
        return self._stop_ids

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ChatTemplateError(
                f"model {self.model_name!r} has no tokenizer; pass tokenizer=DIR"
            )
        return self.tokenizer

    def prepare(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
        *,
        check_fits: bool = True,
    ) -> PreparedChat:
        """Validate, render and tokenize a chat request (checks it fits the context unless
        `check_fits` is False: counting only); no model work. `tool_choice`: "auto" (default),
        "none" (tool-call markup is returned as content), "required" or {"type": "function",
        "function": {"name": N}} (the reply is started as a tool call, for that tool when named).
        `reasoning_effort`: low, medium or high, for chat templates that take it (gpt-oss's;
        others ignore it); default the runtime's."""
        started = time.perf_counter()
        tok = self._require_tokenizer()
        msgs = normalize_messages(messages)
        tools = _check_tools(tools)
        if self.harmony:
            msgs = template_messages(msgs)
        effort = reasoning_effort or self.reasoning_effort
        prompt = render(tok, msgs, tools, today=self.today, reasoning_effort=effort)
        forced = harmony_forced(tool_choice) if self.harmony else forced_tool_text(tok, tool_choice)
        prompt_ids = self.generated.encode(prompt + forced)
        if check_fits:
            self.engine.check_fits(len(prompt_ids))
        if self.harmony:  # (the parser reads the channels; nothing opens in reasoning)
            return PreparedChat(prompt_ids, False, tools, tool_choice, forced, started, True)
        reasoning = opens_in_reasoning(generation_suffix(tok, msgs, tools, prompt)) and not forced
        return PreparedChat(prompt_ids, reasoning, tools, tool_choice, forced, started)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        seed: int | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
    ) -> ChatResult | Iterator[ChatEvent]:
        """One assistant turn for OpenAI-shaped `messages`; `stream=True` yields `ChatEvent`s.
        See `prepare` for `tool_choice` and `reasoning_effort`."""
        prepared = self.prepare(messages, tools, tool_choice, reasoning_effort)
        return self.chat_prepared(prepared, max_tokens, temperature, top_p, stop, stream, seed)

    def chat_prepared(
        self,
        prepared: PreparedChat,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        seed: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> ChatResult | Iterator[ChatEvent]:
        """Generate for a `prepare`d request; `should_stop` is polled per chunk and per token."""
        params = _params(max_tokens, temperature, top_p, self._seed(seed), self.chat_stop_ids)
        parse_tools = prepared.tool_choice != "none"
        if prepared.harmony:
            parser = HarmonyParser(tools=prepared.tools, parse_tools=parse_tools)
        else:
            parser = OutputParser(
                mode="reasoning" if prepared.reasoning else "content",
                tools=prepared.tools,
                parse_tools=parse_tools,
            )
        parser.feed(prepared.forced)
        gen = Generation(started_at=prepared.started, should_stop=should_stop)
        events = self._chat_events(prepared.prompt_ids, params, _check_stop(stop), parser, gen)
        if stream:
            return events
        for event in events:
            if event.type == "done":
                return event.result
        raise RuntimeError("chat ended without a result")  # unreachable

    def _chat_events(
        self,
        prompt_ids,
        params: SamplingParams,
        stops: list[str],
        parser: OutputParser,
        gen: Generation,
    ) -> Iterator[ChatEvent]:
        detok, text = Detokenizer(self.tokenizer), _StopScanner(stops)
        hit, stop = False, (None, False)  # (the stop string met, and whether inside a call)
        tokens = self.engine.stream(self._live_state(), prompt_ids, params, gen, self.reuse)
        try:
            for token in tokens:
                if token in params.stop_token_ids:
                    break
                piece, hit = text.push(detok.push(token))
                yield from parser.feed(piece)
                if hit:
                    gen.finish_reason, stop = "stop", (text.matched, parser.in_call)
                    break
        except Cancelled:
            gen.finish_reason = "cancelled"
        finally:
            tokens.close()  # (now: the engine's end of generation runs before the result)
        if not hit:
            yield from parser.feed(text.push(detok.finish())[0])
            yield from parser.feed(text.flush())
        yield from parser.finish()
        yield ChatEvent("done", result=self._result(parser, gen, stop))

    def _result(
        self, parser: OutputParser, gen: Generation, stop: tuple[str | None, bool] = (None, False)
    ) -> ChatResult:
        ids = gen.token_ids
        self.generated.remember(ids[:-1] if ids and ids[-1] in self.chat_stop_ids else ids)
        finish, (stop_sequence, cut_call) = gen.finish_reason, stop
        if parser.tool_calls and finish == "stop" and not cut_call:
            finish = "tool_calls"  # (a stop string that cut a call short: it stays "stop")
        return ChatResult(
            content="".join(parser.content) if parser.content or not parser.tool_calls else None,
            reasoning_content="".join(parser.reasoning) or None,
            tool_calls=parser.tool_calls,
            token_ids=list(gen.token_ids),
            finish_reason=finish,
            usage={
                "prompt_tokens": gen.prompt_tokens,
                "cached_tokens": gen.cached_tokens,
                "completion_tokens": len(gen.token_ids),
            },
            checkpoint=gen.checkpoint,
            restore_source=gen.restore_source,
            stop_sequence=stop_sequence,
            reuse_s=gen.timings.parts(),
            timings=gen.timings.as_dict(),
        )

    def close(self) -> None:
        """Flush pending checkpoints and release the model (GPU memory back to the allocator)."""
        if self.reuse is not None:
            self.reuse.close()
        self.reuse = NoReuse()
        self._state = None
        if self.engine is not None and self.engine.offload is not None:
            self.engine.offload.close()  # (a CPU warm-up over its host store is waited for)
        self.engine = None  # type: ignore[assignment]
        self.tokenizer = None
        self._source = None
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _make_reuse(mode: str, engine: Engine, source, tokenizer, boundaries, config) -> NoReuse:
    """The reuse policy of a cache mode (semantic: open the state cache for this model)."""
    if mode == "off":
        return NoReuse()
    if mode == "prefix":
        return PrefixReuse()
    from agentrt.session.boundary_text import resolve
    from agentrt.statecache import StateCache
    from agentrt.statecache.keys import fingerprint
    from agentrt.statecache.manager import layout_for

    cfg, dtype = engine.cfg, engine.dtype
    parts = {"config": cfg.canonical(), "dtype": str(dtype), "weights": source.identity}
    cache = StateCache(
        config,
        fingerprint(parts),
        source.name,
        layout_for(cfg, dtype),
        resolve(tokenizer, boundaries),
        block_edges=not cfg.is_hybrid,
        device=engine.device,
    )
    return SemanticReuse(cache)


def _params(max_tokens, temperature, top_p, seed, stop_ids) -> SamplingParams:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise InvalidArgumentError(f"max_tokens must be an integer, got {max_tokens!r}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    return SamplingParams(max_tokens, float(temperature), float(top_p), seed, stop_ids)


def _check_stop(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgumentError("stop must be a string or a list of strings")
    return list(stops)


def _check_tools(tools) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidArgumentError("tools must be a list of objects")
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidArgumentError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
    return tools or None


class _StopScanner:
    """Applies stop strings to streamed text: holds back a possible partial match, cuts at a hit."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.done = False
        self.matched: str | None = None  # the stop string that cut the text

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:at], ""
            return out, True
        keep = max(
            (n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])),
            default=0,
        )
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Clock:
    """Seconds per named phase since the last lap (`laps`, with their running `total_s`)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.laps: dict[str, float] = {"total_s": 0.0}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self.last, 4)
        self.laps["total_s"] = round(self.laps["total_s"] + now - self.last, 4)
        self.last = now


def chat_date(text: str) -> datetime.date:
    """A `chat_date` option (YYYY-MM-DD) as a date."""
    try:
        return datetime.date.fromisoformat(str(text))
    except ValueError:
        raise InvalidArgumentError(f"chat_date must be YYYY-MM-DD, got {text!r}") from None
