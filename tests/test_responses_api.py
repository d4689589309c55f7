"""The OpenAI Responses API (stateless) on 127.0.0.1, driven by the official `openai` client's
`client.responses`: a response and its event stream (the same output), a function-call round
trip whose second request reads the state cache, what is not supported (each a 4xx, the server
keeps answering), the event sequence as the client's own stream accumulator reads it, and the
translation that gives the same token ids as the chat-completions shape of a conversation."""

from __future__ import annotations

import json

import pytest
from test_server import KEY, serve_tiny
from util import TOOLS, chat_with_call, script_replies, thinking_text_and_call

openai = pytest.importorskip("openai", reason="the openai client is a test extra")

R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory, "responses-state")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


def _texts(output) -> list[tuple[str, str]]:
    """(item type, its text or call) per output item."""
    out = []
    for item in output:
        if item.type == "message":
            out.append(("message", "".join(p.text for p in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(p.text for p in item.content or [])))
        else:
            out.append((item.type, f"{item.name}:{item.arguments}"))
    return out


def test_response_and_its_stream_agree(client):
    """A greedy response (cut at max_output_tokens: status incomplete), then the same request
    streamed: the deltas add up to the same items, and the final event carries them."""
    ask = dict(
        model="tiny",
        instructions="You are terse.",
        input="Say something about files.",
        max_output_tokens=12,
        temperature=0,
    )
    reply = client.responses.create(**ask)
    assert reply.object == "response" and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 12 and reply.usage.input_tokens > 0
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas: dict[int, str] = {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            deltas[e.output_index] = deltas.get(e.output_index, "") + e.delta
    final = events[-1].response
    assert _texts(final.output) == _texts(reply.output)
    assert [text for _, text in _texts(final.output)] == [deltas[i] for i in sorted(deltas)]
    assert final.usage.output_tokens == reply.usage.output_tokens


def test_function_call_round_trip_reads_the_state_cache(client):
    """A function call the client sends back with its output: the second request restores the
    first one's prompt from the state cache (cached tokens > 0)."""
    first_input = [{"role": "user", "content": "List the repository."}]
    first = client.responses.create(
        model="tiny", input=first_input, tools=R_TOOLS, max_output_tokens=2, temperature=0
    )
    assert first.usage.input_tokens_details.cached_tokens == 0
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "list_dir",
        "arguments": '{"path": "."}',
    }
    output = {"type": "function_call_output", "call_id": "call_1", "output": "main.py"}
    second = client.responses.create(
        model="tiny",
        input=first_input + [call, output],
        tools=R_TOOLS,
        max_output_tokens=2,
        temperature=0,
    )
    assert second.usage.input_tokens_details.cached_tokens > 0


def _body(**changes) -> dict:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    body.update(changes)
    return body


REFUSED = [
    b"not json",
    json.dumps({"model": "tiny"}).encode(),
    json.dumps(_body(previous_response_id="resp_1")).encode(),
    json.dumps(_body(conversation="conv_1")).encode(),
    json.dumps(_body(background=True)).encode(),
    json.dumps(_body(tools=[{"type": "web_search"}])).encode(),
    json.dumps(_body(text={"format": {"type": "json_schema", "name": "x", "schema": {}}})).encode(),
    json.dumps(_body(input=[])).encode(),
    json.dumps(_body(input=[{"type": "computer_call", "id": "x"}])).encode(),
    json.dumps(
        _body(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    ).encode(),
    json.dumps(
        _body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    ).encode(),
    json.dumps(_body(temperature=3)).encode(),
    json.dumps(_body(max_output_tokens=0)).encode(),
    json.dumps(_body(tools=R_TOOLS, tool_choice={"type": "function", "name": "nope"})).encode(),
    json.dumps(_body(tool_choice="required")).encode(),
    json.dumps(_body(reasoning={"effort": "max"})).encode(),
    json.dumps(_body(reasoning="high")).encode(),
    json.dumps(  # (unhashable call ids and names, a reasoning item whose content is no list)
        _body(
            input=[
                {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"},
                {"type": "function_call_output", "call_id": ["c"], "output": "x"},
            ]
        )
    ).encode(),
    json.dumps(_body(tools=R_TOOLS, tool_choice={"type": "function", "name": ["f"]})).encode(),
    json.dumps(
        _body(input=[{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}])
    ).encode(),
]


def test_unsupported_and_malformed_requests_are_4xx_and_the_server_keeps_serving(server):
    headers = {"content-type": "application/json"}
    for body in REFUSED:
        status, raw = server.raw("/v1/responses", body, headers=headers)
        assert 400 <= status < 500, (status, body[:80], raw[:200])
        assert json.loads(raw)["error"]["message"], raw[:200]
    status, raw = server.raw("/v1/responses", json.dumps(_body()).encode(), headers=headers)
    assert status == 200 and json.loads(raw)["object"] == "response"
    effort = json.dumps(_body(reasoning={"effort": "high"})).encode()
    assert server.raw("/v1/responses", effort, headers=headers)[0] == 200
    status, _ = server.raw("/v1/responses", json.dumps(_body()).encode(), key="wrong")
    assert status == 401


def test_event_sequence_accumulates_in_the_clients_stream_state():
    """Reasoning, text and a function call through `EventStream`, read by the `openai`
    client's own accumulator (`ResponseStreamState`): its completed response holds the same
    three items."""
    from openai._models import construct_type_unchecked
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from agentrt.server import responses, responses_schema

    events = thinking_text_and_call()
    req = responses_schema.decode(json.dumps(_body(tools=R_TOOLS)).encode())
    stream = responses.EventStream(responses.Shell(req, "tiny"))
    text = stream.start() + "".join(t for e in events for t in stream.event(e))
    state = ResponseStreamState(input_tools=R_TOOLS, text_format=openai.omit)
    completed = None
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        body = json.loads(data[len("data: ") :])
        assert name == f"event: {body['type']}"
        for out in state.handle_event(
            construct_type_unchecked(type_=ResponseStreamEvent, value=body)
        ):
            if out.type == "response.completed":
                completed = out.response
    assert completed is not None and completed.status == "completed"
    assert _texts(completed.output) == [
        ("reasoning", "Hmm."),
        ("message", "Reading."),
        ("function_call", 'read_file:{"path": "a.py"}'),
    ]
    assert completed.usage.input_tokens_details.cached_tokens == 30


def test_both_apis_render_a_conversation_to_the_same_tokens():
    """Instructions, tools, reasoning, a message, a function call and its output, in the
    Responses shape and in the chat-completions shape: the same prompt token ids."""
    from agentrt import Runtime
    from agentrt.server import responses_schema

    body = _body(
        instructions="You are an agent.",
        tools=R_TOOLS,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Read main.py"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "I should read it."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Reading.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "read_file",
                "arguments": '{"path": "main.py"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"},
            {"role": "user", "content": "Now explain it."},
        ],
    )
    rt = Runtime.open("tiny", cache="off")
    req = responses_schema.decode(json.dumps(body).encode())
    assert (
        rt.prepare(*responses_schema.to_plain(req)).prompt_ids
        == rt.prepare(chat_with_call("call_1"), TOOLS).prompt_ids
    )


def test_openai_agents_sdk_runs_against_the_server(server, monkeypatch):
    """The OpenAI Agents SDK (from the package index) with a function tool, over the Responses
    API and over chat completions, the model's replies scripted (a tool call, then an answer):
    each run calls the tool, sends its output back, reads the first turn's checkpoints, and
    ends with the answer."""
    pytest.importorskip("agents", reason="openai-agents is a test extra")
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def read_file(path: str) -> str:
        """Read a file of the repository."""
        calls.append(path)
        return "print(1)"

    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "main.py"}}\n</tool_call>'
    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)
    for model in (
        OpenAIResponsesModel(model="tiny", openai_client=client),
        OpenAIChatCompletionsModel(model="tiny", openai_client=client),
    ):
        script_replies(monkeypatch, server.chat.runtime, [call, "Done."])
        agent = Agent(
            name="coder",
            instructions="You read files.",
            tools=[read_file],
            model=model,
            model_settings=ModelSettings(max_tokens=64, temperature=0),
        )
        result = Runner.run_sync(agent, f"Read main.py ({type(model).__name__})", max_turns=3)
        assert result.final_output == "Done." and len(result.raw_responses) == 2
        first, second = (r.usage for r in result.raw_responses)
        assert first.input_tokens > 0 and second.input_tokens_details.cached_tokens > 0
    assert calls == ["main.py", "main.py"]


ARGS = '{"path": "src/main.py", "lines": 40}'
CALL = '<tool_call>\n{"name": "read_file", "arguments": ' + ARGS + "}\n</tool_call>"


def test_tool_calls_stream_incrementally_on_both_openai_apis(client, server, monkeypatch):
    """The model's reply scripted (a tool call): streamed, the call's id and name come first,
    then its arguments in several deltas; reassembled, they equal the call of the same request
    not streamed (chat completions and responses)."""
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Read it"}], tools=TOOLS)
    script_replies(monkeypatch, server.chat.runtime, [CALL, CALL])
    whole = client.chat.completions.create(**ask, max_tokens=64, temperature=0)
    (want,) = whole.choices[0].message.tool_calls
    parts: dict[int, dict] = {}
    deltas = 0
    for chunk in client.chat.completions.create(**ask, max_tokens=64, temperature=0, stream=True):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got = parts.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name:
                assert got["name"] is None and not got["arguments"]  # the name comes first
                got["name"] = call.function.name
            got["arguments"] += call.function.arguments or ""
            deltas += bool(call.function.arguments)
    assert parts == {0: {"name": "read_file", "arguments": want.function.arguments}}
    assert json.loads(want.function.arguments) == {"path": "src/main.py", "lines": 40}
    assert deltas > 1

    inputs = dict(model="tiny", input="Read it", tools=R_TOOLS, max_output_tokens=64)
    script_replies(monkeypatch, server.chat.runtime, [CALL, CALL])
    (item,) = [o for o in client.responses.create(**inputs).output if o.type == "function_call"]
    events = list(client.responses.create(**inputs, stream=True))
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(args) > 1 and "".join(args) == item.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == item.arguments and done.name == "read_file"
