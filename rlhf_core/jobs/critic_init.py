"""Critic-initialisation stage: the critic starts as a copy of the reward model, backbone and value head.

Nothing is re-initialised (OpenRLHF's critic-from-RM trick): the reward model's ``score`` head becomes the value
head and its ``reward_mean``/``reward_std`` travel along. The copy is loaded and saved through
``AutoModelForSequenceClassification``, so a reward-model directory that cannot serve as a critic fails here.
No training happens, so this stage runs in the driver process without Ray.

    python -m rlhf_core.jobs.critic_init --config deployments/configs/tiny.yaml
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rlhf_core.config import ConfigError, PipelineConfig
from rlhf_core.distributed.cluster import Cluster
from rlhf_core.jobs import process, stage_setup
from rlhf_core.models.builders import load_tokenizer
from rlhf_core.types import CheckpointRef

KIND = "critic_init"


def run(cfg: PipelineConfig, stage: str = KIND, cluster: Cluster | None = None) -> CheckpointRef:
    """The copy, in this process: ``cluster`` is unused, taken as every job takes it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    # 1. the reward model, verified
    st = stage_setup.setup_stage(cfg, stage)
    if st.done is not None:
        return st.done
    section, store, work, rm_path = st.section, st.store, st.work, st.model_path
    key = f"{stage}.model.name_or_path"
    trust = section.model.trust_remote_code
    rm_config = AutoConfig.from_pretrained(rm_path, trust_remote_code=trust)
    if not any("ForSequenceClassification" in a for a in rm_config.architectures or []) or rm_config.num_labels != 1:
        raise ConfigError(f"'{key}' = {section.model.name_or_path} is not a reward model (one-output classifier)")

    # 2. copy: load and save the same weights, nothing re-initialised
    critic = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32, trust_remote_code=trust)
    critic.config.critic_initialised_from = section.model.name_or_path
    out = Path(work) / "export"
    shutil.rmtree(out, ignore_errors=True)
    critic.save_pretrained(str(out), safe_serialization=True)
    load_tokenizer(rm_path, section.model.tokenizer, trust_remote_code=trust).save_pretrained(str(out))
    metrics = {
        "parameters": sum(p.numel() for p in critic.parameters()),
        "reward_mean": getattr(rm_config, "reward_mean", None),
        "reward_std": getattr(rm_config, "reward_std", None),
    }
    store.put_artifact(
        str(out),
        stage,
        stage=stage,
        config_hash=st.config_hash,
        metrics=metrics,
        extra={"upstream": st.upstream},
        clear=False,
    )
    shutil.rmtree(work, ignore_errors=True)
    return CheckpointRef(store.uri(stage), stage, 0, st.config_hash, metrics)


if __name__ == "__main__":
    process.main(KIND, run)
