"""The Anthropic Messages API on 127.0.0.1, driven by the official `anthropic` client: a reply and
its event stream (reassembled by the client, equal to the reply), a tool-use round trip whose
second turn reads the state cache, count_tokens, the API key, malformed requests (each a 4xx,
the server keeps answering), the event sequence of thinking, text and a tool call, and the
translation that gives the same token ids as the OpenAI shape of the same conversation."""

from __future__ import annotations

import json

import pytest
from test_server import KEY, serve_tiny
from util import TOOLS, chat_with_call, script_replies, thinking_text_and_call

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a test extra")

# (the client's `create` has no sampling arguments any more; the server still takes them)
GREEDY = {"temperature": 0}

A_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory, "anthropic-state")


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)


def _blocks(message) -> list[dict]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def test_reply_and_its_stream_agree(client):
    """A greedy reply, then the same request streamed: the client's reassembled message has the
    same blocks, stop reason and output tokens."""
    ask = dict(
        model="tiny",
        max_tokens=12,
        extra_body=GREEDY,
        system="You are terse.",
        messages=[{"role": "user", "content": "Say something about files."}],
    )
    reply = client.messages.create(**ask)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "tiny"
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 12
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 0
    with client.messages.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert _blocks(streamed) == _blocks(reply)
    assert streamed.stop_reason == reply.stop_reason
    assert streamed.usage.output_tokens == reply.usage.output_tokens


def test_event_sequence_of_thinking_text_and_a_tool_call():
    """Chat events to Messages events: one block per kind, in order, each opened, filled and
    closed (thinking with a signature delta), the tool call as a tool_use block with its input
    as one JSON delta; then message_delta (stop reason tool_use, usage) and message_stop."""
    from agentrt.server.anthropic import MessageStream

    events = thinking_text_and_call()
    stream = MessageStream("tiny", 50)
    text = stream.start() + "".join(t for e in events for t in stream.event(e))
    parsed = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data[6:])
        assert body["type"] == name[7:]
        parsed.append(body)
    kinds = [(b["type"], b.get("index"), (b.get("delta") or {}).get("type")) for b in parsed]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert parsed[9]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "read_file",
        "input": {},
    }
    assert json.loads(parsed[10]["delta"]["partial_json"]) == {"path": "a.py"}
    assert parsed[12]["delta"]["stop_reason"] == "tool_use"
    assert parsed[12]["usage"] == {
        "input_tokens": 20,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 30,
        "output_tokens": 3,
    }


def test_streamed_tool_use_round_trip(client, server, monkeypatch):
    """The model's replies scripted (a tool call, then an answer): the tool_use block's input
    streams in several JSON deltas, the client's stream accumulator reassembles it, and the
    turn that answers it reads the first turn's checkpoints and ends the turn."""
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "main.py"}}\n</tool_call>'
    script_replies(monkeypatch, server.chat.runtime, [call, "Done."])
    ask = dict(model="tiny", max_tokens=64, extra_body=GREEDY, system="Tools.", tools=A_TOOLS)
    messages = [{"role": "user", "content": "Read main.py, streamed"}]
    with client.messages.stream(messages=messages, **ask) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        first = stream.get_final_message()
    assert sum(e.delta.type == "input_json_delta" for e in deltas) > 1  # as it is written
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "read_file" and use.input == {"path": "main.py"}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "print(1)"}],
        },
    ]
    second = client.messages.create(messages=messages, **ask)
    assert second.stop_reason == "end_turn" and _blocks(second) == [
        {"type": "text", "text": "Done."}
    ]
    assert second.usage.cache_read_input_tokens > 0


def test_a_tool_result_turn_reads_the_checkpoint_of_the_call(client):
    """The same round trip with a tool call the client wrote: the second turn restores the
    first turn's prompt from the state cache, whichever call the model made."""
    system = "You are an agent with tools."
    first_turn = [{"role": "user", "content": "List the repository."}]
    ask = dict(model="tiny", max_tokens=2, extra_body=GREEDY, system=system, tools=A_TOOLS)
    first = client.messages.create(messages=first_turn, **ask)
    assert first.usage.cache_read_input_tokens == 0
    call = {"type": "tool_use", "id": "toolu_1", "name": "list_dir", "input": {"path": "."}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "main.py\nREADME.md"}
    messages = first_turn + [
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    second = client.messages.create(messages=messages, **ask)
    assert second.usage.cache_read_input_tokens > 0
    counted = client.messages.count_tokens(
        model="tiny", system=system, messages=messages, tools=A_TOOLS
    )
    usage = second.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_wrong_api_key_is_an_authentication_error(server):
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )


def _ok_body(**changes) -> dict:
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    body.update(changes)
    return body


MALFORMED = [
    b"not json",
    b"[]",
    json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode(),
    json.dumps(_ok_body(max_tokens=0)).encode(),
    json.dumps(_ok_body(messages=[])).encode(),
    json.dumps(_ok_body(messages=[{"role": "system", "content": "x"}])).encode(),
    json.dumps(_ok_body(temperature=1.5)).encode(),
    json.dumps(_ok_body(top_k=5)).encode(),
    json.dumps(_ok_body(stop_sequences=[""])).encode(),
    json.dumps(_ok_body(messages=[{"role": "user", "content": [{"type": "video"}]}])).encode(),
    json.dumps(
        _ok_body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "base64", "data": ""}}],
                }
            ]
        )
    ).encode(),
    json.dumps(
        _ok_body(
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]
        )
    ).encode(),
    json.dumps(
        _ok_body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        )
    ).encode(),
    json.dumps(
        _ok_body(tools=[{"name": "bad name!", "input_schema": {"type": "object"}}])
    ).encode(),
    json.dumps(_ok_body(tools=[{"name": "f", "input_schema": {"type": "array"}}])).encode(),
    json.dumps(_ok_body(tools=[{"type": "bash_20250124", "name": "bash"}])).encode(),
    json.dumps(_ok_body(tool_choice={"type": "any"})).encode(),
    json.dumps(_ok_body(tools=A_TOOLS, tool_choice={"type": "tool", "name": "nope"})).encode(),
]


def test_malformed_requests_are_4xx_and_the_server_keeps_serving(server):
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    for body in MALFORMED:
        status, raw = server.raw("/v1/messages", body, key=None, headers=headers)
        assert 400 <= status < 500, (status, body[:80], raw[:200])
        answer = json.loads(raw)
        assert answer["type"] == "error" and answer["error"]["message"], raw[:200]
    status, raw = server.raw(
        "/v1/messages", json.dumps(_ok_body()).encode(), key=None, headers=headers
    )
    assert status == 200 and json.loads(raw)["type"] == "message"
    status, raw = server.raw("/v1/messages", None, method="GET", key=None, headers=headers)
    assert status == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_both_apis_render_a_conversation_to_the_same_tokens():
    """A conversation with a system prompt, tools, reasoning, a tool call and its result, in
    the Messages shape and in the chat-completions shape: the same prompt token ids (so the
    same checkpoints serve both)."""
    from agentrt import Runtime
    from agentrt.server import anthropic_schema

    body = {
        "model": "tiny",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "You are an agent."}],
        "tools": A_TOOLS,
        "messages": [
            {"role": "user", "content": "Read main.py"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read it.", "signature": ""},
                    {"type": "text", "text": "Reading."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "read_file",
                        "input": {"path": "main.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"},
                    {"type": "text", "text": "Now explain it."},
                ],
            },
        ],
    }
    rt = Runtime.open("tiny", cache="off")
    req = anthropic_schema.decode(json.dumps(body).encode())
    via_messages = rt.prepare(*anthropic_schema.to_plain(req)).prompt_ids
    assert via_messages == rt.prepare(chat_with_call("toolu_1"), TOOLS).prompt_ids


def test_count_tokens_counts_a_conversation_longer_than_the_context(server, client):
    """count_tokens answers for a conversation past the model's context (a client counts to
    decide when to compact it), while a message for it is refused as too long."""
    context = server.chat.runtime.engine.max_context
    long = [{"role": "user", "content": "!?" * (context // 2 + 1000)}]  # (a token per byte)
    counted = client.messages.count_tokens(model="tiny", messages=long)
    assert counted.input_tokens > context
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client.messages.create(model="tiny", max_tokens=2, messages=long)
