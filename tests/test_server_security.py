"""The server's safe defaults: no non-loopback bind without an API key (unless
`--insecure-no-auth`), keys compared in constant time and never logged or echoed, and no CORS
headers unless `--cors-origin` names an origin (then simple and preflight requests work)."""

from __future__ import annotations

import hmac
import logging
import threading
import time

import click
import pytest
from click.testing import CliRunner

from agentrt.cli import main
from agentrt.errors import InvalidArgumentError
from agentrt.server import app as server_app
from agentrt.server import serving
from agentrt.server.app import ServerConfig, build_app, check_exposure, is_loopback

KEY = "sk-agentrt-secret-4b1d"
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def runtime():
    from agentrt import Runtime

    rt = Runtime.open("tiny", cache="off")
    yield rt
    rt.close()


@pytest.fixture()
def client_for(runtime):
    """`client_for(**config)`: an in-process HTTP client of an app built with that config."""
    from starlette.testclient import TestClient

    servers = []

    def make(**config) -> TestClient:
        app, server = build_app(runtime, ServerConfig(**config))
        servers.append(server)
        return TestClient(app)

    yield make
    for server in servers:
        server.worker.stop()


class _FakeRuntime:
    model_name = "tiny"
    cache = "off"
    startup = {"total_s": 2.0}  # (`Runtime.open`'s phase times)

    def close(self) -> None:
        pass


def _serve_cli(monkeypatch, *args: str) -> tuple[click.testing.Result, list[ServerConfig]]:
    """Run `agentrt serve ARGS` with the model load and the HTTP loop stubbed out."""
    served: list[ServerConfig] = []
    monkeypatch.setattr("agentrt.cli.serve.open_runtime", lambda opts, **kw: _FakeRuntime())
    monkeypatch.setattr("agentrt.cli.serve._listen", lambda host, port: None)
    monkeypatch.setattr(serving, "serve", lambda rt, config, sock: served.append(config))
    return CliRunner().invoke(main, ["serve", *args]), served


def test_serve_on_a_port_in_use_fails_before_the_model_loads(monkeypatch):
    import socket

    loaded = []
    monkeypatch.setattr("agentrt.cli.serve.open_runtime", lambda opts, **kw: loaded.append(1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        result = CliRunner().invoke(main, ["serve", "--port", port])
    assert result.exit_code == 2 and not loaded
    assert result.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    bad = CliRunner().invoke(main, ["serve", "--host", "999.1.1.1", "--api-key", "k" * 20])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: cannot listen on 999.1.1.1")


# ----------------------------------------------------------------------------- bind address


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"]
)
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "example.com"])
def test_non_loopback_hosts_need_a_key(host):
    assert not is_loopback(host)
    with pytest.raises(InvalidArgumentError, match="--insecure-no-auth"):
        check_exposure(ServerConfig(host=host))
    assert check_exposure(ServerConfig(host=host, api_key=KEY)) is False
    assert check_exposure(ServerConfig(host=host, insecure_no_auth=True)) is True


def test_cli_refuses_a_public_bind_without_a_key(monkeypatch):
    result, served = _serve_cli(monkeypatch, "--host", "0.0.0.0")
    assert result.exit_code == 2 and not served
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: refusing to serve on 0.0.0.0")
    assert "--api-key" in lines[0] and "--insecure-no-auth" in lines[0]


def test_cli_public_bind_with_insecure_no_auth_or_a_key(monkeypatch):
    result, served = _serve_cli(monkeypatch, "--host", "0.0.0.0", "--insecure-no-auth")
    assert result.exit_code == 0, result.output
    assert served[0].insecure_no_auth and served[0].api_key is None
    result, served = _serve_cli(monkeypatch, "--host", "0.0.0.0", "--api-key", KEY)
    assert result.exit_code == 0, result.output
    assert served[0].api_key == KEY and KEY not in result.output


def test_serve_warns_when_public_without_a_key(runtime, monkeypatch, capsys):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: calls.append(self.config))
    serving.serve(runtime, ServerConfig(host="0.0.0.0", insecure_no_auth=True))
    assert calls[0].host == "0.0.0.0"
    assert "warning: serving on 0.0.0.0 with no API key" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError):
        serving.serve(runtime, ServerConfig(host="0.0.0.0"))
    assert len(calls) == 1


# ----------------------------------------------------------------------------- API key


def test_keys_are_compared_in_constant_time(client_for, monkeypatch):
    compared, real = [], hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    client = client_for(api_key=KEY)
    monkeypatch.setattr(server_app.hmac, "compare_digest", spy)
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert compared == [(b"wrong", KEY.encode()), (KEY.encode(), KEY.encode())]
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    utf8 = {"Authorization": "Bearer sk-é".encode()}  # raw non-ASCII bytes: no crash
    assert client.get("/v1/models", headers=utf8).status_code == 401
    assert client_for(api_key="sk-é").get("/v1/models", headers=utf8).status_code == 200


def test_key_is_never_logged_or_echoed(runtime, caplog, capfd):
    import socket
    import urllib.error
    import urllib.request

    import uvicorn

    config = ServerConfig(api_key=KEY)
    assert KEY not in repr(config)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app, chat = build_app(runtime, config)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="debug", log_config=None)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    caplog.set_level(logging.DEBUG)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    bodies = []
    try:
        for key in (KEY, KEY + "x", "nope"):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
            req.add_header("Authorization", f"Bearer {key}")
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    bodies.append(resp.read().decode())
            except urllib.error.HTTPError as exc:
                bodies.append(exc.read().decode())
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        chat.worker.stop()
    out, err = capfd.readouterr()
    assert "GET /v1/models" in caplog.text  # the access log was on
    assert not any(KEY in text for text in [caplog.text, out, err, *bodies])


# ----------------------------------------------------------------------------- CORS


def _preflight(client, origin: str = ORIGIN):
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return client.options("/v1/chat/completions", headers=headers)


def test_no_cors_headers_by_default(client_for):
    client = client_for()
    reply = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert reply.status_code == 200
    assert not [h for h in reply.headers if h.lower().startswith("access-control-")]
    preflight = _preflight(client)
    assert preflight.status_code == 405
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_for_a_named_origin(client_for):
    client = client_for(api_key=KEY, cors_origins=(ORIGIN,))
    preflight = _preflight(client)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    auth = {"Authorization": f"Bearer {KEY}"}
    reply = client.get("/v1/models", headers={"Origin": ORIGIN, **auth})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == ORIGIN
    denied = client.get("/v1/models", headers={"Origin": ORIGIN})  # the browser may read the 401
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    other = client.get("/v1/models", headers={"Origin": "http://evil.example", **auth})
    assert "access-control-allow-origin" not in other.headers
    assert _preflight(client, "http://evil.example").status_code == 400


def test_cli_cors_origins(monkeypatch):
    args = ["--cors-origin", "https://App.Example.com:8443/", "--cors-origin", ORIGIN]
    result, served = _serve_cli(monkeypatch, *args)
    assert result.exit_code == 0, result.output
    assert served[0].cors_origins == ("https://app.example.com:8443", ORIGIN)
    for bad in ("ftp://x", "https://x/path", "example.com"):
        result, served = _serve_cli(monkeypatch, "--cors-origin", bad)
        assert result.exit_code == 2 and not served and "not an origin" in result.output
