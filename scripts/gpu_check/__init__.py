"""GPU acceptance checks of the PPO roles and of what rollout and training exchange, run by ``scripts/gpu_check.sh``
(which installs the wheels and sets the process-group environment): world size 1, the plain role classes and the
project's own transports, without Ray or vLLM.

The checks, in the order they run, each in a module of its own whose docstring says what it measures and what must
hold (``--only`` takes these names; ``train`` = both train checks, ``ipc`` = ``weight_sync``):

- ``train_actor``, ``train_critic`` (``train_step.py``): a ZeRO-3 training step of ``PolicyActor`` /
  ``CriticActor`` on a Qwen2-0.5B-shaped model: tokens/s, MFU (6 * matmul weights * tokens / s / 989 TFLOP/s), then
  the offload/reload round trip of the training states, bit for bit.
- ``zero_init`` (``zero_init.py``): the model built under ``deepspeed.zero.Init``: construction peak memory against
  the full model and the per-rank shard.
- ``weight_sync`` (``weight_sync.py``): ``WeightSender`` into a receiver in a spawned process (``cuda_ipc``; gloo on
  the dry run), in buckets, twice: GB/s, and the received weights bit for bit.
- ``attention`` (``attention_padding.py``; records ``attention_sdpa``, on the GPU ``attention_sdpa_fp32``,
  ``attention_flash_attention_2``): one sequence alone against the same sequence padded in a batch.
- ``packing`` (``packed_logprobs.py``; records ``packing_<impl>`` likewise): packed against padded log-probs of a
  ragged batch.
- ``hf_generate`` (``hf_generate.py``): the HF rollout engine's greedy generation around a ``load_state_dict``,
  against the loaded model's own ``generate``.
- ``ds_checkpoint`` (``ds_checkpoint.py``): a ZeRO-3 checkpoint saved, a step, loaded: the states bit for bit and
  the step replayed.
- ``pytest_gpu`` (``pytest_gpu.py``): ``python -m pytest tests/gpu`` in a subprocess: its counts.

What they share: ``common.py`` (the model shapes and plans, device and memory helpers, ``emit`` and ``run_check``,
the worker's ``Ctx``) and ``roles.py`` (the actor and critic built from config, their batch and training states, for
``train_step`` and ``ds_checkpoint``). ``runner.py`` holds the rest: the table ``CHECKS`` (order, entry, limits),
the arguments, the driver and its workers, the summary.

The driver (``python scripts/gpu_check`` without ``--worker``) runs each check in a worker process (``--worker
NAME:SECONDS,...``, started in a process group of its own) under the check's own time limit. On the GPU every check
gets a fresh worker (a CUDA context, memory statistics and a process group of its own); on the dry run one worker
runs them in turn, to import torch, DeepSpeed and transformers once. The driver prints each check's JSON lines as
they come (``{"check": ..., "ok": ..., ...}``; ``"ok": null`` with a ``"skipped"`` reason for a check that cannot
run here). A check past its limit gets ``{"check": NAME, "ok": false, "error": "timed out after N s"}`` and its
worker's whole process group is killed (spawned receivers, pytest); a worker that dies gets ``"error": "crashed
(...): <its last output line>"``; either way the remaining checks go on in a new worker. The summary line comes last
(``{"summary": ..., "ok": ..., "passed": [...], "failed": [...], "skipped": [...], "seconds": ...}``) and the exit
status is 1 when any check failed.

Time limits (seconds, GPU / dry run) are in ``runner.CHECKS``; ``GPU_CHECK_LIMIT_<NAME>`` (e.g.
``GPU_CHECK_LIMIT_PACKING``) overrides one, and ``GPU_CHECK_TIMEOUT`` (default 450) bounds them all together: a check
starts with at most what is left of it. The GPU limits sum to 440 s; a usual run takes a fraction of that.

``--dry-run`` runs the same code on CPU with tiny models, gloo and fp32: ``zero_init`` reports the partitions'
bytes (CPU has no allocator statistics), flash_attention_2 is skipped. To look at one failing check alone:
``bash scripts/gpu_check.sh --dry-run --only NAME`` (its traceback is on stderr).

The names below are what tests/gpu and tests/test_gpu_check.py use.
"""

from .attention_padding import check_attention
from .common import MODEL_SPECS, PLANS
from .ds_checkpoint import check_ds_checkpoint
from .hf_generate import check_hf_generate
from .packed_logprobs import check_packing
from .pytest_gpu import pytest_counts
from .roles import make_roles
from .runner import CHECKS, limit_of, main
from .train_step import check_train
from .weight_sync import check_weight_sync
from .zero_init import check_zero_init

__all__ = [
    "CHECKS",
    "MODEL_SPECS",
    "PLANS",
    "check_attention",
    "check_ds_checkpoint",
    "check_hf_generate",
    "check_packing",
    "check_train",
    "check_weight_sync",
    "check_zero_init",
    "limit_of",
    "main",
    "make_roles",
    "pytest_counts",
]
