"""The built-in agent loop: tools confined to the working directory, invalid calls reported back
as tool errors, the loop on the tiny model, and a scripted model driving several turns."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from util import run_cli

from agentrt.session.agent import Tools, run_agent
from agentrt.session.tokens import GeneratedIds


def test_tools(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def alpha():\n    return 1\n")
    tools = Tools(tmp_path, command_timeout=5, approve="auto")
    assert "pkg/" in tools.call("list_dir", '{"path": "."}')
    assert "return 1" in tools.call("read_file", '{"path": "pkg/a.py"}')
    assert "pkg/a.py:1:" in tools.call("grep", '{"pattern": "def alpha"}')
    assert "[exit code 0]" in tools.call("run_command", '{"command": "echo hi"}')
    assert "timed out" in tools.call("run_command", '{"command": "sleep 10", "timeout": 1}')
    long = tools.call("run_command", '{"command": "python3 -c \\"print(\'x\' * 50000)\\""}')
    assert "characters omitted" in long


def test_invalid_calls_become_tool_errors(tmp_path):
    from agentrt.session.agent import _execute

    tools = Tools(tmp_path)
    bad = [
        ("nope", "{}"),
        ("read_file", "{not json"),
        ("read_file", "[1]"),
        ("read_file", '{"path": "../etc/passwd"}'),
        ("read_file", '{"wrong": 1}'),
        ("read_file", '{"path": "missing.txt"}'),
        ("grep", '{"pattern": "("}'),
    ]
    for name, args in bad:
        out = _execute(tools, {"function": {"name": name, "arguments": args}})
        assert out.startswith("ERROR: "), (name, args, out)


class _ScriptedModel:
    """A test double of Runtime.chat that asks for one tool call, then answers."""

    def __init__(self) -> None:
        self.seen: list[list[dict]] = []
        self.prepared: list[int] = []  # turns after which the engine prepared for the next

    def prepare_ahead(self) -> bool:
        self.prepared.append(len(self.seen))
        return True

    def chat(self, messages, tools=None, max_tokens=0):
        self.seen.append([dict(m) for m in messages])
        calls = []
        if len(self.seen) == 1:
            calls = [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "list_dir", "arguments": '{"path": "."}'},
                }
            ]
        elif len(self.seen) == 2:
            calls = [
                {"id": "c2", "type": "function", "function": {"name": "launch", "arguments": "{}"}}
            ]
        content = "Done: there is one file." if not calls else ""
        usage = {"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 1}
        return SimpleNamespace(
            content=content,
            reasoning_content=None,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else "stop",
            usage=usage,
            timings={"ttft_s": 0.0},
            message=lambda: {
                "role": "assistant",
                "content": content,
                **({"tool_calls": calls} if calls else {}),
            },
        )


def test_loop_feeds_tool_results_and_errors_back(tmp_path):
    (tmp_path / "only.txt").write_text("x")
    model = _ScriptedModel()
    run = run_agent(model, "what is here?", Tools(tmp_path), max_turns=5)
    assert run.finished and run.turns == 3
    tool_msgs = [m for m in run.messages if m["role"] == "tool"]
    assert "only.txt" in tool_msgs[0]["content"] and tool_msgs[1]["content"].startswith(
        "ERROR: unknown tool"
    )
    assert len(run.requests) == 3 and run.requests[2]["messages"][-1]["role"] == "tool"
    assert model.prepared == [1, 2]  # while each turn's tools ran (not after the answer)


@pytest.mark.slow
def test_run_command_on_tiny_completes(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    trace = tmp_path / "run.jsonl"
    proc = run_cli(
        "run",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--workdir",
        str(tmp_path),
        "--max-tokens",
        "16",
        "--trace",
        str(trace),
        "list the files here",
    )
    assert proc.returncode == 0, proc.stderr
    assert "turn(s)" in proc.stderr and trace.is_file()
    lines = trace.read_text().splitlines()
    assert json.loads(lines[0])["agentrt_trace"] == 1 and len(lines) >= 2


def test_generated_ids_are_spliced_back(tmp_path):
    from agentrt.models.tiny import ensure_tiny
    from agentrt.session.tokenizer import load_tokenizer

    tok = load_tokenizer(ensure_tiny())
    text = "hello world"
    odd = [
        i for ch in text for i in tok.encode(ch, add_special_tokens=False)
    ]  # one token per character
    assert odd != tok.encode(text, add_special_tokens=False)
    memory = GeneratedIds(tok)
    memory.remember(odd)
    prompt = "<|im_start|>assistant\n" + text + "<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n"
    ids = memory.encode(prompt)
    assert memory.spliced == 1
    windows = [ids[i : i + len(odd)] for i in range(len(ids) - len(odd) + 1)]
    assert odd in windows  # the generated ids, exactly, inside the prompt
    assert tok.decode(ids) == prompt


def test_generated_ids_spliced_with_prefix_reuse():
    """Turns that carry this runtime's replies: each prompt reuses the previous one's ids up to
    a special token (splices included) and splices only in the rest, giving the ids of a fresh
    encoding with the same remembered generations."""
    from agentrt.models.tiny import ensure_tiny
    from agentrt.session.tokenizer import load_tokenizer

    tok = load_tokenizer(ensure_tiny())
    memory, prompt = GeneratedIds(tok), "<|im_start|>system\n" + "be brief. " * 300 + "<|im_end|>\n"
    for turn in range(4):
        prompt += f"<|im_start|>user\nquestion {turn}<|im_end|>\n<|im_start|>assistant\n"
        memory.encode(prompt)
        reply = f"answer {turn} hello world"
        odd = [i for ch in reply for i in tok.encode(ch, add_special_tokens=False)]
        memory.remember(odd)  # a generation tokenized unlike its text
        prompt += reply + "<|im_end|>\n"
    prompt += "<|im_start|>user\nlast<|im_end|>\n<|im_start|>assistant\n"
    before = memory.prefix.reused
    ids = memory.encode(prompt)
    assert memory.prefix.reused > before  # the shared part was not re-encoded
    fresh = GeneratedIds(tok)
    fresh.items = dict(memory.items)
    assert ids == fresh.encode(prompt) and fresh.spliced == 4
    assert tok.decode(ids) == prompt


def test_generated_special_token_text_disables_prefix_reuse():
    """A reply that spells a special token's text with ordinary tokens (no special id): prompts
    that carry it are encoded whole (prefix reuse counts special tokens by their text), and an
    edited retry still gives the ids of a fresh encoding."""
    from agentrt.models.tiny import ensure_tiny
    from agentrt.session.tokenizer import load_tokenizer

    tok = load_tokenizer(ensure_tiny())
    memory = GeneratedIds(tok)
    base = "<|im_start|>system\n" + "be brief. " * 300 + "<|im_end|>\n<|im_start|>user\nq"
    base += "<|im_end|>\n<|im_start|>assistant\n"
    memory.encode(base)
    reply = "write <|im_start|> literally"
    memory.remember([i for ch in reply for i in tok.encode(ch, add_special_tokens=False)])
    history = base + reply + "<|im_end|>\n<|im_start|>user\nsecond question"
    memory.encode(history + "<|im_end|>\n<|im_start|>assistant\n")
    retry = history + ", edited<|im_end|>\n<|im_start|>assistant\n"
    ids = memory.encode(retry)
    fresh = GeneratedIds(tok)
    fresh.items = dict(memory.items)
    assert ids == fresh.encode(retry) and tok.decode(ids) == retry
    assert memory.prefix.last is None  # nothing to reuse from a prompt holding it


def test_tools_do_not_follow_links_out_and_survive_bad_arguments(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("secret-outside")
    work = tmp_path / "work"
    work.mkdir()
    (work / "link.txt").symlink_to(outside)
    tools = Tools(work)
    assert "secret" not in tools.call("grep", '{"pattern": "secret"}')
    relative = Tools(Path("."))  # a relative working directory is resolved once
    assert relative.cwd.is_absolute()
    from agentrt.session.agent import _execute

    for name, args in [
        ("run_command", '{"command": "echo", "timeout": "abc"}'),
        ("read_file", '{"path": "link.txt"}'),
    ]:
        assert _execute(tools, {"function": {"name": name, "arguments": args}}).startswith(
            "ERROR: "
        )


def test_run_command_timeout_kills_the_whole_group(tmp_path):
    import subprocess

    tools = Tools(tmp_path, command_timeout=1, approve="auto")
    marker = f"agentrt-sleep-{tmp_path.name}"
    assert "timed out" in tools.call(
        "run_command", json.dumps({"command": f"bash -c 'exec -a {marker} sleep 30' & wait"})
    )
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left.strip() == ""


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
def test_prefix_encoder_matches_full_encoding(which):
    """Prompts that extend, edit or shrink the previous one encode to exactly the ids of a full
    encoding, while the shared part before the last special token is not re-encoded."""
    import random

    from conftest import SHARED

    from agentrt.models.tiny import ensure_tiny
    from agentrt.session.tokenizer import load_tokenizer
    from agentrt.session.tokens import PrefixEncoder

    path = ensure_tiny() if which == "tiny" else SHARED / "tokenizers" / "qwen3"
    if not path.is_dir():
        pytest.skip(f"{path} is absent")
    tok = load_tokenizer(path)
    rnd = random.Random(5)
    words = ["def", " x", "  ", "\n", "é", "ß", "<tool_call>", '{"a": 1}', " ", "\t", "ab", "🙂"]

    def message(role: str) -> str:
        body = "".join(rnd.choice(words) for _ in range(rnd.randrange(50, 400)))
        return f"<|im_start|>{role}\n{body}<|im_end|>\n"

    enc, prompt, reused = PrefixEncoder(tok), "", 0
    for step in range(40):
        prompt += message(rnd.choice(["user", "assistant", "tool"]))
        if step % 7 == 6:  # an edit inside the transcript (a framework rewriting context)
            at = rnd.randrange(len(prompt))
            prompt = prompt[:at] + "edited" + prompt[at:]
        if step % 11 == 10:
            prompt = prompt[: len(prompt) // 2]
        tail = prompt + "<|im_start|>assistant\n"
        assert enc.encode(tail) == tok.encode(tail, add_special_tokens=False)
        reused = enc.reused
    assert reused > 0


@pytest.mark.parametrize("kind", ["overlapping", "single_word", "normalized"])
def test_prefix_encoder_never_splits_at_unsafe_special_tokens(kind):
    """Special tokens whose text does not always become the token (part of another added token,
    whole-word matching, normalized) are no split points: the ids equal a full encoding."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from agentrt.session.tokens import PrefixEncoder

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"])
    tk.train_from_iterator(["hello world a test of words"] * 20, trainer)
    added = {
        "overlapping": [AddedToken("<|a|>", special=True), AddedToken("<|a|>!", special=True)],
        "single_word": [AddedToken("<|a|>", special=True, single_word=True)],
        "normalized": [AddedToken("<|a|>", special=True, normalized=True)],
    }[kind]
    tk.add_special_tokens(added)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    base = "hello world " * 300
    prev, new = {  # the split point would be a text occurrence that is not the token
        "overlapping": ("<|a|>! q x <|a|> y<|a|> z", "<|a|>! q x <|a|> Q"),
        "single_word": ("a<|a|> q X <|a|> tail", "a<|a|> q Y"),
        "normalized": ("a<|a|> q X <|a|> tail", "a<|a|> q Y"),
    }[kind]
    prev, new = base + prev, base + new
    enc = PrefixEncoder(tok)
    enc.encode(prev)
    assert enc.encode(new) == tok.encode(new, add_special_tokens=False)


def test_grep_searches_a_file_and_stops_a_search_that_never_ends(tmp_path):
    (tmp_path / "a.py").write_text("def alpha():\n    pass\n")
    (tmp_path / "b.txt").write_text("a" * 40 + "!\n")
    tools = Tools(tmp_path, command_timeout=1.5)
    assert tools.call("grep", '{"pattern": "alpha", "path": "a.py"}') == "a.py:1: def alpha():"
    assert tools.call("grep", '{"pattern": "zeta"}') == "(no matches)"
    stopped = tools.call("grep", json.dumps({"pattern": "(a+)+$"}))  # backtracks for hours
    assert stopped.endswith("[search stopped after 1.5 s]")
    (tmp_path / "many.txt").write_text("hit\n" * 300)
    many = tools.call("grep", '{"pattern": "hit", "path": "many.txt"}')
    assert many.count("many.txt:") == 200 and many.endswith("[stopped at 200 matching lines]")


def test_long_listings_and_match_lines_are_capped_and_say_so(tmp_path):
    from agentrt.session.sandbox import MAX_OUTPUT

    for i in range(520):
        (tmp_path / f"file-with-a-long-name-{i:04d}.txt").write_text("x" * 300 + "\n")
    tools = Tools(tmp_path)
    listing = tools.call("list_dir", "{}")
    assert "[... 20 more entries]" in listing and len(listing) <= MAX_OUTPUT + 100
    found = tools.call("grep", '{"pattern": "x"}')
    assert "characters omitted" in found and len(found) <= MAX_OUTPUT + 100


def test_a_reply_cut_by_the_token_limit_does_not_finish_the_run(tmp_path):
    import time

    class _Cut:
        def chat(self, messages, tools=None, max_tokens=0):
            time.sleep(0.3)
            return SimpleNamespace(
                content="",
                reasoning_content="thinking at length",
                tool_calls=[],
                finish_reason="length",
                usage={},
                message=lambda: {"role": "assistant", "content": ""},
            )

    run = run_agent(_Cut(), "task", Tools(tmp_path), max_turns=3)
    assert not run.finished and run.cut and run.turns == 1
    assert run.requests[0]["t"] < 0.1  # when the request was sent, not when it was answered
