"""Live weight sync from the trainer to the rollout engines, after OpenRLHF's ``broadcast_to_vllm``, in buckets.

Both sides agree beforehand on a list of ``(name, dtype, shape)`` specs and a bucket size; ``bucket_plan`` turns
them into the same list of buckets on both sides (consecutive tensors of about ``bucket_bytes`` each, a tensor
bigger than a bucket in a bucket of its own). Per bucket the sender packs the tensors' bytes into one flat uint8
buffer (``pack_bucket``) and hands it over in ONE transfer; the receiver unpacks views into it (``unpack_bucket``)
and hands them to vLLM's ``reload_weights``, which maps Hugging Face names onto its own layout (stacked qkv,
gate/up, tensor-parallel shards) and re-runs the backend's post-load processing (the CPU backend repacks linear
weights, which is why calling the model's ``load_weights`` directly fails there). One transfer per bucket instead of
one per tensor is the point: per-collective latency, not bandwidth, dominates for the many small tensors of a model.

Every bucket starts with a 16-byte header (status, bucket index). A failure on the sender midway (a failed gather,
a tensor that does not match its spec) still sends that bucket, with the status "abort": the receivers stop at once
instead of waiting in the collective until its timeout, and no transfer is spent on the signal alone.

Transports (``backend``), all behind ``send(buffer)`` / ``recv(nbytes)``:

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

The plain functions ``pack_bucket``, ``unpack_bucket``, ``ipc_handle``, ``open_ipc_handle`` and ``load_into_module``
need neither Ray nor vLLM (a GPU check script can measure an IPC handoff into a model in another process with them).

torch only at import time; vLLM is never imported by this module (the receiver runs inside vLLM's worker process,
where it reaches vLLM through ``self``, the worker it is mixed into).
"""

from __future__ import annotations

import datetime
import logging
import pickle
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

WeightSpec = tuple[str, str, tuple[int, ...]]

BACKENDS = ("gloo", "nccl", "cuda_ipc")
HEADER_BYTES = 16  # int64 status, int64 bucket index
ALIGN = 16  # every tensor starts at a multiple of 16 bytes: a uint8 view can be re-viewed as any dtype
STATUS_DATA, STATUS_ABORT = 1, 2
MIB = 1 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (what travels in the specs)."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def spec_of(name: str, tensor: torch.Tensor) -> WeightSpec:
    return (name, dtype_name(tensor.dtype), tuple(int(s) for s in tensor.shape))


def _normal_specs(specs: Iterable[Sequence[Any]]) -> list[WeightSpec]:
    return [(str(n), str(d), tuple(int(s) for s in shape)) for n, d, shape in specs]


def spec_nbytes(spec: WeightSpec) -> int:
    numel = 1
    for s in spec[2]:
        numel *= s
    return numel * to_dtype(spec[1]).itemsize


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bucket_plan(specs: Sequence[WeightSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``specs`` per bucket, in order: a tensor joins the current bucket unless that would take the
    bucket's tensor bytes over ``bucket_bytes``; a tensor bigger than a bucket gets one of its own. Both sides call
    this with the same arguments, so the plan itself never travels."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    plan: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        n = spec_nbytes(spec)
        if current and size + n > bucket_bytes:
            plan.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        plan.append(current)
    return plan


def bucket_layout(specs: Sequence[WeightSpec]) -> tuple[list[int], int]:
    """Byte offsets of the tensors of one bucket in its buffer, and the buffer's size: the header first, then each
    tensor at the next multiple of ``ALIGN``."""
    offsets, end = [], HEADER_BYTES
    for spec in specs:
        offsets.append(end)
        end = _aligned(end + spec_nbytes(spec))
    return offsets, end


def _set_header(buffer: torch.Tensor, status: int, index: int) -> None:
    buffer[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([status, index], dtype=torch.int64))


def read_header(buffer: torch.Tensor) -> tuple[int, int]:
    status, index = buffer[:HEADER_BYTES].view(torch.int64).tolist()
    return int(status), int(index)


def pack_bucket(
    tensors: Sequence[torch.Tensor], specs: Sequence[WeightSpec], out: torch.Tensor | None = None,
    device: torch.device | str | None = None, index: int = 0,
) -> torch.Tensor:  # fmt: skip
    """The tensors' bytes in one flat uint8 buffer laid out by ``bucket_layout(specs)``, header "data" + ``index``.
    ``out``: a buffer to reuse (at least that big; the slice used is returned); else one is allocated on ``device``
    (default: the first tensor's device). Each tensor is checked against its spec."""
    if len(tensors) != len(specs):
        raise ValueError(f"{len(tensors)} tensors for {len(specs)} specs")
    offsets, nbytes = bucket_layout(specs)
    if out is None:
        device = device if device is not None else (tensors[0].device if tensors else "cpu")
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    else:
        if out.dtype != torch.uint8 or out.numel() < nbytes:
            raise ValueError(f"out must be a uint8 buffer of at least {nbytes} bytes")
        buffer = out[:nbytes]
    for t, spec, off in zip(tensors, specs, offsets):
        if (t.dtype, tuple(t.shape)) != (to_dtype(spec[1]), tuple(spec[2])):
            raise ValueError(f"tensor {spec[0]!r} is {dtype_name(t.dtype)} {tuple(t.shape)}, expected {spec}")
        n = spec_nbytes(spec)
        if n:
            buffer[off : off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    _set_header(buffer, STATUS_DATA, index)
    return buffer


def unpack_bucket(buffer: torch.Tensor, specs: Sequence[WeightSpec]) -> dict[str, torch.Tensor]:
    """Name -> tensor for one bucket: views into ``buffer`` (no copy), dtype and shape from the specs."""
    specs = _normal_specs(specs)
    offsets, nbytes = bucket_layout(specs)
    if buffer.numel() < nbytes:
        raise ValueError(f"bucket buffer has {buffer.numel()} bytes, its specs need {nbytes}")
    out = {}
    for (name, dtype, shape), off in zip(specs, offsets):
        n = spec_nbytes((name, dtype, shape))
        out[name] = buffer[off : off + n].view(to_dtype(dtype)).view(shape)
    return out


def load_into_module(module: torch.nn.Module, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                     ) -> int:  # fmt: skip
    """Copy tensors into ``module``'s parameters/buffers by name (Hugging Face names); returns how many."""
    state = dict(module.named_parameters())
    state.update(dict(module.named_buffers()))
    items = named.items() if isinstance(named, Mapping) else named
    count = 0
    with torch.no_grad():
        for name, tensor in items:
            if name not in state:
                raise KeyError(f"received weight {name!r} is not in the model")
            state[name].copy_(tensor)
            count += 1
    return count


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


def _gpu_uuid() -> str:
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


# -- transports ---------------------------------------------------------------------------------------------------


def _make_store(master_addr: str, master_port: int, is_master: bool, world_size: int | None, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    # wait_for_workers=False: the constructor returns at once; the group construction (or the first store
    # access) is the rendezvous.
    return TCPStore(
        master_addr, master_port, world_size, is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
    )  # fmt: skip


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


class _Collective:
    """gloo or nccl: one broadcast from rank 0 per bucket."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, group_name: str,
                 timeout_s: float, backend: str):  # fmt: skip
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


class _CudaIpc:
    """cuda_ipc: handles and acknowledgements through the TCPStore hosted by actor rank 0. ``peer``: the worker
    rank this actor rank serves (sender) or this worker's rank (receiver). UNVERIFIED here (no GPU)."""

    def __init__(self, master_addr: str, master_port: int, is_master: bool, world_size: int, group_name: str,
                 timeout_s: float, peer: int):  # fmt: skip
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


# -- sender -------------------------------------------------------------------------------------------------------


class WeightSender:
    """The trainer side. With gloo/nccl: rank 0 of the weight-sync group, in the process of the trainer's rank 0;
    its constructor blocks until every receiver has joined (``world_size`` = 1 + number of rollout workers), so the
    receivers must be told to join first, without waiting for them (``engine.init_weight_sync.remote(...)``), then
    the sender is built, then the receivers' results are awaited: ``rollout_engine.connect_weight_sync`` does that.

    With cuda_ipc: one sender per actor rank ``actor_rank`` that shares its GPU with an engine worker (worker rank
    ``actor_rank + 1``); rank 0 hosts the store.

    After each ``send_weights``: ``last_sync_s``, ``last_sync_buckets``, ``last_sync_broadcasts`` (transfers made, one
    per bucket) and ``last_sync_bytes``."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_sync",
        timeout_s: float = 600,
        backend: str = "gloo",
        bucket_bytes: int = 1024 * MIB,
        actor_rank: int = 0,
    ):
        if world_size < 2:
            raise ValueError(f"world_size must count the sender and at least one receiver, got {world_size}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.sync_id = 0
        if backend == "cuda_ipc":
            if actor_rank + 1 >= world_size:
                raise ValueError(f"actor rank {actor_rank} has no engine worker on its GPU (world {world_size})")
            self._transport: Any = _CudaIpc(master_addr, master_port, actor_rank == 0, world_size, group_name,
                                            timeout_s, peer=actor_rank + 1)  # fmt: skip
        else:
            if actor_rank != 0:
                raise ValueError(f"only actor rank 0 sends with {backend!r}")
            self._transport = _Collective(master_addr, master_port, 0, world_size, group_name, timeout_s, backend)
        self.last_sync_s = 0.0
        self.last_sync_buckets = 0
        self.last_sync_broadcasts = 0
        self.last_sync_bytes = 0

    def check_peer(self) -> None:
        """cuda_ipc: the worker this rank serves is on this rank's GPU (after the workers have joined)."""
        if isinstance(self._transport, _CudaIpc):
            self._transport.check_same_gpu()

    def send_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        specs: list[WeightSpec],
        bucket_bytes: int | None = None,
    ) -> int:
        """Send the tensors of ``specs`` (what the receivers were told, with the same ``bucket_bytes``), in order, in
        buckets; returns the sync's id (what the receivers were told with cuda_ipc). Tensors must be full
        (gathered, not ZeRO-3 shards), on any device; each is checked against its spec.

        If producing or checking a tensor fails (a failed gather, a spec mismatch), the bucket being packed is sent
        with the abort status, so the receivers raise at once instead of waiting in the collective until the
        group's timeout; the exception is then re-raised here."""
        if self._transport is None:
            raise RuntimeError("the weight sender is closed")
        specs = _normal_specs(specs)
        bucket_bytes = bucket_bytes or self.bucket_bytes
        plan = bucket_plan(specs, bucket_bytes)
        layouts = [bucket_layout([specs[i] for i in idx]) for idx in plan]
        sync_id, self.sync_id = self.sync_id, self.sync_id + 1
        start = time.perf_counter()
        self.last_sync_buckets = self.last_sync_broadcasts = self.last_sync_bytes = 0
        device = self._transport.device
        # One buffer for the sync, reused per bucket: each transfer has finished (or, NCCL, is ordered on the
        # stream) before the next bucket is packed.
        work = torch.empty(max((n for _, n in layouts), default=HEADER_BYTES), dtype=torch.uint8, device=device)
        iterator = iter(named_tensors)
        for b, (idx, (_, nbytes)) in enumerate(zip(plan, layouts)):
            buffer = work[:nbytes]
            try:
                tensors = []
                for i in idx:
                    item = next(iterator, None)
                    if item is None:
                        raise ValueError(f"got {i} tensors but {len(specs)} were announced")
                    name, tensor = item
                    if spec_of(name, tensor) != specs[i]:
                        raise ValueError(f"tensor {i} is {spec_of(name, tensor)}, the receivers expect {specs[i]}")
                    tensors.append(tensor)
                pack_bucket(tensors, [specs[i] for i in idx], out=buffer, index=b)
            except BaseException:
                _set_header(buffer, STATUS_ABORT, b)
                self._send(buffer, sync_id, b)
                raise
            self._send(buffer, sync_id, b)
        if next(iterator, None) is not None:  # the receivers have what they were promised; the caller is wrong
            raise ValueError(f"more tensors than the {len(specs)} announced")
        self.last_sync_s = time.perf_counter() - start
        self.last_sync_buckets = len(plan)
        logger.info("weight sync: %d tensors in %d buckets (%d transfers, %.1f MiB, %s) in %.3f s", len(specs),
                    len(plan), self.last_sync_broadcasts, self.last_sync_bytes / MIB, self.backend,
                    self.last_sync_s)  # fmt: skip
        return sync_id

    def _send(self, buffer: torch.Tensor, sync_id: int, index: int) -> None:
        self._transport.send(buffer, sync_id, index)
        self.last_sync_broadcasts += 1
        self.last_sync_bytes += buffer.numel()

    def stats(self) -> dict[str, float]:
        return {"weight_sync_s": self.last_sync_s, "weight_sync_buckets": self.last_sync_buckets,
                "weight_sync_broadcasts": self.last_sync_broadcasts,
                "weight_sync_mib": self.last_sync_bytes / MIB}  # fmt: skip

    def close(self) -> None:
        self._transport = None


# -- receiver -----------------------------------------------------------------------------------------------------


def make_receiver_transport(master_addr: str, master_port: int, rank: int, world_size: int, group_name: str,
                            timeout_s: float, backend: str) -> Any:  # fmt: skip
    """The receiver's end of ``backend`` as rank ``rank`` (>= 1) of the weight-sync world. Blocks (gloo/nccl) until
    all ranks have joined."""
    if backend == "cuda_ipc":
        transport = _CudaIpc(master_addr, master_port, False, world_size, group_name, timeout_s, peer=rank)
        transport.announce_gpu()
        return transport
    return _Collective(master_addr, master_port, rank, world_size, group_name, timeout_s, backend)


class WorkerWeightReceiver:
    """vLLM worker extension (``worker_extension_cls``): its methods are mixed into each vLLM worker and called
    through ``LLM.collective_rpc``. Names here must not clash with the worker's own attributes (vLLM checks)."""

    def init_weight_sync_group(
        self,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        timeout_s: float = 600,
        backend: str = "gloo",
    ) -> int:
        """Join the weight-sync group as ``rank_offset`` + this worker's rank (its tensor-parallel rank; pipeline
        parallelism is not supported). Blocks until all ranks have joined. Returns the rank taken."""
        tp_rank = int(getattr(self, "rank", 0))
        rank = rank_offset + tp_rank
        self._rlhf_sync_transport = make_receiver_transport(
            master_addr, master_port, rank, world_size, group_name, timeout_s, backend
        )
        return rank

    def receive_weights(self, specs: list[WeightSpec], bucket_bytes: int = 1024 * MIB, sync_id: int = 0) -> dict:
        """Receive ``specs`` in buckets of ``bucket_bytes`` from the sender, in order, and reload them into the
        model. Returns ``{"seconds": ..., "error": None}``, or the error's text instead of raising it: vLLM's
        multiprocess executor answers a collective_rpc at the first worker that raises and leaves the other
        workers' answers queued, so the next call would receive this sync's failure. The engine raises it
        (``VLLMEngine.receive_weights``) once every worker has answered."""
        start = time.perf_counter()
        try:
            self._receive_weights(specs, bucket_bytes, sync_id)
        except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
            return {"seconds": time.perf_counter() - start, "error": f"{type(e).__name__}: {e}"}
        return {"seconds": time.perf_counter() - start, "error": None}

    def _receive_weights(self, specs: list[WeightSpec], bucket_bytes: int, sync_id: int) -> None:
        transport = getattr(self, "_rlhf_sync_transport", None)
        if transport is None:
            raise RuntimeError("receive_weights before init_weight_sync_group")
        stream = _ReceiveStream(transport, specs, bucket_bytes, sync_id)
        try:
            # The worker's reload_weights (it sets vLLM's current config) takes Hugging Face names and tensors in
            # checkpoint format, maps them (stacked qkv, gate/up, TP shards) and re-runs the backend's post-load
            # processing. The stream ends early on an abort from the sender, so the reload still finalises.
            self.reload_weights(weights_iterator=iter(stream), is_checkpoint_format=True)
        except BaseException:
            _reset_layerwise_reload(self)
            raise
        finally:
            # Keep the transfers in lockstep with the sender even if the loader stopped early or failed.
            stream.drain()
        stream.raise_if_aborted()


def _reset_layerwise_reload(worker: Any) -> None:
    """vLLM's in-place reload wraps every layer's weight loaders and only unwraps them when it finishes; if loading
    raised midway, every later reload fails ("'Parameter' object has no attribute 'weight_loader'"). Finalise it
    here (best effort) so the next sync can succeed."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(worker.get_model(), worker.vllm_config.model_config)
    except Exception as e:  # noqa: BLE001 - the original error is the one to raise
        logger.warning("could not reset vLLM's layerwise reload after a failed weight sync: %s", e)


class WeightSyncAborted(RuntimeError):
    """The sender stopped a sync midway (its own error is raised on its side)."""


class _ReceiveStream:
    """Receives the announced tensors lazily, one bucket at a time (so at most one extra bucket is alive beyond
    what the loader keeps)."""

    def __init__(self, transport: Any, specs: list[WeightSpec], bucket_bytes: int, sync_id: int = 0):
        self.transport = transport
        self.specs = _normal_specs(specs)
        self.plan = bucket_plan(self.specs, bucket_bytes)
        self.sync_id = sync_id
        self.buckets = 0
        self.received = 0
        self.aborted = False

    def _next_bucket(self) -> dict[str, torch.Tensor] | None:
        b = self.buckets
        bucket_specs = [self.specs[i] for i in self.plan[b]]
        buffer = self.transport.recv(bucket_layout(bucket_specs)[1], self.sync_id, b)
        self.buckets += 1
        status, index = read_header(buffer)
        if status == STATUS_ABORT:
            self.aborted = True
            return None
        if status != STATUS_DATA or index != b:
            raise RuntimeError(f"weight sync out of step: expected bucket {b}, got header ({status}, {index})")
        self.received += len(bucket_specs)
        return unpack_bucket(buffer, bucket_specs)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.buckets < len(self.plan) and not self.aborted:
            tensors = self._next_bucket()
            if tensors is None:
                return
            yield from tensors.items()

    def drain(self) -> None:
        """Receive what is left (the loader stopped early or failed), to stay in lockstep with the sender."""
        while self.buckets < len(self.plan) and not self.aborted:
            self._next_bucket()

    def raise_if_aborted(self) -> None:
        if self.aborted:
            raise WeightSyncAborted(
                f"the sender aborted the weight sync in bucket {self.buckets}/{len(self.plan)}, after "
                f"{self.received}/{len(self.specs)} tensors: the layers completed hold new weights, a partly sent "
                "layer is undefined, until the next successful sync"
            )


def receive_into_module(transport: Any, specs: list[WeightSpec], module: torch.nn.Module,
                        bucket_bytes: int = 1024 * MIB, sync_id: int = 0) -> None:  # fmt: skip
    """Receive ``specs`` in buckets and copy them into ``module``'s parameters/buffers by name (the HF backend)."""
    stream = _ReceiveStream(transport, specs, bucket_bytes, sync_id)
    try:
        load_into_module(module, stream)
    finally:
        stream.drain()
    stream.raise_if_aborted()
