"""Shared pieces of the fuzz tests: seeded hypothesis settings, odd JSON values, structural and
byte-level mutations of valid inputs, a one-line CLI-error check, and per-target example
counts printed at the end of a fuzz module. `AGENTRT_FUZZ_SCALE=N` runs N times the examples,
randomised (for a longer search outside CI)."""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("AGENTRT_FUZZ_SCALE", "1"))
COUNTS: dict[str, Counter[str]] = {}


def fuzz_settings(max_examples: int):
    """Derandomized (the same examples every run) unless scaled up."""
    return settings(
        derandomize=SCALE == 1,
        max_examples=max(1, int(max_examples * SCALE)),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def tally(target: str, outcome: str) -> None:
    COUNTS.setdefault(target, Counter())[outcome] += 1


def print_counts(config: pytest.Config) -> None:
    """One line per target: examples tried and their outcomes (shown even with capture on)."""
    plugins = config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for target, outcomes in sorted(COUNTS.items()):
            detail = ", ".join(f"{k} x{v}" for k, v in sorted(outcomes.items()))
            reporter.write_line(f"fuzz {target}: {sum(outcomes.values())} examples ({detail})")
    COUNTS.clear()


def check_cli(result) -> str:
    """A click `Result`: success, or exit status 2 with one `error: ...` line (no traceback)."""
    if result.exit_code == 0:
        return "ok"
    if not isinstance(result.exception, SystemExit):
        import traceback

        detail = "".join(traceback.format_exception(result.exception))
        pytest.fail(f"uncaught exception:\n{detail}")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    return "error"


# ----------------------------------------------------------------------------- odd values

ODD_STRINGS = [
    "", "\x00", "\ud800", "\udfff x", "\u2028\u2029", "\ufeff", "\uffff\U0010ffff",
    "e\u0301\u0301\u0301", "\u202eevil", "🤖👩‍👩‍👧" * 3, "<|im_end|>", "<|im_start|>assistant\n",
    "</tool_call><tool_call>{", "<think></think>", "</tool_response>",
    "{{ raise_exception('x') }}", "{% for x in y %}", "\r\n\t\x0b\x1b[31m", "a" * 1500, "null",
]  # fmt: skip
ODD_NUMBERS = [
    2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**40, -1, 0, -0.0, 1e308, -1e308,
    5e-324, float("inf"), float("nan"),
]  # fmt: skip
KEYS = [
    "model", "messages", "role", "content", "tools", "tool_calls", "function", "name",
    "arguments", "type", "text", "max_tokens", "seed", "stream", "traj", "response", "choices",
    "message", "extra", "timestamp",
]  # fmt: skip
DEEP = "\x00deep\x00"  # written as thousands of nested brackets by `dumps`

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=30),
    st.sampled_from(ODD_STRINGS),
    st.sampled_from(ODD_NUMBERS),
    st.just(DEEP),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def one_in(data, n: int, label: str) -> bool:
    """True about once in `n` draws (hypothesis biases bounded integers towards their ends)."""
    return data.draw(st.sampled_from(range(n)), label=label) == n // 2


# ----------------------------------------------------------------------------- tree mutations


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place inside `value` (a key or index path), the root included."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        items = []
    out = [prefix]
    for k, v in items:
        out += _paths(v, (*prefix, k))
    return out


def _get(root: Any, path: tuple) -> Any:
    for k in path:
        root = root[k]
    return root


def _set(root: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    _get(root, path[:-1])[path[-1]] = new
    return root


def _delete(root: Any, path: tuple) -> Any:
    if not path:
        return None
    del _get(root, path[:-1])[path[-1]]
    return root


def _odd(data, value: Any) -> Any:
    """An odd value of the same JSON type (a string for a string, a number for a number)."""
    if isinstance(value, str):
        return data.draw(st.sampled_from(ODD_STRINGS) | st.text(max_size=20), label="odd str")
    if isinstance(value, bool):
        return data.draw(st.sampled_from([None, 0, 1, "true"]), label="odd bool")
    if isinstance(value, (int, float)):
        return data.draw(st.sampled_from(ODD_NUMBERS), label="odd number")
    return data.draw(st.sampled_from([[], {}, DEEP, None]), label="odd container")


def _retype(value: Any) -> Any:
    """The same information in another JSON type."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=repr)
    return str(value)


MUTATIONS = ("odd", "odd", "odd", "replace", "delete", "wrap_list", "wrap_dict", "add_key")
MUTATIONS += ("repeat", "retype")


def _mutate_at(data, value: Any, path: tuple, op: str) -> Any:
    node = _get(value, path)
    if op == "odd":
        return _set(value, path, _odd(data, node))
    if op == "replace":
        return _set(value, path, data.draw(json_values, label="junk"))
    if op == "delete":
        return _delete(value, path)
    if op == "wrap_list":
        return _set(value, path, [node])
    if op == "wrap_dict":
        return _set(value, path, {data.draw(st.sampled_from(KEYS)): node})
    if op == "retype":
        return _set(value, path, _retype(node))
    if op == "add_key" and isinstance(node, dict):
        node[data.draw(st.sampled_from(KEYS) | st.text(max_size=6))] = data.draw(json_values)
    if op == "repeat" and isinstance(node, list) and node:
        node.extend([copy.deepcopy(node[0])] * data.draw(st.integers(1, 40)))
    return value


def mutate(data, value: Any) -> Any:
    """A copy of `value` with 0-3 mutations (odd values, junk, deletions, wrapping, ...)."""
    value = copy.deepcopy(value)
    for _ in range(data.draw(st.integers(0, 3), label="steps")):
        paths = _paths(value)
        if data.draw(st.booleans(), label="shallow"):  # top-level fields are worth more tries
            paths = [p for p in paths if len(p) == 1] or paths
        path = data.draw(st.sampled_from(paths), label="path")
        value = _mutate_at(data, value, path, data.draw(st.sampled_from(MUTATIONS), label="op"))
    return value


# ----------------------------------------------------------------------------- bytes


def dumps(data, value: Any) -> bytes:
    """JSON bytes (NaN and lone surrogates kept as Python writes them: invalid on purpose)."""
    ascii_only = data.draw(st.booleans(), label="ascii")
    text = json.dumps(value, ensure_ascii=ascii_only)
    depth = data.draw(st.sampled_from([3, 5000, 100_000]), label="depth")
    text = text.replace(json.dumps(DEEP, ensure_ascii=ascii_only), "[" * depth + "]" * depth)
    return text.encode("utf-8", "surrogatepass")


BYTE_MUTATIONS = ("none",) * 6 + ("truncate", "flip", "insert", "utf16", "bom", "random", "empty")


def mutate_bytes(data, raw: bytes) -> bytes:
    """`raw` unchanged (most often), cut short, with a byte flipped or bytes inserted,
    re-encoded, or replaced by random bytes."""
    op = data.draw(st.sampled_from(BYTE_MUTATIONS), label="bytes op")
    if op == "none" or (not raw and op in ("truncate", "flip")):
        return raw
    if op == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if op == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]
    if op == "insert":
        at = data.draw(st.integers(0, len(raw)))
        return raw[:at] + data.draw(st.binary(min_size=1, max_size=16)) + raw[at:]
    if op == "utf16":
        return raw.decode("utf-8", "replace").encode("utf-16")
    if op == "bom":
        return b"\xef\xbb\xbf" + raw
    return data.draw(st.binary(max_size=200)) if op == "random" else b""


def fuzzed_json_bytes(data, seeds: list[Any]) -> bytes:
    """A seed mutated as a tree, then possibly as bytes; or entirely random JSON."""
    if one_in(data, 10, "random json"):
        return dumps(data, data.draw(json_values))
    value = mutate(data, data.draw(st.sampled_from(seeds), label="seed"))
    return mutate_bytes(data, dumps(data, value))
