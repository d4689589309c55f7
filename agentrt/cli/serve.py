"""`agentrt serve`: the HTTP server (OpenAI chat completions and responses, Anthropic messages)."""

from __future__ import annotations

import socket

import click

from agentrt.cli.main import main
from agentrt.cli.options import model_options, open_runtime
from agentrt.cli.values import Finite
from agentrt.errors import InvalidArgumentError


def _origin(value: str) -> str:
    """`scheme://host[:port]` as browsers send it in `Origin` (or `*`, any origin)."""
    if value == "*":
        return value
    from urllib.parse import urlsplit

    url = urlsplit(value.strip())
    bare = url.path in ("", "/") and not (url.query or url.fragment or "@" in url.netloc)
    try:
        url.port  # noqa: B018 - (raises for a port out of range)
    except ValueError:
        bare = False
    if url.scheme not in ("http", "https") or not url.netloc or not bare:
        raise click.BadParameter(f"{value!r} is not an origin like https://example.com:8443")
    return f"{url.scheme}://{url.netloc.lower()}"


def _origins(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_origin(v) for v in values)


@main.command()
@model_options
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface to bind (loopback by default; any other needs --api-key).",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--api-key",
    default=None,
    envvar="AGENTRT_API_KEY",
    help="Require the key: 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
)
@click.option(
    "--insecure-no-auth",
    is_flag=True,
    help="Allow a non-loopback --host without --api-key (anyone who can reach it may use it).",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    callback=_origins,
    metavar="ORIGIN",
    help="A browser origin (https://host[:port]) allowed to call the API; repeatable. "
    "'*': any web page the browser shows (without --api-key, any of them may use the model). "
    "None: no CORS headers.",
)
@click.option(
    "--queue-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Requests waiting beyond this get HTTP 429.",
)
@click.option("--max-request-mb", type=Finite(0.001, 2**20), default=32.0, show_default=True)
def serve(
    host, port, api_key, insecure_no_auth, cors_origins, queue_size, max_request_mb, **opts
) -> None:
    """Serve the model over HTTP: OpenAI chat completions (/v1/chat/completions) and responses
    (/v1/responses, stateless), and Anthropic messages (/v1/messages), all through one state
    cache. Point an OpenAI client at http://HOST:PORT/v1, an Anthropic one (Claude Code:
    ANTHROPIC_BASE_URL) at http://HOST:PORT.

    Loopback only unless --api-key (or --insecure-no-auth) is given; no CORS unless --cors-origin.
    """
    from agentrt.server.app import ServerConfig, check_exposure
    from agentrt.server.serving import serve as run_server

    config = ServerConfig(
        host,
        port,
        api_key,
        int(max_request_mb * 2**20),
        queue_size,
        insecure_no_auth=insecure_no_auth,
        cors_origins=cors_origins,
    )
    check_exposure(config)  # before the model loads, as the port is taken
    sock = _listen(host, port)
    rt = open_runtime(opts, require_tokenizer=True)
    ready = rt.startup.get("total_s", 0.0)
    where = f"[{host}]" if ":" in host else host  # (an IPv6 address in a URL: bracketed)
    click.echo(
        f"agentrt: serving {rt.model_name} (cache={rt.cache}) on http://{where}:{port}/v1 "
        f"(ready in {ready:.1f} s)",
        err=True,
    )
    try:
        run_server(rt, config, sock)
    finally:
        rt.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port`, or a one-line error (a port in use, a host that is
    not this machine's) before the model loads."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock
