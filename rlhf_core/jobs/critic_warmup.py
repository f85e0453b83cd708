"""Critic warm-up stage: the PPO loop with the actor frozen throughout, training the critic on fresh rollouts.

The critic learns the values of the policy it will meet before PPO starts moving that policy (OpenRLHF's
``freezing_steps``). Reads ``critic_warmup.actor`` (stage:sft), ``critic_warmup.critic`` (stage:critic_init),
``critic_warmup.reward``; writes the warmed critic to ``<run_uri>/critic_warmup/``, which the PPO stage loads
(``ppo.critic.name_or_path: stage:critic_warmup``). The number of warm-up steps is ``critic_warmup.train.max_steps``.

    python -m rlhf_core.jobs.critic_warmup --config deployments/configs/tiny.yaml
"""

from __future__ import annotations

from rlhf_core.config import PipelineConfig
from rlhf_core.jobs import common, ppo
from rlhf_core.types import CheckpointRef

KIND = "critic_warmup"


def run(cfg: PipelineConfig, stage: str = KIND) -> CheckpointRef:
    return ppo.run(cfg, stage=stage, train_actor=False)


if __name__ == "__main__":
    common.main(KIND, run)
