"""The clusters the config-key probes run the jobs on, and in-process stand-ins the PPO driver's phases use.

The probes observe what the production code builds and computes, without starting Ray where they can. Every job is
given its cluster: the PPO roles and engines run on ``in_process()`` (a ``LocalCluster`` reporting the test session's
resources, on a one-rank DeepSpeed world); the dpo, kto, generate and score jobs on a ``RecordingCluster``, which keeps
their worker groups local, records what they ask for and answers ``generate`` with fixed responses; the supervised
jobs' trainers note their batch sizes on a ``recording`` cluster (``RecordsTrainers``). The PPO driver's role groups
can answer fixed numbers (``FixedRole``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import OptimConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed.cluster import Cluster, LocalCluster, LocalWorkerGroup
from rlhf_core.distributed.device import resolve_device
from rlhf_core.distributed.launcher import check_call, check_constructor
from rlhf_core.distributed.node_files import local_model_path
from rlhf_core.distributed.strategy import DeepSpeedStrategy, leave_world
from rlhf_core.jobs import dpo, kto, reward_model
from rlhf_core.jobs.preference import score_on_ranks
from rlhf_core.models.builders import load_tokenizer
from tests.config_keys.harness import forward_record

SESSION_CLUSTER = {"CPU": 8.0, "probe_node": 100.0}  # what the test session's Ray offers (tests/conftest.py)


def in_process() -> LocalCluster:
    """This process as the cluster, reporting what the test session's Ray offers (its capacity checks alike)."""
    return LocalCluster(resources=SESSION_CLUSTER)


# ---------------------------------------------------------------------------------------------------------------------
# A one-rank torch.distributed world in this process: what a DeepSpeed engine built outside a cluster joins


_SAVED_ENV: dict[str, str | None] = {}


def one_rank_world() -> None:
    """A one-rank torch.distributed world in this process (made once; ``end_one_rank_world`` ends it): what a role's
    ``DeepSpeedStrategy.init_distributed`` joins when it is the only rank of its group, as in a Ray worker."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    _SAVED_ENV.update({name: os.environ.get(name) for name in world})
    os.environ.update(world)
    DeepSpeedStrategy(StrategyConfig(), OptimConfig(), TrainConfig()).init_distributed()


def end_one_rank_world() -> None:
    """End the world of this process, if any (through DeepSpeed, which forgets its groups with it), and put back the
    environment ``one_rank_world`` changed, so that later tests find no process group."""
    leave_world()
    for name, value in _SAVED_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _SAVED_ENV.clear()


# ---------------------------------------------------------------------------------------------------------------------
# Recording subclasses of the production trainers, which a recording cluster trains instead


class _RecordsBatches:
    """A stage trainer as it is, noting the size of every batch it collates into its final metrics (the eval metrics
    of reward_model, dpo and kto do not depend on the batching, so the batch sizes are what shows eval_batch_size)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.batch_sizes: list[int] = []

    def collate(self, examples, pad_id):
        self.batch_sizes.append(len(examples))
        return super().collate(examples, pad_id)  # type: ignore[misc]

    def evaluate(self, model, batches):  # the last collate of the stage: its final metrics come next
        metrics = super().evaluate(model, batches)  # type: ignore[misc]
        return {**metrics, "batch_sizes": list(self.batch_sizes)}


class RecordingRewardModelTrainer(_RecordsBatches, reward_model.RewardModelTrainer):
    pass


class RecordingDPOTrainer(_RecordsBatches, dpo.DPOTrainer):
    pass


class RecordingKTOTrainer(_RecordsBatches, kto.KTOTrainer):
    pass


RECORDING = {
    reward_model.RewardModelTrainer: RecordingRewardModelTrainer,
    dpo.DPOTrainer: RecordingDPOTrainer,
    kto.KTOTrainer: RecordingKTOTrainer,
}


class RecordingLocal(LocalCluster):
    """This process as the cluster (with the test session's resources), whose ``run_group`` trains the recording
    subclass of the reward_model, dpo and kto trainers."""

    def run_group(self, strategy: StrategyConfig, cls: type, *args: Any, key: str = "strategy") -> list[Any]:
        return super().run_group(strategy, RECORDING.get(cls, cls), *args, key=key)


def recording() -> Cluster:
    """The cluster of a job run whose trainers note their batch sizes."""
    return RecordingLocal(resources=SESSION_CLUSTER)


# ---------------------------------------------------------------------------------------------------------------------
# Role groups answering fixed numbers: the PPO driver's experience phase without models or Ray


RM_RAW = (1.5, 3.5, 2.5, 2.5)  # the reward model's raw scores: normalised by rm_seed0's (0.5, 2.0), 0.5 1.5 1 1
ROLE_SEEDS = {"actor": 1, "reference": 2, "critic": 3}


class FixedRole:
    """A one-rank role group answering PPOController.experience's calls with fixed numbers (the actor's and the
    reference's log-probs, the critic's values, the reward model's raw scores ``RM_RAW``), alike for every config: what
    differs is only what the controller does with them."""

    def __init__(self, role: str):
        self.role = role

    def __len__(self) -> int:
        return 1

    def call_each_async(self, method, shards) -> list:
        (batch,) = shards
        rows = batch.input_ids.shape[0]
        if self.role == "reward":
            return [torch.tensor(RM_RAW[:rows], dtype=torch.float32)]
        gen = torch.Generator().manual_seed(ROLE_SEEDS[self.role])
        numbers = torch.rand(batch.action_mask.shape, generator=gen)
        return [numbers if self.role == "critic" else -numbers]

    call_each = call_each_async  # the results themselves, as a LocalWorkerGroup's


# ---------------------------------------------------------------------------------------------------------------------
# The jobs of the dpo, kto, generate and score kinds in this process, without Ray: their worker groups local, their
# rollout engines recorded


class Shards(LocalWorkerGroup):
    """A job's frozen worker group (reference log-probs, reward scorers, generate's log-prob groups) in this process:
    its ``num_workers`` ranks share the one hosted object and each shard of ``call_each`` runs on it. ``record``: what
    the job gave the group and the forwards of the hosted model."""

    def __init__(self, cfg: StrategyConfig, factory: type, *args, name="worker", **kwargs):
        super().__init__(cfg, factory, *args, name=name, **kwargs)
        model = getattr(self.obj, "model", None)
        hf = getattr(model, "hf_model", model)
        self.record: dict[str, Any] = {
            "factory": factory.__name__,
            "name": name,
            "workers": cfg.num_workers,
            "device": resolve_device(cfg.device),
            "args": [repr(a) for a in args],
            "kwargs": {k: repr(v) for k, v in kwargs.items()},
            "attn": getattr(getattr(hf, "config", None), "_attn_implementation", None),
            "shards": [],
            "forwards": [],
        }
        if isinstance(model, torch.nn.Module):
            model.register_forward_pre_hook(forward_record(self.record["forwards"]), with_kwargs=True)

    def __len__(self) -> int:
        return self.cfg.num_workers

    def call_each(self, method, shards, *args, **kwargs) -> list:
        shards = list(shards)
        assert len(shards) == len(self), f"{len(shards)} shards for {len(self)} workers"
        check_call(self.cls, method, (shards[0], *args), kwargs)
        self.record["shards"].append([s.size for s in shards])
        return [method(self.obj, s, *args, **kwargs) for s in shards]

    call_each_async = call_each


def fixed_responses(count: int, eos_id: int) -> list[list[int]]:
    """Stand-in samples: every third one cut without EOS (finish_reason 'length')."""
    return [[5 + k % 7, 9 + k % 3, 11 if k % 3 == 0 else eos_id] for k in range(count)]


def _engine_model(path: Any) -> Any:
    """A model the engines load: its name, or for a directory (a builtin: policy saved for vLLM) a weight checksum."""
    if not os.path.isdir(str(path)):
        return str(path)
    digest = hashlib.sha256()
    for f in sorted(Path(str(path)).glob("*.safetensors")):
        digest.update(f.read_bytes())
    return {"saved": Path(str(path)).name, "weights": digest.hexdigest()[:16]}


def first_step(cfg: StrategyConfig, factory: type, *args, key: str = "strategy") -> list[dict]:
    """``run_group`` of the ``RecordingCluster`` a DPO/KTO job runs on: the rank's first step without DeepSpeed. The
    trainer the job made (its context and examples, with the reference log-probs the job attached) builds the policy
    as fit() does, in fp32 with sdpa, scores the reference on one rank (score_on_ranks: the starting model's reference
    log-probs when the job attached none), and its loss runs on the first four training examples."""
    check_constructor(factory, args, {})
    method = factory(*args)  # DPOTrainer / KTOTrainer: the stage's loss, run by its preference step loop
    trainer = method.trainer
    ctx = trainer.ctx = dataclasses.replace(trainer.ctx, model_path=local_model_path(trainer.ctx.model_path))
    tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
    model = trainer.build_model(tokenizer, torch.float32, "sdpa")
    examples = {"train": trainer.train_examples, "eval": trainer.eval_examples}
    strategy = DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.train)
    pad_id = tokenizer.pad_token_id
    score_on_ranks(model, ctx, strategy, trainer.p, examples, method.reference_sequences, method.REF_KEYS, pad_id)
    forwards: list[tuple[int, bool]] = []
    model.register_forward_pre_hook(forward_record(forwards), with_kwargs=True)
    loss, metrics = method.loss(model, method.collate(trainer.train_examples[:4], tokenizer.pad_token_id))
    return [
        {
            "steps": 0,
            "loss": round(loss.item(), 6),
            "step_metrics": {k: round(v, 6) for k, v in metrics.items()},
            "online_reference": trainer.online is not None,
            "policy_forwards": forwards,
            "examples": (len(trainer.train_examples), len(trainer.eval_examples)),
        }
    ]


class FixedEngines:
    """The rollout engines of a ``RecordingCluster``: each ``generate`` is recorded (its prompts and
    ``SamplingConfig``) and answered with ``fixed_responses``."""

    def __init__(self, eos_token_id: int, record: list[dict]):
        self.eos, self.record = eos_token_id, record

    def wait_ready(self) -> None:
        pass

    def generate(self, prompt_ids, sampling):
        self.record.append({"prompt_ids": prompt_ids, "sampling": dataclasses.asdict(sampling)})
        return fixed_responses(len(prompt_ids) * sampling.n, self.eos)

    def shutdown(self) -> None:
        pass


class RecordingCluster(LocalCluster):
    """This process as the cluster of a dpo, kto, generate or score job, recording what the job asks of it
    (``record``): the CPUs of each ``start``, its worker groups (``Shards``), the engines it starts (their
    arguments) and what they are asked to generate (``FixedEngines``). Its resources are the test session's Ray's,
    its groups run on the CPU whatever device their strategy names (the record has the one named), and ``run_group``
    is ``first_step``."""

    group_class = Shards

    def __init__(self):
        super().__init__(resources=SESSION_CLUSTER, device="cpu")
        self.record: dict[str, Any] = {"init_ray": [], "groups": [], "engines": [], "generate": []}

    def start(self, min_cpus: float = 1) -> None:
        self.record["init_ray"].append(min_cpus)
        super().start(min_cpus)

    def device(self, requested: str) -> str:
        return resolve_device(requested)  # the device the job decides on; its groups still run on the CPU

    def group(self, *args, **kwargs) -> Any:
        group = super().group(*args, **kwargs)
        self.record["groups"].append(group)
        return group

    def engines(
        self,
        count,
        model_path,
        *,
        eos_token_id,
        backend="vllm",
        tensor_parallel_size=1,
        num_cpus_per_engine=1,
        env_vars=None,
        placement=None,
        share=1.0,
        resources=None,
        **kwargs,
    ) -> Any:
        asked = {"count": count, "model": _engine_model(model_path), "backend": backend}
        asked.update(tp=tensor_parallel_size, cpus=num_cpus_per_engine, resources=resources, kwargs=kwargs)
        self.record["engines"].append(asked)
        return FixedEngines(eos_token_id, self.record["generate"])

    def run_group(self, strategy: StrategyConfig, cls: type, *args: Any, key: str = "strategy") -> list[Any]:
        return first_step(strategy, cls, *args, key=key)
