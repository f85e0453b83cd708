"""Every documented config key changes what the code does.

The documented keys are the rows of ``describe(PipelineConfig)``. ``EFFECTS`` maps each of them to a ``Probe``: the
overrides that change it and a function that runs the code path consuming the key and returns what that code
produced (examples, a DeepSpeed config, an LR curve, a built model, a job's checkpoints, ...). The test loads the tiny
preset twice, without and with the change, runs the probe on both and asserts that the observables differ (and, where
a probe says so, that they changed as expected). ``test_every_documented_key_has_a_probe`` keeps the table complete:
a new key without a probe fails it.

Keys that a stage kind declares unused (``StageKind.unused``) are not documented; ``test_unused_keys_are_refused``
shows that setting one is refused, naming the key.

Probes that need Ray/DeepSpeed (job runs, worker groups, engines, the PPO roles) are marked slow. The PPO roles run
in this process on a one-rank DeepSpeed world: ``PPOController.start()`` (or the whole ``ppo.run``) with Ray's
transport swapped for in-process calls (``in_process_roles``), so that what is observed is what the controller gave
each role and what the real role classes built and computed from it. Keys that only act inside a job's loop share
one job run per distinct config (the cache ignores the run directory). The reward sources, the critic-free estimators
and the dynamic filter act on the driver: they are probed fast, on ``PPOController.experience`` with its role groups
answering fixed numbers (``FixedRole``) and the remote reward servers real loopback ones (``tests/reward_server.py``).

The dpo, kto, generate and score kinds are probed on their own preset (``METHODS``), mostly without Ray: their jobs
run in this process (``in_process_workers``) with their worker groups local, Ray's cluster a stand-in and the rollout
engines recorded; a DPO/KTO job's training group is replaced by its first step on the policy (``first_step``). The
loop keys are probed on the stage graph of ``LOOP``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlhf_core import events
from rlhf_core.config import (
    STAGE_KINDS,
    ConfigError,
    OptimConfig,
    PipelineConfig,
    StrategyConfig,
    TrainConfig,
    describe,
    load_config,
    stage_hash,
    to_dict,
)
from rlhf_core.data.datasets import read_dataset
from rlhf_core.data.examples import kto_examples, preference_examples, sft_examples
from rlhf_core.data.sampler import global_batch, total_steps
from rlhf_core.distributed import launcher
from rlhf_core.distributed.device import resolve_device
from rlhf_core.distributed.node_files import local_model_path
from rlhf_core.distributed.rollout import group as rollout_group
from rlhf_core.distributed.rollout.group import EngineGroup, EngineHandles
from rlhf_core.distributed.rollout.hf_engine import HFGenerateEngine
from rlhf_core.distributed.strategy import DeepSpeedStrategy, lr_lambda
from rlhf_core.jobs import common, critic_init, dpo, kto, reward_model, sft
from rlhf_core.jobs.preference import score_on_ranks
from rlhf_core.models.builders import attn_implementation, build_causal_lm, build_scalar_model, load_tokenizer
from rlhf_core.run_layout import open_store
from rlhf_core.storage import ObjectStore
from tests.conftest import ROOT, TINY
from tests.remote_code import add_remote_code

DATA = ROOT / "tests" / "data" / "config_keys"  # rows with alternative keys, and split folders (train/test/dev)
METHODS = DATA / "methods.yaml"  # one stage of each of the kinds dpo, kto, generate and score, named after it
LOOP = DATA / "loop.yaml"  # a loop of K = 2 iterations (generate -> score -> dpo, sft_best)


# ---------------------------------------------------------------------------------------------------------------------
# The probe table's vocabulary


@dataclass(frozen=True)
class Probe:
    """``change``: overrides that change the key (``{stage}`` and fixture names like ``{alt_tokenizer}`` are filled
    in); ``observe(cfg, stage)``: what the consuming code produced; ``base``: overrides for both configs (a fixture
    data file...); ``expect(before, after)``: the expected change, when cheap to state; ``slow``: needs Ray or
    DeepSpeed; ``preset``: the preset both configs start from (default: the tiny one)."""

    change: tuple[str, ...]
    observe: Callable[[PipelineConfig, str], Any]
    base: tuple[str, ...] = ()
    expect: Callable[[Any, Any], bool] | None = None
    slow: bool = False
    preset: Path = TINY


def probe(*change: str, observe, base=(), expect=None, slow=False, preset=TINY) -> Probe:
    return Probe(tuple(change), observe, tuple(base), expect, slow, preset)


def content_key(cfg: PipelineConfig, stage: str) -> str:
    """The stage's kind and resolved section (not the run directory): configs that compute the same share a key."""
    return json.dumps([cfg.kind(stage), to_dict(cfg)["stages"][stage]], sort_keys=True, default=str)


def outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the type of the error it raised (refusing is also a change of behaviour)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return ("raised", type(e).__name__)


def fingerprint(model: torch.nn.Module) -> dict:
    """What a built model is: class, attention, dtype, vocabulary, parameter count and a weight checksum."""
    if type(model).__name__ == "DeepSpeedEngine":  # a frozen role partitioned with ZeRO-3 (frozen_zero_stage)
        model = model.module
    model = getattr(model, "hf_model", model)  # ScalarHeadModel wraps the Hugging Face model
    params = list(model.parameters())
    return {
        "class": type(model).__name__,
        "attn": model.config._attn_implementation,
        "dtype": str(params[0].dtype),
        "vocab": model.get_input_embeddings().weight.shape[0],
        "params": sum(p.numel() for p in params),
        "checksum": round(sum(p.detach().double().abs().sum().item() for p in params), 6),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Observers of the supervised stages (sft, reward_model) and critic_init: the code their jobs and ranks run


_EXAMPLES: dict[tuple, list] = {}
MAKE_EXAMPLES = {
    "sft": sft_examples,
    "reward_model": preference_examples,
    "dpo": preference_examples,
    "kto": kto_examples,
}


def _examples(cfg: PipelineConfig, stage: str, split: str) -> list:
    st = common.setup_stage(cfg, stage)
    key = (cfg.kind(stage), repr(st.section.data), repr(st.section.model), st.model_path, split)  # tokenized once
    if key not in _EXAMPLES:
        tokenizer = load_tokenizer(st.model_path, st.section.model.tokenizer)
        _EXAMPLES[key] = MAKE_EXAMPLES[cfg.kind(stage)](st.section.data, tokenizer, split, st.store.fs.storage_options)
    return _EXAMPLES[key]


def train_examples(cfg: PipelineConfig, stage: str) -> Any:
    """Training examples the job tokenizes (sft_examples / preference_examples / kto_examples of data, split
    'train')."""
    return outcome(lambda: _examples(cfg, stage, "train"))


def eval_examples(cfg: PipelineConfig, stage: str) -> Any:
    """Held-out examples the job tokenizes (split 'eval')."""
    return outcome(lambda: _examples(cfg, stage, "eval"))


def _stage_trainer(cfg: PipelineConfig, stage: str, ctx: Any):
    """The stage's rank trainer as its job makes it (no examples: its model, collate and loss are probed)."""
    section = cfg.stage(stage)
    if cfg.kind(stage) == "sft":
        return sft.SFTTrainer(ctx, [], [])
    if cfg.kind(stage) in ("dpo", "kto"):  # with its online reference (ref_logprobs: online), so that loss runs alone
        trainer = dpo.DPOTrainer if cfg.kind(stage) == "dpo" else kto.KTOTrainer
        return trainer(ctx, [], [], section, (section.reference or section.model).name_or_path)
    return reward_model.RewardModelTrainer(ctx, [], [], section.margin)


def rank_model(cfg: PipelineConfig, stage: str) -> Any:
    """The model a rank builds: setup_stage -> StageContext -> tokenizer, attention, dtype, trainer.build_model
    (the stage trainer's fit, step 1)."""

    def build():
        ctx = common.setup_stage(cfg, stage).context()
        strategy = DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.train)
        tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        attn = attn_implementation(ctx.strategy.attn_implementation, strategy.device)
        return fingerprint(_stage_trainer(cfg, stage, ctx).build_model(tokenizer, strategy.dtype, attn))

    return outcome(build)


def ds_config(cfg: PipelineConfig, stage: str) -> dict:
    """DeepSpeedStrategy(strategy, optim, train).ds_config(), the config deepspeed.initialize gets."""
    ctx = common.setup_stage(cfg, stage).context()
    return DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.train).ds_config()


def lr_curve(cfg: PipelineConfig, stage: str) -> list[float]:
    """The LambdaLR multipliers of strategy.lr_lambda over a 20-step run."""
    ctx = common.setup_stage(cfg, stage).context()
    fn = lr_lambda(ctx.optim, 20)
    return [round(fn(step), 9) for step in range(20)]


def planned_steps(cfg: PipelineConfig, stage: str) -> int:
    """Optimizer steps the trainer plans for the tokenized training set (sampler.total_steps, as in fit())."""
    t = common.setup_stage(cfg, stage).context().train
    return total_steps(len(_examples(cfg, stage, "train")), t.train_batch_size, t.max_epochs, t.max_steps)


def first_batch(cfg: PipelineConfig, stage: str) -> list[int]:
    """Dataset indices of the first optimizer step (sampler.global_batch with the train seed)."""
    t = common.setup_stage(cfg, stage).context().train
    return global_batch(len(_examples(cfg, stage, "train")), t.train_batch_size, 0, t.seed)


def loss_forwards(cfg: PipelineConfig, stage: str) -> list[tuple[int, bool]]:
    """The model forwards of trainer.loss on four training examples of mixed lengths with a fixed tiny model: (rows,
    whether the rows came packed: position_ids and no attention mask) of each."""
    impl = _stage_trainer(cfg, stage, common.setup_stage(cfg, stage).context())
    tokenizer = load_tokenizer("builtin:tiny")
    model = impl.build_model(tokenizer, torch.float32, "sdpa")
    examples = sorted(_examples(cfg, stage, "train")[:16], key=lambda e: len(e.get("input_ids") or e["chosen_ids"]))
    calls: list[tuple[int, bool]] = []
    model.register_forward_pre_hook(forward_record(calls), with_kwargs=True)
    impl.loss(model, impl.collate(examples[:2] + examples[-2:], tokenizer.pad_token_id))
    return calls


def forward_record(calls: list):
    """A forward pre-hook appending (rows, packed) of each call: packed = position_ids given without a mask."""

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        position_ids = args[2] if len(args) > 2 else kwargs.get("position_ids")
        calls.append((len(ids), mask is None and position_ids is not None))

    return hook


def worker_device(cfg: PipelineConfig, stage: str) -> str:
    """The device a training group's workers get (device.resolve_device, RLHF_DEVICE and num_gpus)."""
    return resolve_device(cfg.stage(stage).strategy.device)


def pairwise_loss(cfg: PipelineConfig, stage: str) -> float:
    """RewardModelTrainer(margin).loss on four fixed preference pairs with a fixed tiny reward model."""
    impl = _stage_trainer(cfg, stage, common.setup_stage(cfg, stage).context())
    tokenizer = load_tokenizer("builtin:tiny")
    model = impl.build_model(tokenizer, torch.float32, "sdpa")
    batch = impl.collate(_examples(cfg, stage, "train")[:4], tokenizer.pad_token_id)
    return round(impl.loss(model, batch)[0].item(), 6)


def stage_runner(cfg: PipelineConfig, stage: str) -> Any:
    """The job module that runs the stage (STAGE_KINDS[kind].job: the pipeline's and the Prefect task's dispatch)."""
    return job_module(cfg, stage).__name__


def job_module(cfg: PipelineConfig, stage: str):
    return importlib.import_module(STAGE_KINDS[cfg.kind(stage)].job)


def store_location(cfg: PipelineConfig, stage: str) -> tuple[str, dict]:
    """Where and how the run's object store writes (run_layout.open_store: root URI, fsspec storage options)."""
    store = open_store(cfg)
    return store.uri(stage), store.fs.storage_options


def critic_copy(cfg: PipelineConfig, stage: str) -> Any:
    """jobs.critic_init.run in-process: the critic it commits (weights, config) and the tokenizer it ships."""

    def run():
        ref = critic_init.run(cfg, stage)
        out = Path(ref.uri.removeprefix("file://"))
        from transformers import AutoModelForSequenceClassification

        # read back by the test (trusting its own fixture code): what matters is what the job wrote
        model = AutoModelForSequenceClassification.from_pretrained(str(out), trust_remote_code=True)
        return {"model": fingerprint(model), "tokenizer_vocab": len(load_tokenizer(str(out), trust_remote_code=True))}

    return outcome(run)


# ---------------------------------------------------------------------------------------------------------------------
# Slow observers: real Ray groups, DeepSpeed engines and job runs, each run once per distinct config


class WorkerReport:
    """Hosted by a training group like the stage trainers (SFTTrainer, ...): what each rank was given."""

    def fit(self) -> dict:
        import ray

        assigned = ray.get_runtime_context().get_assigned_resources()
        return {
            "world_size": int(os.environ["WORLD_SIZE"]),
            "torch_threads": torch.get_num_threads(),
            "cpus": assigned.get("CPU"),
            "custom": {k: v for k, v in assigned.items() if k not in ("CPU", "GPU", "memory")},
        }


_GROUPS: dict[str, Any] = {}


def group_report(strategy: StrategyConfig) -> list[dict]:
    """launcher.run_group(strategy, ...), as the jobs start their groups: one WorkerReport per rank."""
    if repr(strategy) not in _GROUPS:
        _GROUPS[repr(strategy)] = launcher.run_group(strategy, WorkerReport)
    return _GROUPS[repr(strategy)]


def worker_group(cfg: PipelineConfig, stage: str) -> Any:
    """launcher.run_group(strategy, ...) as the supervised jobs call it: one report per rank."""
    return group_report(cfg.stage(stage).strategy)


_SAVED_ENV: dict[str, str | None] = {}


def one_rank_world() -> None:
    """A one-rank torch.distributed world in this process (made once; ``in_process_world`` ends it): what a role's
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


class EngineReport:
    """DeepSpeedStrategy.prepare (optimizer, schedule, recomputation) for a section, in the one-rank world."""

    def __init__(self, strategy_cfg: StrategyConfig, optim, train: TrainConfig):
        self.section = strategy_cfg, optim, train

    def fit(self) -> dict:
        strategy = DeepSpeedStrategy(*self.section)
        strategy.init_distributed()
        tokenizer = load_tokenizer("builtin:tiny")
        model = build_causal_lm("builtin:tiny", tokenizer, seed=0, dtype=strategy.dtype, attn="sdpa")
        return engine_state(model, strategy.prepare(model, 10))


def engine_state(model: torch.nn.Module, engine: Any) -> dict:
    """What an engine's optimizer and model were set up with: the first param group, activation recomputation."""
    group = engine.optimizer.param_groups[0]
    return {
        "lr": group["initial_lr"],
        "betas": [round(b, 9) for b in group["betas"]],
        "weight_decay": group["weight_decay"],
        "gradient_checkpointing": getattr(model, "hf_model", model).is_gradient_checkpointing,
    }


_ENGINES: dict[str, dict] = {}


def engine(cfg: PipelineConfig, stage: str) -> dict:
    """What DeepSpeedStrategy.prepare made of the stage's strategy/optim sections (param group, recomputation)."""
    ctx = common.setup_stage(cfg, stage).context()
    # one rank, whatever the stage asks for: the report is about the optimizer and the model, not the group
    section = dataclasses.replace(ctx.strategy, num_workers=1), ctx.optim, ctx.train
    if repr(section) not in _ENGINES:
        one_rank_world()
        _ENGINES[repr(section)] = EngineReport(*section).fit()
    return _ENGINES[repr(section)]


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


_JOBS: dict[str, dict] = {}


def job_run(cfg: PipelineConfig, stage: str) -> dict:
    """The stage's job run for real, once per distinct config (jobs.sft.run / jobs.reward_model.run on Ray; ppo.run /
    critic_warmup.run, dpo.run / kto.run with their groups in this process): checkpoints kept, step events, metrics,
    the critic output."""
    key = content_key(cfg, stage)
    if key in _JOBS:
        return _JOBS[key]
    run_dir = Path(cfg.run_uri)
    events_file = run_dir / "events.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    saved_env = os.environ.get(events.EVENTS_ENV)
    saved = reward_model.RewardModelTrainer, dpo.DPOTrainer, kto.KTOTrainer
    os.environ[events.EVENTS_ENV] = str(events_file)
    reward_model.RewardModelTrainer = RecordingRewardModelTrainer  # type: ignore[misc]
    dpo.DPOTrainer = RecordingDPOTrainer  # type: ignore[misc]
    kto.KTOTrainer = RecordingKTOTrainer  # type: ignore[misc]
    in_process = PPO_KINDS + ("dpo", "kto")
    transport = in_process_roles() if cfg.kind(stage) in in_process else contextlib.nullcontext()
    try:
        with transport:
            ref = job_module(cfg, stage).run(cfg, stage)
    finally:
        reward_model.RewardModelTrainer, dpo.DPOTrainer, kto.KTOTrainer = saved  # type: ignore[misc]
        if saved_env is None:
            os.environ.pop(events.EVENTS_ENV, None)
        else:
            os.environ[events.EVENTS_ENV] = saved_env
    checkpoints = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / stage / "checkpoints").glob("step_*"))
    steps = [e["step"] for e in map(json.loads, events_file.read_text().splitlines()) if e["event"] == "step"]
    critic = ObjectStore(str(run_dir)).is_complete(f"{stage}/critic")
    _JOBS[key] = {"checkpoints": checkpoints, "step_events": steps, "metrics": ref.metrics, "critic": critic}
    return _JOBS[key]


def newest_checkpoint_step(cfg, stage):
    """Step of the newest in-stage checkpoint the job left."""
    return job_run(cfg, stage)["checkpoints"][-1:]


def checkpoints_kept(cfg, stage):
    """How many in-stage checkpoints the job's pruning kept."""
    return len(job_run(cfg, stage)["checkpoints"])


def checkpoint_steps(cfg, stage):
    """Steps of the in-stage checkpoints the job left (saved every save_steps, pruned to keep_last)."""
    return job_run(cfg, stage)["checkpoints"]


def logged_steps(cfg, stage):
    """Steps the job reported (step events of rank 0 / of the PPO controller)."""
    return job_run(cfg, stage)["step_events"]


def critic_written(cfg, stage):
    """Whether the PPO job committed its trained critic (<run_uri>/<stage>/critic)."""
    return job_run(cfg, stage)["critic"]


def eval_batching(cfg, stage):
    """How the job evaluated: SFT's eval_loss (a mean over eval batches), the RM's eval batch sizes."""
    m = job_run(cfg, stage)["metrics"]
    return m["eval_loss"] if cfg.kind(stage) == "sft" else m["batch_sizes"][m["steps"] :]  # after the training ones


# ---------------------------------------------------------------------------------------------------------------------
# The table: supervised sections (sft and reward_model share model/strategy/optim/train probes)

RM_BASE = ("reward_model.model.name_or_path=builtin:tiny",)  # no upstream SFT output needed
# One job run per kind serves the keys that only act inside the loop: 96 rows / 16 = 6 steps.
JOB_BASE = (
    "{stage}.data.max_samples=96",
    "{stage}.train.save_steps=1",
    "{stage}.train.keep_last=3",
    "{stage}.train.log_steps=8",
    "{stage}.train.eval_batch_size=32",
    "{stage}.train.micro_train_batch_size=16",
)
JOB_CHANGE = (
    "{stage}.train.save_steps=2",
    "{stage}.train.keep_last=1",
    "{stage}.train.log_steps=2",
    "{stage}.train.eval_batch_size=4",
)

TRAINING_SECTION: dict[str, Probe] = {
    "model.name_or_path": probe(
        "{stage}.model.name_or_path=builtin:small", observe=rank_model, expect=lambda a, b: b["params"] > a["params"]
    ),
    "model.tokenizer": probe(
        "{stage}.model.tokenizer={alt_tokenizer}", observe=rank_model, expect=lambda a, b: b["vocab"] == a["vocab"] + 1
    ),
    "model.init_seed": probe("{stage}.model.init_seed=1", observe=rank_model),
    "model.trust_remote_code": probe(
        "{stage}.model.trust_remote_code=true",
        observe=rank_model,
        base=("{stage}.model.name_or_path={remote_code_model}",),
        expect=lambda a, b: a[0] == "raised" and b["class"].startswith("Probe"),
    ),
    "strategy.num_workers": probe(
        "{stage}.strategy.num_workers=2",
        observe=worker_group,
        slow=True,
        base=("{stage}.train.micro_train_batch_size=8",),
        expect=lambda a, b: [r["world_size"] for r in b] == [2, 2],
    ),
    "strategy.zero_stage": probe(
        "{stage}.strategy.zero_stage=3", observe=ds_config, expect=lambda a, b: b["zero_optimization"]["stage"] == 3
    ),
    "strategy.offload_optimizer": probe(
        "{stage}.strategy.offload_optimizer=true",
        observe=ds_config,
        expect=lambda a, b: b["zero_optimization"]["offload_optimizer"]["device"] == "cpu",
    ),
    "strategy.precision": probe(
        "{stage}.strategy.precision=bf16", observe=rank_model, expect=lambda a, b: b["dtype"] == "torch.bfloat16"
    ),
    "strategy.gradient_checkpointing": probe(
        "{stage}.strategy.gradient_checkpointing=true",
        observe=engine,
        slow=True,
        expect=lambda a, b: b["gradient_checkpointing"],
    ),
    "strategy.attn_implementation": probe(
        "{stage}.strategy.attn_implementation=eager",
        observe=rank_model,
        expect=lambda a, b: (a["attn"], b["attn"]) == ("sdpa", "eager"),
    ),
    "strategy.device": probe("{stage}.strategy.device=cuda", observe=worker_device),
    "strategy.packing": probe(
        "{stage}.strategy.packing=false",
        observe=loss_forwards,
        # packed rows (never more of them than the padded rows of the same examples), then padded ones
        expect=lambda a, b: all(p for _, p in a) and not any(p for _, p in b) and a[0][0] <= b[0][0],
    ),
    "strategy.cpus_per_worker": probe(
        "{stage}.strategy.cpus_per_worker=0.5",
        observe=worker_group,
        slow=True,
        expect=lambda a, b: b[0]["cpus"] == 0.5,
    ),
    "strategy.threads_per_worker": probe(
        "{stage}.strategy.threads_per_worker=2",
        observe=worker_group,
        slow=True,
        expect=lambda a, b: b[0]["torch_threads"] == 2,
    ),
    "strategy.resources": probe(  # the session's Ray offers the custom resource probe_node (tests/conftest.py)
        "{stage}.strategy.resources={{probe_node: 2}}",
        observe=worker_group,
        slow=True,
        expect=lambda a, b: a[0]["custom"] == {} and b[0]["custom"] == {"probe_node": 2.0},
    ),
    "optim.lr": probe("{stage}.optim.lr=0.25", observe=engine, slow=True, expect=lambda a, b: b["lr"] == 0.25),
    "optim.weight_decay": probe(
        "{stage}.optim.weight_decay=0.1", observe=engine, slow=True, expect=lambda a, b: b["weight_decay"] == 0.1
    ),
    "optim.adam_betas": probe(
        "{stage}.optim.adam_betas=[0.8,0.9]", observe=engine, slow=True, expect=lambda a, b: b["betas"] == [0.8, 0.9]
    ),
    "optim.lr_scheduler": probe(
        "{stage}.optim.lr_scheduler=constant_with_warmup", observe=lr_curve, expect=lambda a, b: b[-1] == 1.0
    ),
    "optim.lr_warmup_ratio": probe(
        "{stage}.optim.lr_warmup_ratio=0.5", observe=lr_curve, expect=lambda a, b: b[0] == 0.1
    ),
    "optim.min_lr_ratio": probe("{stage}.optim.min_lr_ratio=0.5", observe=lr_curve),
    "optim.max_norm": probe(
        "{stage}.optim.max_norm=0.5", observe=ds_config, expect=lambda a, b: b["gradient_clipping"] == 0.5
    ),
    "train.train_batch_size": probe(
        "{stage}.train.train_batch_size=32",
        observe=ds_config,
        expect=lambda a, b: b["gradient_accumulation_steps"] == 2 * a["gradient_accumulation_steps"],
    ),
    "train.micro_train_batch_size": probe(
        "{stage}.train.micro_train_batch_size=4",
        observe=ds_config,
        expect=lambda a, b: b["train_micro_batch_size_per_gpu"] == 4,
    ),
    "train.max_epochs": probe("{stage}.train.max_epochs=2", observe=planned_steps, expect=lambda a, b: b == 2 * a),
    "train.max_steps": probe("{stage}.train.max_steps=3", observe=planned_steps, expect=lambda a, b: b == 3),
    "train.seed": probe("{stage}.train.seed=7", observe=first_batch),
    "train.save_steps": probe(
        *JOB_CHANGE, observe=newest_checkpoint_step, base=JOB_BASE, slow=True, expect=lambda a, b: (a, b) == ([5], [4])
    ),
    "train.keep_last": probe(
        *JOB_CHANGE, observe=checkpoints_kept, base=JOB_BASE, slow=True, expect=lambda a, b: (a, b) == (3, 1)
    ),
    "train.log_steps": probe(
        *JOB_CHANGE,
        observe=logged_steps,
        base=JOB_BASE,
        slow=True,
        expect=lambda a, b: (a, b) == ([1, 6], [1, 2, 4, 6]),
    ),
    "train.eval_batch_size": probe(*JOB_CHANGE, observe=eval_batching, base=JOB_BASE, slow=True),
}


def _data_probes(fixture: str, keys: dict[str, str]) -> dict[str, Probe]:
    """Probes of a data section on the bundled fixture rows (``keys``: the alternative row keys of the kind)."""
    rows, splits = f"{DATA / fixture}.jsonl", DATA / f"{fixture}_splits"
    on_rows = (f"{{stage}}.data.train_path={rows}", f"{{stage}}.data.eval_path={rows}")
    on_splits = (f"{{stage}}.data.train_path={splits}", f"{{stage}}.data.eval_path={splits}")
    fewer = lambda a, b: 0 < len(b) < len(a)  # noqa: E731
    out = {
        "data.train_path": probe(f"{{stage}}.data.train_path={rows}", observe=train_examples),
        "data.eval_path": probe(f"{{stage}}.data.eval_path={rows}", observe=eval_examples),
        "data.train_split": probe("{stage}.data.train_split=dev", observe=train_examples, base=on_splits),
        "data.eval_split": probe("{stage}.data.eval_split=dev", observe=eval_examples, base=on_splits),
        "data.max_len": probe("{stage}.data.max_len=12", observe=train_examples, base=on_rows),
        "data.max_samples": probe("{stage}.data.max_samples=3", observe=train_examples, base=on_rows, expect=fewer),
        "data.input_template": probe("{stage}.data.input_template='Q: {{}} A:'", observe=train_examples, base=on_rows),
        "data.apply_chat_template": probe(
            "{stage}.data.apply_chat_template=false", observe=train_examples, base=on_rows
        ),
    }
    for key, alternative in keys.items():
        out[f"data.{key}"] = probe(f"{{stage}}.data.{key}={alternative}", observe=train_examples, base=on_rows)
    return out


# The row keys each kind reads (DataConfig is one class for all kinds: the others' are StageKind.unused, refused)
SFT_KEYS = {"input_key": "question", "output_key": "answer"}
PREFERENCE_KEYS = {"prompt_key": "query", "chosen_key": "good", "rejected_key": "bad"}

SFT_SECTION = {**TRAINING_SECTION, **_data_probes("sft", SFT_KEYS)}
REWARD_MODEL_SECTION = {
    **TRAINING_SECTION,
    **_data_probes("pref", PREFERENCE_KEYS),
    "margin": probe("{stage}.margin=1.0", observe=pairwise_loss),
}
CRITIC_INIT_SECTION = {
    "model.name_or_path": probe(
        "{stage}.model.name_or_path={rm_seed1}", observe=critic_copy, base=("{stage}.model.name_or_path={rm_seed0}",)
    ),
    "model.tokenizer": probe(
        "{stage}.model.tokenizer={alt_tokenizer}", observe=critic_copy, base=("{stage}.model.name_or_path={rm_seed0}",)
    ),
    "model.trust_remote_code": probe(
        "{stage}.model.trust_remote_code=true",
        observe=critic_copy,
        base=("{stage}.model.name_or_path={remote_code_rm}",),
    ),
}
KIND_CHANGES = {  # another kind whose section the stage's keys also make valid
    "sft": ("sft.kind=reward_model",),
    "reward_model": ("reward_model.kind=sft",),
    "critic_init": (
        "critic_init.kind=reward_model",
        f"critic_init.data.train_path={DATA / 'pref.jsonl'}",
        f"critic_init.data.eval_path={DATA / 'pref.jsonl'}",
    ),
    "critic_warmup": ("critic_warmup.kind=ppo",),
    "ppo": ("ppo.kind=critic_warmup",),  # on KIND_PRESETS["ppo"]: the tiny ppo stage sets actor_optim
    # on METHODS, whose stages set only keys that the other kind also takes
    "dpo": ("dpo.kind=kto",),
    "kto": ("kto.kind=dpo",),
    "generate": ("generate.kind=sft",),
    "score": (
        "score.kind=ppo",
        "score.actor.name_or_path=builtin:tiny",
        "score.critic.name_or_path=builtin:tiny",
        "score.train.eval_prompts=0",
    ),
}
# The tiny preset's ppo stage sets actor_optim, which a critic_warmup stage refuses: its kind changes on a preset
# whose ppo stage sets only keys both kinds take.
KIND_PRESETS = {"ppo": DATA / "ppo_both_kinds.yaml"}
# The preset with a stage named after each kind: the tiny one for the first kinds, METHODS for the newer ones.
KIND_HOMES = {"dpo": METHODS, "kto": METHODS, "generate": METHODS, "score": METHODS}

# ---------------------------------------------------------------------------------------------------------------------
# PPO sections (critic_warmup and ppo share PPOConfig): the controller's set-up and its advantage phase, in-process

PPO_KINDS = ("critic_warmup", "ppo")


def _ppo_setup(cfg: PipelineConfig, stage: str):
    """The controller as ppo.run builds it (the same models fetched)."""
    from rlhf_core.distributed.placement import RoleSet, role_models
    from rlhf_core.jobs import ppo

    p, train_actor = cfg.stage(stage), cfg.kind(stage) == "ppo"
    roles = RoleSet.of(p, train_actor)
    setup = common.setup_stage(cfg, stage, role_models(p, roles))
    return ppo.PPOController(stage, p, setup, train_actor, roles)


def ppo_controller(cfg: PipelineConfig, stage: str) -> Any:
    """jobs.ppo.PPOController(...) as run() builds it before any Ray actor: prompts, plan, reward stats, gold, KL,
    and the engines' kwargs as start() passes them."""
    from rlhf_core.distributed.placement import engine_kwargs

    def build():
        c = _ppo_setup(cfg, stage)
        p = c.p
        engines = engine_kwargs(p.rollout, p.actor, p.actor_strategy.precision, c.device, p.train.seed, p.data.max_len)
        return {
            "prompts": [e["prompt_ids"] for e in c.prompts],
            "eval_prompts": c.held_out.prompt_ids,
            "steps": c.steps,
            "actor_ppo_steps": c.actor_ppo_steps,
            "stats": c.rewards.stats,
            "gold": getattr(c.held_out.gold, "__name__", None),
            "kl_coef": c.kl_ctl.value,
            "device": c.device,
            "vocab": len(c.tokenizer),
            "engine_kwargs": engines,
            "paths": c.paths,
        }

    return outcome(build)


def fixed_experience(pad_id: int, eos_id: int):
    """Two hand-made rollouts (one closed by EOS, one cut without it) with fixed log-probs, values and scores."""
    from rlhf_core.algos.batching import ensure_eos, make_sequences
    from rlhf_core.algos.experience import Experience

    prompts, responses = [[1, 5, 6], [1, 7]], [[8, 9, eos_id], [10, 11, 12]]
    seq = make_sequences(prompts, responses, pad_id)
    _, truncated = ensure_eos(responses, eos_id)
    shape = seq.action_mask.shape
    gen = torch.Generator().manual_seed(0)
    return Experience.from_sequences(
        seq,
        old_logprobs=-torch.rand(shape, generator=gen),
        ref_logprobs=-torch.rand(shape, generator=gen),
        values=torch.rand(shape, generator=gen),
        scores=torch.tensor([2.0, 3.0]),
        truncated=truncated,
    )


def advantage_phase(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController.advantages on a fixed Experience (scores -> EOS penalty, clip -> KL penalty -> GAE), then one
    KL-controller update."""
    from rlhf_core.rewards import Scored

    def run():
        c = _ppo_setup(cfg, stage)
        exp, logs = c.advantages(Scored(fixed_experience(c.pad_id, c.eos_id), {}))
        c.kl_ctl.update(0.5, 64)
        return {
            "advantages": exp.advantages.tolist(),
            "returns": exp.returns.tolist(),
            "reward": round(logs["reward"], 6),
            "kl_after_update": c.kl_ctl.value,
        }

    return outcome(run)


# The reward sources and the critic-free estimators, fast: PPOController.experience on fixed responses with its role
# groups answering fixed numbers (FixedRole), then .advantages; the remote reward servers are real loopback servers.

FIXED_RESPONSES = ("a lovely happy day", "a sad day", "the calm lake", "the calm river")  # 2 prompts x 2 samples
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


REWARD_SERVERS: dict[str, Any] = {}  # url -> the loopback reward server (tests/reward_server.py) answering there
SERVER_OPTIONS = {"reward_url": {}, "failing_url": {"fail_status": 503}, "slow_url": {"delay_s": 0.4}}


@contextlib.contextmanager
def reward_servers():
    """Within: a loopback reward server for each of ``SERVER_OPTIONS`` (gold scores; always HTTP 503; 0.4 s before
    each answer), their URLs by name; each records the time of each request it gets (``times``)."""
    from tests.reward_server import RewardHandler, RewardServer, ServerState

    class TimedHandler(RewardHandler):
        def do_POST(self) -> None:
            self.server.times.append(time.monotonic())
            super().do_POST()

    urls = {}
    with contextlib.ExitStack() as stack:
        for name, options in SERVER_OPTIONS.items():
            server = RewardServer(0, ServerState(**options))
            server.RequestHandlerClass, server.times = TimedHandler, []
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            stack.callback(thread.join, 5)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            urls[name] = server.url
            REWARD_SERVERS[server.url] = server
        try:
            yield urls
        finally:
            for url in urls.values():
                REWARD_SERVERS.pop(url, None)


def _r(values: Any) -> list[float]:
    return [round(float(v), 5) for v in values]


def experience_phase(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController(...) (its reward sources checked), .experience on FIXED_RESPONSES with the roles answering fixed
    numbers (FixedRole), then .advantages: each source's scores, their weighted sum, advantages, returns, the action
    tokens left per sample, the logs; with a loopback server at remote_rm_url, the requests it got (rows of each, and
    whether a pause of >= 0.5 s came between two)."""
    server = REWARD_SERVERS.get(cfg.stage(stage).remote_rm_url or "")
    seen = (len(server.times), len(server.state.batches)) if server is not None else None

    def run():
        c = _ppo_setup(cfg, stage)
        assert c.p.rollout.n_samples_per_prompt == 2, "FIXED_RESPONSES are two samples of two prompts"
        c.actor = FixedRole("actor")
        c.critic = FixedRole("critic") if c.roles.critic else None
        c.reward = FixedRole("reward") if c.roles.reward_model else None
        c.reference = FixedRole("reference") if c.roles.reference else None
        responses = [c.tokenizer.encode(t, add_special_tokens=False) + [c.eos_id] for t in FIXED_RESPONSES]
        prompts = c.prompts[:2]
        scored = c.experience([e["prompt_ids"] for e in prompts], responses, [e["prompt"] for e in prompts])
        exp, logs = c.advantages(scored)
        return {
            "prompts": [e["prompt"] for e in prompts for _ in range(2)],
            "texts": [c.tokenizer.decode(r, skip_special_tokens=True) for r in responses],
            "parts": {k: _r(v) for k, v in scored.parts.items()},
            "scores": _r(scored.exp.scores),
            "advantages": _rounded(exp.advantages),
            "returns": _rounded(exp.returns),
            "action_tokens": exp.action_mask.sum(1).tolist(),
            "logs": {k: round(v, 5) for k, v in logs.items()},
        }

    out: dict[str, Any] = {"result": outcome(run)}
    if server is not None:
        times = server.times[seen[0] :]
        out |= {
            "requests": len(times),
            "rows": server.state.batches[seen[1] :],
            "backed_off": any(b - a >= 0.5 for a, b in zip(times, times[1:])),
        }
    return out


def _result(*path: str) -> Callable[[Any], Any]:
    """A part of experience_phase's result (None when the controller raised)."""

    def get(observed: dict) -> Any:
        out = observed["result"]
        if isinstance(out, tuple):
            return None
        for part in path:
            out = out[part]
        return out

    return get


def _gold(observed: dict) -> list[float]:
    from tests.reward_server import gold_scores

    out = observed["result"]
    return _r(gold_scores(out["prompts"], out["texts"]))


def ppo_plan(cfg: PipelineConfig, stage: str) -> Any:
    """jobs.ppo.optimizer_steps and placement's resource_demand / check_fits for the stage (what start() asks of
    Ray)."""
    from rlhf_core.distributed import placement
    from rlhf_core.jobs import ppo

    p = cfg.stage(stage)
    roles = placement.RoleSet.of(p)
    return {
        "optimizer_steps": ppo.optimizer_steps(p, 10),
        "cpu": placement.resource_demand(p, roles, "cpu"),
        "cuda": placement.resource_demand(p, roles, "cuda"),
        "fits_cpu": outcome(lambda: placement.check_fits(stage, p, roles, "cpu", {"CPU": 64})),
        "fits_cuda": outcome(lambda: placement.check_fits(stage, p, roles, "cuda", {"CPU": 64, "GPU": 64})),
        "weight_sync": {d: outcome(lambda d=d: placement.weight_sync_backend(stage, p, d)) for d in ("cpu", "cuda")},
    }


def role_ds_config(role: str):
    def observe(cfg: PipelineConfig, stage: str) -> dict:
        p = cfg.stage(stage)
        t = p.train
        batch = TrainConfig(train_batch_size=t.train_batch_size, micro_train_batch_size=t.micro_train_batch_size)
        return DeepSpeedStrategy(getattr(p, f"{role}_strategy"), getattr(p, f"{role}_optim"), batch).ds_config()

    observe.__name__ = f"{role}_ds_config"
    observe.__doc__ = f"DeepSpeedStrategy of the {role} role (strategy, optim, PPO batch).ds_config()."
    return observe


def role_lr_curve(role: str):
    def observe(cfg: PipelineConfig, stage: str) -> list[float]:
        fn = lr_lambda(getattr(cfg.stage(stage), f"{role}_optim"), 20)
        return [round(fn(step), 9) for step in range(20)]

    observe.__name__ = f"{role}_lr_curve"
    observe.__doc__ = f"strategy.lr_lambda of the {role} optimizer over 20 steps."
    return observe


def first_prompts(cfg: PipelineConfig, stage: str) -> list[int]:
    """Prompt indices of PPO step 0 (sampler.global_batch with the train seed, as fit() reads them)."""
    c = _ppo_setup(cfg, stage)
    return global_batch(len(c.prompts), c.p.train.rollout_batch_size, 0, c.p.train.seed)


# ---------------------------------------------------------------------------------------------------------------------
# The PPO roles in this process: PPOController.start() / ppo.run with Ray's transport swapped for in-process calls


class LocalGroup:
    """launcher.RayWorkerGroup's calls on one rank in this process: the hosted object is built from the arguments
    the controller gave the group (checked as the real group checks them); ``cfg`` is the strategy it was given."""

    def __init__(self, cfg: StrategyConfig, factory: type, *args, name="worker", placement=None, share=1.0, **kwargs):
        launcher.check_constructor(factory, args, kwargs)
        self.cfg, self.cls = cfg, factory
        self.obj = factory(*args, **kwargs)

    def __len__(self) -> int:
        return 1

    def call(self, method, *args, **kwargs) -> list:
        launcher.check_call(self.cls, method, args, kwargs)
        return [method(self.obj, *args, **kwargs)]

    call_async = call

    def call_each(self, method, shards, *args, **kwargs) -> list:
        (shard,) = shards
        return self.call(method, shard, *args, **kwargs)

    call_each_async = call_each

    def shutdown(self) -> None:
        self.obj = None


class LocalEngines(EngineHandles):
    """Rollout engines in this process behind ``EngineHandles``: each call runs at once and its result goes through
    Ray's object store (ObjectRef arguments resolved as Ray does), the way EngineGroup and sync_weights call an
    engine actor."""

    def _submit(self, actor: Any, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        import ray

        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        return ray.put(method(actor, *args, **kwargs))

    def kill(self) -> None:  # nothing to kill: the engines are objects of this process
        self.actors = []


class LocalEngineGroup(EngineGroup):
    @classmethod
    def create(
        cls,
        count: int,
        model_path: str,
        *,
        eos_token_id: int,
        backend: str = "vllm",
        tensor_parallel_size: int = 1,
        num_cpus_per_engine: float = 1,
        env_vars=None,
        placement=None,
        share: float = 1.0,
        resources=None,
        **kwargs,
    ) -> EngineGroup:
        """EngineGroup.create for the HF backend, each engine in this process."""
        assert backend == "hf" and tensor_parallel_size == 1, "in-process engines: the HF backend only"
        engines = [HFGenerateEngine(model_path, **kwargs) for _ in range(count)]
        return cls(LocalEngines(HFGenerateEngine, engines), eos_token_id)


@contextlib.contextmanager
def in_process_roles():
    """Within: the controller's worker groups and rollout engines live in this process (one rank each, the one-rank
    DeepSpeed world); results travel through Ray's object store only where the controller calls Ray itself."""
    one_rank_world()
    swaps = [
        (launcher, "RayWorkerGroup", LocalGroup),
        (launcher, "wait", list),
        (rollout_group, "EngineGroup", LocalEngineGroup),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, value in swaps:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _rounded(t: torch.Tensor | None) -> list | None:
    return None if t is None else [[round(v, 5) for v in row] for row in t.tolist()]


def _trained_role(role: Any) -> dict:
    """The model and the optimizer's set-up; a role that never trains (the critic warm-up's actor) has no optimizer
    (ZeRO-3: DeepSpeed's parameter-gathering inference wrapper in its place)."""
    engine = role.engine
    if not role.ctx.trains:
        optimizer = engine.optimizer
        return {**fingerprint(engine.module), "optimizer": type(optimizer).__name__ if optimizer else None}
    return {**fingerprint(engine.module), **engine_state(engine.module, engine)}


def _role_report(c) -> dict:
    """After start(): what each role built, then the phases on fixed sequences: experience (with the forward
    micro-batch sizes of each role), the held-out evaluation, one train() on that experience (its old log-probs and
    values shifted, so that the clips act; the engines' log-probs taken as the unshifted ones, 0.5 above the old
    ones, for the truncated importance weights)."""
    tokenizer_len = len(c.tokenizer)
    gen = torch.Generator().manual_seed(0)
    prompts = [e["prompt_ids"] for e in c.prompts[:8]]
    texts = [e["prompt"] for e in c.prompts[:8]]
    responses = [
        torch.randint(5, tokenizer_len, (2 + i % 5,), generator=gen).tolist() + [c.eos_id] * (i % 2) for i in range(16)
    ]
    roles = {"actor": c.actor.obj.engine.module, "critic": c.critic.obj.engine.module, "reward": c.reward.obj.model}
    if c.reference is not None:
        roles["reference"] = c.reference.obj.model
    out: dict[str, Any] = {
        "actor": _trained_role(c.actor.obj),
        "critic": _trained_role(c.critic.obj),
        "reward": fingerprint(c.reward.obj.model),
        "reference": fingerprint(c.reference.obj.model) if c.reference is not None else None,
        "engine": fingerprint(c.engines.handles.actors[0].model),
        "groups": {"actor": c.actor.cfg, "critic": c.critic.cfg},
        "devices": {"actor": resolve_device(c.actor.cfg.device), "critic": resolve_device(c.critic.cfg.device)},
        "micro_batches": {role: [] for role in roles},
    }

    calls = out["micro_batches"]
    hooks = [m.register_forward_pre_hook(forward_record(calls[r]), with_kwargs=True) for r, m in roles.items()]
    try:
        scored = c.experience(prompts, responses, texts)
    finally:
        for h in hooks:
            h.remove()
    exp = scored.exp
    out["logprobs"] = {"old": _rounded(exp.old_logprobs), "ref": _rounded(exp.ref_logprobs)}
    out["evaluate"] = {k: round(v, 6) for k, v in c.evaluate().items()}
    mask = exp.action_mask
    shifted = dataclasses.replace(exp, old_logprobs=exp.old_logprobs - 0.5 * mask, values=exp.values + 0.5 * mask)
    engine = torch.where(mask.bool(), exp.old_logprobs, torch.full_like(exp.old_logprobs, float("nan")))
    shifted, _ = c.advantages(dataclasses.replace(scored, exp=shifted), engine)
    # Forwards of each trained role's first decoder layer in train(): twice as many when backward recomputes them.
    out["layer_forwards_in_train"] = calls = {"actor": 0, "critic": 0}
    layers = {r: next(m for m in roles[r].modules() if type(m).__name__.endswith("DecoderLayer")) for r in calls}
    # a pre-hook: a recomputation stops early (torch.utils.checkpoint), before a forward hook would run
    hooks = [layers[r].register_forward_pre_hook(lambda *_, r=r: calls.__setitem__(r, calls[r] + 1)) for r in calls]
    try:
        # step 0 of fit(): the actor trains unless the stage never trains it (freeze_actor_steps = 0 here)
        stats = c.train(shifted, 0, actor_frozen=not c.train_actor)
    finally:
        for h in hooks:
            h.remove()
    out["train"] = {k: round(v, 6) for k, v in stats.items()}
    return out


_REPORTS: dict[str, Any] = {}


def ppo_roles(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController.start() in-process, then ``_role_report`` (once per distinct config)."""
    key = content_key(cfg, stage)
    if key not in _REPORTS:

        def run():
            with in_process_roles():
                c = _ppo_setup(cfg, stage)
                try:
                    c.start()
                    return _role_report(c)
                finally:
                    c.shutdown()

        _REPORTS[key] = outcome(run)
    return _REPORTS[key]


def actor_sync_plan(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController.start() in-process, then the buckets the actor's weight push sends (and, under ZeRO-3, gathers):
    the number of tensors in each bucket of its parameters' plan."""
    from rlhf_core.distributed.weight_sync.buckets import bucket_plan

    def run():
        with in_process_roles():
            c = _ppo_setup(cfg, stage)
            try:
                c.start()
                actor = c.actor.obj
                return [len(b) for b in bucket_plan(actor._param_specs(), actor.bucket_bytes)]
            finally:
                c.shutdown()

    return outcome(run)


def frozen_engines(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController.start() in-process, then how the reward and reference models were built: the DeepSpeed inference
    config of a partitioned one (frozen_zero_stage 3), else None. Nothing runs after start(): in one process, a ZeRO-3
    role's DeepSpeed state would reach the other roles' models (in a run each role is its own Ray worker)."""

    def run():
        with in_process_roles():
            c = _ppo_setup(cfg, stage)
            try:
                c.start()
                groups = (("reward", c.reward), ("reference", c.reference))
                return {role: getattr(g.obj.strategy, "engine_config", None) for role, g in groups if g is not None}
            finally:
                c.shutdown()

    return outcome(run)


def report_part(*path: str, doc: str):
    """An observer of one part of ``ppo_roles`` (the whole report when start() raised)."""

    def observe(cfg: PipelineConfig, stage: str) -> Any:
        out = ppo_roles(cfg, stage)
        if isinstance(out, tuple):  # ("raised", ...)
            return out
        for part in path:
            out = out[part]
        return out

    observe.__name__ = "ppo_roles:" + ".".join(path)
    observe.__doc__ = doc
    return observe


def role_model(role: str):
    return report_part(
        role,
        doc=f"What the {role} role built in start() (model class, attention, vocabulary, weights"
        f"{', optimizer, recomputation' if role in ('actor', 'critic') else ''}).",
    )


def role_workers(role: str):
    def observe(cfg: PipelineConfig, stage: str) -> Any:
        return group_report(ppo_roles(cfg, stage)["groups"][role])

    observe.__name__ = f"{role}_workers"
    observe.__doc__ = f"A real Ray group started with the strategy start() gave the {role} group: what each rank got."
    return observe


def recomputation(role: str):
    return report_part(
        "layer_forwards_in_train",
        role,
        doc=f"Forwards of the {role}'s first decoder layer in PPOController.train() (backward recomputes them).",
    )


micro_batches = report_part(
    "micro_batches", doc="(rows, packed) of each forward of each role in the experience phase."
)
sampling = report_part("evaluate", doc="PPOController.evaluate(): the engines sample the held-out prompts.")
train_phase = report_part("train", doc="PPOController.train() on a fixed experience: the actor's and critic's fit.")


def rollout_distribution(cfg: PipelineConfig, stage: str) -> Any:
    """The distribution of the rollout: the actor's and reference's log-probs of fixed sequences (experience phase)
    and the engines' samples (evaluate)."""
    out = ppo_roles(cfg, stage)
    return {"logprobs": out["logprobs"], "evaluate": out["evaluate"]}


PACKING_FOLLOWERS = {"actor": ("actor", "reward", "reference"), "critic": ("critic",)}


def packing_turned_off(roles: tuple[str, ...]) -> Callable[[Any, Any], bool]:
    """Expectation on ``micro_batches``: every forward of ``roles`` packed before and none after; the other roles'
    forwards unchanged."""

    def expect(a: dict, b: dict) -> bool:
        for role in a:
            if role in roles:
                if not (all(p for _, p in a[role]) and not any(p for _, p in b[role])):
                    return False
            elif a[role] != b[role]:
                return False
        return True

    return expect


PPO_BASE = (
    "{stage}.actor.name_or_path=builtin:tiny",
    "{stage}.critic.name_or_path={rm_seed0}",
    "{stage}.reward.name_or_path={rm_seed0}",
    "{stage}.train.eval_prompts=8",
    "{stage}.data.max_samples=32",
    "{stage}.train.max_steps=null",
)  # 32 prompts / 16 per step = 2 PPO steps
PROMPT_ROWS = f"{DATA / 'prompts.jsonl'}"
PROMPT_SPLITS = f"{DATA / 'prompts_splits'}"
# The real job runs (roles in-process): 24 prompts / 8 per step = 3 PPO steps, checkpoints after steps 1 and 2.
PPO_RUN_BASE = (
    "{stage}.data.max_samples=24",
    "{stage}.train.rollout_batch_size=8",
    "{stage}.train.eval_prompts=0",
    "{stage}.rollout.max_new_tokens=8",
    "{stage}.train.save_steps=1",
    "{stage}.train.keep_last=3",
    "{stage}.train.log_steps=1",
)
PPO_RUN_CHANGE = ("{stage}.train.save_steps=2", "{stage}.train.log_steps=2")
# Models whose init_seed / tokenizer act (built from config: builtin:), and models with custom code.
BUILTIN_BASES = {
    "actor": (),
    "critic": ("{stage}.critic.name_or_path=builtin:tiny",),
    "reward": ("{stage}.reward.name_or_path=builtin:tiny", "{stage}.algo.normalize_reward=false"),
    "reference": ("{stage}.reference.name_or_path=builtin:tiny",),
}
REMOTE_BASES = {
    "actor": "{remote_code_model}",
    "critic": "{remote_code_rm}",
    "reward": "{remote_code_rm}",
    "reference": "{remote_code_model}",
}


def _raised_then(cls_prefix: str) -> Callable[[Any, Any], bool]:
    return lambda a, b: a[0] == "raised" and b["class"].startswith(cls_prefix)


def _advantages_are_returns(observed: dict) -> bool:
    return _result("advantages")(observed) == _result("returns")(observed)


def _shifted_by(a: dict, b: dict, weight: float, source: str) -> bool:
    """b's summed scores are a's with ``source`` weighed by ``weight`` instead of 1 (its own part unchanged)."""
    parts, before, after = _result("parts")(a), _result("scores")(a), _result("scores")(b)
    expected = [s + (weight - 1.0) * x for s, x in zip(before, parts[source])]
    return parts == _result("parts")(b) and all(_close(x, y) for x, y in zip(after, expected))


# Rewards by a function (no reward model): the response's length (score and the PPO kinds)
BY_LENGTH = ("{stage}.reward=null", "{stage}.reward_fn=tests/data/config_keys/reward_fn.py:response_length")
# The server that answers HTTP 503 to every request, tried three times without pauses
FAILING_SERVER = (
    "{stage}.remote_rm_url={failing_url}",
    "{stage}.remote_rm.retries=2",
    "{stage}.remote_rm.backoff_s=0",
)
# The KL term in the actor's loss, to a reference other than the actor's starting model (else it is 0 at step 0)
KL_LOSS = ("{stage}.algo.kl_mode=loss", "{stage}.reference.name_or_path=builtin:tiny", "{stage}.reference.init_seed=1")

# The estimators, the actor-loss options and the reward sources (the kinds' StageKind.unused filters them): fast on
# experience_phase / advantage_phase, slow where they act in PolicyActor.fit (train_phase on the in-process roles).
RL_PROBES: dict[str, Probe] = {
    "algo.advantage_estimator": probe(  # critic-free: the advantage is the return of the group-normalised score
        "{stage}.algo.advantage_estimator=grpo",
        "{stage}.critic=null",
        observe=experience_phase,
        expect=lambda a, b: not _advantages_are_returns(a) and _advantages_are_returns(b),
    ),
    "algo.dynamic_filter": probe(  # the second prompt's samples score alike (RM_RAW): dropped
        "{stage}.algo.dynamic_filter=true",
        observe=experience_phase,
        expect=lambda a, b: (
            "filtered_frac" not in _result("logs")(a)
            and _result("logs")(b)["filtered_frac"] == 0.5
            and _result("action_tokens")(b)[2:] == [0, 0]
            and _result("action_tokens")(a)[2:] != [0, 0]
        ),
    ),
    "algo.kl_mode": probe("{stage}.algo.kl_mode=loss", observe=advantage_phase),  # no KL penalty in the rewards
    "algo.kl_loss_unbiased": probe(  # the KL term weighed by pi / pi_old (the old log-probs are 0.5 below)
        "{stage}.algo.kl_loss_unbiased=true",
        observe=train_phase,
        base=KL_LOSS,
        slow=True,
        expect=lambda a, b: a["kl_loss"] != b["kl_loss"],
    ),
    "algo.eps_clip_high": probe(  # the ratio starts at e^0.5 = 1.65: clipped at 1.2, not at 1.8
        "{stage}.algo.eps_clip_high=0.8",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: b["clip_frac"] < a["clip_frac"],
    ),
    "algo.dual_clip": probe(
        "{stage}.algo.dual_clip=1.1",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: a["dual_clip_frac"] == 0 < b["dual_clip_frac"],
    ),
    "algo.loss_agg": probe(  # responses of 2 to 7 tokens: each sequence weighs the same instead of each token
        "{stage}.algo.loss_agg=seq_mean",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: a["policy_loss"] != b["policy_loss"],
    ),
    "algo.entropy_coef": probe(
        "{stage}.algo.entropy_coef=0.01",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: "entropy" not in a and b["entropy"] > 0,
    ),
    "algo.is_correction_cap": probe(  # the engines' log-probs are 0.5 above the old ones: weights e^-0.5
        "{stage}.algo.is_correction_cap=2.0",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: a["policy_loss"] != b["policy_loss"],
    ),
    "reward_fn": probe(  # instead of the reward model: the response's length
        *BY_LENGTH,
        observe=experience_phase,
        expect=lambda a, b: (
            _result("parts")(b) == {"reward_fn": [float(len(t)) for t in _result("texts")(b)]}
            and "reward_fn_score" in _result("logs")(b)
            and "rm_score" not in _result("logs")(b)
        ),
    ),
    "remote_rm_url": probe(  # the server's gold scores added; its requests: the check, then the batch
        "{stage}.remote_rm_url={reward_url}",
        observe=experience_phase,
        expect=lambda a, b: _result("parts", "remote_rm_url")(b) == _gold(b) and b["rows"] == [1, 4],
    ),
    "remote_rm.batch_size": probe(
        "{stage}.remote_rm.batch_size=1",
        observe=experience_phase,
        base=("{stage}.remote_rm_url={reward_url}",),
        expect=lambda a, b: (a["rows"], b["rows"]) == ([1, 4], [1, 1, 1, 1, 1]) and a["result"] == b["result"],
    ),
    "remote_rm.retries": probe(  # HTTP 503 to every request: tried once, then three times
        "{stage}.remote_rm.retries=2",
        observe=experience_phase,
        base=(*FAILING_SERVER, "{stage}.remote_rm.retries=0"),
        expect=lambda a, b: (
            (a["requests"], b["requests"]) == (1, 3) and a["result"] == b["result"] == ("raised", "RemoteRewardError")
        ),
    ),
    "remote_rm.backoff_s": probe(  # the third try after 2 x 0.5 s
        "{stage}.remote_rm.backoff_s=0.5",
        observe=experience_phase,
        base=FAILING_SERVER,
        expect=lambda a, b: (
            (a["requests"], b["requests"]) == (3, 3) and (a["backed_off"], b["backed_off"]) == (False, True)
        ),
    ),
    "remote_rm.timeout_s": probe(  # the server answers after 0.4 s
        "{stage}.remote_rm.timeout_s=0.1",
        observe=experience_phase,
        base=("{stage}.remote_rm_url={slow_url}", "{stage}.remote_rm.retries=0"),
        expect=lambda a, b: isinstance(a["result"], dict) and b["result"] == ("raised", "RemoteRewardError"),
    ),
    "reward_weights": probe(  # reward model + length; the length at half weight
        "{stage}.reward_weights={{reward_fn: 0.5}}",
        observe=experience_phase,
        base=(BY_LENGTH[1],),
        expect=lambda a, b: _shifted_by(a, b, 0.5, "reward_fn"),
    ),
}


def _ppo_section(kind: str) -> dict[str, Probe]:
    trains_actor = kind == "ppo"  # critic_warmup: the actor never trains (no actor_optim, save_critic, freezing)
    on_splits = (
        f"{{stage}}.data.train_path={PROMPT_SPLITS}",
        f"{{stage}}.data.eval_path={PROMPT_SPLITS}",
        "{stage}.train.rollout_batch_size=4",
        "{stage}.train.train_batch_size=8",
        "{stage}.train.micro_train_batch_size=8",
        "{stage}.train.micro_rollout_batch_size=8",
    )
    out: dict[str, Probe] = {
        "data.train_path": probe(
            f"{{stage}}.data.train_path={PROMPT_SPLITS}/train.jsonl", observe=ppo_controller, base=on_splits[1:]
        ),
        "data.eval_path": probe(f"{{stage}}.data.eval_path={PROMPT_ROWS}", observe=ppo_controller),
        "data.train_split": probe("{stage}.data.train_split=dev", observe=ppo_controller, base=on_splits),
        "data.eval_split": probe("{stage}.data.eval_split=dev", observe=ppo_controller, base=on_splits),
        "data.max_len": probe("{stage}.data.max_len=12", observe=ppo_controller),
        "data.max_samples": probe("{stage}.data.max_samples=16", observe=ppo_controller),
        "data.input_template": probe("{stage}.data.input_template='Q: {{}} A:'", observe=ppo_controller),
        "data.apply_chat_template": probe("{stage}.data.apply_chat_template=false", observe=ppo_controller),
        "data.input_key": probe("{stage}.data.input_key=question", observe=ppo_controller, base=on_splits),
    }
    for role in ("actor", "critic", "reward", "reference"):
        path = "builtin:small" if role == "actor" else "{rm_seed1}"
        out[f"{role}.name_or_path"] = probe(f"{{stage}}.{role}.name_or_path={path}", observe=ppo_controller)
        out[f"{role}.tokenizer"] = probe(
            f"{{stage}}.{role}.tokenizer={{alt_tokenizer}}",
            observe=ppo_controller if role == "actor" else role_model(role),
            base=BUILTIN_BASES[role],
            slow=role != "actor",
            expect=None if role == "actor" else lambda a, b: b["vocab"] == a["vocab"] + 1,
        )
        out[f"{role}.init_seed"] = probe(
            f"{{stage}}.{role}.init_seed=1",
            observe=role_model(role),
            base=BUILTIN_BASES[role],
            slow=True,
            expect=lambda a, b: a["checksum"] != b["checksum"],
        )
        out[f"{role}.trust_remote_code"] = probe(
            f"{{stage}}.{role}.trust_remote_code=true",
            observe=role_model(role),
            base=(f"{{stage}}.{role}.name_or_path={REMOTE_BASES[role]}",),
            slow=True,
            expect=_raised_then("Probe"),
        )
    out["reference.name_or_path"] = probe("{stage}.reference.name_or_path=builtin:small", observe=ppo_controller)
    for role in ("actor", "critic"):
        ds = role_ds_config(role)
        s = f"{{stage}}.{role}_strategy"
        out |= {
            f"{role}_strategy.num_workers": probe(
                f"{s}.num_workers=2", "{stage}.train.micro_train_batch_size=8", observe=ppo_plan
            ),
            f"{role}_strategy.zero_stage": probe(f"{s}.zero_stage=3", observe=ds),
            f"{role}_strategy.offload_optimizer": probe(f"{s}.offload_optimizer=true", observe=ds),
            f"{role}_strategy.precision": probe(f"{s}.precision=bf16", observe=ds),
            f"{role}_strategy.gradient_checkpointing": probe(
                f"{s}.gradient_checkpointing=true",
                observe=recomputation(role),
                slow=True,
                expect=lambda a, b: a > 0 and b == 2 * a,
            ),
            f"{role}_strategy.attn_implementation": probe(
                f"{s}.attn_implementation=eager",
                observe=role_model(role),
                slow=True,
                expect=lambda a, b: (a["attn"], b["attn"]) == ("sdpa", "eager"),
            ),
            f"{role}_strategy.cpus_per_worker": probe(f"{s}.cpus_per_worker=2.0", observe=ppo_plan),
            # the actor's flag also sets the frozen reward and reference models' packing
            f"{role}_strategy.packing": probe(
                f"{s}.packing=false",
                observe=micro_batches,
                slow=True,
                expect=packing_turned_off(PACKING_FOLLOWERS[role]),
            ),
            f"{role}_strategy.resources": probe(
                f"{s}.resources={{{{node_a: 1}}}}", observe=ppo_plan, expect=lambda a, b: b["cpu"]["node_a"] == 1
            ),
            f"{role}_strategy.threads_per_worker": probe(
                f"{s}.threads_per_worker=2",
                observe=role_workers(role),
                slow=True,
                expect=lambda a, b: b[0]["torch_threads"] == 2,
            ),
        }
        if role == "actor":  # the controller's device (resources, engines), also what the actor group gets
            out[f"{role}_strategy.device"] = probe(f"{s}.device=cuda", observe=ppo_controller)
        else:
            device = report_part("devices", role, doc=f"The device start() gave the {role} group's ranks.")
            out[f"{role}_strategy.device"] = probe(
                f"{s}.device=cuda", observe=device, slow=True, expect=lambda a, b: (a, b) == ("cpu", "cuda")
            )
        if role == "actor" and not trains_actor:
            continue
        o = f"{{stage}}.{role}_optim"
        curve = role_lr_curve(role)
        out |= {
            f"{role}_optim.lr": probe(
                f"{o}.lr=0.25", observe=role_model(role), slow=True, expect=lambda a, b: b["lr"] == 0.25
            ),
            f"{role}_optim.weight_decay": probe(
                f"{o}.weight_decay=0.1",
                observe=role_model(role),
                slow=True,
                expect=lambda a, b: b["weight_decay"] == 0.1,
            ),
            f"{role}_optim.adam_betas": probe(
                f"{o}.adam_betas=[0.8,0.9]",
                observe=role_model(role),
                slow=True,
                expect=lambda a, b: b["betas"] == [0.8, 0.9],
            ),
            f"{role}_optim.lr_scheduler": probe(f"{o}.lr_scheduler=cosine_with_min_lr", observe=curve),
            f"{role}_optim.lr_warmup_ratio": probe(f"{o}.lr_warmup_ratio=0.5", observe=curve),
            f"{role}_optim.min_lr_ratio": probe(
                f"{o}.min_lr_ratio=0.5",
                f"{o}.lr_scheduler=cosine_with_min_lr",
                observe=curve,
                base=(f"{o}.lr_scheduler=cosine_with_min_lr",),
            ),
            f"{role}_optim.max_norm": probe(f"{o}.max_norm=0.5", observe=ds),
        }
    out |= {
        "reward_workers": probe("{stage}.reward_workers=2", observe=ppo_plan),
        "reference_workers": probe("{stage}.reference_workers=2", observe=ppo_plan),
        "frozen_cpus_per_worker": probe("{stage}.frozen_cpus_per_worker=1.0", observe=ppo_plan),
        "frozen_zero_stage": probe(
            "{stage}.frozen_zero_stage=3",
            observe=frozen_engines,
            slow=True,
            expect=lambda a, b: a["reward"] is None and b["reward"]["zero_optimization"]["stage"] == 3,
        ),
        "frozen_offload": probe(
            "{stage}.frozen_offload=true",
            observe=frozen_engines,
            base=("{stage}.frozen_zero_stage=3",),
            slow=True,
            expect=lambda a, b: (
                "offload_param" not in a["reward"]["zero_optimization"]
                and b["reward"]["zero_optimization"]["offload_param"]["device"] == "cpu"
            ),
        ),
        "reward_resources": probe(
            "{stage}.reward_resources={{node_b: 1}}", observe=ppo_plan, expect=lambda a, b: b["cpu"]["node_b"] == 1
        ),
        "reference_resources": probe(
            "{stage}.reference_resources={{node_b: 1}}", observe=ppo_plan, expect=lambda a, b: b["cpu"]["node_b"] == 1
        ),
        "offload_states_during_rollout": probe(  # DeepSpeed offloads optimizer states of ZeRO 1-3 only
            "{stage}.offload_states_during_rollout=true",
            observe=ppo_plan,
            base=("{stage}.critic_strategy.zero_stage=0",),
            expect=lambda a, b: a["fits_cpu"] is None and b["fits_cpu"] == ("raised", "ConfigError"),
        ),
        "colocate_actor_ref": probe("{stage}.colocate_actor_ref=true", observe=ppo_plan),
        "colocate_critic_reward": probe("{stage}.colocate_critic_reward=true", observe=ppo_plan),
        "colocate_all": probe("{stage}.colocate_all=true", observe=ppo_plan),
        "rollout.backend": probe("{stage}.rollout.backend=vllm", observe=ppo_controller),
        "rollout.num_engines": probe("{stage}.rollout.num_engines=2", observe=ppo_plan),
        "rollout.tensor_parallel_size": probe(
            "{stage}.rollout.tensor_parallel_size=2", observe=ppo_plan, base=("{stage}.rollout.backend=vllm",)
        ),
        "rollout.cpus_per_engine": probe("{stage}.rollout.cpus_per_engine=2.0", observe=ppo_plan),
        "rollout.weight_sync_backend": probe(
            "{stage}.rollout.weight_sync_backend=gloo",
            observe=ppo_plan,
            expect=lambda a, b: (
                (a["weight_sync"], b["weight_sync"])
                == ({"cpu": "gloo", "cuda": "nccl"}, {"cpu": "gloo", "cuda": "gloo"})
            ),
        ),
        "rollout.weight_sync_bucket_mb": probe(  # builtin:small is 4.3 MiB of fp32 weights
            "{stage}.rollout.weight_sync_bucket_mb=1",
            observe=actor_sync_plan,
            base=("{stage}.actor.name_or_path=builtin:small",),
            slow=True,
            expect=lambda a, b: len(a) == 1 and len(b) == 5,
        ),
        "rollout.resources": probe(
            "{stage}.rollout.resources={{node_a: 1}}", observe=ppo_plan, expect=lambda a, b: b["cpu"]["node_a"] == 1
        ),
        "rollout.gpu_memory_utilization": probe(
            "{stage}.rollout.gpu_memory_utilization=0.4",
            observe=ppo_controller,
            base=("{stage}.rollout.backend=vllm",),
            expect=lambda a, b: b["engine_kwargs"]["gpu_memory_utilization"] == 0.4,
        ),
        "rollout.enforce_eager": probe(  # null: eager on the CPU build; false: CUDA graphs wherever vLLM has them
            "{stage}.rollout.enforce_eager=false",
            observe=ppo_controller,
            base=("{stage}.rollout.backend=vllm",),
            expect=lambda a, b: (
                (a["engine_kwargs"]["enforce_eager"], b["engine_kwargs"]["enforce_eager"]) == (True, False)
            ),
        ),
        "rollout.enable_sleep": probe(  # vLLM's sleep mode needs CUDA: refused on this CPU machine, before Ray
            "{stage}.rollout.enable_sleep=true",
            observe=ppo_plan,
            base=("{stage}.rollout.backend=vllm",),
            expect=lambda a, b: a["fits_cpu"] is None and b["fits_cpu"] == ("raised", "ConfigError"),
        ),
        "rollout.kv_cache_gib": probe(
            "{stage}.rollout.kv_cache_gib=2", observe=ppo_controller, base=("{stage}.rollout.backend=vllm",)
        ),
        "rollout.n_samples_per_prompt": probe("{stage}.rollout.n_samples_per_prompt=4", observe=ppo_plan),
        "rollout.temperature": probe(
            "{stage}.rollout.temperature=0.5",
            observe=rollout_distribution,
            slow=True,
            expect=lambda a, b: a["logprobs"] != b["logprobs"] and a["evaluate"] != b["evaluate"],
        ),
        "rollout.top_p": probe("{stage}.rollout.top_p=0.5", observe=sampling, slow=True),
        "rollout.max_new_tokens": probe(
            "{stage}.rollout.max_new_tokens=8", observe=ppo_controller, base=("{stage}.rollout.backend=vllm",)
        ),
        "algo.kl_coef": probe("{stage}.algo.kl_coef=0.5", observe=advantage_phase),
        "algo.kl_estimator": probe("{stage}.algo.kl_estimator=k3", observe=advantage_phase),
        "algo.kl_target": probe("{stage}.algo.kl_target=0.1", observe=advantage_phase),
        "algo.kl_horizon": probe(
            "{stage}.algo.kl_horizon=100", observe=advantage_phase, base=("{stage}.algo.kl_target=0.1",)
        ),
        "algo.gamma": probe("{stage}.algo.gamma=0.5", observe=advantage_phase),
        "algo.lam": probe("{stage}.algo.lam=0.5", observe=advantage_phase),
        "algo.eps_clip": probe("{stage}.algo.eps_clip=0.1", observe=train_phase, slow=True),
        "algo.value_clip": probe("{stage}.algo.value_clip=0.1", observe=train_phase, slow=True),
        "algo.normalize_reward": probe(  # the reward model's part of the rewards: raw instead of normalised
            "{stage}.algo.normalize_reward=false",
            observe=experience_phase,
            expect=lambda a, b: _result("scores")(b) == list(RM_RAW) != _result("scores")(a),
        ),
        "algo.reward_clip": probe("{stage}.algo.reward_clip=[-1.0,1.0]", observe=advantage_phase),
        "algo.missing_eos_penalty": probe("{stage}.algo.missing_eos_penalty=-1.0", observe=advantage_phase),
        "algo.whiten_advantages": probe("{stage}.algo.whiten_advantages=false", observe=train_phase, slow=True),
        "algo.ppo_epochs": probe("{stage}.algo.ppo_epochs=2", observe=ppo_plan),
        **RL_PROBES,
        "train.rollout_batch_size": probe("{stage}.train.rollout_batch_size=32", observe=ppo_controller),
        "train.train_batch_size": probe("{stage}.train.train_batch_size=8", observe=ppo_plan),
        "train.micro_train_batch_size": probe(
            "{stage}.train.micro_train_batch_size=4", observe=role_ds_config("actor")
        ),
        "train.micro_rollout_batch_size": probe(
            "{stage}.train.micro_rollout_batch_size=4",
            observe=micro_batches,
            slow=True,
            base=("{stage}.actor_strategy.packing=false", "{stage}.critic_strategy.packing=false"),
            expect=lambda a, b: all({n for n, _ in calls} == {4} for calls in b.values()),
        ),
        "train.num_episodes": probe("{stage}.train.num_episodes=2", observe=ppo_controller),
        "train.max_steps": probe("{stage}.train.max_steps=1", observe=ppo_controller),
        "train.seed": probe("{stage}.train.seed=7", observe=first_prompts),
        "train.save_steps": probe(
            *PPO_RUN_CHANGE,
            observe=checkpoint_steps,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == ([1, 2], [2]),
        ),
        "train.keep_last": probe(
            "{stage}.train.keep_last=1",
            observe=checkpoint_steps,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == ([1, 2], [2]),
        ),
        "train.log_steps": probe(
            *PPO_RUN_CHANGE,
            observe=logged_steps,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == ([1, 2, 3], [2, 3]),
        ),
        "train.eval_prompts": probe("{stage}.train.eval_prompts=4", observe=ppo_controller),
        "train.gold_reward": probe("{stage}.train.gold_reward=null", observe=ppo_controller),
    }
    if trains_actor:
        out["train.freeze_actor_steps"] = probe("{stage}.train.freeze_actor_steps=1", observe=ppo_controller)
        out["train.save_critic"] = probe(
            *PPO_RUN_CHANGE,
            "{stage}.train.save_critic=false",
            observe=critic_written,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == (True, False),
        )
        # the same run as save_steps / log_steps: one run for the three
        for key in ("train.save_steps", "train.log_steps"):
            out[key] = dataclasses.replace(out[key], change=out["train.save_critic"].change)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The jobs of the dpo, kto, generate and score kinds in this process, without Ray: their worker groups local, their
# rollout engines recorded


SESSION_CLUSTER = {"CPU": 8.0, "probe_node": 100.0}  # what the test session's Ray offers (tests/conftest.py)


class LocalShards(LocalGroup):
    """A job's frozen worker group (``launcher.RayWorkerGroup``: reference log-probs, reward scorers, generate's
    log-prob groups) in this process: its ``num_workers`` ranks share one hosted object and each shard of
    ``call_each`` runs on it. ``record``: what the job gave the group and the forwards of the hosted model."""

    def __init__(self, cfg: StrategyConfig, factory: type, *args, name="worker", placement=None, share=1.0, **kwargs):
        super().__init__(cfg, factory, *args, name=name, placement=placement, share=share, **kwargs)
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
        launcher.check_call(self.cls, method, (shards[0], *args), kwargs)
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
    """``launcher.run_group``'s stand-in for a DPO/KTO job: the rank's first step without DeepSpeed. The trainer the
    job made (its context and examples, with the reference log-probs the job attached) builds the policy as fit()
    does, in fp32 with sdpa, scores the reference on one rank (score_on_ranks: the starting model's reference
    log-probs when the job attached none), and its loss runs on the first four training examples."""
    launcher.check_constructor(factory, args, {})
    trainer = factory(*args)
    ctx = trainer.ctx = dataclasses.replace(trainer.ctx, model_path=local_model_path(trainer.ctx.model_path))
    tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
    model = trainer.build_model(tokenizer, torch.float32, "sdpa")
    examples = {"train": trainer.train_examples, "eval": trainer.eval_examples}
    strategy = DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.train)
    pad_id = tokenizer.pad_token_id
    score_on_ranks(model, ctx, strategy, trainer.p, examples, trainer.reference_sequences, trainer.REF_KEYS, pad_id)
    forwards: list[tuple[int, bool]] = []
    model.register_forward_pre_hook(forward_record(forwards), with_kwargs=True)
    loss, metrics = trainer.loss(model, trainer.collate(trainer.train_examples[:4], tokenizer.pad_token_id))
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


@contextlib.contextmanager
def in_process_workers():
    """Within: the jobs' worker groups are ``LocalShards`` of this process, Ray is neither started nor asked
    (``init_ray`` notes the CPUs asked for; the cluster is ``SESSION_CLUSTER``), ``run_group`` is ``first_step``,
    and the rollout engines are recorded (``EngineGroup.create``'s arguments, the prompts and ``SamplingConfig``
    given to ``generate``), answering ``fixed_responses``. Yields the record."""
    record: dict[str, Any] = {"init_ray": [], "groups": [], "engines": [], "generate": []}

    class Group(LocalShards):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            record["groups"].append(self)

    class Engines:
        def __init__(self, eos_token_id: int):
            self.eos = eos_token_id

        @classmethod
        def create(
            cls,
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
        ):
            asked = {"count": count, "model": _engine_model(model_path), "backend": backend}
            asked.update(tp=tensor_parallel_size, cpus=num_cpus_per_engine, resources=resources, kwargs=kwargs)
            record["engines"].append(asked)
            return cls(eos_token_id)

        def wait_ready(self) -> None:
            pass

        def generate(self, prompt_ids, sampling):
            record["generate"].append({"prompt_ids": prompt_ids, "sampling": dataclasses.asdict(sampling)})
            return fixed_responses(len(prompt_ids) * sampling.n, self.eos)

        def shutdown(self) -> None:
            pass

    swaps = [
        (launcher, "RayWorkerGroup", Group),
        (launcher, "init_ray", lambda min_cpus=1: record["init_ray"].append(min_cpus) or False),
        (launcher, "cluster_resources", lambda: dict(SESSION_CLUSTER)),
        (launcher, "node_resources", lambda: [dict(SESSION_CLUSTER)]),
        (launcher, "wait", list),
        (launcher, "shutdown_ray", lambda: None),
        (launcher, "run_group", first_step),
        (rollout_group, "EngineGroup", Engines),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, value in swaps:
        setattr(module, name, value)
    try:
        yield record
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


_IN_PROCESS: dict[str, Any] = {}


def in_process_job(cfg: PipelineConfig, stage: str) -> Any:
    """The stage's job (dpo / kto / generate / score .run) in this process (``in_process_workers``), once per
    distinct config: the CPUs it asks Ray for, its worker groups, the engines it starts and what it gives them, and
    what it commits (a dataset's file and rows; the DPO/KTO first step and reference_logprobs/), with its metrics."""
    key = content_key(cfg, stage)
    if key not in _IN_PROCESS:

        def run():
            with in_process_workers() as record:
                ref = job_module(cfg, stage).run(cfg, stage)
            store = open_store(cfg)
            out = {
                "init_ray": record["init_ray"],
                "groups": [g.record for g in record["groups"]],
                "strategies": [g.cfg for g in record["groups"]],
                "engines": record["engines"],
                "generate": record["generate"],
                "metrics": ref.metrics,
            }
            if cfg.kind(stage) in ("dpo", "kto"):
                out["reference_logprobs"] = store.is_complete(f"{stage}/{preference_rel()}")
            else:
                out["file"] = store.read_manifest(stage, verify=False).extra["dataset"]
                out["rows"] = read_dataset(store, stage)
            return out

        _IN_PROCESS[key] = outcome(run)
    return _IN_PROCESS[key]


def preference_rel() -> str:
    from rlhf_core.run_layout import REFERENCE_LOGPROBS

    return REFERENCE_LOGPROBS


def in_process_part(*path: str | int, doc: str):
    """An observer of one part of ``in_process_job`` (the whole outcome when the job raised)."""

    def observe(cfg: PipelineConfig, stage: str) -> Any:
        out = in_process_job(cfg, stage)
        if isinstance(out, tuple):  # ("raised", ...)
            return out
        for part in path:
            out = out[part]
        return out

    observe.__name__ = "in_process_job:" + ".".join(map(str, path))
    observe.__doc__ = doc
    return observe


first_step_of = in_process_part(
    "metrics", doc="dpo/kto run in-process: the first step's loss, metrics, reference and forwards (first_step)."
)
job_output = in_process_part("rows", doc="The rows the job committed as its dataset (read back, verified).")
job_file = in_process_part("file", doc="The dataset file the job committed.")


def job_workers(cfg: PipelineConfig, stage: str) -> Any:
    """A real Ray group started with the strategy the job (run in this process) gave its worker groups: what each rank
    got."""
    out = in_process_job(cfg, stage)
    return out if isinstance(out, tuple) else group_report(out["strategies"][0])


def stage_graph(cfg: PipelineConfig, stage: str) -> dict:
    """The run's stage graph as the pipeline walks it (cfg.order()): each instance's kind, loop iteration (cfg.
    iterations), the stages it reads and its config hash."""
    return {
        name: {
            "kind": cfg.kind(name),
            "iteration": cfg.iterations.get(name),
            "upstream": cfg.spec(name).upstream_names(),
            "hash": stage_hash(cfg.stage(name)),
        }
        for name in cfg.order()
    }


# ---------------------------------------------------------------------------------------------------------------------
# The table: dpo and kto (TRAINING_SECTION, the preference data probes, their losses), generate, score, the loop


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(a), abs(b))


def _raised_then_ran(a: Any, b: Any) -> bool:
    return a[0] == "raised" and isinstance(b, dict)


KTO_ROWS = f"{DATA / 'kto_unpaired.jsonl'}"  # pairs (chosen/rejected) and unpaired rows (response, answer, label)
# KTO makes two examples of a pair: half the pairs give the job runs' 96 examples (6 steps, as JOB_BASE's 96 pairs)
KTO_JOB = ("{stage}.data.max_samples=48",)


def _preference_section(kind: str) -> dict[str, Probe]:
    """What dpo and kto share: TRAINING_SECTION, the preference data probes, the reference and ref_logprobs."""
    out = {**TRAINING_SECTION, **_data_probes("pref", PREFERENCE_KEYS)}
    if kind == "kto":
        for key in ("train.save_steps", "train.keep_last", "train.log_steps", "train.eval_batch_size"):
            out[key] = dataclasses.replace(out[key], base=out[key].base + KTO_JOB)
    out |= {
        "reference.name_or_path": probe("{stage}.reference.name_or_path=builtin:small", observe=first_step_of),
        "reference.tokenizer": probe("{stage}.reference.tokenizer={alt_tokenizer}", observe=first_step_of),
        "reference.init_seed": probe("{stage}.reference.init_seed=2", observe=first_step_of),
        "reference.trust_remote_code": probe(
            "{stage}.reference.trust_remote_code=true",
            observe=first_step_of,
            base=("{stage}.reference.name_or_path={remote_code_model}",),
            expect=_raised_then_ran,
        ),
        "ref_logprobs": probe(  # the same numbers, from an online copy on the rank instead of reference_logprobs/
            "{stage}.ref_logprobs=online",
            observe=in_process_part(
                doc="dpo/kto run in-process: reference_logprobs/ committed, the first step's loss and reference."
            ),
            expect=lambda a, b: (
                a["reference_logprobs"]
                and not b["reference_logprobs"]
                and len(a["groups"]) == 1  # the preset's reference is another model: a ReferencePolicy group
                and not b["groups"]
                and (a["metrics"]["online_reference"], b["metrics"]["online_reference"]) == (False, True)
                and _close(a["metrics"]["loss"], b["metrics"]["loss"])
            ),
        ),
        "beta": probe(
            "{stage}.beta=0.2",
            observe=first_step_of,
            expect=lambda a, b: _close(2 * a["step_metrics"]["chosen_reward"], b["step_metrics"]["chosen_reward"]),
        ),
    }
    return out


DPO_SECTION = {
    **_preference_section("dpo"),
    # the implicit rewards stay, the loss of them changes
    "loss_type": probe(
        "{stage}.loss_type=ipo",
        observe=first_step_of,
        expect=lambda a, b: a["step_metrics"] == b["step_metrics"] and a["loss"] != b["loss"],
    ),
    "label_smoothing": probe(
        "{stage}.label_smoothing=0.2",
        observe=first_step_of,
        expect=lambda a, b: a["step_metrics"] == b["step_metrics"] and a["loss"] != b["loss"],
    ),
    "nll_loss_coef": probe(
        "{stage}.nll_loss_coef=1.0",
        observe=first_step_of,
        expect=lambda a, b: "nll" not in a["step_metrics"] and _close(b["loss"], a["loss"] + b["step_metrics"]["nll"]),
    ),
}
KTO_SECTION = {
    **_preference_section("kto"),
    "data.label_key": probe(  # the same file: 8 pairs (16 examples) -> 8 labelled rows
        "{stage}.data.label_key=label",
        observe=train_examples,
        base=(f"{{stage}}.data.train_path={KTO_ROWS}",),
        expect=lambda a, b: len(a) == 16 and [e["desirable"] for e in b] == [True, False] * 4,
    ),
    "data.response_key": probe(
        "{stage}.data.response_key=answer",
        observe=train_examples,
        base=(f"{{stage}}.data.train_path={KTO_ROWS}", "{stage}.data.label_key=label"),
    ),
    "desirable_weight": probe(
        "{stage}.desirable_weight=2.0", observe=first_step_of, expect=lambda a, b: b["loss"] > a["loss"]
    ),
    "undesirable_weight": probe(
        "{stage}.undesirable_weight=2.0", observe=first_step_of, expect=lambda a, b: b["loss"] > a["loss"]
    ),
}

# generate: the HF engines, two samples per prompt of 8 tokens at most, and a reference (KL to it: log-prob groups)
GENERATE_BASE = (
    "{stage}.rollout.backend=hf",
    "{stage}.rollout.max_new_tokens=8",
    "{stage}.rollout.n_samples_per_prompt=2",
    "{stage}.reference.name_or_path=builtin:tiny",
    "{stage}.reference.init_seed=1",
)
VLLM = ("{stage}.rollout.backend=vllm",)
engines_asked = in_process_part("engines", 0, doc="The engines generate starts (EngineGroup.create's arguments).")
engine_kwargs_of = in_process_part("engines", 0, "kwargs", doc="The constructor kwargs generate gives its engines.")
sampling_of = in_process_part("generate", 0, "sampling", doc="The SamplingConfig generate gives its engines.")
prompts_of = in_process_part("generate", 0, "prompt_ids", doc="The prompts (token ids) generate gives its engines.")
kl_groups = in_process_part("groups", doc="generate's log-prob groups (policy, reference): what each got, computed.")
cpus_asked = in_process_part("init_ray", doc="The CPUs the job asks Ray for (launcher.init_ray(min_cpus)).")


def _kl(rows: Any) -> Any:
    return rows if isinstance(rows, tuple) else [r["kl_to_ref"] for r in rows]


def kl_to_ref(cfg: PipelineConfig, stage: str) -> Any:
    """The kl_to_ref of each row generate committed (its log-prob groups on the fixed responses)."""
    return _kl(job_output(cfg, stage))


# What generate's log-prob groups and score's reward-model workers were given, from a real job run (slow)
FROZEN_WORKERS: dict[str, Probe] = {
    "strategy.threads_per_worker": probe(
        "{stage}.strategy.threads_per_worker=2",
        observe=job_workers,
        slow=True,
        expect=lambda a, b: b[0]["torch_threads"] == 2,
    ),
    "strategy.resources": probe(
        "{stage}.strategy.resources={{probe_node: 2}}",
        observe=job_workers,
        slow=True,
        expect=lambda a, b: a[0]["custom"] == {} and b[0]["custom"] == {"probe_node": 2.0},
    ),
}

GENERATE_SECTION: dict[str, Probe] = {
    "model.name_or_path": probe(
        "{stage}.model.name_or_path=builtin:small",
        observe=engines_asked,
        expect=lambda a, b: b["model"] == "builtin:small",
    ),
    "model.tokenizer": probe(
        "{stage}.model.tokenizer={alt_tokenizer}", observe=engine_kwargs_of, expect=lambda a, b: b["tokenizer"]
    ),
    "model.init_seed": probe(  # the HF engines build a builtin: policy; for vLLM it is built and saved first
        "{stage}.model.init_seed=1", observe=engines_asked, expect=lambda a, b: b["kwargs"]["init_seed"] == 1
    ),
    "model.trust_remote_code": probe(
        "{stage}.model.trust_remote_code=true",
        observe=in_process_part(doc="generate run in-process."),
        base=("{stage}.model.name_or_path={remote_code_model}",),
        expect=lambda a, b: _raised_then_ran(a, b) and b["engines"][0]["kwargs"]["trust_remote_code"],
    ),
    "data.train_path": probe(f"{{stage}}.data.train_path={PROMPT_ROWS}", observe=job_output),
    "data.train_split": probe(
        "{stage}.data.train_split=dev", observe=job_output, base=(f"{{stage}}.data.train_path={PROMPT_SPLITS}",)
    ),
    "data.max_len": probe(  # vLLM's context: prompt plus response
        "{stage}.data.max_len=24",
        observe=engine_kwargs_of,
        base=VLLM,
        expect=lambda a, b: a["max_model_len"] - b["max_model_len"] == 8,
    ),
    "data.max_samples": probe(
        "{stage}.data.max_samples=2", observe=job_output, expect=lambda a, b: 2 * len(b) == len(a) == 8
    ),
    "data.input_key": probe(
        "{stage}.data.input_key=question", observe=job_output, base=(f"{{stage}}.data.train_path={PROMPT_ROWS}",)
    ),
    "data.input_template": probe("{stage}.data.input_template='Q: {{}} A:'", observe=prompts_of),
    "data.apply_chat_template": probe("{stage}.data.apply_chat_template=false", observe=prompts_of),
    "reference.name_or_path": probe("{stage}.reference.name_or_path=builtin:small", observe=kl_to_ref),
    "reference.tokenizer": probe("{stage}.reference.tokenizer={alt_tokenizer}", observe=kl_to_ref),
    "reference.init_seed": probe("{stage}.reference.init_seed=2", observe=kl_to_ref),
    "reference.trust_remote_code": probe(
        "{stage}.reference.trust_remote_code=true",
        observe=kl_to_ref,
        base=("{stage}.reference.name_or_path={remote_code_model}",),
        expect=lambda a, b: a[0] == "raised" and isinstance(b, list),
    ),
    "strategy.num_workers": probe(
        "{stage}.strategy.num_workers=2",
        observe=kl_groups,
        expect=lambda a, b: [g["shards"] for g in a] == [[[8]]] * 2 and [g["shards"] for g in b] == [[[4, 4]]] * 2,
    ),
    "strategy.precision": probe(
        "{stage}.strategy.precision=bf16", observe=engine_kwargs_of, expect=lambda a, b: b["dtype"] == "bfloat16"
    ),
    "strategy.device": probe(  # the workers' device; vLLM without CUDA graphs on the CPU only
        "{stage}.strategy.device=cuda",
        observe=in_process_part(doc="generate run in-process."),
        base=VLLM,
        expect=lambda a, b: (
            {g["device"] for g in b["groups"]} == {"cuda"}
            and (a["engines"][0]["kwargs"]["enforce_eager"], b["engines"][0]["kwargs"]["enforce_eager"])
            == (True, False)
        ),
    ),
    "strategy.cpus_per_worker": probe(
        "{stage}.strategy.cpus_per_worker=2.0", observe=cpus_asked, expect=lambda a, b: b[0] - a[0] == 2 * 1.0
    ),
    **FROZEN_WORKERS,
    "strategy.packing": probe(
        "{stage}.strategy.packing=false",
        observe=kl_groups,
        expect=lambda a, b: (
            all(p for g in a for _, p in g["forwards"]) and not any(p for g in b for _, p in g["forwards"])
        ),
    ),
    "rollout.backend": probe(
        "{stage}.rollout.backend=vllm",
        observe=engines_asked,
        expect=lambda a, b: (a["backend"], b["backend"]) == ("hf", "vllm"),
    ),
    "rollout.num_engines": probe(
        "{stage}.rollout.num_engines=2",
        observe=in_process_part(doc="generate run in-process."),
        expect=lambda a, b: b["engines"][0]["count"] == 2 and b["init_ray"][0] == a["init_ray"][0] + 1,
    ),
    "rollout.tensor_parallel_size": probe(
        "{stage}.rollout.tensor_parallel_size=2", observe=engines_asked, base=VLLM, expect=lambda a, b: b["tp"] == 2
    ),
    "rollout.cpus_per_engine": probe(
        "{stage}.rollout.cpus_per_engine=2.0", observe=cpus_asked, expect=lambda a, b: b[0] == a[0] + 1
    ),
    "rollout.kv_cache_gib": probe(
        "{stage}.rollout.kv_cache_gib=2",
        observe=engine_kwargs_of,
        base=VLLM,
        expect=lambda a, b: b["kv_cache_gib"] == 2,
    ),
    "rollout.gpu_memory_utilization": probe(
        "{stage}.rollout.gpu_memory_utilization=0.4",
        observe=engine_kwargs_of,
        base=VLLM,
        expect=lambda a, b: b["gpu_memory_utilization"] == 0.4,
    ),
    "rollout.enforce_eager": probe(
        "{stage}.rollout.enforce_eager=false",
        observe=engine_kwargs_of,
        base=VLLM,
        expect=lambda a, b: (a["enforce_eager"], b["enforce_eager"]) == (True, False),
    ),
    "rollout.resources": probe(
        "{stage}.rollout.resources={{probe_node: 1}}",
        observe=engines_asked,
        expect=lambda a, b: (a["resources"], b["resources"]) == ({}, {"probe_node": 1.0}),
    ),
    "rollout.n_samples_per_prompt": probe(
        "{stage}.rollout.n_samples_per_prompt=3", observe=job_output, expect=lambda a, b: 2 * len(b) == 3 * len(a)
    ),
    "rollout.temperature": probe(  # the engines sample at it, the log-prob groups divide the logits by it
        "{stage}.rollout.temperature=0.5",
        observe=in_process_part(doc="generate run in-process."),
        expect=lambda a, b: b["generate"][0]["sampling"]["temperature"] == 0.5 and _kl(a["rows"]) != _kl(b["rows"]),
    ),
    "rollout.top_p": probe("{stage}.rollout.top_p=0.5", observe=sampling_of, expect=lambda a, b: b["top_p"] == 0.5),
    "rollout.max_new_tokens": probe(
        "{stage}.rollout.max_new_tokens=4", observe=sampling_of, expect=lambda a, b: b["max_new_tokens"] == 4
    ),
    "seed": probe(
        "{stage}.seed=7",
        observe=in_process_part(doc="generate run in-process."),
        expect=lambda a, b: b["generate"][0]["sampling"]["seed"] == 7 == b["engines"][0]["kwargs"]["seed"],
    ),
    "gold_reward": probe(
        "{stage}.gold_reward=rlhf_core.data.synthetic:gold_reward",
        observe=job_output,
        expect=lambda a, b: "gold_reward" not in a[0] and all(isinstance(r["gold_reward"], float) for r in b),
    ),
    "output_format": probe(
        "{stage}.output_format=parquet", observe=job_file, expect=lambda a, b: (a, b) == ("data.jsonl", "data.parquet")
    ),
}

# score: the rows of 4 prompts x 3 responses; scored by builtin:tiny as a reward model, or by their length
SCORED_ROWS = DATA / "generated_splits"
scores_of = in_process_part("rows", doc="The rows score committed: each with its score (select all).")
scorer_groups = in_process_part("groups", doc="score's reward-model group: what it got, its forwards.")


def scores(cfg: PipelineConfig, stage: str) -> Any:
    """The score of each row score committed (select all)."""
    rows = scores_of(cfg, stage)
    return rows if isinstance(rows, tuple) else [round(r["score"], 5) for r in rows]


SCORE_SECTION: dict[str, Probe] = {
    "data.train_path": probe(f"{{stage}}.data.train_path={SCORED_ROWS / 'train.jsonl'}", observe=scores_of),
    "data.train_split": probe(
        "{stage}.data.train_split=dev", observe=scores_of, base=(f"{{stage}}.data.train_path={SCORED_ROWS}",)
    ),
    "data.max_len": probe("{stage}.data.max_len=16", observe=scores),
    "data.max_samples": probe(
        "{stage}.data.max_samples=6", observe=scores_of, expect=lambda a, b: (len(a), len(b)) == (12, 6)
    ),
    "data.prompt_key": probe("{stage}.data.prompt_key=query", observe=scores_of),
    "data.response_key": probe("{stage}.data.response_key=answer", observe=scores_of),
    "data.input_template": probe("{stage}.data.input_template='Q: {{}} A:'", observe=scores),
    "data.apply_chat_template": probe("{stage}.data.apply_chat_template=false", observe=scores),
    "reward.name_or_path": probe("{stage}.reward.name_or_path={rm_seed1}", observe=scores),
    "reward.tokenizer": probe("{stage}.reward.tokenizer={alt_tokenizer}", observe=scores),
    "reward.init_seed": probe("{stage}.reward.init_seed=1", observe=scores),
    "reward.trust_remote_code": probe(
        "{stage}.reward.trust_remote_code=true",
        observe=scores,
        base=("{stage}.reward.name_or_path={remote_code_rm}",),
        expect=lambda a, b: a[0] == "raised" and isinstance(b, list),
    ),
    "reward_fn": probe(
        *BY_LENGTH,
        observe=in_process_part(doc="score run in-process."),
        expect=lambda a, b: (
            not b["groups"] and [r["score"] for r in b["rows"]] == [len(r["response"]) for r in b["rows"]]
        ),
    ),
    "strategy.num_workers": probe(
        "{stage}.strategy.num_workers=2",
        observe=scorer_groups,
        expect=lambda a, b: (a[0]["shards"], b[0]["shards"]) == ([[12]], [[6, 6]]),
    ),
    "strategy.precision": probe("{stage}.strategy.precision=fp32", observe=scores),
    "strategy.device": probe(
        "{stage}.strategy.device=cuda", observe=scorer_groups, expect=lambda a, b: b[0]["device"] == "cuda"
    ),
    "strategy.cpus_per_worker": probe(
        "{stage}.strategy.cpus_per_worker=0.5", observe=cpus_asked, expect=lambda a, b: (a, b) == ([1.0], [0.5])
    ),
    **FROZEN_WORKERS,
    "strategy.packing": probe(
        "{stage}.strategy.packing=false",
        observe=scorer_groups,
        expect=lambda a, b: all(p for _, p in a[0]["forwards"]) and not any(p for _, p in b[0]["forwards"]),
    ),
    "micro_batch_size": probe(
        "{stage}.micro_batch_size=4",
        observe=scorer_groups,
        expect=lambda a, b: len(a[0]["forwards"]) == 1 and len(b[0]["forwards"]) == 3,
    ),
    "select": probe(  # the longest response of each of the 4 prompts
        "{stage}.select=best",
        observe=scores_of,
        base=BY_LENGTH,
        expect=lambda a, b: len(b) == 4 and all("lovely" in r["response"] for r in b),
    ),
    "threshold": probe(  # the best responses are 32 to 35 characters long
        "{stage}.threshold=34",
        observe=in_process_part("metrics", doc="score's metrics."),
        base=(*BY_LENGTH, "{stage}.select=best"),
        expect=lambda a, b: (a["prompts_dropped"], b["prompts_dropped"]) == (0, 2),
    ),
    "output_format": probe(
        "{stage}.output_format=parquet", observe=job_file, expect=lambda a, b: (a, b) == ("data.jsonl", "data.parquet")
    ),
}

LOOP_SECTION: dict[str, Probe] = {
    "loop.iterations": probe(
        "loop.iterations=3",
        observe=stage_graph,
        preset=LOOP,
        expect=lambda a, b: (
            set(b) - set(a) == {"generate_3", "score_3", "dpo_3", "sft_best_3"}
            and b["generate_3"]["upstream"] == ["dpo_2"]
            and b["generate_3"]["iteration"] == 3
        ),
    ),
    "loop.policy": probe(
        "loop.policy=builtin:small",
        observe=stage_graph,
        preset=LOOP,
        expect=lambda a, b: (
            (a["generate_1"]["upstream"], b["generate_1"]["upstream"]) == (["sft"], [])
            and a["generate_2"] == b["generate_2"]
        ),
    ),
    "loop.next_policy": probe(
        "loop.next_policy=sft_best",
        observe=stage_graph,
        preset=LOOP,
        expect=lambda a, b: (
            (a["dpo_2"]["upstream"], b["dpo_2"]["upstream"]) == (["dpo_1", "score_2"], ["score_2", "sft_best_1"])
        ),
    ),
    "loop.stages": probe(
        "loop.stages.extra={{kind: generate, model: {{name_or_path: 'loop:policy'}}, data: {{train_path: "
        "rlhf_core/assets/data/synthetic/prompts_eval.jsonl, input_key: prompt}}}}",
        observe=stage_graph,
        preset=LOOP,
        expect=lambda a, b: set(b) - set(a) == {"extra_1", "extra_2"} and b["extra_2"]["upstream"] == ["dpo_1"],
    ),
}

RUN_LEVEL: dict[str, Probe] = {
    "run_uri": probe("run_uri={tmp}/elsewhere", observe=store_location),
    "storage.endpoint_url": probe(
        "storage.endpoint_url=http://127.0.0.1:9", observe=store_location, base=("run_uri=s3://probe-bucket/run",)
    ),
    "storage.key": probe("storage.key=probe-key", observe=store_location, base=("run_uri=s3://probe-bucket/run",)),
    "storage.secret": probe(
        "storage.secret=probe-secret", observe=store_location, base=("run_uri=s3://probe-bucket/run",)
    ),
    "storage.region": probe(
        "storage.region=eu-probe-1", observe=store_location, base=("run_uri=s3://probe-bucket/run",)
    ),
}


def trackers_written(cfg: PipelineConfig, stage: str) -> Any:
    """rlhf_core.tracking: the sft stage's trackers opened as its rank 0 opens them, one step logged, closed; what
    each wrote, read back (TensorBoard folders, MLflow runs, the W&B offline run record), the run folder's name
    written as <run>."""
    from rlhf_core import tracking
    from tests.test_tracking import wandb_records

    def run() -> dict:
        store = open_store(cfg)
        with tracking.Tracker(tracking.spec_for(cfg, "sft", store)) as tracker:
            tracker.log(1, {"loss": 1.0})
        root = Path(store.root_uri)
        folder = root.name

        def plain(name: str) -> str:
            return name.replace(folder, "<run>")

        out: dict[str, Any] = {"tensorboard": sorted(p.name for p in (root / "tensorboard").glob("*"))}
        if cfg.tracking.mlflow is not None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=cfg.tracking.mlflow.tracking_uri)
            exp = client.get_experiment_by_name(cfg.tracking.mlflow.experiment)
            runs = client.search_runs([exp.experiment_id]) if exp is not None else []
            mine = [r for r in runs if r.data.tags.get("rlhf.run_uri") == store.root_uri]
            out["mlflow"] = (
                cfg.tracking.mlflow.tracking_uri.rsplit("/", 1)[-1],
                exp.name if exp else None,
                [(plain(r.info.run_name), r.info.status, r.data.metrics) for r in mine],
            )
        for run_file in (root / "wandb").glob("offline-run-*/run-*.wandb"):
            for record in wandb_records(run_file):
                if record.HasField("run"):
                    r = record.run
                    out["wandb"] = (r.project, r.entity, plain(r.display_name))
        return out

    return outcome(run)


TRACKING: dict[str, Probe] = {
    "tracking.tensorboard": probe(
        "tracking.tensorboard=true",
        observe=trackers_written,
        expect=lambda a, b: (a["tensorboard"], b["tensorboard"]) == ([], ["sft"]),
    ),
    "tracking.mlflow.tracking_uri": probe(
        "tracking.mlflow.tracking_uri=sqlite:///{tmp}/mlflow-b.db",
        observe=trackers_written,
        base=("tracking.mlflow.tracking_uri=sqlite:///{tmp}/mlflow-a.db",),
        expect=lambda a, b: (a["mlflow"][0], b["mlflow"][0]) == ("mlflow-a.db", "mlflow-b.db"),
    ),
    "tracking.mlflow.experiment": probe(
        "tracking.mlflow.experiment=probe-b",
        observe=trackers_written,
        base=("tracking.mlflow.tracking_uri=sqlite:///{tmp}/mlflow-a.db",),
        expect=lambda a, b: b["mlflow"][1:] == ("probe-b", [("<run>/sft", "FINISHED", {"loss": 1.0})]),
    ),
    "tracking.run_name": probe(
        "tracking.run_name=probe",
        observe=trackers_written,
        base=("tracking.tensorboard=true", "tracking.mlflow.tracking_uri=sqlite:///{tmp}/mlflow-a.db"),
        expect=lambda a, b: (a["mlflow"][2][0][0], b["mlflow"][2][0][0]) == ("<run>/sft", "probe/sft"),
    ),
    "tracking.wandb.project": probe(
        "tracking.wandb.project=probe-b",
        observe=trackers_written,
        base=("tracking.wandb.project=probe-a",),
        expect=lambda a, b: (a["wandb"], b["wandb"]) == (("probe-a", "", "<run>/sft"), ("probe-b", "", "<run>/sft")),
    ),
    "tracking.wandb.entity": probe(
        "tracking.wandb.entity=probe-team",
        observe=trackers_written,
        base=("tracking.wandb.project=probe-a",),
        expect=lambda a, b: b["wandb"] == ("probe-a", "probe-team", "<run>/sft"),
    ),
    "tracking.wandb.mode": probe(  # online needs WANDB_API_KEY, which the tests never have: refused before any run
        "tracking.wandb.mode=online",
        observe=trackers_written,
        base=("tracking.wandb.project=probe-a",),
        expect=lambda a, b: "wandb" in a and b == ("raised", "ConfigError"),
    ),
}


def _section(kind: str, probes: dict[str, Probe], base: tuple[str, ...] = ()) -> dict[str, Probe]:
    """The probes of a kind's keys, on the preset of its stage (KIND_HOMES; the tiny one by default)."""
    home = KIND_HOMES.get(kind, TINY)
    out = {
        f"{kind}.kind": probe(
            *KIND_CHANGES[kind], observe=stage_runner, base=base, preset=KIND_PRESETS.get(kind, home)
        )
    }
    for rel, p in probes.items():
        if rel not in STAGE_KINDS[kind].unused:  # undocumented and refused: test_unused_keys_are_refused
            out[f"{kind}.{rel}"] = dataclasses.replace(
                p, base=base + p.base, preset=home if p.preset == TINY else p.preset
            )
    return out


EFFECTS: dict[str, Probe] = {
    **RUN_LEVEL,
    **_section("sft", SFT_SECTION),
    **_section("reward_model", REWARD_MODEL_SECTION, RM_BASE),
    **_section("critic_init", CRITIC_INIT_SECTION),
    **_section("critic_warmup", _ppo_section("critic_warmup"), PPO_BASE),
    **_section("ppo", _ppo_section("ppo"), PPO_BASE),
    **_section("dpo", DPO_SECTION),
    **_section("kto", KTO_SECTION),
    **_section(
        "generate", {k: dataclasses.replace(p, base=GENERATE_BASE + p.base) for k, p in GENERATE_SECTION.items()}
    ),
    **_section("score", SCORE_SECTION),
    **LOOP_SECTION,
    **TRACKING,
}


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures: a second tokenizer, models with custom code, tiny reward models


def _with_remote_code(model: torch.nn.Module, tokenizer, out: Path, architecture: str) -> str:
    """Save ``model`` as a directory whose config needs its own modelling code (config.json auto_map)."""
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    add_remote_code(out, "keyprobe", architecture)
    return str(out)


@pytest.fixture(scope="session")
def paths(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Fixture files by name (a second tokenizer, models with custom code, tiny reward models), and the URLs of the
    loopback reward servers (``reward_servers``)."""
    root = tmp_path_factory.mktemp("config-keys")
    tokenizer = load_tokenizer("builtin:tiny")
    alt = load_tokenizer("builtin:tiny")
    alt.add_special_tokens({"additional_special_tokens": ["<|probe|>"]})
    alt.save_pretrained(str(root / "alt_tokenizer"))
    out = {"alt_tokenizer": str(root / "alt_tokenizer"), "tmp": str(root)}
    lm = build_causal_lm("builtin:tiny", tokenizer, seed=0, dtype=torch.float32, attn="sdpa")
    out["remote_code_model"] = _with_remote_code(lm, tokenizer, root / "remote_lm", "ProbeForCausalLM")
    for seed in (0, 1):
        rm = build_scalar_model("builtin:tiny", tokenizer, seed=seed, dtype=torch.float32, attn="sdpa")
        rm.config.reward_mean, rm.config.reward_std = 0.5 + seed, 2.0  # as the reward-model stage stores them
        rm.save_pretrained(str(root / f"rm{seed}"))
        tokenizer.save_pretrained(str(root / f"rm{seed}"))
        out[f"rm_seed{seed}"] = str(root / f"rm{seed}")
    rm = build_scalar_model("builtin:tiny", tokenizer, seed=0, dtype=torch.float32, attn="sdpa")
    rm.config.reward_mean, rm.config.reward_std = 0.5, 2.0  # usable as a PPO reward model with normalize_reward
    out["remote_code_rm"] = _with_remote_code(rm, tokenizer, root / "remote_rm", "ProbeForSequenceClassification")
    with reward_servers() as urls:
        yield {**out, **urls}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        events.EVENTS_ENV,
        "WANDB_API_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RLHF_WORK_DIR", str(tmp_path / "work"))


def configs(key: str, p: Probe, paths: dict[str, str]) -> tuple[PipelineConfig, PipelineConfig, str]:
    """(tiny preset + base, tiny preset + base + change, stage) for ``key``, each in its own run directory."""
    stage = key.split(".")[0] if "." in key and key.split(".")[0] not in ("storage",) else "sft"

    def load(overrides: tuple[str, ...]) -> PipelineConfig:
        filled = [o.format(stage=stage, **paths) for o in overrides]
        run = Path(paths["tmp"]) / "runs" / hashlib.sha256(json.dumps([key, filled]).encode()).hexdigest()[:16]
        return load_config(p.preset, [f"run_uri={run}", *filled])

    return load(p.base), load(p.base + p.change), stage


def check(key: str, paths: dict[str, str]) -> None:
    p = EFFECTS[key]
    base, changed, stage = configs(key, p, paths)
    before, after = p.observe(base, stage), p.observe(changed, stage)
    what = f"{p.observe.__name__} ({' '.join((p.observe.__doc__ or '').split())})"
    assert before != after, f"{key}: no effect on {what}: {_short(before)}"
    if p.expect is not None:
        assert p.expect(before, after), f"{key}: unexpected change of {what}: {_short(before)} -> {_short(after)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:300] + "..."


# ---------------------------------------------------------------------------------------------------------------------
# Tests


def documented_keys() -> set[str]:
    return {key for key, _, _ in describe(PipelineConfig)}


def test_every_documented_key_has_a_probe():
    documented = documented_keys()
    assert not documented - set(EFFECTS), f"documented keys without a probe: {sorted(documented - set(EFFECTS))}"
    assert not set(EFFECTS) - documented, f"probes of undocumented keys: {sorted(set(EFFECTS) - documented)}"


def test_unused_keys_are_refused(tmp_path):
    """Each kind's StageKind.unused keys (keys of its shared section classes that it has no use for) are real keys of
    the section, left out of the documentation, and refused by name when an override or a preset sets them."""
    documented = documented_keys()
    for kind, spec in STAGE_KINDS.items():
        home = KIND_HOMES.get(kind, TINY)
        preset = yaml.safe_load(home.read_text())
        section_keys = {row[0] for row in describe(spec.section, kind)}
        for rel in sorted(spec.unused):
            key = f"{kind}.{rel}"  # the home preset's stage of each kind is named after it
            assert key in section_keys and key not in documented, key
            refused = re.escape(f"'{key}' does not apply to a {kind} stage")
            with pytest.raises(ConfigError, match=refused):
                load_config(home, [f"run_uri={tmp_path}", f"{key}=1"])
            edited = json.loads(json.dumps(preset))  # the preset with the key set in the stage's section
            section = edited["stages"][kind]
            *parents, leaf = rel.split(".")
            for part in parents:
                section = section.setdefault(part, {})
            section[leaf] = 1
            path = tmp_path / f"{kind}.yaml"
            path.write_text(yaml.safe_dump(edited))
            with pytest.raises(ConfigError, match=refused):
                load_config(path, [f"run_uri={tmp_path}"])


FAST = sorted(k for k, p in EFFECTS.items() if not p.slow)
SLOW = sorted(k for k, p in EFFECTS.items() if p.slow)


@pytest.mark.parametrize("key", FAST)
def test_key_changes_behaviour(key, paths):
    check(key, paths)


@pytest.fixture(scope="module")
def in_process_world():
    """The one-rank DeepSpeed world of the in-process roles and engines (made on first use), ended after the module
    so that later tests find no process group."""
    yield
    import torch.distributed as dist

    _REPORTS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    for name, value in _SAVED_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _SAVED_ENV.clear()


@pytest.mark.slow
@pytest.mark.parametrize("key", SLOW)
def test_key_changes_behaviour_in_a_run(key, paths, ray_cluster, in_process_world):
    check(key, paths)
