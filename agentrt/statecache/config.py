"""`StateCacheConfig`: the semantic state cache's settings (docs/architecture.md §6)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentrt.env import home_dir
from agentrt.errors import InvalidArgumentError
from agentrt.host.cputhreads import usable_cores

GIB = 2**30


def default_state_dir() -> Path:
    return home_dir() / "state"


@dataclass(frozen=True)
class StateCacheConfig:
    """Settings of the semantic state cache (docs/architecture.md §6)."""

    state_dir: Path = field(default_factory=default_state_dir)
    max_bytes: int = 20 * GIB  # cap on stored payloads (--state-max-gb)
    ram_bytes: int = 2 * GIB  # RAM tier of recent checkpoints
    min_distance: int = 128  # minimum tokens between two checkpoints taken in one pass
    queue_size: int = 8  # background writer queue; a full queue drops checkpoints
    compress_level: int = 1
    workers: int = 4  # compression threads of the writer
    restore_threads: int = 0  # restore's read threads (0: one per core but one, up to 16)
    staging_bytes: int = 2 * GIB  # pinned host ring for device->host checkpoint copies (CUDA)

    def __post_init__(self) -> None:
        if not isinstance(self.state_dir, Path):  # a str from Python callers
            object.__setattr__(self, "state_dir", Path(self.state_dir).expanduser())
        if self.max_bytes <= 0 or self.ram_bytes < 0:
            raise InvalidArgumentError("state cache sizes must be positive")
        if (
            self.min_distance < 0
            or self.queue_size < 1
            or self.workers < 1
            or self.restore_threads < 0
        ):
            raise InvalidArgumentError("invalid state cache settings")


def restore_threads(config: StateCacheConfig) -> int:
    """Threads a restore reads and decompresses chunks on: `config.restore_threads`, or one per
    core but one (the restoring thread uploads what they finish meanwhile: on a 16-core host a
    32K-token checkpoint came from the RAM tier in 42 ms with 15 threads, 49-58 ms with 16), at
    least 2 and at most 16."""
    if config.restore_threads:
        return config.restore_threads
    return max(2, min(16, usable_cores() - 1))
