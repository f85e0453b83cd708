"""The rollout engines as the weight sync sees them: what an engine offers to receive weights (``ReceivingEngine``)
and how the trainer side calls the engines (``ReceivingEngines``).

The sync defines both and the rollout package implements them (``RolloutEngine`` extends ``ReceivingEngine``, and
``EngineHandles`` is a ``ReceivingEngines``), so the imports run one way: rollout -> weight_sync, never back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from rlhf_core.distributed.weight_sync.buckets import MIB, WeightSpec

P = ParamSpec("P")
R = TypeVar("R")


class ReceivingEngine(Protocol):
    """The weight-sync part of one rollout engine. The sender calls the engines with these stubs as method objects
    (``engines.call(ReceivingEngine.num_workers)``); the handles send the hosted class's own method."""

    def num_workers(self) -> int:
        """Ranks this engine takes in the weight-sync group (its tensor-parallel size)."""
        ...

    def init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        timeout_s: float = 600,
        backend: str = "gloo",
    ) -> list[int]:
        """Join the weight-sync group (its workers as ranks ``rank_offset``..); blocks until every rank has joined.
        Returns the ranks taken."""
        ...

    def receive_weights(self, specs: list[WeightSpec], bucket_bytes: int = 1024 * MIB, sync_id: int = 0) -> float:
        """Receive one sync in buckets of ``bucket_bytes`` (see ``weight_sync``); returns the seconds taken."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Direct load without a collective (HF backend only; vLLM refuses)."""
        ...


class ReceivingEngines(Protocol):
    """The engines of one group as the sender reaches them: ``ReceivingEngine``'s methods on every engine (``call``,
    ``call_async``) or on one (``call_one_async``), the ``_async`` results through ``get``, and a value that several
    engines take stored once (``put``)."""

    def __len__(self) -> int: ...

    def call(
        self, method: Callable[Concatenate[ReceivingEngine, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]: ...

    def call_async(
        self, method: Callable[Concatenate[ReceivingEngine, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[Any]: ...

    def call_one_async(
        self, index: int, method: Callable[Concatenate[ReceivingEngine, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Any: ...

    def get(self, pending: Sequence[Any]) -> list[Any]: ...

    def put(self, value: Any) -> Any: ...
