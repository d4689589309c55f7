"""Semantic state cache: transparency (outputs identical to cache="off", cached_tokens exactly
where a checkpoint could apply), persistence across processes, crash and corruption safety,
fingerprints, concurrency, eviction, prefix mode, and the `agentrt cache` commands."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lmdb
import pytest
import torch
from util import TOOLS, agent_requests, invoke_cli

from agentrt import Runtime
from agentrt.statecache.config import StateCacheConfig
from agentrt.statecache.keys import BLOCK, PrefixKeys
from agentrt.statecache.report import verify_all
from agentrt.statecache.store import Store

HERE = Path(__file__).parent


def _config(state_dir: Path, **kw) -> StateCacheConfig:
    return StateCacheConfig(state_dir=state_dir, min_distance=0, queue_size=10_000, **kw)


def _semantic(model: str, state_dir: Path, **kw) -> Runtime:
    return Runtime.open(model, cache="semantic", state_cache=_config(state_dir, **kw))


def _prompt_ids(rt: Runtime, msgs) -> list[int]:
    text = rt.tokenizer.apply_chat_template(
        msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    return rt.tokenizer.encode(text, add_special_tokens=False)


class _Oracle:
    """Computes where a checkpoint could apply, from everything the runtime has seen."""

    def __init__(self, boundaries, hybrid: bool) -> None:
        self.boundaries, self.hybrid = boundaries, hybrid
        self.saved: list[tuple[list[int], int]] = []  # (sequence, checkpoint position)
        self.live: list[int] = []

    def expected(self, prompt: list[int]) -> int:
        best = 0
        for pos, _ in self.boundaries.find(prompt):
            if pos < len(prompt) and any(
                q == pos and s[:pos] == prompt[:pos] for s, q in self.saved
            ):
                best = max(best, pos)
        if not self.hybrid:
            for pos in range(BLOCK, len(prompt), BLOCK):
                if any(q >= pos and s[:pos] == prompt[:pos] for s, q in self.saved):
                    best = max(best, pos)
        common = 0
        while common < min(len(self.live), len(prompt) - 1) and self.live[common] == prompt[common]:
            common += 1
        if common == len(self.live) or not self.hybrid:
            best = max(best, common)
        return best

    def record(self, prompt: list[int], generated: list[int], start: int) -> None:
        for pos, _ in self.boundaries.find(prompt, start):
            if pos > start:
                self.saved.append((prompt, pos))
        fed = prompt + generated[:-1]
        for pos in range(len(prompt) + 1, len(fed) + 1):
            if self.boundaries.ends_with(fed[:pos]):
                self.saved.append((fed, pos))
        self.live = fed


@pytest.fixture(params=["hybrid", "attention-only"])
def model(request, tiny_qwen3) -> str:
    return "tiny" if request.param == "hybrid" else str(tiny_qwen3)


@pytest.mark.slow
def test_semantic_is_transparent_and_reuses_exactly_where_possible(model, tmp_path):
    off = Runtime.open(model, cache="off")
    sem = _semantic(model, tmp_path / "state")
    oracle = _Oracle(sem.reuse.cache.boundaries, hybrid=sem.engine.cfg.is_hybrid)
    cached, sources = [], set()
    for tag in ("a", "b"):
        for msgs in agent_requests(tag, output_len=700):
            want = off.chat(msgs, tools=TOOLS, max_tokens=10)
            got = sem.chat(msgs, tools=TOOLS, max_tokens=10)
            assert got.token_ids == want.token_ids
            prompt = _prompt_ids(sem, msgs)
            assert got.usage["cached_tokens"] == oracle.expected(prompt)
            oracle.record(prompt, got.token_ids, got.usage["cached_tokens"])
            cached.append(got.usage["cached_tokens"])
            sources.add(got.restore_source)
    assert cached[0] == 0 and all(c > 0 for c in cached[1:5])  # every later turn reuses state
    if sem.engine.cfg.is_hybrid:  # cut back on the device, or a snapshot over the live KV
        assert "device" in sources and "ram+live_kv" in sources, sources
    stats = sem.reuse.cache.stats
    sem.close()
    assert stats["dropped_queue_full"] == 0 and stats["write_errors"] == 0


def test_captures_on_the_chunk_grid_restore_early_and_stay_transparent(tmp_path):
    """`capture_grid=64` (the default with fla's kernels on a GPU; here with torch's): eager
    prefill takes a checkpoint inside a piece at the last chunk start before its boundary. The
    record is found by the boundary's prefix and restores those fewer tokens (the state there,
    as a prefill of them alone gives it); greedy outputs stay those of `off`."""
    from dataclasses import replace

    off = Runtime.open("tiny", cache="off")
    sem = _semantic("tiny", tmp_path / "state")
    sem.engine.config = replace(sem.engine.config, capture_grid=64)
    assert sem.engine.capture_grid == 64
    early, cached = set(), []
    for msgs in agent_requests("g", output_len=700):
        want = off.chat(msgs, tools=TOOLS, max_tokens=10)
        got = sem.chat(msgs, tools=TOOLS, max_tokens=10)
        assert got.token_ids == want.token_ids
        cached.append(got.usage["cached_tokens"])
        state = sem._live_state()
        for asked, at in state.moved.items():
            assert asked - 64 < at < asked and at in state.captured_positions()
            early.add(at)
    assert early, "no capture inside an eager piece moved onto the grid"
    assert all(c > 0 for c in cached[1:5])
    sem.close()
    # a record of a moved capture, read back by the boundary's prefix from LMDB
    cache = _semantic("tiny", tmp_path / "state", ram_bytes=0).reuse.cache
    prompt = _prompt_ids(off, agent_requests("g", output_len=700)[0])
    fresh = off.engine.new_state()
    hit = cache.restore_into(prompt, 0, fresh.kv_caches(), fresh.linear_caches())
    assert hit is not None and hit.source == "lmdb" and hit.pos in early, (hit, early)
    fresh.adopt(prompt[: hit.pos])
    ref = off.engine.new_state()
    off.engine.prefill(ref, prompt[: hit.pos])
    for a, b in zip(fresh.linear_caches(), ref.linear_caches(), strict=True):
        assert torch.allclose(a.recurrent, b.recurrent, atol=1e-4)
        assert torch.allclose(a.conv, b.conv, atol=1e-5)
    cache.close()


def test_a_prompt_end_checkpoint_is_taken_on_the_grid_and_restores_there(tmp_path):
    """`capture_grid=64`: the checkpoint at a prompt's end is taken at the last chunk start
    before it too, so a later turn restored from it resumes on the chunk grid a prefill of its
    whole prompt runs on (with fla on a GPU, such a turn's logits are bit-identical to that
    prefill's: `bench statecache --fidelity`); here its logits are those of the whole prefill
    (fp32 CPU, up to rounding: torch's matmuls round by shape)."""
    from dataclasses import replace

    from agentrt.engine import SamplingParams

    sem = _semantic("tiny", tmp_path / "state")
    eng = sem.engine
    eng.config = replace(eng.config, capture_grid=64)
    marker = sem.tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = [(7 + 31 * i) % 1900 + 20 for i in range(299)] + [marker]  # a boundary at 300
    second = first + [(5 + 17 * i) % 1900 + 20 for i in range(150)]
    eng.generate(sem._live_state(), first, SamplingParams(max_tokens=2), sem.reuse)
    assert sem._live_state().moved == {300: 256}
    sem.reuse.cache.flush()
    for ram in (True, False):  # from this process's cache, then from LMDB alone
        rt = sem if ram else _semantic("tiny", tmp_path / "state", ram_bytes=0)
        rt.engine.config = replace(rt.engine.config, capture_grid=64)
        state = rt.engine.new_state()
        start, kind = rt.reuse.begin(state, second)
        assert (start, kind) == (256, "message_end") and rt.reuse.source != "device"
        restored = rt.engine.prefill(state, second[start:])
        whole = rt.engine.prefill(rt.engine.new_state(), second)
        assert torch.allclose(restored, whole, atol=1e-5)
        rt.close()


def test_reasoning_dropped_and_truncated_outputs_reuse_earlier_boundaries(tmp_path):
    sem = _semantic("tiny", tmp_path / "state")
    results = [sem.chat(m, tools=TOOLS, max_tokens=4) for m in agent_requests("x", output_len=700)]
    first_prompt = _prompt_ids(sem, agent_requests("x")[0])
    # new user turn: reasoning of earlier turns vanishes; the state after the first prompt applies
    assert results[3].usage["cached_tokens"] == len(first_prompt)
    assert results[3].checkpoint == "turn_start"
    # truncated old tool output: the checkpoint right before that tool message applies
    assert results[4].checkpoint == "message_end"
    sem.close()


def test_the_leading_messages_are_kept_however_short_the_task(tmp_path):
    """A new session's first prompt keeps the end of its system block (system prompt and
    tools, what every session of one agent shares) although the task after it is shorter than
    the checkpoints' minimum distance; the next session's first turn starts from it. Message
    ends after the first assistant turn keep the distance rule."""
    from agentrt.statecache import Boundaries

    cfg = StateCacheConfig(state_dir=tmp_path / "state", queue_size=10_000)  # min_distance 128
    sem = Runtime.open("tiny", cache="semantic", state_cache=cfg)
    system = {"role": "system", "content": "You are a careful agent. " * 60}
    first = [system, {"role": "user", "content": "Fix the bug."}]
    ids = _prompt_ids(sem, first)
    block_end = sem.reuse.cache.boundaries.first(ids, "message_end")
    assert 300 < block_end and len(ids) - block_end < 128  # (a long system block, a short task)
    wanted = sem.reuse.cache.capture_positions(ids, 0)
    assert block_end in wanted and max(wanted) == len(ids)
    sem.chat(first, tools=TOOLS, max_tokens=2)
    other = sem.chat(
        [system, {"role": "user", "content": "Add a test."}], tools=TOOLS, max_tokens=2
    )
    assert other.usage["cached_tokens"] == block_end and other.checkpoint == "message_end"
    # constructed ids: 9 ends a message, (5, 6) starts an assistant turn
    marks = Boundaries({"message_end": ((9,),), "turn_start": ((5, 6),)})
    assert marks.first([1, 5, 2, 5, 6, 9], "turn_start") == 5
    assert marks.first([1, 5, 2], "turn_start") is None
    prompt = [1] * 299 + [9] + [2] * 40 + [9, 5, 6] + [3] * 200 + [9] + [3] * 20 + [9, 5, 6]
    sem.reuse.cache.boundaries = marks
    # boundaries: message ends at 300, 341, 544, 565; assistant turns at 343, 567. The system
    # end (300) kept although the first turn (kept: 224 tokens before the last) is 43 tokens
    # on, the task's end (341) not: 41 tokens past it. The message ends after the first turn
    # keep the distance rule: 23 and 2 tokens before the last, not kept
    assert sorted(sem.reuse.cache.capture_positions(prompt, 0)) == [300, 343, 567]
    assert sorted(sem.reuse.cache.capture_positions(prompt, 250)) == [567]  # 300: too near
    assert sorted(sem.reuse.cache.capture_positions(prompt, 343)) == [567]
    # a long task: its end, just before the first turn's header (kept), adds nothing
    task = [1] * 299 + [9] + [2] * 199 + [9, 5, 6]
    assert sorted(sem.reuse.cache.capture_positions(task, 0)) == [300, 502]
    sem.close()


@pytest.mark.parametrize(
    "family, template",
    [("qwen3", "chat_template.qwen3-hybrid-thinking.jinja"), ("gpt-oss", "chat_template.jinja")],
)
def test_real_templates_keep_the_block_every_session_of_an_agent_shares(family, template):
    """With the real Qwen3 and gpt-oss (harmony) tokenizers and chat templates, a new
    session's first prompt (a long system prompt, tools, a short task) keeps a checkpoint
    where the shared block ends: the system message (Qwen3 puts the tools in it) or harmony's
    developer message (instructions and tools), so a session with another task restores it."""
    from conftest import SHARED
    from transformers import AutoTokenizer

    from agentrt.session.boundary_text import resolve
    from agentrt.statecache.boundaries import choose_captures

    directory = SHARED / "tokenizers" / family
    if not (directory / template).is_file():
        pytest.skip("needs ../shared/data")
    tok = AutoTokenizer.from_pretrained(directory)
    chat_template = (directory / template).read_text()
    system = {"role": "system", "content": "You are an airline agent. Follow the policy. " * 60}

    def ids(task: str) -> list[int]:
        text = tok.apply_chat_template(
            [system, {"role": "user", "content": task}],
            tools=TOOLS,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
        return tok.encode(text, add_special_tokens=False)

    first, other = ids("Book a flight to Seattle."), ids("Cancel my reservation, please.")
    shared = len(os.path.commonprefix([first, other]))
    chosen = choose_captures(resolve(tok), first, 0, 128)
    kept = [pos for pos, kind in chosen.items() if kind == "message_end"]
    # the shared block's end, a few tokens (the next message's header) before the prompts differ
    assert kept and max(kept) <= shared and shared - max(kept) < 8 and shared > 500
    assert max(chosen) == len(first)


def test_vanished_chunks_fall_back_with_identical_outputs(tmp_path):
    """KV chunks deleted behind the cache's back (another process evicting): restores that need
    them fail after other workers filled part of the caches; the turn falls back, outputs stay
    identical to `off`, and the cache keeps working."""
    state = tmp_path / "state"
    requests = agent_requests("v", 700)
    sem = _semantic("tiny", state, ram_bytes=0)  # nothing in RAM: every restore reads LMDB
    for msgs in requests[:3]:
        sem.chat(msgs, tools=TOOLS, max_tokens=4)
    sem.close()
    env = lmdb.open(str(state), max_dbs=8)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True) as txn:
        keys = [bytes(k) for k, _ in txn.cursor(db=chunks)]
        for key in keys[len(keys) // 2 :]:  # the later half of the chunks
            txn.delete(key, db=chunks)
    env.close()
    off = Runtime.open(cache="off")
    sem = _semantic("tiny", state, ram_bytes=0)
    for msgs in requests[2:]:  # the first of them restores past a chunk edge (no live state)
        got = sem.chat(msgs, tools=TOOLS, max_tokens=4)
        assert got.token_ids == off.chat(msgs, tools=TOOLS, max_tokens=4).token_ids
    assert sem.reuse.cache.stats["payload_missing"] >= 1  # a restore did hit a missing chunk
    sem.close()


def _run_script(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


SECOND_PROCESS = """
    import json, sys
    from pathlib import Path
    from agentrt import Runtime
    from agentrt.statecache.config import StateCacheConfig
    from util import TOOLS, agent_requests
    config = StateCacheConfig(state_dir=Path(sys.argv[1]), min_distance=0)
    rt = Runtime.open("tiny", cache="semantic", state_cache=config)
    res = rt.chat(agent_requests(sys.argv[2], 700)[int(sys.argv[3])], tools=TOOLS, max_tokens=6)
    print(json.dumps({"cached": res.usage["cached_tokens"], "ids": res.token_ids}))
"""


@pytest.mark.slow
def test_second_process_reuses_checkpoints(tmp_path):
    state = tmp_path / "state"
    sem = _semantic("tiny", state)
    for msgs in agent_requests("p", 700)[:3]:
        sem.chat(msgs, tools=TOOLS, max_tokens=6)
    sem.close()
    proc = _run_script(SECOND_PROCESS, str(state), "p", "3")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    off = Runtime.open(cache="off").chat(agent_requests("p", 700)[3], tools=TOOLS, max_tokens=6)
    assert out["cached"] > 0 and out["ids"] == off.token_ids


WRITER = """
    import sys, random
    from pathlib import Path
    from agentrt import Runtime
    from agentrt.statecache.config import StateCacheConfig
    from util import TOOLS, agent_requests
    state, log = Path(sys.argv[1]), Path(sys.argv[2])
    config = StateCacheConfig(state_dir=state, min_distance=0, queue_size=10_000)
    rt = Runtime.open("tiny", cache="semantic", state_cache=config)
    print("ready", flush=True)
    for i in range(10_000):
        tag = f"{sys.argv[3]}-{i}"
        with log.open("a") as f:
            f.write(tag + "\\n")
        for msgs in agent_requests(tag, 500)[:4]:
            rt.chat(msgs, tools=TOOLS, max_tokens=2)
"""


def _wait_for_records(state: Path, timeout: float) -> None:
    """Poll (read-only, as another process would) until the store holds a committed record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            env = lmdb.open(str(state), max_dbs=8, readonly=True)
        except lmdb.Error:
            env = None
        if env is not None:
            try:
                records = env.open_db(b"records", create=False)
                with env.begin() as txn:
                    if txn.stat(records)["entries"]:
                        return
            except lmdb.Error:
                pass
            finally:
                env.close()
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint committed within {timeout} s")


@pytest.mark.slow
def test_sigkill_while_writing_never_restores_wrong_state(tmp_path):
    state, log = tmp_path / "state", tmp_path / "tags.log"
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    rng = random.Random(0)
    for round_ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WRITER), str(state), str(log), f"r{round_}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        assert proc.stdout.readline().strip() == b"ready"
        if round_ == 0:  # on a loaded machine the first commit can take a while
            _wait_for_records(state, timeout=120)
        time.sleep(rng.uniform(0.5, 2.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = Store(state, StateCacheConfig().max_bytes)
    assert store.stats()["records"] > 0
    assert verify_all(store) == 0  # every committed record decodes and verifies
    store.close()
    tags = log.read_text().split()
    off = Runtime.open(cache="off")
    sem = _semantic("tiny", state)
    reused = 0
    for tag in tags[-3:] + tags[:2]:
        for msgs in agent_requests(tag, 500)[:4]:
            got = sem.chat(msgs, tools=TOOLS, max_tokens=3)
            assert got.token_ids == off.chat(msgs, tools=TOOLS, max_tokens=3).token_ids
            reused += got.usage["cached_tokens"]
    assert reused > 0
    sem.close()


@pytest.mark.parametrize("where", ["middle", "size field"])
def test_corrupted_payload_is_detected_deleted_and_falls_back(tmp_path, where):
    """A flipped bit in a stored blob (in its data, or in the raw size its first part declares,
    which must not turn into a huge allocation) is detected, the record deleted, the turn falls
    back to a full prefill with the same output."""
    from agentrt.statecache.codec import _HEAD, blob_parts

    state = tmp_path / "state"
    requests = agent_requests("c", 700)
    sem = _semantic("tiny", state)
    for msgs in requests[:3]:
        sem.chat(msgs, tools=TOOLS, max_tokens=4)
    sem.close()
    env = lmdb.open(str(state), max_dbs=8)
    blobs, records = env.open_db(b"blobs"), env.open_db(b"records")
    with env.begin(write=True) as txn:
        keys = [bytes(k) for k, _ in txn.cursor(db=records)]
        for key in keys:  # flip one bit in every blob
            value = bytearray(txn.get(key, db=blobs))
            if where == "middle":
                value[len(value) // 2] ^= 0x40
            else:  # a high byte of the first part's raw length (+1 TiB)
                value[blob_parts(bytes(value))[0][0] + _HEAD.size - 3] ^= 0x01
            txn.put(key, bytes(value), db=blobs)
    env.close()
    sem = _semantic("tiny", state)
    got = sem.chat(requests[3], tools=TOOLS, max_tokens=4)
    assert got.usage["cached_tokens"] == 0  # nothing usable is left: full prefill
    assert (
        got.token_ids
        == Runtime.open(cache="off").chat(requests[3], tools=TOOLS, max_tokens=4).token_ids
    )
    assert sem.reuse.cache.stats["corrupt_deleted"] >= 1
    assert not sem.reuse.cache.store.has_record(keys[0]) or len(keys) > 1
    sem.close()


def test_other_model_dtype_or_format_never_matches(tmp_path, monkeypatch, tiny_qwen3):
    state = tmp_path / "state"
    requests = agent_requests("f", 700)
    sem = _semantic("tiny", state)
    for msgs in requests[:3]:
        sem.chat(msgs, tools=TOOLS, max_tokens=4)
    sem.close()
    other_weights = tmp_path / "tiny-seed1"
    from agentrt.models.synthetic import write_checkpoint
    from agentrt.models.tiny import build_tiny, ensure_tiny

    build_tiny(other_weights)
    write_checkpoint(
        "tiny",
        other_weights,
        seed=1,
        config_overrides=json.loads((ensure_tiny() / "config.json").read_text()),
    )
    for rt in (
        Runtime.open("tiny", cache="semantic", dtype="bfloat16", state_cache=_config(state)),
        Runtime.open(str(other_weights), cache="semantic", state_cache=_config(state)),
    ):
        assert rt.chat(requests[3], tools=TOOLS, max_tokens=2).usage["cached_tokens"] == 0
        rt.close()
    import agentrt.statecache.keys as keys

    monkeypatch.setattr(keys, "FORMAT_VERSION", keys.FORMAT_VERSION + 1)
    rt = _semantic("tiny", state)
    assert rt.chat(requests[3], tools=TOOLS, max_tokens=2).usage["cached_tokens"] == 0
    rt.close()
    monkeypatch.undo()
    rt = _semantic("tiny", state)  # the original model still matches
    assert rt.chat(requests[3], tools=TOOLS, max_tokens=2).usage["cached_tokens"] > 0
    rt.close()


CONCURRENT = """
    import json, sys
    from pathlib import Path
    from agentrt import Runtime
    from agentrt.statecache.config import StateCacheConfig
    from util import TOOLS, agent_requests
    config = StateCacheConfig(state_dir=Path(sys.argv[1]), min_distance=0, queue_size=10_000)
    rt = Runtime.open("tiny", cache="semantic", state_cache=config)
    for i in range(6):
        for msgs in agent_requests(f"{sys.argv[2]}-{i}", 500)[:3]:
            rt.chat(msgs, tools=TOOLS, max_tokens=2)
    cache = rt.reuse.cache
    cache.flush()
    print(json.dumps(dict(cache.stats)))
    rt.close()
"""


@pytest.mark.slow
def test_two_processes_share_a_state_dir(tmp_path):
    state = tmp_path / "state"
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env["OMP_NUM_THREADS"] = "1"  # two processes at once: one thread each (2-core CI)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(CONCURRENT), str(state), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name in ("p1", "p2")
    ]
    stats = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        stats.append(json.loads(out.strip().splitlines()[-1]))
    written = sum(s.get("write_written", 0) for s in stats)
    assert written > 0 and all(s.get("write_errors", 0) == 0 for s in stats)
    store = Store(state, StateCacheConfig().max_bytes)
    assert store.stats()["records"] == written  # nothing lost
    assert verify_all(store) == 0  # nothing corrupt
    store.close()
    sem = _semantic("tiny", state)
    for name in ("p1", "p2"):
        assert (
            sem.chat(agent_requests(f"{name}-0", 500)[2], tools=TOOLS, max_tokens=2).usage[
                "cached_tokens"
            ]
            > 0
        )
    sem.close()


def test_full_store_evicts_instead_of_failing(tmp_path):
    state = tmp_path / "state"
    cap = 2 * 2**20
    sem = _semantic("tiny", state, max_bytes=cap, ram_bytes=0)
    for i in range(6):
        for msgs in agent_requests(f"e{i}", 500)[:3]:
            sem.chat(msgs, tools=TOOLS, max_tokens=2)
    cache = sem.reuse.cache
    cache.flush()
    assert cache.stats["write_errors"] == 0 and cache.stats["write_written"] > 0
    assert cache.store.total_bytes() <= cap
    assert cache.store.stats()["records"] < cache.stats["write_written"]  # some were evicted
    sem.close()


def test_prefix_mode_reuses_only_exact_extensions(tmp_path):
    from agentrt.engine import SamplingParams
    from agentrt.engine.reuse import PrefixReuse

    rt = Runtime.open("tiny", cache="prefix")
    eng, reuse, state = rt.engine, rt.reuse, rt.engine.new_state()
    assert isinstance(reuse, PrefixReuse)
    prompt = list(range(10, 300))
    first = eng.generate(state, prompt, SamplingParams(max_tokens=5), reuse)
    extended = prompt + first.token_ids + [7, 8, 9]
    second = eng.generate(state, extended, SamplingParams(max_tokens=5), reuse)
    assert second.cached_tokens == len(prompt) + 4 and second.checkpoint == "live"
    edited = list(extended)
    edited[100] += 1  # an edit inside the history: a hybrid state cannot be cut back
    assert eng.generate(state, edited, SamplingParams(max_tokens=5), reuse).cached_tokens == 0


@pytest.mark.slow
def test_cache_cli_commands(tmp_path):
    state = tmp_path / "state"
    sem = _semantic("tiny", state)
    for msgs in agent_requests("cli", 500)[:2]:
        sem.chat(msgs, tools=TOOLS, max_tokens=2)
    sem.close()

    def run(*args: str, state_dir: Path = state):
        return invoke_cli("cache", *args, "--state-dir", str(state_dir))

    ls = run("ls", "--json", str(tmp_path / "ls.json"))
    assert ls.returncode == 0 and "turn_start" in ls.stdout
    rows = json.loads((tmp_path / "ls.json").read_text())
    assert rows and {"key", "model", "tokens", "kind", "mib", "hits"} <= set(rows[0])
    stats = run("stats")
    assert stats.returncode == 0 and "records" in stats.stdout
    gc = run("gc", "--verify", "--max-gb", "100")
    assert gc.returncode == 0 and "0 corrupt" in gc.stdout
    assert run("clear", "--yes").returncode == 0
    assert "0 checkpoint(s)" in run("ls").stderr
    missing = run("ls", state_dir=tmp_path / "none")
    assert missing.returncode == 2 and missing.stderr.startswith("error: no state cache")


def test_generated_boundary_tokens_are_checkpointed_during_decode(tmp_path):
    from agentrt.engine import SamplingParams
    from agentrt.statecache import Boundaries

    prompt = list(range(20, 400))
    first = Runtime.open("tiny", cache="off").generate(prompt, max_tokens=3)
    marker = Boundaries({"tool_call_end": ((first[0],),)})  # pretend the first token closes a call
    writer = _semantic("tiny", tmp_path / "state")
    writer.reuse.cache.boundaries = marker
    assert writer.generate(prompt, max_tokens=3) == first
    writer.close()
    reader = _semantic("tiny", tmp_path / "state", ram_bytes=0)
    reader.reuse.cache.boundaries = marker
    eng = reader.engine
    gen = eng.generate(
        eng.new_state(), prompt + first[:2] + [5], SamplingParams(max_tokens=2), reader.reuse
    )
    assert gen.cached_tokens == len(prompt) + 1 and gen.checkpoint == "tool_call_end"
    reader.close()


def _assert_bitwise_equal(a, b) -> None:
    assert a.num_tokens == b.num_tokens and a.token_ids == b.token_ids
    pairs = list(zip(a.kv, b.kv, strict=True))
    tensors = [(x, y) for (ka, va), (kb, vb) in pairs for x, y in ((ka, kb), (va, vb))]
    tensors += list(zip(a.conv + a.recurrent, b.conv + b.recurrent, strict=True))
    for x, y in tensors:
        assert x.dtype == y.dtype and x.cpu().equal(y.cpu())


@pytest.mark.parametrize("ram", [True, False])
def test_restored_state_is_bitwise_the_captured_state(tmp_path, ram):
    """Restore copies bytes: the state after restore equals the state captured, exactly."""
    from agentrt.engine.reuse import SemanticReuse

    sem = _semantic("tiny", tmp_path / "state")
    eng = sem.engine
    marker = sem.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = list(range(30, 900)) + [marker] + list(range(40, 60))
    pos = 871
    state = eng.new_state()
    eng.prefill(state, prompt, capture=[pos])
    captured = state.export(pos)
    conv, rec = state.linear_at(pos)
    sem.reuse.cache.save(prompt, pos, "message_end", state.kv_caches(), conv, rec)
    sem.reuse.cache.flush()
    reader = sem if ram else _semantic("tiny", tmp_path / "state", ram_bytes=0)
    assert isinstance(reader.reuse, SemanticReuse)
    fresh = eng.new_state()
    start, kind = reader.reuse.begin(fresh, prompt)
    assert (start, kind) == (pos, "message_end")
    _assert_bitwise_equal(fresh.export(), captured)
    sem.close()
    reader.close()


def test_hits_from_either_tier_reach_the_record_in_one_write(tmp_path, monkeypatch):
    """A restore from the RAM tier counts a hit as one from LMDB does (the eviction score ranks
    by hits); the writer stores the hits gathered in one transaction, not one per restore."""
    from agentrt.statecache import writer
    from agentrt.statecache.store import Store

    sem = _semantic("tiny", tmp_path / "state")
    eng, cache = sem.engine, sem.reuse.cache
    marker = sem.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = list(range(30, 300)) + [marker] + list(range(40, 60))
    state = eng.new_state()
    eng.prefill(state, prompt, capture=[271])
    conv, rec = state.linear_at(271)
    cache.save(prompt, 271, "message_end", state.kv_caches(), conv, rec)
    cache.flush()
    writes: list[dict] = []
    real = Store.touch
    monkeypatch.setattr(
        Store, "touch", lambda self, hits: (writes.append(dict(hits)), real(self, hits))
    )
    monkeypatch.setattr(writer, "TOUCH_IDLE_S", 60.0)  # (stored at close here)
    lmdb_reader = _semantic("tiny", tmp_path / "state", ram_bytes=0)
    for reader, source in ((sem, "ram"), (sem, "ram"), (lmdb_reader, "lmdb")):
        assert reader.reuse.begin(eng.new_state(), prompt)[0] == 271
        assert reader.reuse.cache.stats[f"hits_{source}"] >= 1
    assert writes == []  # (nothing written beside the requests)
    sem.close()
    lmdb_reader.close()
    assert [sum(w.values()) for w in writes] == [2, 1]
    store = Store(tmp_path / "state", StateCacheConfig().max_bytes)
    assert [rec.hits for _, rec in store.list_records()] == [3]
    store.close()


@pytest.mark.parametrize("ram", [True, False])
def test_windowed_layers_store_only_their_window_and_restore_exactly(tmp_path, tiny_gpt_oss, ram):
    """gpt-oss's sliding-window layers see only the last `window` positions: their KV is kept
    out of the chunks and each record's blob holds their window. A restore fills the chunked
    layers' KV and those windows, bit for bit, and continues exactly as the same prefix
    recomputed; block edges (bare chunks) never restore such a model."""
    sem = _semantic(str(tiny_gpt_oss), tmp_path / "state")
    cache, eng = sem.reuse.cache, sem.engine
    layout = cache.layout
    assert layout.windowed == (0, 2) and layout.window == 32 and not cache.block_edges
    full = 2 * layout.num_attn * layout.kv_heads * layout.kv_row_bytes()
    assert layout.kv_token_bytes() * 2 == full  # (half of the layers in chunks)
    marker = sem.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = list(range(30, 700)) + [marker] + list(range(40, 80))
    pos = 671  # (past two whole blocks and the window)
    state = eng.new_state()
    eng.prefill(state, prompt[:pos], capture=[pos])
    captured = state.export(pos)
    cache.save(prompt, pos, "message_end", state.kv_caches(), [], [])
    cache.flush()
    record = cache.store.get_record(PrefixKeys(cache.fp, prompt).key(pos))
    assert record.chunk_bytes <= 2 * BLOCK * layout.kv_token_bytes() + 512  # (raw: random)
    reader = sem if ram else _semantic(str(tiny_gpt_oss), tmp_path / "state", ram_bytes=0)
    fresh = eng.new_state()
    assert reader.reuse.begin(fresh, prompt) == (pos, "message_end")
    got = fresh.export()
    for i, ((ka, va), (kb, vb)) in enumerate(zip(got.kv, captured.kv, strict=True)):
        first = pos - layout.window if i in layout.windowed else 0
        assert ka[:, first:pos].equal(kb[:, first:pos]) and va[:, first:pos].equal(vb[:, first:pos])
    want = eng.prefill(state, prompt[pos:], all_logits=True)
    assert eng.prefill(fresh, prompt[pos:], all_logits=True).equal(want)
    assert all(kind != "block" for _, kind in cache.candidates(prompt))
    sem.close()
    if reader is not sem:
        reader.close()


def test_a_restored_window_is_never_cut_back_below_its_start(tmp_path, tiny_gpt_oss):
    """After a restore, gpt-oss's sliding-window layers hold only the restored window (below
    it, whatever the buffers held before: zeros in a new process). A later prompt sharing a
    shorter prefix with the live state must not cut it back below the window (its queries would
    attend to stale keys): it restores or prefills instead, and generates what a state
    recomputed from nothing does."""
    marker = 2  # (`<|im_end|>`: a message end, so the prompt has a checkpoint)
    first = list(range(30, 700)) + [marker] + list(range(40, 80))
    writer = _semantic(str(tiny_gpt_oss), tmp_path / "state")
    writer.generate(first, max_tokens=1)
    writer.close()
    sem = _semantic(str(tiny_gpt_oss), tmp_path / "state")  # (its buffers hold nothing yet)
    off = Runtime.open(str(tiny_gpt_oss), cache="off")
    restored = first[:671] + list(range(50, 90))
    assert sem.generate(restored, max_tokens=8) == off.generate(restored, max_tokens=8)
    assert sem.reuse.source in ("ram", "lmdb") and sem._live_state().floor == 670
    shorter = first[:600] + list(range(200, 230))  # (shares 600 tokens with the live state)
    assert sem.generate(shorter, max_tokens=24) == off.generate(shorter, max_tokens=24)
    assert sem.reuse.source != "live"
    sem.close()


def _checkpoint(rt: Runtime, prompt: list[int], pos: int) -> None:
    """Save the state after `prompt[:pos]` as a message-end checkpoint and wait for it."""
    cache, eng = rt.reuse.cache, rt.engine
    state = eng.new_state()
    eng.prefill(state, prompt[:pos])
    conv, rec = state.linear_at(pos)
    cache.save(prompt, pos, "message_end", state.kv_caches(), conv, rec)
    cache.flush()


def test_room_made_for_a_checkpoint_keeps_the_chunks_it_shares(tmp_path):
    """A full cache evicts before a write, but never the last record holding a KV chunk the
    new checkpoint references without carrying it (an idle, shorter prefix of the same
    session): the checkpoint is stored, not dropped for a missing chunk; records that share
    that chunk with others still go (every session with the same first 256 tokens does), and
    the cap holds."""
    from agentrt.statecache.codec import encode_record

    rt = _semantic("tiny", tmp_path / "state", ram_bytes=0)
    cache, store = rt.reuse.cache, rt.reuse.cache.store
    session = list(range(20, 320)) * 2
    _checkpoint(rt, session, 300)  # (owns the session's first chunk)
    one = store.total_bytes()
    keys = PrefixKeys(cache.fp, session)
    idle = store.get_record(keys.key(300))
    idle.last_used -= 7200  # (two hours idle: the first to go)
    store._txn(lambda txn: txn.put(keys.key(300), encode_record(idle), db=store.records), True)
    for i in range(3):  # (other sessions: the same first chunk, then their own tokens)
        _checkpoint(rt, [*session[:256], 5 + i, *range(21, 320)], 280)
    store.max_bytes = store.total_bytes() + one // 4  # (nearly full)
    records = store.stats()["records"]
    _checkpoint(rt, session, 560)
    assert store.has_record(keys.key(560)) and not cache.stats["write_missing_chunk"]
    assert store.stats()["records"] < records + 1 and store.total_bytes() <= store.max_bytes
    rt.close()


def test_chunks_evicted_since_are_carried_again(tmp_path):
    """The writer remembers which KV chunks are stored, to copy only new ones; after an
    eviction it asks again, so a later checkpoint carries a chunk deleted since instead of
    being dropped for it."""
    rt = _semantic("tiny", tmp_path / "state", ram_bytes=0)
    cache = rt.reuse.cache
    session = [*range(20, 299), 2, *range(20, 320), 2, *range(30, 80), 2, *range(40, 60)]
    rt.generate(session[:281], max_tokens=1)
    cache.flush()
    assert cache.store.evict(0) == 1
    rt._live_state().reset()
    rt.generate(session, max_tokens=1)
    cache.flush()
    assert not cache.stats["dropped_missing_chunk"] and cache.store.stats()["records"] == 3
    rt.close()


def test_pinned_ring_hands_out_regions_first_in_first_out(monkeypatch):
    """Ring placement: in order, wrapping to the start, None when full; out-of-order frees are
    tolerated; one ring per size per process. (Plain memory stands in for page-locked here.)"""
    import torch

    from agentrt.statecache.staging import PinnedRing

    def plain(self):
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8)
        self.ready.set()

    monkeypatch.setattr(PinnedRing, "_allocate", plain)
    ring = PinnedRing(1024)
    ring.ready.wait()
    a, b = ring.alloc(400), ring.alloc(400)
    assert a == (0, 512) and b == (512, 1024) and ring.alloc(1) is None  # 256-byte aligned
    ring.free(a)
    d = ring.alloc(256)
    assert d == (0, 256)  # wrapped into the space a left
    ring.free(d)  # out of order (b is older): accepted, its space is free again
    assert ring.alloc(256) == (0, 256)
    ring.free(b)
    c = ring.alloc(256)
    assert c == (256, 512)
    views = ring.views(c, [torch.zeros(2, 3, dtype=torch.float32)])
    assert views[0].shape == (2, 3) and views[0].dtype == torch.float32
    monkeypatch.setattr(PinnedRing, "_shared", {})
    assert PinnedRing.shared(2048) is PinnedRing.shared(2048)
    assert PinnedRing.shared(2048) is not PinnedRing.shared(4096)


def test_reads_do_not_wait_for_a_write_in_progress(tmp_path):
    """A request's lookups run beside the background writer's (long) transaction; a map resize
    waits until no transaction of this process is open."""
    import threading

    store = Store(tmp_path / "s", 2**30)
    inside, release = threading.Event(), threading.Event()

    def slow_write(txn):
        txn.put(b"k", b"v", db=store.meta)
        inside.set()
        release.wait(10)

    writer = threading.Thread(target=lambda: store._txn(slow_write, write=True))
    writer.start()
    assert inside.wait(10)
    t0 = time.perf_counter()
    assert not store.has_record(b"absent")  # would block until the write commits if serialised
    assert time.perf_counter() - t0 < 5
    resized = threading.Event()
    grower = threading.Thread(target=lambda: (store._grow(), resized.set()))
    grower.start()
    assert not resized.wait(0.3)  # the open write transaction holds the resize off
    release.set()
    writer.join(10)
    assert resized.wait(10)
    grower.join(10)
    with store.shared.lock.shared(), store.shared.lock.shared():  # re-entrant per thread
        with pytest.raises(RuntimeError):
            with store.shared.lock.alone():
                pass
    store.close()


@pytest.mark.slow
def test_bench_statecache_cli_reports_restores_that_match_recompute(tmp_path):
    out = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "agentrt.cli", "bench", "statecache", "--model", "tiny"]
    cmd += ["--lengths", "600", "--state-dir", str(tmp_path / "st"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["repeats"] == 7 and run["restore_sources"] == ["ram", "lmdb"]
    assert run["kv_chunk_bytes"] > 0 and run["writer_mib_s"] > 0
    low, high = run["capture_overhead_many_range"]
    assert low <= run["capture_overhead_many"] <= high
    assert 0 < run["save_handover_many_s"] < run["prefill_capture_many_s"]
    assert run["restored_vs_recomputed_max_abs_diff"] < 1e-4  # fp32 on the CPU


@pytest.mark.slow
def test_bench_statecache_fidelity_restored_equals_recomputed_on_the_cpu(tmp_path):
    """`bench statecache --fidelity`: in fp32 on the CPU a restored checkpoint's suffix logits
    and greedy continuation equal the recomputed ones exactly, in both capture designs; the
    engine's noise floor (other chunk sizes), one pass and the fp32 reference are reported."""
    out = tmp_path / "f.json"
    cmd = [sys.executable, "-m", "agentrt.cli", "bench", "statecache", "--fidelity"]
    cmd += ["--model", "tiny", "--lengths", "200", "--rounds", "1", "--suffix", "24"]
    cmd += ["--generate", "8", "--prefill-chunk", "64", "--state-dir", str(tmp_path / "st")]
    proc = subprocess.run(cmd + ["--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["bench"] == "statecache-fidelity" and report["restored_from"] == "lmdb"
    assert {r["design"] for r in report["runs"]} == {"grid", "split"}
    for run in report["runs"]:
        assert run["checkpoints"] == [{"asked": 200, "held": 200}]
        restored = run["restored"]
        assert restored["max_abs"] == 0.0 and restored["mean_kl"] == 0.0
        assert restored["top1_min"] == 1.0 and restored["greedy_shared"] == [8]
        assert {"chunk 32", "chunk 128", "chunk 49", "one pass", "restored vs fp32 cpu"} <= set(run)
        for size in ("chunk 32", "chunk 49"):  # on and off the 64-token chunk grid
            noise = run[size]
            assert 0.0 < noise["max_abs"] < 1e-4 and noise["greedy_identical_share"] == 1.0
        assert run["restored vs fp32 cpu"]["max_abs"] < 1e-4


def test_full_staging_ring_drops_checkpoints_instead_of_stalling(tmp_path, monkeypatch):
    """A pinned ring held by queued jobs means the writer is behind: a checkpoint that could fit
    is dropped and counted (no synchronous copy in the request); one larger than the whole ring
    is copied into ordinary memory and written."""
    import torch

    from agentrt.statecache.staging import PinnedRing

    def plain(self):
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8)
        self.ready.set()

    monkeypatch.setattr(PinnedRing, "_allocate", plain)
    sem = _semantic("tiny", tmp_path / "state")
    cache = sem.reuse.cache
    cache._ring = PinnedRing(64 * 2**20)
    cache._ring.ready.wait()
    held = cache._ring.alloc(cache._ring.capacity)  # all of it, as queued jobs would hold it
    msgs = agent_requests("r", 300)[0]
    sem.chat(msgs, tools=TOOLS, max_tokens=2)
    cache.flush()
    assert cache.stats["dropped_staging_full"] > 0 and cache.stats["write_written"] == 0
    cache._ring.free(held)
    cache._ring = PinnedRing(256)  # smaller than any checkpoint
    cache._ring.ready.wait()
    sem.chat(agent_requests("s", 300)[0], tools=TOOLS, max_tokens=2)
    cache.flush()
    assert cache.stats["write_written"] > 0
    sem.close()


def test_state_dir_may_be_given_as_a_string(tmp_path):
    config = StateCacheConfig(state_dir=str(tmp_path / "s"))
    assert config.state_dir == tmp_path / "s"
    Store(config.state_dir, config.max_bytes).close()


def test_payload_checks_cover_the_frame_header_and_the_data():
    """Reads verify zstd's content checksum; a header that no longer declares it, or declares
    another size, is rejected too (so no flipped bit can switch the check off)."""
    import torch

    from agentrt.statecache.codec import _HEAD, CorruptPayload, pack_tensors, unpack

    t = torch.arange(4096, dtype=torch.float32)
    payload = pack_tensors([t], 1)
    assert bytes(unpack(payload)) == t.numpy().tobytes()
    descriptor = _HEAD.size + 4  # zstd magic, then the frame header descriptor
    for position, bit in [(descriptor, 0x04), (descriptor, 0x80), (len(payload) - 2, 0x01)]:
        bad = bytearray(payload)
        bad[position] ^= bit  # checksum flag, size field width, the stored checksum itself
        with pytest.raises(CorruptPayload):
            unpack(bytes(bad))
    with pytest.raises(CorruptPayload):
        unpack(payload[:-5])


def test_payloads_zstd_does_not_shrink_are_stored_raw_and_still_checked():
    """Random-looking values (zstd keeps > 2/3 of them) are stored raw, compressible ones
    (fp32 holding bf16 values) compressed; both read back to the same bytes, scattered or
    whole, and a flipped bit or a wrong size in a raw payload is refused like a damaged
    frame."""
    import torch

    from agentrt.statecache.codec import (
        _HEAD,
        MAGIC,
        RAW_MAGIC,
        CorruptPayload,
        pack_parts,
        pack_tensors,
        row_bytes,
        unpack,
        unpack_scatter,
    )

    noise = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).bfloat16()
    smooth = torch.randn(64000).bfloat16().float()  # fp32 holding bf16 values: ~48% after zstd
    raw, packed = bytes(pack_tensors([noise])), bytes(pack_tensors([smooth]))
    assert raw[:4] == RAW_MAGIC and len(raw) == _HEAD.size + noise.numel() * 2
    assert packed[:4] == MAGIC and len(packed) < smooth.numel() * 4 // 2
    assert bytes(unpack(raw)) == noise.view(torch.uint16).numpy().tobytes()
    dest = torch.zeros(2, 32000, dtype=torch.bfloat16)
    assert unpack_scatter(raw, [row_bytes(dest[0]), row_bytes(dest[1])]) == noise.numel() * 2
    assert torch.equal(dest.reshape(-1), noise.reshape(-1))
    blob = bytes(pack_parts([smooth, noise], part_bytes=64000 * 4))  # one part of each kind
    assert bytes(unpack(blob)) == smooth.numpy().tobytes() + raw[_HEAD.size :]
    for position in (len(raw) // 2, 9, _HEAD.size - 1):  # data, the size field, its high byte
        bad = bytearray(raw)
        bad[position] ^= 0x10
        with pytest.raises(CorruptPayload):
            unpack(bytes(bad))
    with pytest.raises(CorruptPayload):
        unpack(raw[:-2])
    # the RAM tier's own bytes skip the checksum (not the size check): a flipped data bit is
    # copied as it is there, refused with it
    bad = bytearray(raw)
    bad[len(raw) // 2] ^= 0x10
    place = torch.zeros(64000, dtype=torch.bfloat16)
    unpack_scatter(bytes(bad), [row_bytes(place)], verify=False)
    assert row_bytes(place).tobytes() == bytes(bad[_HEAD.size :])
    with pytest.raises(CorruptPayload):
        unpack_scatter(bytes(bad), [row_bytes(place)])
    with pytest.raises(CorruptPayload):
        unpack_scatter(raw, [row_bytes(place[:-1])], verify=False)


def test_compressibility_is_judged_from_windows_across_the_whole_payload():
    """The raw-or-zstd verdict samples windows spread over a payload's tensors, not its first
    bytes: random values followed by many zeros compress, zeros followed by mostly random
    values stay raw; the sample of a small payload is all of it."""
    import torch

    from agentrt.statecache.codec import MAGIC, RAW_MAGIC, SAMPLE_BYTES, _sample, pack_tensors

    g = torch.Generator().manual_seed(0)
    head = torch.randn(1 << 18, generator=g)  # 1 MiB of random fp32
    zeros = torch.zeros(7 << 18)
    first = bytes(pack_tensors([head, zeros]))
    assert first[:4] == MAGIC and len(first) < (head.numel() + zeros.numel()) * 4 // 4
    rest = torch.randn(7 << 18, generator=g)
    assert bytes(pack_tensors([torch.zeros(1 << 13), rest]))[:4] == RAW_MAGIC
    views = [memoryview(b"abc"), memoryview(b"de")]
    assert _sample(views) == b"abcde"
    big = torch.randint(0, 256, (4 * SAMPLE_BYTES,), generator=g, dtype=torch.uint8)
    big = big.numpy().tobytes()  # four samples' worth, in two views
    sample = _sample([memoryview(big[:1000]), memoryview(big[1000:])])
    width = SAMPLE_BYTES // 4
    starts = [i * (len(big) - width) // 3 for i in range(4)]
    assert sample == b"".join(big[s : s + width] for s in starts)


def test_scattered_decompression_fills_each_place_and_checks_the_data():
    """A chunk decompresses straight into several places (its rows in the caches): the same
    bytes as one buffer, and a corrupt payload or places of the wrong total size are refused."""
    import torch

    from agentrt.statecache.codec import (
        CorruptPayload,
        pack_tensors,
        row_bytes,
        unpack,
        unpack_scatter,
    )

    t = torch.randn(6, 100)
    payload = pack_tensors([t], 1)
    dest = torch.zeros(3, 200)  # places of 100, 100 and 400 floats
    places = [row_bytes(dest[0, :100]), row_bytes(dest[0, 100:]), row_bytes(dest[1:])]
    places = [places[0], places[1], places[2][: 4 * 400]]
    assert unpack_scatter(payload, places) == t.numel() * 4
    assert torch.equal(dest.reshape(-1), t.reshape(-1))
    assert bytes(unpack(payload)) == t.numpy().tobytes()
    with pytest.raises(CorruptPayload):
        unpack_scatter(payload, places[:2])
    bad = bytearray(payload)
    bad[len(payload) // 2] ^= 0x10
    with pytest.raises(CorruptPayload):
        unpack_scatter(bytes(bad), places)
    with pytest.raises(ValueError):
        row_bytes(dest[:, :10])  # not one contiguous run


def test_restore_waits_briefly_for_a_checkpoint_still_queued(tmp_path):
    """A checkpoint an earlier request queued applies even if the writer has not stored it yet
    (the restore waits for it), but a writer that far behind never stalls a request for long,
    and no restore waits for one whose state was taken no later than what it holds already."""
    import threading

    sem = _semantic("tiny", tmp_path / "state")
    cache = sem.reuse.cache
    with cache._lock:
        cache._queued[b"k"] = [300]

    written_at: list[float] = []

    def written() -> None:
        with cache._lock:
            cache._uncount(b"k", 300)
            written_at.append(time.perf_counter())

    threading.Timer(0.2, written).start()
    cache._await_queued([b"other", b"k"], min_pos=299)
    returned_at = time.perf_counter()
    assert written_at and written_at[0] <= returned_at and not cache._queued  # (it waited)
    assert cache.stats["waited_for_writer"] == 1
    with cache._lock:
        cache._queued[b"stuck"] = [300]
    t0 = time.perf_counter()
    cache._await_queued([b"stuck"], timeout=0.1)
    assert time.perf_counter() - t0 < 0.5  # gives up
    cache._await_queued([b"absent"])  # nothing queued: returns at once
    t0 = time.perf_counter()
    cache._await_queued([b"stuck"], min_pos=300)  # (taken early: the caller holds as much)
    assert time.perf_counter() - t0 < 0.05
    assert cache.stats["waited_for_writer"] == 2
    with cache._lock:
        cache._queued.clear()
    sem.close()


def test_lmdb_writes_through_write2_unless_asked_to_use_its_map(tmp_path, monkeypatch):
    """Commits into LMDB's shared map slowed the threads computing beside them, so checkpoints
    go through write(2); `AGENTRT_STATE_WRITEMAP=1` keeps the map for comparisons. Either way
    a checkpoint reads back."""
    from agentrt.statecache.codec import Record

    for name, setting, expected in (("plain", None, False), ("mapped", "1", True)):
        if setting is None:
            monkeypatch.delenv("AGENTRT_STATE_WRITEMAP", raising=False)
        else:
            monkeypatch.setenv("AGENTRT_STATE_WRITEMAP", setting)
        store = Store(tmp_path / name, 2**30)
        assert store.env.flags()["writemap"] is expected
        record = Record(b"fp", "t", 5, "message_end", [], 3, 0, 0.0, 0.0)
        assert store.put_checkpoint(b"k", record, {}, b"abc") == "written"
        assert store.get_record(b"k").n_tokens == 5
        store.close()


def test_a_process_adopts_the_lmdb_mode_another_process_uses_on_the_directory(
    tmp_path, monkeypatch, capfd
):
    """LMDB must not be opened with and without its writable map on one directory at once: a
    process that finds another one using the map on its directory uses the map too (and says
    so); once that process is gone, the default (write(2)) applies again."""
    from agentrt.statecache.codec import Record

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys
            from agentrt.statecache.store import Store
            store = Store(__import__("pathlib").Path({str(tmp_path)!r}), 2**30)
            assert store.env.flags()["writemap"]
            print("open", flush=True)
            sys.stdin.readline()
            store.close()
        """),
        ],
        env={**os.environ, "AGENTRT_STATE_WRITEMAP": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        monkeypatch.delenv("AGENTRT_STATE_WRITEMAP", raising=False)
        store = Store(tmp_path, 2**30)
        assert store.env.flags()["writemap"] is True
        assert "through its shared map; this one does too" in capfd.readouterr().err
        record = Record(b"fp", "t", 5, "message_end", [], 3, 0, 0.0, 0.0)
        assert store.put_checkpoint(b"k", record, {}, b"abc") == "written"
        store.close()
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    store = Store(tmp_path, 2**30)
    assert store.env.flags()["writemap"] is False
    assert store.get_record(b"k").n_tokens == 5
    store.close()


def test_store_reads_beside_writes_that_grow_the_map(tmp_path):
    """Threads reading (plain and parallel zero-copy reads) while another writes checkpoints
    large enough to grow the map several times: no error, no deadlock, nothing lost."""
    import threading

    from agentrt.statecache.codec import Record

    store = Store(tmp_path / "s", 2**30)
    start_map = store.env.info()["map_size"]
    errors: list[BaseException] = []
    done = threading.Event()
    payload = os.urandom(4 * 2**20)

    def write() -> None:
        try:
            for i in range(40):
                key, chunk = f"rec{i}".encode(), f"chunk{i}".encode()
                record = Record(b"fp", "t", i, "message_end", [chunk], 16, len(payload), 0.0, 0.0)
                assert store.put_checkpoint(key, record, {chunk: payload}, b"b" * 16) == "written"
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            done.set()

    def read() -> None:
        try:
            while not done.is_set():
                store.has_record(b"rec3")
                store.missing_chunks([b"chunk1", b"chunk2"])
                with store.parallel_reads():
                    store.read_chunk(b"chunk1", len)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors
    assert store.env.info()["map_size"] >= 2 * start_map  # it did grow while being read
    assert store.stats()["records"] == 40
    with store.parallel_reads():
        assert store.read_chunk(b"chunk39", len) == len(payload)
    store.close()


def _plain_staging(monkeypatch) -> None:
    """CUDA's staging on this CPU-only run: plain memory for the pinned ring, a no-op event."""
    import torch

    from agentrt.statecache.staging import PinnedRing

    class Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    def plain(self):
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8)
        self.ready.set()

    monkeypatch.setattr(PinnedRing, "_allocate", plain)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)


def test_a_write_commit_counts_its_thread_as_waiting_not_busy(tmp_path, monkeypatch):
    """The commit of a write transaction waits on the disk (LMDB syncs the map's pages), so
    the writer, counted busy around a checkpoint, is uncounted while it commits; the puts
    before it still count."""
    from agentrt.host.cputhreads import busy, busy_helpers
    from agentrt.statecache.codec import Record

    store = Store(tmp_path / "s", 2**30)
    seen: dict[str, list[int]] = {"put": [], "commit": []}

    class Txn:  # the real transaction, with the busy count noted at each put and the commit
        def __init__(self, txn) -> None:
            self.txn = txn

        def __enter__(self):
            self.txn.__enter__()
            return self

        def __exit__(self, *exc):
            return self.txn.__exit__(*exc)

        def put(self, *args, **kwargs):
            seen["put"].append(busy_helpers())
            return self.txn.put(*args, **kwargs)

        def commit(self):
            seen["commit"].append(busy_helpers())
            return self.txn.commit()

        def __getattr__(self, name):
            return getattr(self.txn, name)

    class Env:
        def __init__(self, env) -> None:
            self.env = env

        def begin(self, **kwargs):
            return (
                Txn(self.env.begin(**kwargs)) if kwargs.get("write") else self.env.begin(**kwargs)
            )

        def __getattr__(self, name):
            return getattr(self.env, name)

    monkeypatch.setattr(store, "env", Env(store.env))
    before = busy_helpers()
    record = Record(b"fp", "t", 1, "message_end", [b"c"], 16, 4, 0.0, 0.0)
    with busy():
        assert store.put_checkpoint(b"k", record, {b"c": b"abcd"}, b"b" * 16) == "written"
    assert seen["put"] and set(seen["put"]) == {before + 1}
    assert seen["commit"] == [before]
    assert store.has_record(b"k")
    store.close()


def _slow_decode(monkeypatch, sem: Runtime, seconds: float) -> list[tuple[int, int, bool]]:
    """Each fed token takes `seconds` longer; returns, per token, the checkpoints written and
    pending then and whether writes were resumed."""
    cache, seen = sem.reuse.cache, []
    after_token = sem.reuse.after_token

    def slow(state):
        time.sleep(seconds)
        seen.append((cache.stats["write_written"], cache.writes_pending, cache._resume.is_set()))
        return after_token(state)

    monkeypatch.setattr(sem.reuse, "after_token", slow)
    return seen


def test_the_writer_holds_checkpoints_while_a_request_decodes(tmp_path, monkeypatch):
    """The prefill's checkpoints wait while its request decodes (each token 0.1 s here, time
    enough for the writer to store several) and are written once the response is out;
    `AGENTRT_DECODE_HOLD=0` writes them meanwhile."""
    from agentrt.statecache import writer

    sem = _semantic("tiny", tmp_path / "state")
    seen = _slow_decode(monkeypatch, sem, 0.1)
    sem.chat(agent_requests("q", 300)[0], tools=TOOLS, max_tokens=6)
    assert len(seen) == 5 and all(w == 0 and p > 0 and not r for w, p, r in seen)
    sem.reuse.cache.flush()
    assert sem.reuse.cache.stats["write_written"] > 0
    assert sem.reuse.cache.stats["hold_overrun"] == 0
    sem.close()

    monkeypatch.setenv("AGENTRT_DECODE_HOLD", "0")
    writer.decode_hold.cache_clear()
    try:
        sem = _semantic("tiny", tmp_path / "state2")
        seen = _slow_decode(monkeypatch, sem, 0.1)
        sem.chat(agent_requests("q", 300)[0], tools=TOOLS, max_tokens=6)
        assert all(r for _, _, r in seen) and seen[-1][0] > 0
        sem.close()
    finally:
        writer.decode_hold.cache_clear()


def test_the_writer_waits_out_each_prefill_and_catches_up_in_decode_without_idle_time(
    tmp_path, monkeypatch
):
    """The writer starts no checkpoint beside a prefill. Checkpoints still pending when a
    request arrives (it came straight after the last response: no idle time) are written while
    it decodes; with idle time between the requests they were written then, and the next
    request's checkpoints wait for its response again."""
    sem = _semantic("tiny", tmp_path / "state")
    cache, engine = sem.reuse.cache, sem.engine
    write = cache._write
    monkeypatch.setattr(cache, "_write", lambda job: (time.sleep(0.3), write(job)))
    prefills: list[bool] = []  # per prefill: whether writes were resumed at its start
    prefill = engine.prefill

    def watched(*args, **kwargs):
        prefills.append(cache._resume.is_set())
        return prefill(*args, **kwargs)

    monkeypatch.setattr(engine, "prefill", watched)
    requests = agent_requests("q", 300)
    seen = _slow_decode(monkeypatch, sem, 0.02)
    sem.chat(requests[0], tools=TOOLS, max_tokens=4)
    assert cache.writes_pending and not any(r for _, _, r in seen)  # held while decoding
    seen.clear()
    sem.chat(requests[1], tools=TOOLS, max_tokens=4)  # at once: the first turn's are pending
    assert prefills == [False, False]  # (held beside both prefills)
    assert seen and all(r for _, _, r in seen)  # caught up while the second one decoded
    cache.flush()
    seen.clear()
    sem.chat(requests[2], tools=TOOLS, max_tokens=4)  # after idle time: nothing pending
    assert not any(r for _, _, r in seen) and prefills[-1] is False
    cache.flush()
    assert cache.stats["write_written"] > 0 and cache.stats["hold_overrun"] == 0
    sem.close()


def test_writes_held_for_a_request_resume_when_it_fails(tmp_path, monkeypatch):
    """A request whose restore or prefill raises (or is cancelled) leaves no writes held: its
    checkpoints, and earlier ones, are not kept waiting for `HOLD_LIMIT_S`."""
    from agentrt.engine import Cancelled

    sem = _semantic("tiny", tmp_path / "state")
    cache, requests = sem.reuse.cache, agent_requests("q", 300)
    sem.chat(requests[0], tools=TOOLS, max_tokens=2)

    def broken(*args, **kwargs):
        raise RuntimeError("restore failed")

    def cancelled(*args, **kwargs):
        raise Cancelled("cancelled during prefill")

    with monkeypatch.context() as patch:
        patch.setattr(cache, "restore_into", broken)
        with pytest.raises(RuntimeError):
            sem.chat(requests[1], tools=TOOLS, max_tokens=2)
    assert cache._resume.is_set()
    with monkeypatch.context() as patch:
        patch.setattr(sem.engine, "prefill", cancelled)
        sem.chat(requests[1], tools=TOOLS, max_tokens=2)  # (ends as cancelled, no error)
    assert cache._resume.is_set()
    cache.flush()
    assert cache.stats["hold_overrun"] == 0
    sem.close()


def test_held_checkpoints_are_written_past_the_limit_or_with_the_queue_half_full(
    tmp_path, monkeypatch
):
    """A hold never starves the writer: a checkpoint that waited `HOLD_LIMIT_S` is written
    during the decode, as is every one once the queue is half full (counted as overruns)."""
    from agentrt.statecache import writer

    monkeypatch.setattr(writer, "HOLD_LIMIT_S", 0.2)
    sem = _semantic("tiny", tmp_path / "state")
    seen = _slow_decode(monkeypatch, sem, 0.15)
    sem.chat(agent_requests("q", 300)[0], tools=TOOLS, max_tokens=8)
    assert seen[-1][0] > 0 and sem.reuse.cache.stats["hold_overrun"] > 0
    sem.close()

    monkeypatch.setattr(writer, "HOLD_LIMIT_S", 30.0)
    sem = Runtime.open(
        "tiny",
        cache="semantic",
        state_cache=StateCacheConfig(state_dir=tmp_path / "s2", min_distance=0, queue_size=2),
    )
    seen = _slow_decode(monkeypatch, sem, 0.1)
    sem.chat(agent_requests("q", 300)[0], tools=TOOLS, max_tokens=6)
    assert seen[-1][0] > 0 and sem.reuse.cache.stats["hold_overrun"] > 0
    sem.close()


def test_queue_bookkeeping_is_undone_when_a_job_cannot_be_queued(tmp_path, monkeypatch):
    """Every queued checkpoint is uncounted once written, and one that cannot be queued after
    its copies were staged gives its staging region back (else the ring would fill for good)."""
    import queue as queue_mod

    from agentrt.statecache.staging import PinnedRing

    _plain_staging(monkeypatch)
    sem = _semantic("tiny", tmp_path / "state")
    cache = sem.reuse.cache
    sem.chat(agent_requests("q", 300)[0], tools=TOOLS, max_tokens=2)
    cache.flush()
    assert cache.stats["write_written"] > 0 and not cache._queued and not cache._pending
    cache._ring = PinnedRing(64 * 2**20)
    cache._ring.ready.wait()

    def full(item):
        raise queue_mod.Full

    monkeypatch.setattr(cache._queue, "put_nowait", full)
    sem.chat(agent_requests("r", 300)[0], tools=TOOLS, max_tokens=2)
    assert cache.stats["dropped_queue_full"] > 0
    assert not cache._ring.live and not cache._queued and not cache._pending
    sem.close()


def test_the_writer_commits_straight_from_the_staging_ring(tmp_path, monkeypatch):
    """Staged checkpoints (CUDA's pinned ring; plain memory stands in here) are framed straight
    from their region, which is given back only after the commit: the stored payloads equal
    those written without a ring, and the ring ends empty."""

    from agentrt.statecache import StateCache
    from agentrt.statecache.staging import PinnedRing

    _plain_staging(monkeypatch)
    live_at_commit: list[int] = []
    commit = StateCache._commit

    def watched(self, job):
        live_at_commit.append(len(self._ring.live) if self._ring is not None else -1)
        return commit(self, job)

    monkeypatch.setattr(StateCache, "_commit", watched)
    stored = []
    for name, ring in (("plain", False), ("ring", True)):
        rt = _semantic("tiny", tmp_path / name)
        cache = rt.reuse.cache
        if ring:
            cache._ring = PinnedRing(64 * 2**20)
            cache._ring.ready.wait()
        for msgs in agent_requests("q", 300)[:2]:
            rt.chat(msgs, tools=TOOLS, max_tokens=2)
        cache.flush()
        assert not ring or not cache._ring.live
        stored.append(
            {k: bytes(v[1] if isinstance(v, tuple) else v) for k, (v, _) in cache.ram.items.items()}
        )
        rt.close()
    assert stored[0] and stored[0] == stored[1]
    staged = [n for n in live_at_commit if n >= 0]  # (-1: the run without a ring)
    assert staged and min(staged) >= 1  # (the region was still held while committing)


def test_blob_parts_round_trip_and_reject_a_damaged_table():
    """A blob is several payloads (a restore decompresses them in parallel): together they give
    the tensors' bytes in order; a damaged part table or part is detected, never misread."""
    import struct

    import torch

    from agentrt.statecache.codec import CorruptPayload, blob_parts, pack_parts, unpack

    tensors = [torch.arange(n, dtype=torch.float32) * (i + 1) for i, n in enumerate([700, 50, 900])]
    blob = bytes(pack_parts(tensors, 1, part_bytes=2900))  # 2800 B, 200 B, 3600 B: three parts
    parts = blob_parts(blob)
    assert [size for _, _, size in parts] == [2800, 200, 3600]
    assert bytes(unpack(blob)) == b"".join(t.numpy().tobytes() for t in tensors)
    assert len(blob_parts(pack_parts(tensors, 1))) == 1  # small tensors share one part
    damaged = [
        blob[:-1],  # truncated
        blob + b"\0",  # longer than its table
        blob[:8] + struct.pack("<Q", parts[0][1] + 1) + blob[16:],  # a length off by one
        blob[:4] + struct.pack("<I", 0) + blob[8:],  # no parts
    ]
    middle = bytearray(blob)
    middle[parts[1][0] + parts[1][1] // 2] ^= 0x10  # inside the second part
    size = bytearray(blob)
    size[parts[0][0] + 13] ^= 0x01  # the first part's declared raw size + 1 TiB: no allocation
    for bad in [*damaged, bytes(middle), bytes(size)]:
        with pytest.raises(CorruptPayload):
            unpack(bad)


@pytest.mark.parametrize("ending", ["length", "stop"])
def test_a_writer_behind_gets_the_checkpoints_after_the_response(tmp_path, monkeypatch, ending):
    """Back-to-back requests outpace a slow writer: checkpoints its queue has no room for at
    prefill time are queued again after the response (waiting for room), not lost, whether the
    response ends at its token limit or at a stop token (where the chat stops reading the
    engine's tokens); every boundary the prefill chose is stored in the end."""
    import agentrt.engine.engine as engine_module
    from agentrt.statecache.keys import PrefixKeys
    from agentrt.statecache.manager import StateCache

    slow_write = StateCache._write

    def slow(self, job):
        time.sleep(0.05)
        slow_write(self, job)

    monkeypatch.setattr(StateCache, "_write", slow)
    sem = Runtime.open(
        "tiny",
        cache="semantic",
        state_cache=StateCacheConfig(state_dir=tmp_path / "state", min_distance=0, queue_size=1),
    )
    cache = sem.reuse.cache
    msgs = agent_requests("w", 300)[0]
    ids = _prompt_ids(sem, msgs)
    wanted = cache.capture_positions(ids, 0)
    assert len(wanted) >= 3  # more checkpoints than the queue holds
    if ending == "stop":
        sampled, real = [], engine_module.sample

        def stop_second(logits, params, rng):
            sampled.append(1)
            return sem.chat_stop_ids[0] if len(sampled) == 2 else real(logits, params, rng)

        monkeypatch.setattr(engine_module, "sample", stop_second)
    result = sem.chat(msgs, tools=TOOLS, max_tokens=2 if ending == "length" else 50)
    assert result.finish_reason == ending
    cache.flush()
    assert cache.stats["deferred_saved"] > 0 and cache.stats["deferred_dropped"] == 0
    keys = PrefixKeys(cache.fp, ids)
    assert all(cache._stored(keys.key(pos)) for pos in wanted)
    sem.close()


def test_restore_threads_leave_a_core_to_the_restoring_thread(monkeypatch):
    """A restore reads on one thread per core but one (the restoring thread uploads meanwhile),
    2 to 16 of them; an explicit count wins; a negative one is refused."""
    from agentrt.errors import InvalidArgumentError
    from agentrt.statecache.config import StateCacheConfig, restore_threads

    for cores, threads in ((1, 2), (2, 2), (8, 7), (16, 15), (64, 16)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, cores=cores: set(range(cores)))
        assert restore_threads(StateCacheConfig()) == threads
    assert restore_threads(StateCacheConfig(restore_threads=3)) == 3
    with pytest.raises(InvalidArgumentError):
        StateCacheConfig(restore_threads=-1)
