"""The names of the methods in ``algos``, as types: the one list of each vocabulary. The config's fields use these
types and checks these tuples; the functions that take a name dispatch on them. No torch here, so that reading a
config (the ``rlhf`` CLI, ``compare``) does not load torch."""

from __future__ import annotations

from typing import Literal, get_args

# Advantage estimators (advantages.py): GAE needs a critic; the rest are critic-free, the group ones over n samples.
GroupEstimator = Literal["reinforce++_baseline", "grpo", "rloo", "dr_grpo"]
AdvantageEstimator = Literal["gae", "reinforce++", GroupEstimator]
ADVANTAGE_ESTIMATORS: tuple[AdvantageEstimator, ...] = get_args(AdvantageEstimator)
GROUP_ESTIMATORS: tuple[GroupEstimator, ...] = get_args(GroupEstimator)

# KL estimators of log(pi/pi_ref) per token (ppo.py: approx_kl).
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[KLEstimator, ...] = get_args(KLEstimator)

# How the per-token policy loss becomes one number (ppo.py: aggregate_loss).
LossAggregation = Literal["token_mean", "seq_mean", "seq_sum_norm"]
LOSS_AGGREGATIONS: tuple[LossAggregation, ...] = get_args(LossAggregation)

# How the policy ratio is formed (ppo.py: policy_loss_tokens): per token (PPO) or per sequence (GSPO, gspo.py).
PolicyLoss = Literal["ppo", "gspo"]
POLICY_LOSSES: tuple[PolicyLoss, ...] = get_args(PolicyLoss)

# Off-policy correction between the rollout engine's log-probs and the trainer's (is_correction.py).
ISCorrection = Literal["tis", "icepop", "seq-mask-tis"]
IS_CORRECTIONS: tuple[ISCorrection, ...] = get_args(ISCorrection)
