"""Traces and replay (docs/architecture.md §2, §7): the trace format, importers of real agent logs,
a synthetic coding-agent session generator, and replay on the local runtime or an OpenAI-compatible
endpoint with a TTFT report."""
