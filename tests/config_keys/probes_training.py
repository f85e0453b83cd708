"""Probes of the supervised stages (sft, reward_model), critic_init and the sections they share (model, strategy,
optim, train, data): observers of the code their jobs and ranks run, then their rows.

``TRAINING_SECTION`` and ``data_probes`` also serve dpo and kto (``probes_methods``). The slow observers start real
Ray groups and DeepSpeed engines, or run a stage's job for real once per distinct config (``job_run``, which the PPO
rows also read).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlhf_core import events, run_layout
from rlhf_core.config import PipelineConfig, StrategyConfig, TrainConfig
from rlhf_core.data.examples import kto_examples, preference_examples, sft_examples
from rlhf_core.data.sampler import global_batch, total_steps
from rlhf_core.distributed import launcher
from rlhf_core.distributed.checkpoints import adapter_record, export_hf
from rlhf_core.distributed.device import resolve_device
from rlhf_core.distributed.strategy import DeepSpeedStrategy, lr_lambda
from rlhf_core.jobs import critic_init, dpo, kto, reward_model, sft, stage_setup
from rlhf_core.models.builders import attn_implementation, build_causal_lm, load_tokenizer
from rlhf_core.storage import ObjectStore
from tests.config_keys.fakes import one_rank_world, recording
from tests.config_keys.harness import (
    DATA,
    Probe,
    content_key,
    fingerprint,
    forward_record,
    job_module,
    lora_report,
    outcome,
    probe,
)

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
    st = stage_setup.setup_stage(cfg, stage)
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


def build_rank_model(impl: Any, tokenizer: Any, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    """The policy ``impl``'s rank builds: its own ``build_model`` (sft, reward_model), its preference step loop's
    (dpo, kto: ``impl.trainer``)."""
    return getattr(impl, "trainer", impl).build_model(tokenizer, dtype, attn)


def rank_model(cfg: PipelineConfig, stage: str) -> Any:
    """The model a rank builds: setup_stage -> StageContext -> tokenizer, attention, dtype, trainer.build_model
    (the stage trainer's fit, step 1)."""

    def build():
        ctx = stage_setup.setup_stage(cfg, stage).context()
        strategy = DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.train)
        tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        attn = attn_implementation(ctx.strategy.attn_implementation, strategy.device)
        return fingerprint(build_rank_model(_stage_trainer(cfg, stage, ctx), tokenizer, strategy.dtype, attn))

    return outcome(build)


def rank_lora(cfg: PipelineConfig, stage: str) -> Any:
    """The LoRA adapters of the model a rank builds (``rank_model``'s path): layers, scaling, dropout, what trains."""

    def build():
        ctx = stage_setup.setup_stage(cfg, stage).context()
        tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        return lora_report(build_rank_model(_stage_trainer(cfg, stage, ctx), tokenizer, torch.float32, "sdpa"))

    return outcome(build)


def rank_export(cfg: PipelineConfig, stage: str) -> Any:
    """The files of the stage's output as its export writes them (``export_stage``: ``export_hf`` with the
    context's ``adapter_record``) for the model a rank builds (``rank_lora``'s path)."""

    def build():
        ctx = stage_setup.setup_stage(cfg, stage).context()
        tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        model = build_rank_model(_stage_trainer(cfg, stage, ctx), tokenizer, torch.float32, "sdpa")
        return export_files(model, tokenizer, ctx)

    return outcome(build)


def export_files(model: torch.nn.Module, tokenizer: Any, ctx: Any) -> list[str]:
    """The names of the files ``export_hf`` writes for ``model`` with ``ctx``'s ``adapter_record``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = export_hf(model, model.state_dict(), tokenizer, Path(tmp) / "out", adapter=adapter_record(ctx))
        return sorted(p.name for p in out.iterdir())


def lora_export_probe(prefix: str, observe: Any, base: tuple[str, ...] = (), slow: bool = False) -> dict[str, Probe]:
    """``<prefix>.lora.export``: the output folder a plain model's or a PEFT adapter folder's files."""
    return {
        f"{prefix}.lora.export": probe(
            f"{{stage}}.{prefix}.lora.export=adapter",
            observe=observe,
            base=(*base, f"{{stage}}.{prefix}.lora.rank=4"),
            slow=slow,
            expect=lambda a, b: "config.json" in a and "config.json" not in b and "adapter_model.safetensors" in b,
        )
    }


def lora_probes(prefix: str, observe: Any, base: tuple[str, ...] = (), slow: bool = False) -> dict[str, Probe]:
    """The ``<prefix>.lora.*`` keys, each seen in the adapters of the model built (``harness.lora_report``)."""
    on = (*base, f"{{stage}}.{prefix}.lora.rank=4")
    key = f"{prefix}.lora"
    return {
        f"{key}.rank": probe(
            f"{{stage}}.{key}.rank=4",
            observe=observe,
            base=base,
            slow=slow,
            expect=lambda a, b: a["count"] == 0 and b["count"] > 0 and b["trainable_params"] < a["trainable_params"],
        ),
        f"{key}.alpha": probe(
            f"{{stage}}.{key}.alpha=32",
            observe=observe,
            base=on,
            slow=slow,
            expect=lambda a, b: (a["scaling"], b["scaling"]) == ([4.0], [8.0]),
        ),
        f"{key}.dropout": probe(
            f"{{stage}}.{key}.dropout=0.1",
            observe=observe,
            base=on,
            slow=slow,
            expect=lambda a, b: (a["dropout"], b["dropout"]) == ([], [0.1]),
        ),
        f"{key}.target_modules": probe(
            f"{{stage}}.{key}.target_modules=[q_proj,v_proj]",
            observe=observe,
            base=on,
            slow=slow,
            expect=lambda a, b: b["layers"] == ["q_proj", "v_proj"] and len(a["layers"]) == 7,
        ),
        f"{key}.load_in_4bit": probe(
            f"{{stage}}.{key}.load_in_4bit=true",
            observe=observe,
            base=on,
            slow=slow,
            expect=lambda a, b: a["weights_4bit"] == 0 and b["weights_4bit"] > 0,
        ),
        f"{key}.modules_to_save": probe(
            f"{{stage}}.{key}.modules_to_save=[embed_tokens]",
            observe=observe,
            base=on,
            slow=slow,
            expect=lambda a, b: (
                "embed_tokens" in b["trainable_modules"] and "embed_tokens" not in a["trainable_modules"]
            ),
        ),
        f"{key}.target_parameters": probe(  # on an MoE model, q_proj alone: all-linear reaches the experts too
            f"{{stage}}.{key}.target_parameters=[mlp.experts.gate_up_proj]",
            observe=observe,
            base=(
                *on,
                f"{{stage}}.{prefix}.name_or_path=builtin:tiny-moe",
                f"{{stage}}.{key}.target_modules=[q_proj]",
            ),
            slow=slow,
            expect=lambda a, b: (a["layers"], b["layers"]) == (["q_proj"], ["gate_up_proj", "q_proj"]),
        ),
    }


def ds_config(cfg: PipelineConfig, stage: str) -> dict:
    """DeepSpeedStrategy(strategy, optim, train).ds_config(), the config deepspeed.initialize gets."""
    ctx = stage_setup.setup_stage(cfg, stage).context()
    return DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.train).ds_config()


def lr_curve(cfg: PipelineConfig, stage: str) -> list[float]:
    """The LambdaLR multipliers of strategy.lr_lambda over a 20-step run."""
    ctx = stage_setup.setup_stage(cfg, stage).context()
    fn = lr_lambda(ctx.optim, 20)
    return [round(fn(step), 9) for step in range(20)]


def planned_steps(cfg: PipelineConfig, stage: str) -> int:
    """Optimizer steps the trainer plans for the tokenized training set (sampler.total_steps, as in fit())."""
    t = stage_setup.setup_stage(cfg, stage).context().train
    return total_steps(len(_examples(cfg, stage, "train")), t.train_batch_size, t.max_epochs, t.max_steps)


def first_batch(cfg: PipelineConfig, stage: str) -> list[int]:
    """Dataset indices of the first optimizer step (sampler.global_batch with the train seed)."""
    t = stage_setup.setup_stage(cfg, stage).context().train
    return global_batch(len(_examples(cfg, stage, "train")), t.train_batch_size, 0, t.seed)


def loss_forwards(cfg: PipelineConfig, stage: str) -> list[tuple[int, bool]]:
    """The model forwards of trainer.loss on four training examples of mixed lengths with a fixed tiny model: (rows,
    whether the rows came packed: position_ids and no attention mask) of each."""
    impl = _stage_trainer(cfg, stage, stage_setup.setup_stage(cfg, stage).context())
    tokenizer = load_tokenizer("builtin:tiny")
    model = build_rank_model(impl, tokenizer, torch.float32, "sdpa")
    examples = sorted(_examples(cfg, stage, "train")[:16], key=lambda e: len(e.get("input_ids") or e["chosen_ids"]))
    calls: list[tuple[int, bool]] = []
    model.register_forward_pre_hook(forward_record(calls), with_kwargs=True)
    impl.loss(model, impl.collate(examples[:2] + examples[-2:], tokenizer.pad_token_id))
    return calls


def first_loss(cfg: PipelineConfig, stage: str) -> Any:
    """The stage's first training loss and its metrics: trainer.loss on four training examples with the model the
    rank builds (sft, reward_model); dpo and kto through their in-process first step (``fakes.first_step``)."""
    if cfg.kind(stage) in ("dpo", "kto"):
        from tests.config_keys.probes_methods import first_step_of

        return first_step_of(cfg, stage)
    impl = _stage_trainer(cfg, stage, stage_setup.setup_stage(cfg, stage).context())
    tokenizer = load_tokenizer("builtin:tiny")
    model = build_rank_model(impl, tokenizer, torch.float32, "sdpa")
    loss, metrics = impl.loss(model, impl.collate(_examples(cfg, stage, "train")[:4], tokenizer.pad_token_id))
    return {"loss": round(loss.item(), 6), "step_metrics": {k: round(v, 6) for k, v in metrics.items()}}


def _adds_aux_loss(a: Any, b: Any) -> bool:
    """The loss of an MoE model gains the load-balancing term (the same model, data and step), reported as
    aux_loss."""
    before, after = a, b
    aux = after["step_metrics"].get("aux_loss")
    return "aux_loss" not in before["step_metrics"] and aux is not None and aux > 0 and after["loss"] > before["loss"]


def worker_device(cfg: PipelineConfig, stage: str) -> str:
    """The device a training group's workers get (device.resolve_device, RLHF_DEVICE and num_gpus)."""
    return resolve_device(cfg.stage(stage).strategy.device)


def pairwise_loss(cfg: PipelineConfig, stage: str) -> float:
    """RewardModelTrainer(margin).loss on four fixed preference pairs with a fixed tiny reward model."""
    impl = _stage_trainer(cfg, stage, stage_setup.setup_stage(cfg, stage).context())
    tokenizer = load_tokenizer("builtin:tiny")
    model = build_rank_model(impl, tokenizer, torch.float32, "sdpa")
    batch = impl.collate(_examples(cfg, stage, "train")[:4], tokenizer.pad_token_id)
    return round(impl.loss(model, batch)[0].item(), 6)


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
    ctx = stage_setup.setup_stage(cfg, stage).context()
    # one rank, whatever the stage asks for: the report is about the optimizer and the model, not the group
    section = dataclasses.replace(ctx.strategy, num_workers=1), ctx.optim, ctx.train
    if repr(section) not in _ENGINES:
        one_rank_world()
        _ENGINES[repr(section)] = EngineReport(*section).fit()
    return _ENGINES[repr(section)]


_JOBS: dict[str, dict] = {}


def job_run(cfg: PipelineConfig, stage: str) -> dict:
    """The stage's job run for real, once per distinct config, on this process as the cluster (``LocalCluster``: one
    rank, no Ray), its trainers noting their batch sizes: checkpoints kept, step events, metrics, the critic
    output, a PPO job's step history."""
    key = content_key(cfg, stage)
    if key in _JOBS:
        return _JOBS[key]
    run_dir = Path(cfg.run_uri)
    events_file = run_dir / "events.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    saved_env = os.environ.get(events.EVENTS_ENV)
    os.environ[events.EVENTS_ENV] = str(events_file)
    cluster = recording()
    try:
        ref = job_module(cfg, stage).run(cfg, stage, cluster=cluster)
    finally:
        if saved_env is None:
            os.environ.pop(events.EVENTS_ENV, None)
        else:
            os.environ[events.EVENTS_ENV] = saved_env
    checkpoints = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / stage / "checkpoints").glob("step_*"))
    steps = [e["step"] for e in map(json.loads, events_file.read_text().splitlines()) if e["event"] == "step"]
    store = ObjectStore(str(run_dir))
    critic = store.is_complete(f"{stage}/critic")
    history = store.read_json(run_layout.metrics(stage)).get("history") if cfg.kind(stage) == "ppo" else None
    _JOBS[key] = {
        "checkpoints": checkpoints,
        "step_events": steps,
        "metrics": ref.metrics,
        "critic": critic,
        "history": history,
    }
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


def rollout_staleness(cfg, stage):
    """The weight updates each step's rollout lagged (train.async_enable; None: generated in the step)."""
    return [entry.get("rollout_staleness") for entry in job_run(cfg, stage)["history"]]


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
    **lora_probes("model", rank_lora),
    **lora_export_probe("model", rank_export),
    "model.aux_loss_coef": probe(
        "{stage}.model.aux_loss_coef=0.5",
        observe=first_loss,
        base=("{stage}.model.name_or_path=builtin:tiny-moe",),
        expect=_adds_aux_loss,
    ),
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


def data_probes(fixture: str, keys: dict[str, str]) -> dict[str, Probe]:
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
        "data.prompt_template": probe(
            "{stage}.data.prompt_template='Q: {{}} A:'", observe=train_examples, base=on_rows
        ),
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

SFT_SECTION = {**TRAINING_SECTION, **data_probes("sft", SFT_KEYS)}
REWARD_MODEL_SECTION = {
    **TRAINING_SECTION,
    **data_probes("pref", PREFERENCE_KEYS),
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
