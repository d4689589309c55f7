"""Harmony (gpt-oss) chat: the channel parser, streamed in any split, against whole replies;
rendering with the real gpt-oss tokenizer and template (a fixed date); and a whole turn through
`Runtime.chat` with a gpt-oss model and that tokenizer (skipped without the shared data)."""

from __future__ import annotations

import collections
import datetime
import json

import pytest
from conftest import SHARED

from agentrt.session.harmony import HarmonyParser, template_messages

GPT_OSS_TOKENIZER = SHARED / "tokenizers" / "gpt-oss"
needs_tokenizer = pytest.mark.skipif(
    not (GPT_OSS_TOKENIZER / "tokenizer.json").is_file(), reason="needs ../shared/data"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_REPLY = (
    "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
FINAL_REPLY = (
    "<|channel|>analysis<|message|>Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
)


def _parse(text: str, pieces: list[int] | None = None, **kw) -> tuple[HarmonyParser, list]:
    parser = HarmonyParser(**kw)
    events, at = [], 0
    for size in pieces or [len(text)]:
        events += parser.feed(text[at : at + size])
        at += size
    events += parser.feed(text[at:])
    return parser, events + parser.finish()


def _summary(parser: HarmonyParser) -> tuple:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.tool_calls]
    return "".join(parser.reasoning), "".join(parser.content), calls


def test_a_tool_call_reply_splits_into_reasoning_and_a_streamed_call():
    parser, events = _parse(CALL_REPLY, tools=TOOLS)
    assert _summary(parser) == (
        "The user wants the weather.",
        "",
        [("get_weather", '{"city": "Paris"}')],
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "reasoning" and kinds[-1] == "tool_call" and "tool_call_start" in kinds
    deltas = "".join(e.text for e in events if e.type == "tool_call_args")
    assert deltas == parser.tool_calls[0]["function"]["arguments"] and events[-1].streamed


def test_a_call_without_arguments_streams_the_arguments_it_ends_with():
    """An empty body (`<|message|>` then `<|call|>`) is a call with `{}`: its streamed argument
    deltas join to that too (a streaming client never ends up with an empty string)."""
    reply = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|><|call|>"
    parser, events = _parse(reply, tools=TOOLS)
    assert _summary(parser) == ("", "", [("get_weather", "{}")])
    assert "".join(e.text for e in events if e.type == "tool_call_args") == "{}"


@pytest.mark.parametrize("reply", [CALL_REPLY, FINAL_REPLY])
def test_any_split_of_the_stream_gives_the_whole_reply(reply):
    whole = _summary(_parse(reply, tools=TOOLS)[0])
    for size in (1, 2, 3, 7):
        assert _summary(_parse(reply, [size] * (len(reply) // size), tools=TOOLS)[0]) == whole
    assert whole[1] == ("It is sunny in Paris." if reply == FINAL_REPLY else "")


def test_recipient_before_the_channel_unknown_functions_and_tool_choice_none():
    reply = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
    assert _summary(_parse(reply, tools=TOOLS)[0])[2] == [("get_weather", '{"city": "Oslo"}')]
    unknown = reply.replace("get_weather", "launch")
    assert _summary(_parse(unknown, tools=TOOLS)[0]) == ("", '{"city": "Oslo"}', [])
    assert _summary(_parse(reply, tools=TOOLS, parse_tools=False)[0])[2] == []
    assert _summary(_parse(unknown)[0])[2] == [("launch", '{"city": "Oslo"}')]  # no tools given


ORACLE_REPLIES = [
    CALL_REPLY,
    FINAL_REPLY,
    "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary"
    "<|message|>Checking the weather first.<|end|><|start|>assistant to=functions.get_weather"
    '<|channel|>commentary json<|message|>{"city": "Rome"}',
    "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>"
    "Two, with <angle> brackets & \\n escapes.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Done: 42 °C, naïve café.",
]


@needs_tokenizer
@pytest.mark.parametrize("reply", ORACLE_REPLIES)
def test_the_parser_agrees_with_openai_harmony_token_by_token(reply, monkeypatch):
    """openai-harmony (the format's own parser) as the oracle: a reply's tokens, detokenized
    one at a time as in generation, give the same reasoning, content and tool calls."""
    harmony = pytest.importorskip("openai_harmony")
    from transformers import AutoTokenizer

    from agentrt.session.chat import Detokenizer

    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(GPT_OSS_TOKENIZER))
    encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    tokens = encoding.encode(reply + "<|call|>", allowed_special="all")
    messages = encoding.parse_messages_from_completion_tokens(tokens, role=harmony.Role.ASSISTANT)
    want_reasoning, want_content, want_calls = "", "", []
    for m in messages:
        text = "".join(part.text for part in m.content)
        if (m.recipient or "").startswith("functions."):
            want_calls.append((m.recipient[len("functions.") :], text))
        elif m.channel == "analysis":
            want_reasoning += text
        else:
            want_content += text
    tok = AutoTokenizer.from_pretrained(GPT_OSS_TOKENIZER)
    ids = tok.encode(reply, add_special_tokens=False)
    assert ids == tokens[:-1]  # (the same tokenization as the format's own)
    parser, detok = HarmonyParser(tools=TOOLS), Detokenizer(tok)
    for token in ids:
        parser.feed(detok.push(token))
    parser.feed(detok.finish())
    parser.finish()
    assert _summary(parser) == (want_reasoning, want_content, want_calls)


def test_several_calls_in_one_message_render_one_call_per_message():
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": {"i": i}}}
        for i in range(2)
    ]
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "reasoning_content": "two", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "a"},
        {"role": "tool", "tool_call_id": "c1", "content": "b"},
    ]
    out = template_messages(msgs)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "assistant", "tool"]
    assert out[1]["thinking"] == "two" and "reasoning_content" not in out[1]
    assert [m["tool_calls"][0]["id"] for m in out if m["role"] == "assistant"] == ["c0", "c1"]


def test_nothing_is_dropped_that_the_template_would_drop_or_refuse():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
    msgs = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "go"},
        {"role": "system", "content": "a reminder"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Hm.",
            "tool_calls": [call],
        },
    ]
    out = template_messages(msgs)
    assert [m["role"] for m in out] == ["system", "user", "user", "assistant"]
    assert out[3]["thinking"] == "Hm.\n\nLet me look." and out[3]["content"] == ""


@needs_tokenizer
def test_rendering_with_the_real_template_fixes_the_date():
    from transformers import AutoTokenizer

    from agentrt.session.chat import normalize_messages, render

    tok = AutoTokenizer.from_pretrained(GPT_OSS_TOKENIZER)
    msgs = template_messages(
        normalize_messages(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "Need the tool.",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ]
        )
    )
    text = render(tok, msgs, TOOLS, today=datetime.date(2031, 5, 6))
    assert "Current date: 2031-05-06\n" in text
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>" in text
    assert '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in text
    assert text.endswith("<|end|><|start|>assistant")
    assert "Reasoning: medium\n" in text  # (the template's default)
    assert render(tok, msgs, TOOLS, today=datetime.date(2031, 5, 7)) != text
    high = render(tok, msgs, TOOLS, today=datetime.date(2031, 5, 6), reasoning_effort="high")
    assert "Reasoning: high\n" in high
    from agentrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="reasoning_effort"):
        render(tok, msgs, TOOLS, reasoning_effort="max")


@pytest.fixture(scope="module")
def gpt_oss_runtime(tmp_path_factory):
    """A tiny gpt-oss model with the real gpt-oss vocabulary, opened with its tokenizer."""
    if not (GPT_OSS_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip("needs ../shared/data")
    from agentrt import Runtime
    from agentrt.models.synthetic import write_checkpoint

    path = write_checkpoint(
        "tiny-gpt-oss",
        tmp_path_factory.mktemp("gpt-oss") / "m",
        config_overrides={"vocab_size": 201088, "eos_token_id": 200002},
    )
    state = tmp_path_factory.mktemp("state")
    rt = Runtime.open(
        model=str(path),
        device="cpu",
        tokenizer=str(GPT_OSS_TOKENIZER),
        state_dir=str(state),
        chat_date="2031-05-06",
    )
    yield rt
    rt.close()


def _script(monkeypatch, rt, reply: str, stop: str) -> None:
    """The engine samples `reply` and then `stop` (a stop token) instead of random tokens."""
    from agentrt.engine import engine as engine_module

    queue = collections.deque(rt.tokenizer.encode(reply + stop, add_special_tokens=False))
    real = engine_module.sample
    monkeypatch.setattr(
        engine_module, "sample", lambda *a, **k: queue.popleft() if queue else real(*a, **k)
    )


@pytest.mark.slow
def test_a_gpt_oss_turn_returns_openai_tool_calls_and_the_next_turn_reuses_state(
    gpt_oss_runtime, monkeypatch
):
    rt = gpt_oss_runtime
    assert rt.harmony and rt.today == datetime.date(2031, 5, 6)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    _script(monkeypatch, rt, CALL_REPLY, "<|call|>")
    first = rt.chat(messages, tools=TOOLS, max_tokens=64)
    assert first.finish_reason == "tool_calls" and first.content is None
    assert first.reasoning_content == "The user wants the weather."
    call = first.tool_calls[0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    messages += [first.message(), {"role": "tool", "tool_call_id": call["id"], "content": "sun"}]
    _script(monkeypatch, rt, FINAL_REPLY, "<|return|>")
    events = list(rt.chat(messages, tools=TOOLS, max_tokens=64, stream=True))
    second = events[-1].result
    assert second.content == "It is sunny in Paris." and second.finish_reason == "stop"
    assert second.usage["cached_tokens"] > first.usage["prompt_tokens"] // 2
    assert "".join(e.text for e in events if e.type == "content") == second.content


def test_a_bad_chat_date_or_reasoning_effort_is_refused(gpt_oss_runtime):
    from agentrt import Runtime
    from agentrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="YYYY-MM-DD"):
        Runtime.open(model="tiny", device="cpu", chat_date="tomorrow")
    with pytest.raises(InvalidArgumentError, match="reasoning_effort"):
        Runtime.open(model="tiny", device="cpu", reasoning_effort="extreme")


def test_the_runtimes_reasoning_effort_is_the_default_a_request_overrides(gpt_oss_runtime):
    rt = gpt_oss_runtime
    messages = [{"role": "user", "content": "hi"}]

    def effort_line(**kw) -> str:
        text = rt.tokenizer.decode(rt.prepare(messages, **kw).prompt_ids)
        return next(line for line in text.splitlines() if line.startswith("Reasoning:"))

    assert effort_line() == "Reasoning: medium"  # (the template's own default)
    rt.reasoning_effort = "low"
    try:
        assert effort_line() == "Reasoning: low"
        assert effort_line(reasoning_effort="high") == "Reasoning: high"
    finally:
        rt.reasoning_effort = None
