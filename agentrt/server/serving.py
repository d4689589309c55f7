"""Running the HTTP server: uvicorn on the app until a stop signal. A stop (SIGTERM, Ctrl-C)
first ends every queued and running generation (their clients get a 503, or an error event on
a stream), so uvicorn's graceful shutdown, which waits for open connections, ends within
`GRACE_S`; then the engine worker stops and control returns to the caller (which closes the
runtime: checkpoints flushed)."""

from __future__ import annotations

import contextlib
import signal
import sys

from agentrt.server.app import ServerConfig, build_app, check_exposure

GRACE_S = 10.0  # the longest a stop waits for open connections


def serve(runtime, config: ServerConfig, sock=None) -> None:
    """Serve until stopped, on `sock` when given (bound before the model loaded)."""
    import uvicorn

    if check_exposure(config):
        print(f"agentrt: warning: serving on {config.host} with no API key", file=sys.stderr)
    app, server = build_app(runtime, config)
    worker = server.worker

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            worker.end_all()  # (the connections uvicorn waits for end with their jobs)
            super().handle_exit(sig, frame)

    # uvicorn stops gracefully on SIGTERM, then raises it again under the handler it found: this
    # one exits through the `finally` blocks (worker stopped, checkpoints flushed), not at once
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        options = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=GRACE_S,
        )
        with contextlib.suppress(KeyboardInterrupt):  # (as uvicorn.run: Ctrl-C stops)
            _Server(options).run(sockets=None if sock is None else [sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.stop()


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
