"""How a bucket travels: all transports behind ``send(buffer, sync_id, index)`` / ``recv(nbytes, sync_id, index)``.

- ``gloo``: a standalone group of the trainer's rank 0 (rank 0) and every rollout worker (ranks 1..N:
  ``rank_offset`` of an engine + that worker's tensor-parallel rank), one broadcast per bucket, buffers on CPU.
  The group is built directly from a ``torch.distributed.TCPStore`` and a ``ProcessGroupGloo`` object, so neither
  the trainer's default (DeepSpeed) group nor vLLM's own groups are touched, and it is reused across syncs. This is
  the transport the tests run.
- ``nccl``: the same group as a ``ProcessGroupNCCL`` over the same kind of store, buffers on each process's current
  CUDA device. UNVERIFIED: written from torch's API (no GPU here).
- ``cuda_ipc``: for engines on the trainer's GPUs (colocate_all). No collective: the processes meet in a TCPStore
  hosted by actor rank 0, and each announces the UUID of its GPU. An actor rank serves the engine workers on its own
  GPU (``ipc_pairs``): it packs each bucket on its GPU and publishes a CUDA IPC handle of the buffer (``ipc_handle``,
  torch's ``reduce_tensor``) under a key named by that GPU's UUID; each worker reads the key of its own GPU, opens it
  (``open_ipc_handle``), copies it into its own memory, and acknowledges through the store. Pairing by UUID, as
  vLLM's own IPC weight transfer and OpenRLHF do, rather than "actor rank r serves worker r + 1": Ray decides which
  GPU an actor's bundle gets, and vLLM's Ray executor gives its k-th worker the k-th smallest GPU of the engine's
  bundles, so the two orders need not agree. The handles travel through the store rather than one Ray call per
  bucket so that each worker keeps one lazy stream into one ``reload_weights`` call, the same as with the
  collectives. UNVERIFIED on a GPU here: the store protocol and the pairing are tested on CPU with the CUDA calls
  replaced.

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


def _local_gpu() -> tuple[torch.device, str]:
    """This process's current CUDA device and its UUID; refuses a process that sees no GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("weight sync backend 'cuda_ipc' needs CUDA, and this process sees no GPU: use gloo")
    index = torch.cuda.current_device()
    return torch.device("cuda", index), str(torch.cuda.get_device_properties(index).uuid)


def _private_copy(shared: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of an opened handle, copied into this process's own memory and finished."""
    local = shared[:nbytes].clone()
    if local.is_cuda:
        torch.cuda.current_stream(local.device).synchronize()
    return local


def ipc_pairs(actor_gpus: dict[int, str], worker_gpus: dict[int, str]) -> dict[int, list[int]]:
    """cuda_ipc's pairing: for each actor rank, the engine workers on its GPU (both given as rank -> GPU UUID).
    Every worker needs an actor rank on its GPU, and a GPU with workers needs exactly one actor rank (two would
    publish under the same key)."""
    by_gpu: dict[str, list[int]] = {}
    for rank, gpu in sorted(actor_gpus.items()):
        by_gpu.setdefault(gpu, []).append(rank)
    pairs: dict[int, list[int]] = {rank: [] for rank in actor_gpus}
    for worker, gpu in sorted(worker_gpus.items()):
        ranks = by_gpu.get(gpu, [])
        if not ranks:
            raise RuntimeError(
                f"cuda_ipc weight sync: engine worker {worker} is on GPU {gpu}, where no actor rank is "
                f"(actor ranks' GPUs: {sorted(by_gpu)}); cuda_ipc needs each engine worker on an actor rank's GPU "
                "(placement.colocate_all), else use nccl"
            )
        if len(ranks) > 1:
            raise RuntimeError(f"cuda_ipc weight sync: actor ranks {ranks} share GPU {gpu}; each needs its own GPU")
        pairs[ranks[0]].append(worker)
    return pairs


def _make_store(master_addr: str, master_port: int, is_master: bool, world_size: int | None, timeout_s: float) -> Any:
    # torch documents it as torch.distributed.TCPStore, but its __init__ re-exports it without declaring it public
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

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
    from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage] (as TCPStore)

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
    """cuda_ipc: handles and acknowledgements through the TCPStore hosted by actor rank 0 (``is_master``). A sender
    is actor rank ``rank``, a receiver is engine worker ``rank`` of the weight-sync world (1..N); each announces its
    GPU's UUID at construction. A sender learns the workers it serves with ``pair``. UNVERIFIED on a GPU here."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        is_master: bool,
        group_name: str,
        timeout_s: float,
        *,
        sender: bool,
        rank: int,
    ):
        from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage] (as TCPStore)

        self.backend = "cuda_ipc"
        self.device, self.gpu = _local_gpu()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # world_size None: the store's clients are the workers and the other actor ranks, more than world_size
        self._tcp = _make_store(master_addr, master_port, is_master, None, timeout_s)
        self.store = PrefixStore(f"{group_name}/", self._tcp)
        self.rank = rank
        self.peers: list[int] = []  # a sender's workers, set by pair()
        self.store.set(f"gpu/{'actor' if sender else 'worker'}/{rank}", self.gpu)

    def _gpus(self, side: str, ranks: range) -> dict[int, str]:
        keys = [f"gpu/{side}/{r}" for r in ranks]
        self.store.wait(keys, self.timeout)
        return {r: self.store.get(k).decode() for r, k in zip(ranks, keys)}

    def pair(self, actor_world_size: int, sync_world_size: int) -> list[int]:
        """Sender: wait until the ``actor_world_size`` actor ranks and the ``sync_world_size - 1`` workers have
        announced their GPUs, and keep the workers on this rank's GPU (``ipc_pairs``; every rank computes the same
        pairing from the same announcements, so a bad placement fails on every rank alike)."""
        actors = self._gpus("actor", range(actor_world_size))
        workers = self._gpus("worker", range(1, sync_world_size))
        self.peers = ipc_pairs(actors, workers)[self.rank]
        return self.peers

    def _key(self, sync_id: int, index: int) -> str:
        return f"bucket/{sync_id}/{index}/{self.gpu}"

    def send(self, buffer: torch.Tensor, sync_id: int, index: int) -> None:
        key = self._key(sync_id, index)
        acks = [f"{key}/ack/{w}" for w in self.peers]
        # torch's stub types Store.set's value as str; its binding takes bytes too (pickles do not decode)
        self.store.set(key, pickle.dumps(ipc_handle(buffer)))  # pyright: ignore[reportArgumentType]
        self.store.wait(acks, self.timeout)  # the buffer is reused for the next bucket only after this
        for k in (key, *acks):
            self.store.delete_key(k)

    def recv(self, nbytes: int, sync_id: int, index: int) -> torch.Tensor:
        key = self._key(sync_id, index)
        self.store.wait([key], self.timeout)
        shared = open_ipc_handle(pickle.loads(self.store.get(key)))
        # A copy of our own: vLLM's layer-wise reload may keep views until a layer is complete, while the sender
        # reuses its buffer after the acknowledgement.
        local = _private_copy(shared, nbytes)
        del shared
        self.store.set(f"{key}/ack/{self.rank}", b"1")  # pyright: ignore[reportArgumentType] (bytes: see send)
        return local
