"""The trainer side of the weight sync: the sender, connecting it to the engines, and one push.

``connect_weight_sync`` builds the group (engines join first, without waiting, then the sender); ``connect_rank`` is
each actor rank's part of that (with cuda_ipc every rank that shares its GPU with an engine worker sends);
``sync_weights`` announces the specs to every engine (non-blocking), sends the buckets, then waits for the engines.
Only the processes holding a ``WeightSender`` send; the other trainer ranks only take part in whatever gathering
``named_tensors`` does (e.g. ZeRO-3 ``GatheredParameters``). Engines are called through their handles
(``peers.ReceivingEngines``) with the ``peers.ReceivingEngine`` protocol's methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rlhf_core.distributed.weight_sync.buckets import (
    HEADER_BYTES,
    MIB,
    STATUS_ABORT,
    WeightSpec,
    bucket_layout,
    bucket_plan,
    normal_specs,
    pack_bucket,
    set_header,
    spec_of,
)
from rlhf_core.distributed.weight_sync.peers import ReceivingEngine, ReceivingEngines
from rlhf_core.distributed.weight_sync.transports import Collective, CudaIpc
from rlhf_core.ports import free_port

logger = logging.getLogger(__name__)


class WeightSender:
    """The trainer side. With gloo/nccl: rank 0 of the weight-sync group, in the process of the trainer's rank 0;
    its constructor blocks until every receiver has joined (``world_size`` = 1 + number of rollout workers), so the
    receivers must be told to join first, without waiting for them (``ReceivingEngine.init_weight_sync``), then the
    sender is built, then the receivers' results are awaited: ``connect_weight_sync`` does that.

    With cuda_ipc: one sender per actor rank ``actor_rank`` (of ``actor_world_size``); rank 0 hosts the store.
    ``check_peer`` then finds the engine workers on this rank's GPU, by UUID (``transports.ipc_pairs``).

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
        actor_world_size: int = 1,
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
        self.actor_world_size = actor_world_size
        if backend == "cuda_ipc":
            self._transport: Any = CudaIpc(
                master_addr, master_port, actor_rank == 0, group_name, timeout_s, sender=True, rank=actor_rank
            )
        else:
            if actor_rank != 0:
                raise ValueError(f"only actor rank 0 sends with {backend!r}")
            self._transport = Collective(master_addr, master_port, 0, world_size, group_name, timeout_s, backend)
        self.last_sync_s = 0.0
        self.last_sync_buckets = 0
        self.last_sync_broadcasts = 0
        self.last_sync_bytes = 0

    def check_peer(self) -> bool:
        """Whether this sender serves any engine worker, once every worker has joined. cuda_ipc: pairs this rank with
        the workers on its GPU (every actor rank must have announced its GPU too), and refuses a worker on a GPU
        without an actor rank. gloo/nccl: rank 0 serves every worker."""
        if isinstance(self._transport, CudaIpc):
            return bool(self._transport.pair(self.actor_world_size, self.world_size))
        return True

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
        specs = normal_specs(specs)
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
                set_header(buffer, STATUS_ABORT, b)
                self._send(buffer, sync_id, b)
                raise
            self._send(buffer, sync_id, b)
        if next(iterator, None) is not None:  # the receivers have what they were promised; the caller is wrong
            raise ValueError(f"more tensors than the {len(specs)} announced")
        self.last_sync_s = time.perf_counter() - start
        self.last_sync_buckets = len(plan)
        logger.info(
            "weight sync: %d tensors in %d buckets (%d transfers, %.1f MiB, %s) in %.3f s",
            len(specs),
            len(plan),
            self.last_sync_broadcasts,
            self.last_sync_bytes / MIB,
            self.backend,
            self.last_sync_s,
        )
        return sync_id

    def _send(self, buffer: torch.Tensor, sync_id: int, index: int) -> None:
        self._transport.send(buffer, sync_id, index)
        self.last_sync_broadcasts += 1
        self.last_sync_bytes += buffer.numel()

    def stats(self) -> dict[str, float]:
        return {
            "weight_sync_s": self.last_sync_s,
            "weight_sync_buckets": self.last_sync_buckets,
            "weight_sync_broadcasts": self.last_sync_broadcasts,
            "weight_sync_mib": self.last_sync_bytes / MIB,
        }

    def close(self) -> None:
        self._transport = None


def connect_weight_sync(
    engines: ReceivingEngines,
    *,
    backend: str = "gloo",
    bucket_mb: float = 1024,
    master_addr: str | None = None,
    master_port: int | None = None,
    group_name: str = "weight_sync",
    timeout_s: float = 600,
    actor_world_size: int = 1,
) -> WeightSender:
    """Build the weight-sync group between this process (rank 0) and every worker of ``engines``, over ``backend``
    (gloo, nccl or cuda_ipc; see ``transports``), sending buckets of ``bucket_mb`` MiB.

    Order matters: the group's construction blocks every rank until all have joined, so the engines are told to
    join without waiting for them, then this process joins, then the engines' answers are collected. With cuda_ipc
    this process is actor rank 0 of ``actor_world_size`` and serves the workers on its GPU; the other actor ranks
    build their own senders (``connect_rank``).
    """
    import ray

    master_addr = master_addr or ray.util.get_node_ip_address()
    master_port = master_port or free_port()
    sizes = engines.call(ReceivingEngine.num_workers)
    world_size = 1 + sum(sizes)
    offsets = [1 + sum(sizes[:i]) for i in range(len(engines))]
    joins = [
        engines.call_one_async(
            i,
            ReceivingEngine.init_weight_sync,
            master_addr,
            master_port,
            off,
            world_size,
            group_name,
            timeout_s,
            backend,
        )
        for i, off in enumerate(offsets)
    ]
    try:
        sender = WeightSender(
            master_addr,
            master_port,
            world_size,
            group_name,
            timeout_s,
            backend,
            bucket_bytes=int(bucket_mb * MIB),
            actor_world_size=actor_world_size,
        )
        engines.get(joins)
        sender.check_peer()
    except Exception:
        _report_engine_errors(joins)
        raise
    return sender


def connect_rank(
    engines: ReceivingEngines,
    rank: int,
    world_size: int,
    broadcast_object: Callable[[Any], Any],
    *,
    backend: str,
    bucket_mb: float,
) -> WeightSender | None:
    """Actor rank ``rank`` (of ``world_size``) joins the weight sync with every engine worker over ``backend``
    (already resolved: gloo, nccl or cuda_ipc) in buckets of ``bucket_mb`` MiB; returns its sender, or None for a rank
    that does not send. gloo/nccl: rank 0 sends, the other ranks only help gather. cuda_ipc: every rank announces its
    GPU, and each rank with engine workers on its GPU sends to them (paired by GPU UUID); rank 0 picks the store's
    address and tells the others through ``broadcast_object`` (a collective over the actor ranks: every rank calls
    this)."""
    if backend != "cuda_ipc":
        return connect_weight_sync(engines, backend=backend, bucket_mb=bucket_mb) if rank == 0 else None
    import ray

    where = None
    if rank == 0:
        sizes = engines.call(ReceivingEngine.num_workers)
        where = (ray.util.get_node_ip_address(), free_port(), 1 + sum(sizes))
    addr, port, sync_world = broadcast_object(where)
    if sync_world - 1 > world_size:
        raise ValueError(
            f"cuda_ipc weight sync: {sync_world - 1} engine workers but {world_size} actor ranks; each worker needs "
            "the actor rank on its GPU (colocate_all)"
        )
    if rank == 0:
        sender = connect_weight_sync(
            engines,
            backend=backend,
            bucket_mb=bucket_mb,
            master_addr=addr,
            master_port=port,
            actor_world_size=world_size,
        )
    else:
        sender = WeightSender(
            addr,
            port,
            sync_world,
            backend=backend,
            bucket_bytes=int(bucket_mb * MIB),
            actor_rank=rank,
            actor_world_size=world_size,
        )
        if not sender.check_peer():
            sender.close()
            return None
    return sender


def _report_engine_errors(refs: list[Any], wait_s: float = 10.0) -> None:
    """After a failed collective on this side, log what the engines said (their errors, if they failed first)."""
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - reported, the caller re-raises its own error
            logger.error("rollout engine side of the weight sync failed: %s", e)


def sync_weights(
    sender: WeightSender | None,
    engines: ReceivingEngines,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    specs: list[WeightSpec] | None = None,
    bucket_bytes: int | None = None,
) -> float:
    """Push the trainer's weights (Hugging Face names, full tensors) to every engine; returns the seconds taken.

    With a sender: every engine is told the specs, the bucket size (``bucket_bytes``, default the sender's) and the
    sync's id first (non-blocking: each then waits for its first bucket), then this process sends the buckets, then
    the engines are awaited; ``sender.stats()`` then has the buckets and transfers. Without ``specs``,
    ``named_tensors`` is materialised to compute them (fine for ZeRO-0/1/2, where rank 0 holds full weights); for
    ZeRO-3 pass ``specs`` (from the parameters' full shapes) and a lazy ``named_tensors`` that gathers one bucket at
    a time (``buckets.bucket_plan``), in the same order.

    Without a sender (``None``): a direct ``load_state_dict`` on each engine, the state dict stored once for all of
    them (``engines.put``: Ray's object store; engines of the driver's process take it as it is) (HF backend).
    """
    start = time.perf_counter()
    if sender is None:
        state = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        engines.call(ReceivingEngine.load_state_dict, engines.put(state))
        return time.perf_counter() - start
    if specs is None:
        named_tensors = [(name, t) for name, t in named_tensors]
        specs = [spec_of(name, t) for name, t in named_tensors]
    bucket_bytes = bucket_bytes or sender.bucket_bytes
    receipts = engines.call_async(ReceivingEngine.receive_weights, specs, bucket_bytes, sender.sync_id)
    try:
        # On an error here (a failed gather, a tensor that does not match its spec) the sender tells the engines to
        # abort, so they fail at once instead of waiting in the broadcast; their weights are then partly updated and
        # the next successful sync_weights repairs them.
        sender.send_weights(named_tensors, specs=specs, bucket_bytes=bucket_bytes)
    except Exception:
        _report_engine_errors(receipts)
        raise
    engines.get(receipts)
    elapsed = time.perf_counter() - start
    logger.info(
        "weight sync of %d tensors in %d buckets to %d engine(s) took %.3f s",
        len(specs),
        sender.last_sync_buckets,
        len(engines),
        elapsed,
    )
    return elapsed
