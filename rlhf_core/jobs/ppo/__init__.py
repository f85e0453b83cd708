"""The ``ppo`` stage kind's job (and the critic warm-up's loop, its actor frozen), after OpenRLHF's single controller.

controller     ``PPOController``: set-up, the roles' start, ``fit`` and its numbered phases; ``run``, ``main``
roles          what the trained roles' contexts hold and how the frozen roles (reward model, reference) start
async_rollout  the generator thread of ``train.async_enable`` (and partial rollout)
experience     phases 2 and 3: the experience (log-probs, values, reward sources) and the advantages
old_logprobs   where a step's old log-probs come from (the training forward, the engines or the actor's forward)
evaluation     the held-out evaluation before and after training, the weight sync's probe, the final metrics

  python -m rlhf_core.jobs.ppo --config deployments/configs/tiny.yaml
"""

from __future__ import annotations

from rlhf_core.jobs.ppo.controller import main, run

__all__ = ["main", "run"]
