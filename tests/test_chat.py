"""Chat output parsing (streaming-safe at every split point), stop strings, and Runtime.chat."""

from __future__ import annotations

import json

import pytest

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
        (f"<think>x</think><tool_call>\n{CALL}\n</tool_call><tool_call>{CALL}</tool_call>", "x", None, ["read_file"] * 2),
        ("no markup at all <thin", None, "no markup at all <thin", []),
        ("<tool_call>{not json}</tool_call> after", None, "<tool_call>{not json}</tool_call> after", []),
        ("<tool_call>{\"name\": \"x\"", None, "<tool_call>{\"name\": \"x\"", []),
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
    assert [(e.type, e.text) for e in events] == [("reasoning", "still thinking"), ("content", "answer")]


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
    rt = Runtime.open()
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
