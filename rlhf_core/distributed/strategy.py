"""DeepSpeed ZeRO training inside one Ray worker: process group, engine, checkpoints, full weights for export.

The batch arithmetic follows OpenRLHF: ``train_batch_size`` samples per optimizer step over all ranks,
``micro_train_batch_size`` per forward on a rank, so gradient accumulation = train / (micro x world size).
gloo joins the ranks on CPU and NCCL on GPU; optimizer offload uses DeepSpeedCPUAdam, otherwise torch AdamW.

Models bigger than one device: with ZeRO-3 a model is built inside ``model_init()`` (``deepspeed.zero.Init``), so each
rank materialises only its partition, never the whole model; the DeepSpeed config given to zero.Init is the very one
``prepare`` hands to ``deepspeed.initialize``. The frozen roles (reward, reference) use ``FrozenStrategy``: a plain
replica per worker, or a ZeRO-3 inference engine partitioned over the role's workers (OpenRLHF's eval engines).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhf_core.config import OptimConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed import device


class DeepSpeedStrategy:
    def __init__(self, cfg: StrategyConfig, optim: OptimConfig, train: TrainConfig):
        self.cfg, self.optim_cfg, self.train_cfg = cfg, optim, train
        self.device = device.current().type  # "cpu" or "cuda", chosen once by the driver (RLHF_DEVICE)
        self.rank, self.world_size = 0, 1
        self.engine_config: dict | None = None  # fixed by model_init(): zero.Init and deepspeed.initialize share it
        self._hf_zero3: HfZero3Config | None = None

    # -- process group ------------------------------------------------------------------------------------------------
    def init_distributed(self) -> None:
        self.rank, self.world_size = join_world()

    @property
    def dtype(self) -> torch.dtype:
        return precision_dtype(self.cfg.precision)

    @property
    def accumulation_steps(self) -> int:
        return self.train_cfg.train_batch_size // (self.train_cfg.micro_train_batch_size * self.world_size)

    def ds_config(self) -> dict:
        zero: dict[str, Any] = {"stage": self.cfg.zero_stage}
        if self.cfg.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.device == "cuda"}
        if self.cfg.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        return {
            "train_batch_size": self.train_cfg.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_cfg.micro_train_batch_size,
            "gradient_accumulation_steps": self.accumulation_steps,
            "gradient_clipping": self.optim_cfg.max_norm,
            "zero_optimization": zero,
            "bf16": {"enabled": self.cfg.precision == "bf16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    # -- engine -------------------------------------------------------------------------------------------------------
    def model_init(self) -> Any:
        """The context to build the model in (after ``init_distributed``). With ZeRO-3, ``deepspeed.zero.Init``: each
        parameter is partitioned over the ranks as soon as its module is built, and transformers sees the same
        DeepSpeed config (``from_pretrained`` then loads each rank's partition); otherwise nothing."""
        self.engine_config = self.ds_config()
        if self.cfg.zero_stage != 3:
            return nullcontext()
        self._hf_zero3 = HfZero3Config(self.engine_config)  # kept alive with the strategy (a weakref in transformers)
        return self._hf_zero3.partitioned()

    def prepare(self, model: nn.Module, total_steps: int) -> Any:
        """Wrap ``model`` in a DeepSpeed engine with AdamW and the configured LR schedule (with the config the model
        was partitioned with, when it was built inside ``model_init()``)."""
        deepspeed = import_deepspeed()

        config = self.engine_config if self.engine_config is not None else self.ds_config()

        if self.cfg.gradient_checkpointing:
            hf: Any = getattr(model, "hf_model", model)  # a transformers model: gradient_checkpointing_enable
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        o = self.optim_cfg
        params = [p for p in model.parameters() if p.requires_grad]
        kwargs: dict[str, Any] = dict(lr=o.lr, betas=tuple(o.adam_betas), weight_decay=o.weight_decay)
        if self.cfg.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
        else:
            optimizer = torch.optim.AdamW(params, **kwargs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, total_steps))
        _import_muon_uncompiled()
        moe_leaf_modules(model, config)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        return engine

    def prepare_frozen(self, model: nn.Module) -> Any:
        """``model`` in a DeepSpeed engine without optimizer, for a trained role's model that a stage keeps frozen
        throughout (the critic warm-up's actor): no Adam states, fp32 master weights, gradient buffers or LR
        schedule. ZeRO-3 keeps the config the model was partitioned with (``model_init``), which without an optimizer
        gives DeepSpeed's ZeRO-3 inference engine (as ``FrozenStrategy``). ZeRO-1/2 partition only what training
        holds, so below stage 3 each rank runs a replica: stage 0, and bf16 off (a bf16 engine would get DeepSpeed's
        bf16 optimizer, with fp32 master weights), its parameters cast here as that engine casts them."""
        deepspeed = import_deepspeed()

        config = self.engine_config if self.engine_config is not None else self.ds_config()
        if config["zero_optimization"]["stage"] != 3:
            if config["bf16"]["enabled"]:
                for param in model.parameters():
                    if param.is_floating_point():
                        param.data = param.data.to(torch.bfloat16)
            config = {**config, "zero_optimization": {"stage": 0}, "bf16": {"enabled": False}}
        moe_leaf_modules(model, config)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        return engine

    # -- collectives (device-aware: rlhf_core.distributed.device) -----------------------------------------------------
    def all_reduce_mean(self, value: float) -> float:
        return device.all_reduce_mean(value)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: the element-wise sum over all ranks, issued on the process group's device (any input device)."""
        return device.all_reduce_sum(tensor)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: the element-wise maximum over all ranks (e.g. ``train.dynamic_batch``'s micro-batch counts)."""
        return device.all_reduce_max(tensor)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return device.all_gather_object(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return device.broadcast_object(obj)

    def barrier(self) -> None:
        device.barrier()

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def save_checkpoint(self, engine: Any, local_dir: str, client_state: dict) -> None:
        """Every rank writes its ZeRO shards under ``local_dir/ds`` (rank 0 also the module and client state). The
        frozen parameters (a LoRA model's base weights) are left out: a resume rebuilds them from the model's source,
        so a checkpoint holds what trains (the adapters, a value head)."""
        engine.save_checkpoint(
            local_dir,
            tag="ds",
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=_has_frozen(engine),
        )

    def load_checkpoint(self, engine: Any, local_dir: str) -> dict:
        _, client_state = engine.load_checkpoint(
            local_dir,
            tag="ds",
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=not _has_frozen(engine),  # the frozen weights were not saved (save_checkpoint)
        )
        assert client_state is not None, f"no DeepSpeed checkpoint under {local_dir}/ds"
        return client_state

    def full_state_dict(self, engine: Any) -> dict[str, torch.Tensor] | None:
        """All weights gathered on rank 0 (None elsewhere); every rank must call it (ZeRO-3 gathers shards)."""
        if self.cfg.zero_stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict()
        else:
            state = engine.module.state_dict()
        if self.rank != 0:
            return None
        return {k: v.detach().to("cpu").clone() for k, v in state.items()}


def offload_training_states(engine: Any, pin_memory: bool) -> None:
    """Move what only training needs (fp32 master weights, Adam states, gradient buffers) of a DeepSpeed ZeRO-1/2/3
    engine to host memory; ``engine.reload_states()`` brings all of it back. The parameters the forwards use stay.

    DeepSpeed's ZeRO-3 ``offload_states`` refuses the master weights and Adam states unless the optimizer is its own
    ``FusedAdam`` (a CUDA op compiled on first use), though the moves it makes read only the Adam state keys, which
    ``torch.optim.AdamW`` shares. For ZeRO-3 those two are moved here as DeepSpeed moves them, and recorded in its
    ``offloaded_states``, so that its ``reload_states`` restores them with the rest."""
    import_deepspeed()
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from deepspeed.runtime.zero.offload_states import offload_adam_states

    zero3 = engine.zero_optimization_stage() == 3
    kinds = ["lp_grads", "contiguous_grad_buffer", *([] if zero3 else ["optim_states", "hp_params"])]
    include = [OffloadStateTypeEnum(k) for k in kinds]
    engine.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=pin_memory)
    if not zero3:
        return
    opt, done = engine.optimizer, engine.optimizer.offloaded_states
    if OffloadStateTypeEnum.hp_params not in done:
        if pin_memory:  # the buffers DeepSpeed's reload_states copies back from
            if not hasattr(opt, "hp_params_pin_buffers"):
                opt.hp_params_pin_buffers = [
                    torch.empty_like(t, device="cpu").pin_memory() for t in opt.fp32_partitioned_groups_flat
                ]
            for flat, buffer in zip(opt.fp32_partitioned_groups_flat, opt.hp_params_pin_buffers, strict=True):
                buffer.copy_(flat)
                flat.data = buffer
        else:
            for flat in opt.fp32_partitioned_groups_flat:
                flat.data = flat.data.to("cpu")
        done.add(OffloadStateTypeEnum.hp_params)
    if OffloadStateTypeEnum.optim_states not in done:
        offload_adam_states(opt.optimizer, "cpu", pin_memory=pin_memory)
        done.add(OffloadStateTypeEnum.optim_states)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def moe_leaf_modules(model: nn.Module, config: dict) -> list[type]:
    """ZeRO-3: mark each Mixture-of-Experts block class of ``model`` (``*SparseMoeBlock``) as a leaf module, so that
    its parameters are gathered together when the block runs. Otherwise ZeRO-3 fetches each expert as the router
    picks it, the ranks route their tokens to different experts, and their collectives no longer match: the group
    hangs (DeepSpeed's ``set_z3_leaf_modules``, as OpenRLHF does). Returns the classes marked."""
    if config["zero_optimization"]["stage"] != 3:
        return []
    classes = sorted({type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")}, key=str)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)
    return classes


def _has_frozen(engine: Any) -> bool:
    return any(not p.requires_grad for p in engine.module.parameters())


def join_world() -> tuple[int, int]:
    """Join this worker's torch.distributed world (NCCL on CUDA, after selecting the worker's device; gloo on CPU),
    unless already joined; returns (rank, world size)."""
    deepspeed = import_deepspeed()

    where = device.current()
    if where.type == "cuda":
        torch.cuda.set_device(where)
    _skip_shm_comm_op()  # before deepspeed.comm makes its backend, here or in deepspeed.initialize
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if where.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def leave_world() -> None:
    """End this process's torch.distributed world (``join_world``'s) through DeepSpeed when DeepSpeed is in use: it
    caches the world's groups (ZeRO-3 asks for them) and would hand destroyed ones to the next world of the process."""
    if not dist.is_initialized():
        return
    if "deepspeed" in sys.modules:
        import deepspeed.comm

        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()
            return
    dist.destroy_process_group()


def import_deepspeed() -> Any:
    """``import deepspeed``, the first time without letting it import mlflow: DeepSpeed's autotuner imports mlflow
    whenever it is installed (``deepspeed.autotuning.autotuner``: ``try: import mlflow``), 1.1-1.9 s of the 1.5-2.5 s
    that ``import deepspeed`` takes, in every worker of every stage, for autotuning, which nothing here runs. While
    DeepSpeed loads, ``sys.modules["mlflow"]`` is None (an import of it raises ImportError, which the autotuner takes
    as "not installed"); the entry is removed right after, so the MLflow tracker (``rlhf_core.tracking``) still
    imports the real package. A process that imported mlflow before is left as it is.

    DeepSpeed's JIT-compiled ops (CPU Adam) go to ``<environment>/torch_extensions`` unless ``TORCH_EXTENSIONS_DIR``
    is set: an op lives with the torch and DeepSpeed headers it was built against (``make setup`` builds it there), so
    two environments never rebuild each other's op in a shared cache (about 90 s each time)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
        try:
            import deepspeed  # noqa: F401
        finally:
            if sys.modules.get("mlflow", 0) is None:
                del sys.modules["mlflow"]
    import deepspeed

    return deepspeed


SHM_COMM_OP = "deepspeed_shm_comm"


def _skip_shm_comm_op() -> None:
    """Keep DeepSpeed's communication backend from loading its shared-memory all-reduce op: a C++ extension that
    ``deepspeed.comm`` JIT-builds (or loads from TORCH_EXTENSIONS_DIR) in every worker on CPU, whose only user is
    ``inference_all_reduce`` (tensor-parallel inference of injected kernels), which nothing here calls: ZeRO's
    collectives go to torch.distributed either way, so the numbers are the same. Building it takes a fresh machine
    about a minute per extension directory, and any change of its compile command (another venv path, another
    compiler) rebuilds it in the next worker. ``deepspeed.ops.__compatible_ops__`` is the switch DeepSpeed itself
    reads (``build_shm_op``): one dict per process, probed on first access, kept with edits."""
    import_deepspeed()
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer module with torch.compile switched off (``TORCHDYNAMO_DISABLE``), before
    ``deepspeed.initialize``: ZeRO imports it in every trained worker (``is_zero_supported_optimizer`` adds the class
    to its list, ZeRO-1/2's gradient reduction checks the optimizer against it), and its ``torch.compile``
    decorators import all of torch._inductor, seconds of each worker's start-up. Decorated with compile off, its
    kernels stay plain functions, which nothing here runs (the optimizers are AdamW and DeepSpeedCPUAdam); what ZeRO
    reads, the class, is the same."""
    import importlib
    import sys

    if MUON_MODULE in sys.modules:
        return
    saved = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:  # a DeepSpeed without Muon: nothing to import
        pass
    finally:
        if saved is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = saved


def precision_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


class HfZero3Config:
    """The DeepSpeed config transformers reads while it builds or loads a model under ZeRO-3.

    transformers looks it up through a weak reference (``set_hf_deepspeed_config``) and asks only ``config`` and
    ``is_zero3()``: its own ``HfDeepSpeedConfig`` adds accelerate as a dependency for nothing more, so we register
    this instead. Keep the object alive as long as the model: ``from_pretrained`` then builds under zero.Init and loads
    each rank's partition, and ``rlhf_core.models.builders`` initialises builtin models partition-aware."""

    def __init__(self, config: dict):
        from transformers.integrations.deepspeed import set_hf_deepspeed_config

        self.config = config
        set_hf_deepspeed_config(self)

    def is_zero3(self) -> bool:
        return self.config["zero_optimization"]["stage"] == 3

    @contextmanager
    def partitioned(self) -> Iterator[None]:
        deepspeed = import_deepspeed()

        _mmap_threshold(1 << 20)
        try:
            with deepspeed.zero.Init(config_dict_or_path=self.config):
                yield
        finally:
            _mmap_threshold(32 << 20)


def _mmap_threshold(nbytes: int) -> None:
    """Under zero.Init every module's full tensors live a moment and are freed once partitioned. glibc's malloc
    raises its mmap threshold to the size of each freed mapping (up to 32 MiB), so later tensors of that size come
    from the heap, which fragments between the kept partitions and never shrinks: measured on a 1.26 GiB model, a
    rank's RSS grew by 1.23 GiB while building its 0.63 GiB partition. A 1 MiB threshold (``mallopt``) during
    construction gives each larger tensor its own mapping, returned to the OS when freed (0.77 GiB there). After
    it, 32 MiB (glibc's own ceiling): a training step's many short-lived tensors below that come from the heap again
    instead of fresh, zero-filled mappings. Not glibc: nothing to do."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


class FrozenStrategy:
    """One rank of a frozen role (reward model, reference policy): forwards only, no optimizer.

    ``zero_stage`` 0: a full replica on this worker's device, alone. 3: the role's workers form one torch.distributed
    world and the model is a ZeRO-3 inference engine (``deepspeed.initialize`` without an optimizer), built
    partitioned; ``offload`` keeps the partitions on the CPU (ZeRO-3 parameter offload). Every forward of a ZeRO-3
    engine gathers the parameters from all ranks, so every rank must run as many forwards per call: ``map_micro``
    pads a shorter shard with dummy micro-batches."""

    def __init__(self, zero_stage: int, offload: bool, precision: str, micro_batch_size: int):
        self.zero_stage, self.offload, self.micro = zero_stage, offload, micro_batch_size
        self.precision = precision
        self.device = device.current()
        self.rank, self.world_size = 0, 1
        self.engine_config: dict | None = None
        self._hf_zero3: HfZero3Config | None = None
        if zero_stage == 3:
            self.rank, self.world_size = join_world()
            self.engine_config = self.ds_config()
            self._hf_zero3 = HfZero3Config(self.engine_config)

    @property
    def dtype(self) -> torch.dtype:
        return precision_dtype(self.precision)

    def ds_config(self) -> dict:
        """OpenRLHF's eval config: ZeRO-3 without optimizer, parameters offloaded to the CPU when asked."""
        zero: dict[str, Any] = {"stage": 3}
        if self.offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": self.device.type == "cuda"}
        return {
            "train_batch_size": self.micro * self.world_size,
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "bf16": {"enabled": self.precision == "bf16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    def build(self, make: Callable[[], nn.Module]) -> Any:
        """``make()`` built on this rank (partitioned under ZeRO-3) and made ready for eval-mode forwards."""
        if self._hf_zero3 is None:
            return make().to(self.device).eval()
        deepspeed = import_deepspeed()

        assert self.engine_config is not None  # made with _hf_zero3
        with self._hf_zero3.partitioned():
            model = make()
        moe_leaf_modules(model, self.engine_config)
        engine, *_ = deepspeed.initialize(model=model, config=self.engine_config)
        engine.eval()
        return engine

    def map_micro(self, batch: Any, fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """``fn(micro)`` (on the device) over micro-batches of ``batch``, concatenated on the CPU. Under ZeRO-3 every
        rank runs the largest rank's number of forwards: the extra ones repeat a one-row dummy and are dropped."""
        micros = batch.split(self.micro) if batch.size else []
        forwards = len(micros)
        if self.zero_stage == 3:
            forwards = max(device.all_gather_object(len(micros)))
        out = []
        for i in range(forwards):
            if i < len(micros):
                out.append(fn(device.to_device(micros[i], self.device)).float().cpu())
            else:  # keep in step with the other ranks' gathers
                fn(device.to_device(dummy_rows(batch), self.device))
        return torch.cat(out) if out else torch.zeros(0)


def dummy_rows(batch: Any) -> Any:
    """One row to run a padding forward on: the batch's first row, or (an empty shard) a row of two tokens."""
    if batch.size:
        return batch.split(1)[0]
    from rlhf_core.algos.batching import make_sequences

    return make_sequences([[0]], [[0]], 0)


def lr_lambda(o: OptimConfig, total_steps: int):
    """LR multiplier per step: linear warm-up, then constant or cosine decay to ``min_lr_ratio``."""
    warmup = math.ceil(o.lr_warmup_ratio * total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if o.lr_scheduler == "constant_with_warmup":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn
