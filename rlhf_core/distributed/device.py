"""The one place that knows where tensors live: the worker's device, moving batches to it, and every collective.

The device is chosen once, by the driver (``resolve_device``: ``auto`` = cuda when the cluster has GPUs), and reaches
each Ray worker as ``RLHF_DEVICE``; ``current()`` reads it back. A batch from Ray arrives on the CPU: the role and
trainer code hands it through ``to_device`` before any forward (DeepSpeed's forward does not move inputs).

Collectives: an NCCL process group only takes CUDA tensors and gloo only CPU ones, so each collective here moves its
tensor to the device of the group's backend (``comm_device``), runs, and copies the result back into the caller's
tensor, whatever device that tensor is on. Role and trainer code calls these functions (or ``DeepSpeedStrategy``'s
methods, which call them) and never ``torch.distributed`` directly; ``tests/test_architecture.py`` checks that no
other module issues an ``all_reduce`` or ``broadcast``. Standalone groups (the weight-sync group between the trainer
and the rollout engines, built from a ``ProcessGroup`` object and not registered with ``torch.distributed``) go
through ``group_broadcast``.

Without an initialised default group (one process, no Ray) the collectives are the identity, so the plain role
classes run alone.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist

DEVICE_ENV = "RLHF_DEVICE"
B = TypeVar("B")


def resolve_device(requested: str, gpus: float | None = None) -> str:
    """``auto`` -> ``cuda`` when the cluster has GPUs (``gpus``: its ``GPU`` resource), else ``cpu``; ``cpu``/``cuda``
    are kept. Without ``gpus`` (no cluster: this process is where the work runs) a GPU visible here decides. On a
    Ray cluster the workers' GPUs count, not the driver's: a driver in a container without GPUs, or on a CPU head
    node, still puts the roles on the GPUs that the engines take."""
    if requested != "auto":
        return requested
    has_gpu = torch.cuda.is_available() if gpus is None else gpus > 0
    return "cuda" if has_gpu else "cpu"


def current() -> torch.device:
    """This worker's device: ``RLHF_DEVICE`` (set by the driver for every worker; ``cpu`` when unset). On CUDA the
    device of ``LOCAL_RANK`` (a Ray worker sees only its own GPU, so that is ``cuda:0`` there)."""
    kind = os.environ.get(DEVICE_ENV, "cpu")
    if kind == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    return torch.device(kind)


def to_device(batch: B, device: torch.device | str) -> B:
    """``batch`` with every tensor on ``device``: a dict of tensors (the supervised stages' collated batches) or a
    tensor-batch dataclass (``rlhf_core.algos.experience``: ``tensors()`` lists its fields). Non-blocking copies
    from pinned memory are left to PyTorch; tensors already there are not copied."""
    if isinstance(batch, dict):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # type: ignore[return-value]
    if dataclasses.is_dataclass(batch) and hasattr(batch, "tensors"):
        return dataclasses.replace(batch, **{k: v.to(device) for k, v in batch.tensors().items()})  # type: ignore[arg-type]
    raise TypeError(f"cannot move a {type(batch).__name__} to {device}: expected a dict of tensors or a TensorBatch")


# -- collectives on the default (DeepSpeed) group ---------------------------------------------------------------------


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def comm_device(group: Any = None) -> torch.device:
    """The device the group's backend communicates on: the current CUDA device for NCCL, the CPU otherwise."""
    if initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """In place: the element-wise sum over the group's ranks, on the backend's device; returns ``tensor``."""
    if not initialized():
        return tensor
    work = tensor.to(comm_device(group))
    dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """In place: the element-wise maximum over the group's ranks, on the backend's device; returns ``tensor``."""
    if not initialized():
        return tensor
    work = tensor.to(comm_device(group))
    dist.all_reduce(work, op=dist.ReduceOp.MAX, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_reduce_mean(value: float, group: Any = None) -> float:
    """The mean of a Python number over the group's ranks (float64 on the wire)."""
    if not initialized():
        return float(value)
    total = all_reduce_sum(torch.tensor([float(value)], dtype=torch.float64), group)
    return total.item() / dist.get_world_size(group)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; NCCL stages them on the current CUDA device itself)."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Any = None) -> None:
    if initialized():
        dist.barrier(group=group)


# -- standalone groups (ProcessGroup objects) -------------------------------------------------------------------------


def group_broadcast(group: Any, tensor: torch.Tensor, root: int = 0) -> None:
    """Broadcast ``tensor`` in place from ``root`` over a standalone ``ProcessGroup`` object (e.g. the weight-sync
    group). The tensor must already be on the group's device (the sender packs its buckets there)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()
