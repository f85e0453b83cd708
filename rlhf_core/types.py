"""Small value types passed between stages (and, later, between Prefect tasks): references, never models."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CheckpointRef:
    """A committed artifact: where it is, which stage and step made it, and the hash of the config behind it."""

    uri: str
    stage: str
    step: int
    config_hash: str
    metrics: dict = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict:
        return asdict(self)
