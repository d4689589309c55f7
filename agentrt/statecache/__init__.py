"""Semantic state cache (docs/architecture.md §6): checkpoints of KV + recurrent state at the
boundaries where agent frameworks edit context, persisted in LMDB, found again by longest exact
prefix.

Knows token ids and model state tensors only: nothing of chat text, HTTP or sessions.
"""

from agentrt.statecache.boundaries import BOUNDARY_KINDS, Boundaries
from agentrt.statecache.manager import StateCache
from agentrt.statecache.restore import Hit

__all__ = ["BOUNDARY_KINDS", "Boundaries", "Hit", "StateCache"]
