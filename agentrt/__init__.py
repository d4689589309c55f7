"""agentrt: a local runtime for tool-calling agents on Mixture-of-Experts models.

Public API: `Runtime` and `RuntimeConfig` (see docs/architecture.md §2). Importing this package is
cheap: torch and transformers load only when a Runtime is opened."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Runtime", "RuntimeConfig", "__version__"]

if TYPE_CHECKING:
    from agentrt.session.runtime import Runtime, RuntimeConfig


def __getattr__(name: str):
    if name in ("Runtime", "RuntimeConfig"):
        from agentrt.session import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'agentrt' has no attribute {name!r}")
