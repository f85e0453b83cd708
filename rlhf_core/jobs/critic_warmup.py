"""Critic warm-up stage: the PPO loop with the actor frozen throughout, training the critic on fresh rollouts.

The critic learns the values of the policy it will meet before PPO starts moving that policy (OpenRLHF's
``freezing_steps``). Reads ``critic_warmup.actor.model`` (stage:sft), ``critic_warmup.critic.model``
(stage:critic_init), ``critic_warmup.reward.model``; writes the warmed critic to ``<run_uri>/critic_warmup/``, which
the PPO stage loads (``ppo.critic.model.name_or_path: stage:critic_warmup``). The number of warm-up steps is
``critic_warmup.train.max_steps``. The section (``config.CriticWarmupConfig``) has no actor optimizer or loss; the PPO
loop runs it with PPO's defaults for those (``config.as_ppo``), which a frozen actor never uses.

    python -m rlhf_core.jobs.critic_warmup --config deployments/configs/tiny.yaml
"""

from __future__ import annotations

from rlhf_core.config import PipelineConfig
from rlhf_core.distributed.cluster import Cluster
from rlhf_core.jobs import ppo, process
from rlhf_core.types import CheckpointRef

KIND = "critic_warmup"


def run(cfg: PipelineConfig, stage: str = KIND, cluster: Cluster | None = None) -> CheckpointRef:
    """The stage on ``cluster`` (default: Ray)."""
    return ppo.run(cfg, stage=stage, train_actor=False, cluster=cluster)


if __name__ == "__main__":
    process.main(KIND, run)
