"""Layering rules: imports flow cli -> bench -> server/replay -> session -> engine ->
models/offload/statecache -> the modules at the package root, and `import agentrt` stays
light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "agentrt"
FORBIDDEN = {
    "models": {"engine", "session", "server", "replay", "cli", "offload", "statecache", "bench"},
    "offload": {"engine", "session", "server", "replay", "cli", "statecache", "bench"},
    "statecache": {"engine", "session", "server", "replay", "cli", "offload", "bench"},
    "engine": {"session", "server", "replay", "cli", "bench"},
    "session": {"server", "replay", "cli", "bench"},
    "server": {"replay", "cli", "bench"},
    "replay": {"server", "cli", "bench"},
    "bench": {"cli"},
}
# modules at the package root (besides the package's lazy `Runtime` export) and `agentrt/host`
# sit below every layer
ROOT_FORBIDDEN = {"models", "offload", "statecache", "engine", "session", "server", "replay"}
ROOT_FORBIDDEN |= {"cli", "bench"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {n.split(".")[1] for n in names if n.startswith("agentrt.") and n.count(".") >= 1}


def test_import_direction():
    bad = []
    for layer, forbidden in FORBIDDEN.items():
        for path in (PKG / layer).rglob("*.py"):
            hits = _imports(path) & forbidden
            bad += [f"{path.relative_to(PKG)} imports agentrt.{h}" for h in hits]
    assert not bad, bad


def test_root_modules_sit_below_every_layer():
    """The root modules and `agentrt/host` (what the process needs from its host) import no
    layer."""
    bad = []
    for path in [*PKG.glob("*.py"), *(PKG / "host").rglob("*.py")]:
        if path.parent == PKG and path.name == "__init__.py":
            continue
        hits = _imports(path) & ROOT_FORBIDDEN
        bad += [f"{path.relative_to(PKG)} imports agentrt.{h}" for h in hits]
    assert not bad, bad


def test_the_package_root_holds_only_the_api_errors_and_environment():
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "env.py", "errors.py"]


def test_environment_is_read_in_env_only():
    """`agentrt/env.py` is the one module that touches `os.environ` / `os.getenv`."""
    bad = []
    for path in PKG.rglob("*.py"):
        if path.name == "env.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                bad.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not bad, bad


MAX_LINES = 500


def test_no_module_is_over_500_lines():
    """Modules stay small enough to read in one sitting."""
    long = {
        str(p.relative_to(PKG)): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_every_module_has_a_docstring():
    missing = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if ast.get_docstring(ast.parse(p.read_text())) is None
    ]
    assert not missing, missing


def test_import_agentrt_is_light():
    code = "import sys, agentrt; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]
