"""How a bucket travels: all transports behind ``send(buffer, sync_id, index)`` / ``recv(nbytes, sync_id, index)``.

- ``gloo``: a standalone group of the trainer's rank 0 (rank 0) and every rollout worker (ranks 1..N:
  ``rank_offset`` of an engine + that worker's tensor-parallel rank), one broadcast per bucket, buffers on CPU.
  The group is built directly from a ``torch.distributed.TCPStore`` and a ``ProcessGroupGloo`` object, so neither
  the trainer's default (DeepSpeed) group nor vLLM's own groups are touched, and it is reused across syncs. This is
  the transport the tests run.
- ``nccl``: the same group as a ``ProcessGroupNCCL`` over the same kind of store, buffers on each process's current
  CUDA device. UNVERIFIED: written from torch's API (no GPU here).
- ``cuda_ipc``: for engines on the trainer's GPUs (colocate_all). No collective: actor rank ``r`` packs each bucket
  on its GPU and publishes a CUDA IPC handle of the buffer (``ipc_handle``, torch's ``reduce_tensor``) in the
  TCPStore under a key for the worker on its GPU (worker rank ``r + 1``); the worker opens it (``open_ipc_handle``),
  copies it into its own memory, acknowledges through the store, and unpacks. The handles travel through the store
  rather than one Ray call per bucket so that each worker keeps one lazy stream into one ``reload_weights`` call,
  the same as with the collectives. At connect time each side checks that both are on the same GPU (by UUID).
  UNVERIFIED: written from torch's API (no GPU here).

torch only; ``ipc_handle`` and ``open_ipc_handle`` need neither Ray nor vLLM.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch

BACKENDS = ("gloo", "nccl", "cuda_ipc")


def resolve_backend(requested: str, device: str, colocate_all: bool, key: str = "rollout.weight_sync_backend") -> str:
    """The transport for ``requested`` ("auto", "gloo", "nccl", "cuda_ipc") on ``device`` ("cpu" or "cuda"):
    auto = cuda_ipc with colocate_all on GPU, nccl on GPU, else gloo. A GPU transport on a CPU machine is refused
    with the key's name."""
    if requested == "auto":
        return ("cuda_ipc" if colocate_all else "nccl") if device == "cuda" else "gloo"
    from rlhf_core.config import ConfigError

    if requested not in BACKENDS:
        raise ConfigError(f"invalid value {requested!r} for '{key}': expected auto, gloo, nccl or cuda_ipc")
    if requested != "gloo" and device != "cuda":
        raise ConfigError(f"'{key}={requested}' needs CUDA GPUs, this run is on {device}: use gloo or auto")
    return requested


def ipc_handle(buffer: torch.Tensor) -> tuple[Any, tuple]:
    """A picklable CUDA IPC handle of ``buffer`` (torch's ``reduce_tensor``). The buffer must stay alive and
    unmodified until the receiver has copied it. UNVERIFIED here (no GPU)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not buffer.is_cuda:
        raise ValueError("ipc_handle needs a CUDA tensor")
    torch.cuda.current_stream(buffer.device).synchronize()  # the packing kernels have finished before it is read
    return reduce_tensor(buffer)


def open_ipc_handle(handle: tuple[Any, tuple], device: int | None = None) -> torch.Tensor:
    """The sender's buffer, mapped into this process (no copy). The device index in the handle is the sender's
    numbering; it is replaced by ``device`` (default: this process's current device), which must be the same GPU
    under this process's ``CUDA_VISIBLE_DEVICES`` (OpenRLHF patches the same argument). UNVERIFIED here (no GPU)."""
    rebuild, args = handle
    args = list(args)
    args[6] = torch.cuda.current_device() if device is None else device  # storage_device of rebuild_cuda_tensor
    return rebuild(*args)


def _gpu_uuid() -> str:
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _make_store(master_addr: str, master_port: int, is_master: bool, world_size: int | None, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    # wait_for_workers=False: the constructor returns at once; the group construction (or the first store
    # access) is the rendezvous.
    return TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _make_group(
    master_addr: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float, backend: str
) -> Any:
    """A standalone process group (not registered with ``torch.distributed``'s default world)."""
    from torch.distributed import PrefixStore

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("weight sync backend 'nccl' needs CUDA, and this process sees no GPU: use gloo")
        from torch.distributed import ProcessGroupNCCL  # CUDA builds of torch only

        store = _make_store(master_addr, master_port, rank == 0, world_size, timeout_s)
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # Created lazily on the first collective, on this process's current CUDA device (the trainer has set it,
        # vLLM's worker has too). UNVERIFIED here.
        return store, ProcessGroupNCCL(PrefixStore(f"{group_name}/", store), rank, world_size, opts)
    if backend != "gloo":
        raise ValueError(f"weight sync backend {backend!r} is not a collective (expected gloo or nccl)")
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    store = _make_store(master_addr, master_port, rank == 0, world_size, timeout_s)
    # blocks until all ``world_size`` ranks have joined
    return store, ProcessGroupGloo(PrefixStore(f"{group_name}/", store), rank, world_size, timeout)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    from rlhf_core.distributed.device import group_broadcast

    group_broadcast(group, tensor, root=0)


class Collective:
    """gloo or nccl: one broadcast from rank 0 per bucket."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        timeout_s: float,
        backend: str,
    ):
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.store, self.group = _make_group(
            master_addr, master_port, rank, world_size, group_name, timeout_s, backend
        )

    def send(self, buffer: torch.Tensor, sync_id: int, index: int) -> None:
        _broadcast(self.group, buffer)

    def recv(self, nbytes: int, sync_id: int, index: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # fresh: the loader may keep views
        _broadcast(self.group, buffer)
        return buffer


class CudaIpc:
    """cuda_ipc: handles and acknowledgements through the TCPStore hosted by actor rank 0. ``peer``: the worker
    rank this actor rank serves (sender) or this worker's rank (receiver). UNVERIFIED here (no GPU)."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        is_master: bool,
        world_size: int,
        group_name: str,
        timeout_s: float,
        peer: int,
    ):
        if not torch.cuda.is_available():
            raise RuntimeError("weight sync backend 'cuda_ipc' needs CUDA, and this process sees no GPU: use gloo")
        from torch.distributed import PrefixStore

        self.backend = "cuda_ipc"
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # world_size None: the store's clients are the workers and the other actor ranks, more than world_size
        self._tcp = _make_store(master_addr, master_port, is_master, None, timeout_s)
        self.store = PrefixStore(f"{group_name}/", self._tcp)
        self.peer = peer

    def _key(self, sync_id: int, index: int) -> str:
        return f"bucket/{sync_id}/{index}/{self.peer}"

    def announce_gpu(self) -> None:
        self.store.set(f"gpu/{self.peer}", _gpu_uuid())

    def check_same_gpu(self) -> None:
        self.store.wait([f"gpu/{self.peer}"], self.timeout)
        theirs, mine = self.store.get(f"gpu/{self.peer}").decode(), _gpu_uuid()
        if theirs != mine:
            raise RuntimeError(
                f"cuda_ipc weight sync: engine worker {self.peer} is on GPU {theirs}, its actor rank on {mine}; "
                "cuda_ipc needs each engine worker on its actor rank's GPU (colocate_all), else use nccl"
            )

    def send(self, buffer: torch.Tensor, sync_id: int, index: int) -> None:
        key = self._key(sync_id, index)
        self.store.set(key, pickle.dumps(ipc_handle(buffer)))
        self.store.wait([key + "/ack"], self.timeout)  # the buffer is reused for the next bucket only after this
        self.store.delete_key(key)
        self.store.delete_key(key + "/ack")

    def recv(self, nbytes: int, sync_id: int, index: int) -> torch.Tensor:
        key = self._key(sync_id, index)
        self.store.wait([key], self.timeout)
        shared = open_ipc_handle(pickle.loads(self.store.get(key)))
        # A copy of our own: vLLM's layer-wise reload may keep views until a layer is complete, while the sender
        # reuses its buffer after the acknowledgement.
        local = shared[:nbytes].clone()
        torch.cuda.current_stream().synchronize()
        del shared
        self.store.set(key + "/ack", b"1")
        return local
