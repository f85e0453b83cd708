"""ZeRO-3 partitioned parameters, driven through their own methods (recognised by their ZeRO attributes, ``ds_id``),
so that model building does not import DeepSpeed: the one context that holds them whole while they are written."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, cast

import torch


class ZeroParameter(Protocol):
    """What DeepSpeed's ``zero.Init`` adds to a parameter it partitions (set on the instance at runtime, so no class
    declares it): its id, status and full shape, and the methods that gather and re-partition a list of them."""

    ds_id: int
    ds_status: Any  # a ZeroParamStatus
    ds_shape: torch.Size

    def all_gather(self, param_list: list[Any] | None = None, async_op: bool = False, hierarchy: int = 0) -> Any: ...

    def partition(
        self,
        param_list: list[Any] | None = None,
        hierarchy: int = 0,
        has_been_updated: bool = False,
        free_data: bool = True,
    ) -> Any: ...


def _partitioned(params: Sequence[torch.Tensor]) -> list[ZeroParameter]:
    """The ZeRO-3 parameters among ``params`` whose full value is not on this rank now."""
    zero = [cast(ZeroParameter, p) for p in params if hasattr(p, "ds_id")]
    return [p for p in zero if p.ds_status.name == "NOT_AVAILABLE"]


def full_copies(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The full values of ``params`` to read: ZeRO-3 partitioned ones gathered once, copied out (detached) and
    released again; ordinary ones as they are (no copy). Every rank must call it for the same parameters."""
    gathered = _partitioned(params)
    if not gathered:
        return list(params)
    gathered[0].all_gather(param_list=gathered)
    ids = {id(p) for p in gathered}
    try:
        return [p.data.detach().clone() if id(p) in ids else p for p in params]
    finally:
        gathered[0].partition(param_list=gathered)


@contextmanager
def full_values(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside, ZeRO-3 partitioned ``params`` hold their full values, and what is written to them is kept: gathered on
    entry, re-partitioned from the written values on exit. Every rank must enter and write the same values (our
    writes come from seeded generators). A no-op for ordinary parameters."""
    gathered = _partitioned(params)
    if gathered:
        gathered[0].all_gather(param_list=gathered)
    try:
        yield
    finally:
        if gathered:
            gathered[0].partition(param_list=gathered, has_been_updated=True)
