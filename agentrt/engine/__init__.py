"""Engine: sequence state and snapshots, chunked prefill with boundary capture, decode, sampling.
Knows token ids only; imports models (and later offload/statecache), never sessions or text.
"""

from agentrt.engine.engine import Engine
from agentrt.engine.generation import Cancelled, Generation, Timings
from agentrt.engine.sampling import SamplingParams
from agentrt.engine.state import SequenceState, Snapshot

__all__ = [
    "Cancelled",
    "Engine",
    "Generation",
    "SamplingParams",
    "SequenceState",
    "Snapshot",
    "Timings",
]
