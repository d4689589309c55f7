"""OpenAI-compatible HTTP server (docs/architecture.md §2): `/v1/chat/completions` (streaming and
not), `/v1/models`, `/health`, `/metrics`. One engine worker thread serves requests in arrival
order."""
