"""An example reward function for the score stage: the synthetic task's gold reward over a batch.

    score.reward_fn: rlhf_core/assets/reward_fns/gold.py:gold_rewards

A reward function takes the rows' prompts (raw values: strings or message lists) and responses and returns one
finite float per row.
"""

from __future__ import annotations

import json

from rlhf_core.data.synthetic import gold_reward


def gold_rewards(prompts: list, responses: list[str]) -> list[float]:
    return [
        gold_reward(p if isinstance(p, str) else json.dumps(p), r) for p, r in zip(prompts, responses, strict=True)
    ]
