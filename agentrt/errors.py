"""Typed exceptions of agentrt.

Every error a user can cause (bad model directory, unknown architecture, a prompt longer than the
context, an option this build does not support yet) is raised as a subclass of `AgentrtError`, whose
message is one line naming the problem. The CLI prints that line without a traceback; Python callers
can catch the specific class. Internal bugs stay ordinary exceptions.
"""

from __future__ import annotations


class AgentrtError(Exception):
    """Base class of all user-facing agentrt errors."""


class ModelNotFoundError(AgentrtError):
    """The model name or directory does not exist."""


class ModelFormatError(AgentrtError):
    """A model directory exists but its config or weights are missing or malformed."""


class UnsupportedArchitectureError(AgentrtError):
    """The checkpoint's architecture (or one of its features) is not implemented."""


class PromptTooLongError(AgentrtError):
    """The prompt (plus requested tokens) does not fit in the model's context."""


class InvalidArgumentError(AgentrtError, ValueError):
    """An argument or option has a value agentrt does not accept."""


class NotSupportedYetError(AgentrtError):
    """A documented option whose implementation has not landed yet."""


class ChatTemplateError(AgentrtError):
    """The tokenizer has no chat template, or rendering the messages failed."""
