"""Importers of recorded agent sessions into the trace format.

- `tau-bench`: historical trajectories (a JSON list of {task_id, trial, traj}); every assistant
  turn of a trajectory becomes one request carrying the history before it. Tool schemas are not
  in those files, so they are inferred from the calls (names and argument types).
- `openhands`: LLM-call logs, one JSON file per call (`messages`, `tools`, response, timestamp);
  the files of one directory (or the files given) form one session, ordered by timestamp.
- `mini-swe-agent`: `.traj.json` run artifacts; every assistant turn becomes one request. The tool
  schema comes from a `tools.json` beside the file (or is inferred).
Only OpenAI chat fields are kept in messages (framework bookkeeping such as `extra` is dropped).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from agentrt.replay.trace import FORMAT, Header, Request, Response, Trace, TraceError

MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
FORMATS = ("tau-bench", "openhands", "mini-swe-agent")


def _json_int(text: str) -> int | float:
    """A JSON integer; beyond 64 bits (which a trace cannot hold) a float, as JSON readers do."""
    value = int(text) if len(text) <= 21 else None
    return value if value is not None and -(2**63) <= value < 2**64 else float(text)


def _load_json(path: Path) -> Any:
    try:
        data = json.loads(path.read_text(), parse_int=_json_int)
        json.dumps(data, ensure_ascii=False).encode()  # lone surrogate escapes cannot be written
        return data
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, UnicodeError) as exc:
        raise TraceError(f"{path}: not valid JSON: {exc}") from None
    except RecursionError:
        raise TraceError(f"{path}: JSON nested too deeply") from None


def _is_objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    """`value` if it is a list of message objects whose tool calls are objects (with a
    `function` object), else TraceError naming `where`."""
    if not _is_objects(value):
        raise TraceError(f"{where}: expected a list of message objects")
    for i, msg in enumerate(value):
        calls = msg.get("tool_calls")
        if calls and not (
            _is_objects(calls) and all(isinstance(c.get("function") or {}, dict) for c in calls)
        ):
            raise TraceError(f"{where}[{i}]: tool_calls must be a list of call objects")
    return value


def _tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    if value and not _is_objects(value):
        raise TraceError(f"{where}: tools must be a list of objects")
    return value or None


def _dig(value: Any, *keys: str) -> Any:
    """value[k1][k2]..., or None where a step is not an object (recorded extras are optional)."""
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _file_name(text: str) -> str:
    """A trace file name made from recorded ids (no path separators or control characters)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:120]


def clean_message(msg: dict[str, Any]) -> dict[str, Any]:
    out = {k: msg[k] for k in MESSAGE_KEYS if k in msg and msg[k] is not None}
    if out.get("tool_calls"):
        out["tool_calls"] = [_clean_call(c) for c in out["tool_calls"]]
    elif "tool_calls" in out:
        del out["tool_calls"]
    if out.get("role") == "assistant" and out.get("reasoning_content") == "":
        del out["reasoning_content"]
    return out


def _clean_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI tool-call fields only; arguments always a JSON string."""
    out = {k: call[k] for k in ("id", "type", "function") if k in call}
    fn = dict(out.get("function") or {})
    if not isinstance(fn.get("arguments", ""), str):
        fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
    out["function"] = fn
    return out


def _response(msg: dict[str, Any], usage: Any = None) -> Response:
    reasoning = msg.get("reasoning_content")
    return Response(
        content=msg.get("content") if isinstance(msg.get("content"), str) else None,
        reasoning_content=reasoning if isinstance(reasoning, str) and reasoning else None,
        tool_calls=clean_message(msg).get("tool_calls"),
        usage=usage if isinstance(usage, dict) else None,
    )


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def infer_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Minimal function schemas from the tool calls seen (for logs that lack them)."""
    props: dict[str, dict[str, str]] = {}
    for msg in messages:
        for call in msg.get("tool_calls") or []:
            fn = call.get("function") or {}
            name = fn.get("name")
            if not name or not isinstance(name, str):
                continue
            try:
                raw = fn.get("arguments") or "{}"
                args = json.loads(raw) if isinstance(raw, str) else raw
            except (ValueError, RecursionError):
                args = {}
            entry = props.setdefault(name, {})
            for key, value in args.items() if isinstance(args, dict) else []:
                entry.setdefault(key, _json_type(value))
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name} (schema inferred from recorded calls)",
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": t} for k, t in p.items()},
                },
            },
        }
        for name, p in sorted(props.items())
    ]


def _turn_requests(
    messages: list[dict[str, Any]], tools, prefix: str, usages=None
) -> list[Request]:
    """One request per assistant message: the history before it, and it as the response."""
    clean = [clean_message(m) for m in messages]
    requests = []
    for i, msg in enumerate(clean):
        if msg.get("role") != "assistant" or i == 0:
            continue
        usage = usages[i] if usages else None
        requests.append(
            Request(
                f"{prefix}-{len(requests)}",
                clean[:i],
                tools,
                response=_response(messages[i], usage),
            )
        )
    return requests


# ----------------------------------------------------------------------------- formats


def import_tau_bench(path: Path) -> list[Trace]:
    data = _load_json(path)
    if not isinstance(data, list) or not all(isinstance(e, dict) and "traj" in e for e in data):
        raise TraceError(f"{path}: expected a list of tau-bench trajectories with a 'traj' field")
    trajs = [_messages(e["traj"], f"{path}: task {e.get('task_id')} traj") for e in data]
    # the agent offered every tool of the domain on every request: one schema set inferred from
    # the calls of the whole file, not from each trajectory's own (which may have none)
    tools = infer_tools([m for traj in trajs for m in traj])
    traces = []
    for entry, traj in zip(data, trajs, strict=True):
        name = f"tau-bench-{path.stem}-task{entry.get('task_id')}-trial{entry.get('trial', 0)}"
        name = _file_name(name)
        header = Header(
            FORMAT,
            "tau-bench",
            f"{path.name} task {entry.get('task_id')} trial {entry.get('trial')}",
        )
        traces.append(Trace(header, _turn_requests(traj, tools, name), f"{name}.jsonl"))
    return traces


def import_mini_swe_agent(path: Path) -> list[Trace]:
    data = _load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise TraceError(f"{path}: expected a mini-swe-agent .traj.json with 'messages'")
    messages = _messages(data["messages"], f"{path}: messages")
    tools_file = path.with_name("tools.json")
    if tools_file.is_file():
        tools = _tools(_load_json(tools_file), str(tools_file))
    else:
        tools = infer_tools(messages)
    usages = [_dig(m, "extra", "response", "usage") for m in messages]
    name = _file_name(f"mini-swe-agent-{data.get('instance_id') or path.stem}")
    header = Header(FORMAT, "mini-swe-agent", f"{path.name} ({data.get('trajectory_format', '')})")
    return [Trace(header, _turn_requests(messages, tools, name, usages), f"{name}.jsonl")]


def _openhands_call(path: Path) -> dict[str, Any]:
    data = _load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise TraceError(f"{path}: expected an OpenHands LLM log with 'messages'")
    _messages(data["messages"], f"{path}: messages")
    _tools(data.get("tools"), str(path))
    _messages([_recorded_message(data)], f"{path}: response message")
    return data


def _recorded_message(call: dict[str, Any]) -> dict[str, Any]:
    """The response message an OpenHands call recorded ({} when absent or malformed)."""
    choices = _dig(call, "response", "choices")
    message = _dig(choices[0] if isinstance(choices, list) and choices else None, "message")
    return message if isinstance(message, dict) else {}


def import_openhands(paths: list[Path]) -> list[Trace]:
    """A directory is one session; loose files given together form one session."""
    groups: list[tuple[str, list[Path]]] = []
    loose = [p for p in paths if p.is_file()]
    for p in paths:
        if p.is_dir():
            groups.append((p.name, sorted(p.glob("*.json"))))
    if loose:
        groups.append((loose[0].parent.name, loose))
    return [_openhands_session(name, files) for name, files in groups if files]


def _stamp(call: dict[str, Any]) -> float:
    try:
        stamp = float(call.get("timestamp") or 0)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return stamp if math.isfinite(stamp) else 0.0


def _openhands_session(name: str, files: list[Path]) -> Trace:
    calls = sorted((_openhands_call(f) for f in files), key=_stamp)
    start = _stamp(calls[0])
    requests = []
    for i, call in enumerate(calls):
        requests.append(
            Request(
                f"openhands-{name}-{i}",
                [clean_message(m) for m in call["messages"]],
                call.get("tools") or None,
                t=round(max(_stamp(call) - start, 0.0), 3),
                response=_response(_recorded_message(call), _dig(call, "response", "usage")),
            )
        )
    header = Header(FORMAT, "openhands", f"OpenHands LLM-call log {name} ({len(calls)} calls)")
    return Trace(header, requests, f"openhands-{_file_name(name)}.jsonl")


def import_traces(fmt: str, inputs: list[Path]) -> list[Trace]:
    missing = [str(p) for p in inputs if not p.exists()]
    if missing:
        raise TraceError(f"input not found: {', '.join(missing)}")
    if fmt == "tau-bench":
        return [t for p in inputs for t in import_tau_bench(p)]
    if fmt == "mini-swe-agent":
        files = [f for p in inputs for f in (sorted(p.glob("*.traj.json")) if p.is_dir() else [p])]
        return [t for f in files for t in import_mini_swe_agent(f)]
    if fmt == "openhands":
        return import_openhands(inputs)
    raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
