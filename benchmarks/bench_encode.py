"""Request preparation's tokenization over a real agent trace, with every recorded reply
remembered as if this runtime had generated it (so it is spliced back into later prompts, as
with a framework talking to `agentrt serve`). Prints JSON: prompts, their largest size, and the
median and largest encode time.

    python benchmarks/bench_encode.py TRACE TOKENIZER_DIR [CHAT_TEMPLATE] [REQUESTS]

e.g. `.traces-dev/msa/mini-swe-agent-marshmallow-code__marshmallow-1359.jsonl.zst .tok/qwen3
.tok/qwen3/chat_template.qwen3-hybrid-thinking.jinja 30` (see benchmarks/gpu_ttft.sh prepare).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from agentrt.replay.trace import read_trace
from agentrt.session.chat import normalize_messages, render
from agentrt.session.runtime import _check_tools
from agentrt.session.tokenizer import load_tokenizer
from agentrt.session.tokens import GeneratedIds


def main() -> None:
    trace, tok = read_trace(sys.argv[1]), load_tokenizer(sys.argv[2])
    if len(sys.argv) > 3:
        with open(sys.argv[3]) as f:
            tok.chat_template = f.read()
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    memory, times, longest = GeneratedIds(tok), [], 0
    for req in trace.requests[:count]:
        text = render(tok, normalize_messages(req.messages), _check_tools(req.tools))
        start = time.perf_counter()
        longest = max(longest, len(memory.encode(text)))
        times.append(time.perf_counter() - start)
        reply = req.response
        parts = [] if reply is None else [reply.content, reply.reasoning_content]
        parts += [call["function"]["arguments"] for call in (reply and reply.tool_calls) or []]
        for part in filter(None, parts):
            memory.remember(tok.encode(part, add_special_tokens=False))
    print(
        json.dumps(
            {
                "prompts": len(times),
                "largest_prompt_tokens": longest,
                "encode_ms_median": round(statistics.median(times) * 1e3, 2),
                "encode_ms_max": round(max(times) * 1e3, 2),
                "spliced": memory.spliced,
            }
        )
    )


if __name__ == "__main__":
    main()
