"""Chat output parsing (streaming-safe at every split point), stop strings, and Runtime.chat."""

from __future__ import annotations

import json

import pytest
from conftest import SHARED

from agentrt import Runtime
from agentrt.session.chat import OutputParser, opens_in_reasoning
from agentrt.session.runtime import _StopScanner

CALL = '{"name": "read_file", "arguments": {"path": "a.py"}}'


def _parse(pieces: list[str], mode: str = "content"):
    parser = OutputParser(mode=mode)
    events = [ev for piece in pieces for ev in parser.feed(piece)] + parser.finish()
    return parser, events


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize(
    "text, reasoning, content, calls",
    [
        ("<think>\nplan it\n</think>\n\nHello there.", "plan it", "Hello there.", []),
        (f"Let me look.\n<tool_call>{CALL}</tool_call>", None, "Let me look.", ["read_file"]),
        (
            f"<think>x</think><tool_call>\n{CALL}\n</tool_call><tool_call>{CALL}</tool_call>",
            "x",
            None,
            ["read_file"] * 2,
        ),
        ("no markup at all <thin", None, "no markup at all <thin", []),
        (
            "<tool_call>{not json}</tool_call> after",
            None,
            "<tool_call>{not json}</tool_call> after",
            [],
        ),
        ('<tool_call>{"name": "x"', None, '<tool_call>{"name": "x"', []),
    ],
)
def test_parser_is_split_invariant(text, reasoning, content, calls):
    for pieces in _splits(text):
        parser, events = _parse(pieces)
        got_reasoning = "".join(e.text for e in events if e.type == "reasoning") or None
        got_content = "".join(e.text for e in events if e.type == "content") or None
        assert got_reasoning == reasoning, pieces
        assert got_content == content, pieces
        assert [c["function"]["name"] for c in parser.tool_calls] == calls
        for call in parser.tool_calls:
            assert json.loads(call["function"]["arguments"]) == {"path": "a.py"}


def test_prompt_that_opens_reasoning():
    assert opens_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_in_reasoning("<think>a</think><|im_start|>assistant\n")
    _, events = _parse(["still thinking</think>answer"], mode="reasoning")
    assert [(e.type, e.text) for e in events] == [
        ("reasoning", "still thinking"),
        ("content", "answer"),
    ]


def test_stop_scanner_cuts_and_holds_back():
    for pieces in _splits("abc STOP def"):
        scanner, out, hit = _StopScanner(["STOP"]), "", False
        for p in pieces:
            text, hit = scanner.push(p)
            out += text
            if hit:
                break
        assert hit and out == "abc "


def test_runtime_chat_stream_matches_non_stream():
    rt = Runtime.open(cache="off")
    messages = [{"role": "user", "content": "read a.py please"}]
    result = rt.chat(messages, max_tokens=24)
    events = list(rt.chat(messages, max_tokens=24, stream=True))
    assert events[-1].type == "done"
    streamed = "".join(e.text for e in events if e.type == "content")
    assert streamed == (result.content or "")
    assert events[-1].result.token_ids == result.token_ids
    assert result.usage["completion_tokens"] == len(result.token_ids) == 24
    assert result.usage["cached_tokens"] == 0 and result.finish_reason == "length"
    assert set(result.timings) == {"ttft_s", "prefill_s", "decode_s"}


def test_runtime_chat_stop_string():
    rt = Runtime.open()
    messages = [{"role": "user", "content": "hello"}]
    full = rt.chat(messages, max_tokens=24).content
    stop = full[5:8]
    cut = rt.chat(messages, max_tokens=24, stop=[stop])
    assert cut.finish_reason == "stop" and cut.content == full[: full.index(stop)]


def test_a_stop_string_inside_a_tool_call_ends_with_stop(monkeypatch):
    """A stop string met inside a tool call cuts it short: the turn ends with `stop` (the
    Anthropic API's `stop_sequence`, naming it), not as a finished tool call; one met after a
    whole call ends the turn as that call (`tool_calls`, `tool_use`)."""
    from util import TOOLS, script_replies

    from agentrt.server.anthropic import stop_reason

    rt = Runtime.open()
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "main.py"}}\n</tool_call>'
    messages = [{"role": "user", "content": "read main.py"}]
    script_replies(monkeypatch, rt, [call])
    whole = rt.chat(messages, tools=TOOLS, max_tokens=64)
    assert whole.finish_reason == "tool_calls" and stop_reason(whole) == ("tool_use", None)
    script_replies(monkeypatch, rt, [call])
    cut = rt.chat(messages, tools=TOOLS, max_tokens=64, stop=["main"])
    assert cut.finish_reason == "stop" and stop_reason(cut) == ("stop_sequence", "main")
    script_replies(monkeypatch, rt, [call + "\nDone. HALT here"])
    after = rt.chat(messages, tools=TOOLS, max_tokens=64, stop=["HALT"])
    assert after.finish_reason == "tool_calls" and stop_reason(after) == ("tool_use", None)
    assert after.tool_calls[0]["function"]["arguments"] == '{"path": "main.py"}'


def test_xml_style_tool_call_body_is_parsed_with_schema_types():
    from agentrt.session.chat import parse_tool_call

    tools = [
        {
            "type": "function",
            "function": {
                "name": "run",
                "parameters": {
                    "properties": {
                        "cmd": {"type": "string"},
                        "timeout": {"type": "integer"},
                        "code": {"type": "string"},
                    }
                },
            },
        }
    ]
    body = (
        "\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n"
        "<parameter=timeout>\n30\n</parameter>\n"
        "<parameter=code>\n42\n</parameter>\n</function>\n"
    )
    call = parse_tool_call(body, tools)
    assert call["function"]["name"] == "run"
    assert json.loads(call["function"]["arguments"]) == {
        "cmd": "ls -la",
        "timeout": 30,
        "code": "42",
    }
    assert parse_tool_call("<function=run><parameter=x>1</parameter>", tools) is None


def test_string_tool_arguments_reach_templates_as_objects():
    from agentrt.session.chat import normalize_messages

    msgs = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        }
    ]
    out = normalize_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert (
        msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    )  # caller's data untouched
    from agentrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        normalize_messages(
            [{"role": "assistant", "content": "", "tool_calls": [{"function": "nope"}]}]
        )


def test_literal_think_tag_in_user_text_does_not_start_reasoning():
    rt = Runtime.open()
    result = rt.chat([{"role": "user", "content": "What does the <think> tag do?"}], max_tokens=6)
    assert result.reasoning_content is None and result.content


def test_chat_timings_when_stopped_by_a_stop_string():
    rt = Runtime.open()
    messages = [{"role": "user", "content": "hello"}]
    full = rt.chat(messages, max_tokens=24).content
    cut = rt.chat(messages, max_tokens=24, stop=[full[10:13]])
    assert cut.finish_reason == "stop" and cut.timings["decode_s"] > 0


@pytest.mark.slow
def test_content_equals_decoded_tokens_even_when_cut_mid_character():
    rt = Runtime.open()
    msgs = [{"role": "user", "content": "Write ünïcode ✓ 日本"}]
    full = rt.chat(msgs, max_tokens=40).token_ids
    # the cuts inside a character (a partial UTF-8 sequence decodes to U+FFFD), and a few others
    cuts = [n for n in range(1, len(full)) if rt.tokenizer.decode(full[:n]).endswith("\ufffd")]
    assert cuts  # (the greedy reply of the tiny model does cut characters)
    for n in sorted({*cuts, 1, 2, len(full) // 2}):
        res = rt.chat(msgs, max_tokens=n)
        assert res.token_ids == full[:n]
        assert (res.content or "") == rt.tokenizer.decode(res.token_ids).strip("\n")


def test_bad_argument_types_are_typed_errors():
    from agentrt.errors import InvalidArgumentError

    rt = Runtime.open()
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs in (
        {"stop": [1]},
        {"stop": 5},
        {"max_tokens": "5"},
        {"tools": "x"},
        {"temperature": "hot"},
    ):
        with pytest.raises(InvalidArgumentError):
            rt.chat(msgs, **kwargs)
    with pytest.raises(InvalidArgumentError):
        rt.generate([1.7])


QWEN3 = SHARED / "tokenizers" / "qwen3"


@pytest.mark.skipif(not QWEN3.is_dir(), reason="../shared/data/tokenizers/qwen3 is absent")
def test_null_content_tool_call_renders_with_the_qwen3_template():
    """OpenAI clients send `content: null` on assistant tool-call turns; Qwen3's template tests
    `'</think>' in content`, so null must render as an empty string, not fail."""
    from agentrt.session.chat import normalize_messages, render
    from agentrt.session.tokenizer import load_tokenizer

    tok = load_tokenizer(QWEN3, QWEN3 / "chat_template.qwen3-hybrid-thinking.jinja")
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ]
    text = render(tok, normalize_messages(messages), None)
    assert "<tool_call>" in text and "<tool_response>\na.py" in text


STREAMED = [
    # (text, final arguments, content)
    (
        '<tool_call>\n{"name": "read_file", "arguments": {"path":"a.py"}}\n</tool_call>',
        '{"path":"a.py"}',
        None,
    ),
    (
        '<tool_call>{"name": "read_file", "arguments": {"path": "a}</tool_call>.py"}}</tool_call>',
        '{"path": "a}',
        '.py"}}</tool_call>',
    ),
    (
        '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}, "x": 1}</tool_call>',
        '{"path": "a.py"}',
        ', "x": 1}',
    ),
    ('<tool_call>{"name": "read_file", "arguments": {"path": "a.p', '{"path": "a.p', None),
]


@pytest.mark.parametrize("text, arguments, content", STREAMED)
def test_tool_calls_stream_as_written_at_every_split(text, arguments, content):
    """A JSON call is announced (id, name) once its arguments object opens, then its arguments
    text goes out as written: at every split point the deltas add up to the final arguments
    (the model's own text), which stay a tool call even when cut off or followed by other
    text (that text becomes content)."""
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    for pieces in _splits(text):
        parser = OutputParser(tools=tools)
        events = [ev for piece in pieces for ev in parser.feed(piece)] + parser.finish()
        kinds = [e.type for e in events if e.type.startswith("tool_call")]
        assert kinds[0] == "tool_call_start" and kinds[-1] == "tool_call", pieces
        (call,) = parser.tool_calls
        start = next(e.tool_call for e in events if e.type == "tool_call_start")
        assert start["id"] == call["id"] and start["function"]["arguments"] == ""
        streamed = "".join(e.text for e in events if e.type == "tool_call_args")
        assert streamed == call["function"]["arguments"] == arguments, pieces
        assert events[[e.type for e in events].index("tool_call")].streamed
        got_content = "".join(e.text for e in events if e.type == "content") or None
        assert got_content == content, pieces


def test_calls_that_do_not_reach_the_commit_point_are_parsed_whole():
    """An unknown tool (with tools given) or the arguments before the name: no streaming; the
    body is parsed at its close, as before (a call, or content when malformed)."""
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    for text, calls in [
        ('<tool_call>{"name": "other", "arguments": {"a": 1}}</tool_call>', ["other"]),
        ('<tool_call>{"arguments": {"a": 1}, "name": "read_file"}</tool_call>', ["read_file"]),
        ('<tool_call>{"name": "other", "arguments": {"a": </tool_call>', []),
    ]:
        for pieces in _splits(text):
            parser = OutputParser(tools=tools)
            events = [ev for piece in pieces for ev in parser.feed(piece)] + parser.finish()
            assert not any(e.type in ("tool_call_start", "tool_call_args") for e in events)
            assert [c["function"]["name"] for c in parser.tool_calls] == calls


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    '{"name": "read_file", "arguments": ',
    '{"name": "x", ',
    '"arguments": ',
    "{",
    "}",
    '"a\\"}b"',
    '"path"',
    ": ",
    ", ",
    "1",
    "\n",
    "<think>",
    "</think>",
    "text",
    "</tool_",
    "[",
    "]",
]


def test_streamed_calls_are_split_invariant_on_fuzzed_markup():
    """Random markup, cut at random points: the final calls and content equal the unsplit
    parse, and each streamed call's argument deltas add up to its final arguments."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]

    def parse(pieces):
        parser = OutputParser(tools=tools)
        events = [ev for piece in pieces for ev in parser.feed(piece)] + parser.finish()
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.tool_calls]
        content = "".join(e.text for e in events if e.type == "content")
        return events, calls, content

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.randoms())
    def check(fragments, rnd):
        text = "".join(fragments)
        cuts = sorted(rnd.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        events, calls, content = parse(pieces)
        assert (calls, content) == parse([text])[1:]
        streamed, args = [], None
        for e in events:
            if e.type == "tool_call_start":
                args = ""
            elif e.type == "tool_call_args":
                args += e.text
            elif e.type == "tool_call" and e.streamed:
                streamed.append(args)
                assert args == e.tool_call["function"]["arguments"]
        assert len(streamed) <= len(calls)

    check()
