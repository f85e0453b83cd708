"""Live weight sync from the trainer to the rollout engines, after OpenRLHF's ``broadcast_to_vllm``.

One extra process group joins the trainer's rank 0 (rank 0 of the group) and every rollout worker (ranks 1..N:
``rank_offset`` of an engine + that worker's tensor-parallel rank). Per sync, rank 0 sends each full tensor by
broadcast in an order both sides agreed on beforehand (a list of ``(name, dtype, shape)`` specs), and each worker
hands the received tensors to vLLM's ``reload_weights``, which maps Hugging Face names onto its own layout (stacked
qkv, gate/up, tensor-parallel shards) and re-runs the backend's post-load processing (the CPU backend repacks linear
weights, which is why calling the model's ``load_weights`` directly fails there).

The group is built directly from a ``torch.distributed.TCPStore`` and a ``ProcessGroupGloo`` object, so neither the
trainer's default (DeepSpeed) group nor vLLM's own groups are touched, and the group can be reused across syncs.

Device choice: this module implements the gloo transport, which works wherever the tensors can be on CPU (the
sender moves each tensor to CPU before sending). On GPU machines the same two classes are the place to switch to
NCCL (vLLM 0.32 ships ``vllm.distributed.weight_transfer`` with NCCL and CUDA-IPC engines, and OpenRLHF uses
``StatelessProcessGroup`` + ``PyNcclCommunicator``): replace ``_make_group`` / ``_broadcast`` on both sides and keep
``WeightSender.broadcast`` and ``WorkerWeightReceiver.receive_weights`` as they are. That path is not implemented
nor tested here; ``backend="nccl"`` raises ``NotImplementedError``.

torch only at import time; vLLM is never imported by this module (the receiver runs inside vLLM's worker process,
where it reaches vLLM through ``self``, the worker it is mixed into).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

WeightSpec = tuple[str, str, tuple[int, ...]]


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


def _make_group(
    master_addr: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float, backend: str
) -> Any:
    """A standalone process group (not registered with ``torch.distributed``'s default world)."""
    if backend != "gloo":
        raise NotImplementedError(
            f"weight sync backend {backend!r}: only 'gloo' is implemented (GPU/NCCL would go here, see module doc)"
        )
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    # Rank 0 hosts the store; wait_for_workers=False so the constructor returns at once and the group construction
    # below is the single rendezvous point (it blocks until all ``world_size`` ranks have joined).
    store = TCPStore(
        master_addr, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )
    group = ProcessGroupGloo(PrefixStore(f"{group_name}/", store), rank, world_size, timeout)
    return store, group


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class WeightSender:
    """Rank 0 of the weight-sync group; lives in the process of the trainer's rank 0.

    The constructor blocks until every receiver has joined (``world_size`` = 1 + number of rollout workers), so the
    receivers must be told to join first, without waiting for them (``engine.init_weight_sync.remote(...)``), then
    the sender is built, then the receivers' results are awaited: ``rollout_engine.connect_weight_sync`` does that.
    """

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_sync",
        timeout_s: float = 600,
        backend: str = "gloo",
    ):
        if world_size < 2:
            raise ValueError(f"world_size must count the sender and at least one receiver, got {world_size}")
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        self._store, self._group = _make_group(master_addr, master_port, 0, world_size, group_name, timeout_s, backend)
        self.last_sync_s = 0.0

    def broadcast(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], specs: list[WeightSpec] | None = None
    ) -> None:
        """Send each tensor, in order. Tensors must be full (gathered, not ZeRO-3 shards); they are moved to CPU and
        made contiguous here, as gloo needs. With ``specs`` (what the receivers were told), each tensor is checked
        against its spec before it is sent.

        Each tensor is preceded by a one-element header (1: a tensor follows, 0: abort). If producing or checking a
        tensor fails here (a failed gather, a spec mismatch), the receivers get the abort header and raise at once
        instead of waiting in the broadcast until the group's timeout; the exception is then re-raised here."""
        if self._group is None:
            raise RuntimeError("the weight sender is closed")
        start = time.perf_counter()
        count = 0
        iterator = iter(named_tensors)
        while True:
            try:
                item = next(iterator, None)
                if item is None:
                    if specs is not None and count != len(specs):
                        raise ValueError(f"got {count} tensors but {len(specs)} were announced")
                    break
                name, tensor = item
                t = tensor.detach().to("cpu").contiguous()
                if specs is not None:
                    if count >= len(specs):
                        raise ValueError(f"more tensors than the {len(specs)} announced (extra: {name})")
                    if spec_of(name, t) != tuple(specs[count]):
                        raise ValueError(f"tensor {count} is {spec_of(name, t)}, the receivers expect {specs[count]}")
            except BaseException:
                if specs is None or count < len(specs):
                    _broadcast(self._group, torch.zeros(1, dtype=torch.int64))  # abort
                raise
            _broadcast(self._group, torch.ones(1, dtype=torch.int64))
            _broadcast(self._group, t)
            count += 1
        self.last_sync_s = time.perf_counter() - start
        logger.info("weight sync: broadcast %d tensors in %.3f s", count, self.last_sync_s)

    def close(self) -> None:
        self._group = None
        self._store = None


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
        self._rlhf_sync_store, self._rlhf_sync_group = _make_group(
            master_addr, master_port, rank, world_size, group_name, timeout_s, backend
        )
        return rank

    def receive_weights(self, specs: list[WeightSpec]) -> float:
        """Receive ``specs`` tensors by broadcast from rank 0, in order, and reload them into the model.
        Returns the seconds taken."""
        group = getattr(self, "_rlhf_sync_group", None)
        if group is None:
            raise RuntimeError("receive_weights before init_weight_sync_group")
        start = time.perf_counter()
        stream = _ReceiveStream(group, specs)
        try:
            # The worker's reload_weights (it sets vLLM's current config) takes Hugging Face names and tensors in
            # checkpoint format, maps them (stacked qkv, gate/up, TP shards) and re-runs the backend's post-load
            # processing. The stream ends early on an abort from the sender, so the reload still finalises.
            self.reload_weights(weights_iterator=iter(stream), is_checkpoint_format=True)
        except BaseException:
            _reset_layerwise_reload(self)
            raise
        finally:
            # Keep the collective in lockstep with the sender even if the loader stopped early or failed.
            stream.drain()
        if stream.aborted:
            raise WeightSyncAborted(
                f"the sender aborted the weight sync after {stream.received}/{len(specs)} tensors: the layers it "
                "completed hold new weights, a partly sent layer is undefined, until the next successful sync"
            )
        return time.perf_counter() - start


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
    """Receives the announced tensors lazily (one at a time, so at most one extra copy of a tensor is alive)."""

    def __init__(self, group: Any, specs: list[WeightSpec]):
        self.group = group
        self.specs = [(str(n), str(d), tuple(int(s) for s in shape)) for n, d, shape in specs]
        self.received = 0
        self.aborted = False

    def _next(self) -> tuple[str, torch.Tensor] | None:
        header = torch.zeros(1, dtype=torch.int64)
        _broadcast(self.group, header)
        if int(header.item()) != 1:
            self.aborted = True
            return None
        name, dtype, shape = self.specs[self.received]
        tensor = torch.empty(shape, dtype=to_dtype(dtype))
        _broadcast(self.group, tensor)
        self.received += 1
        return name, tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.received < len(self.specs) and not self.aborted:
            item = self._next()
            if item is None:
                return
            yield item

    def drain(self) -> None:
        """Receive what is left (the loader stopped early or failed), to stay in lockstep with the sender."""
        while self.received < len(self.specs) and not self.aborted:
            self._next()


def receive_into_module(group: Any, specs: list[WeightSpec], module: torch.nn.Module) -> None:
    """Receive ``specs`` by broadcast and copy them into ``module``'s parameters/buffers by name (the HF backend)."""
    stream = _ReceiveStream(group, specs)
    state = dict(module.named_parameters())
    state.update(dict(module.named_buffers()))
    try:
        with torch.no_grad():
            for name, tensor in stream:
                if name not in state:
                    raise KeyError(f"received weight {name!r} is not in the model")
                state[name].copy_(tensor)
    finally:
        stream.drain()
    if stream.aborted:
        raise WeightSyncAborted(f"the sender aborted the weight sync after {stream.received}/{len(specs)} tensors")
