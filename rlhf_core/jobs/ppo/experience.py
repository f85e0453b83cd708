"""Phases 2 and 3 of a PPO-kind step: the experience of a rollout, its rewards and its advantages.

``ExperienceMaker.make`` runs the roles' forwards on the rollout (old and reference log-probs, values, the reward
model's scores) concurrently on their shards, while the driver calls the reward function and server; the sources are
summed into each sample's score (``RewardSources``). ``advantages`` turns the scores into token rewards (missing-EOS
penalty, clip, group shaping, the KL penalty with ``algo.kl_in_reward``) and those into advantages and returns (GAE,
or the returns of the critic-free estimators), with the off-policy correction's weights and the step's metrics.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from rlhf_core import timing
from rlhf_core.algos.advantages import cumulative_returns, shape_scores, varied_groups
from rlhf_core.algos.batching import ensure_eos, make_sequences
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.is_correction import is_correction_setting, is_correction_weights
from rlhf_core.algos.logprob_gap import engine_logprob_tensor
from rlhf_core.algos.losses import masked_mean
from rlhf_core.algos.ppo import apply_missing_eos_penalty, approx_kl, clip_scores, gae, token_rewards
from rlhf_core.config import PPOConfig
from rlhf_core.distributed.actor import PolicyActor
from rlhf_core.distributed.cluster import Cluster, WorkerGroup
from rlhf_core.distributed.critic import CriticActor
from rlhf_core.distributed.reference import ReferencePolicy
from rlhf_core.distributed.reward import RewardScorer
from rlhf_core.jobs.ppo.old_logprobs import old_logprobs
from rlhf_core.rewards import SOURCE_LOGS, Columns, RewardSources, Scored


@dataclasses.dataclass
class ExperienceMaker:
    """What the experience phase calls: the stage's role groups (None for a role it does not build), the cluster
    that waits on them, the reward sources, the actor's tokenizer with its pad, EOS and stop ids, and
    ``ref_from_actor`` (the critic warm-up's frozen actor is its own reference: no reference group)."""

    stage: str
    p: PPOConfig
    actor: WorkerGroup[PolicyActor]
    critic: WorkerGroup[CriticActor] | None
    reward: WorkerGroup[RewardScorer] | None
    reference: WorkerGroup[ReferencePolicy] | None
    cluster: Cluster
    rewards: RewardSources
    tokenizer: Any
    pad_id: int
    eos_id: int
    stop_ids: Any
    ref_from_actor: bool

    def make(
        self,
        prompt_ids: list[list[int]],
        responses: list[list[int]],
        prompts: list,
        timer: timing.PhaseTimer | None = None,
        old: str = "forward",
        engine_logprobs: list[list[float]] | None = None,
        columns: Columns | None = None,
    ) -> Scored:
        """Old and reference log-probs, values (with a critic) and the summed reward sources, the roles concurrently
        on their shards while the driver calls the reward function and server. The reward model scores prompt +
        response + EOS where a response was cut (``ensure_eos``), as it was trained. ``timer``: each role's seconds
        from the first dispatch to its last result, as ``experience_<role>``. ``old``: where the old log-probs come
        from (``jobs.ppo.old_logprobs``); ``engine_logprobs``: the engines' per-response log-probs; ``columns``: the
        prompts' labels and other values, one per prompt, for the reward function and the server."""
        n = len(responses) // len(prompt_ids)
        expanded = [ids for ids in prompt_ids for _ in range(n)]
        seq = make_sequences(expanded, responses, self.pad_id)
        closed, truncated = ensure_eos(responses, self.eos_id, self.stop_ids)
        engine_lp = engine_logprob_tensor(seq, engine_logprobs) if engine_logprobs is not None else None
        assert old == "forward" or engine_lp is not None, f"old log-probs from {old} need the engines' log-probs"
        started = time.perf_counter()
        shards, refs = seq.shard(len(self.actor)), {}
        if old == "engine":  # the actor scores the first micro-batch of each rank's shard: the gap's probe
            shards = [s.split(self.p.train.micro_rollout_batch_size)[0] for s in shards]
        if old != "training":
            refs["actor"] = self.actor.call_each_async(PolicyActor.logprobs, shards)
        if self.reference is not None:
            refs["reference"] = self.reference.call_each_async(
                ReferencePolicy.logprobs, seq.shard(len(self.reference))
            )
        if self.critic is not None:
            refs["critic"] = self.critic.call_each_async(CriticActor.values, seq.shard(len(self.critic)))
        if self.reward is not None:
            scored = make_sequences(expanded, closed, self.pad_id)
            refs["reward"] = self.reward.call_each_async(RewardScorer.scores, scored.shard(len(self.reward)))
        raw = [pr for pr in prompts for _ in range(n)]
        sample_columns = columns.expanded(n) if columns is not None else None
        parts, keep = self.rewards.score_on_driver(self.tokenizer, raw, responses, timer, sample_columns)
        out, seconds = self.cluster.wait_timed(refs, started)
        if timer is not None:
            for role, sec in seconds.items():
                timer.add(f"experience_{role}", sec)
        if "reward" in out:
            parts["reward"] = torch.cat(out["reward"])
        pi_old, logs = old_logprobs(self.stage, self.p, self.actor, seq, old, engine_lp, out.get("actor"), timer)
        ref_logprobs = torch.cat(out["reference"]) if "reference" in out else None
        if ref_logprobs is None and self.ref_from_actor:
            ref_logprobs = pi_old
        exp = Experience.from_sequences(
            seq,
            old_logprobs=pi_old,
            scores=self.rewards.combine(parts),
            values=torch.cat(out["critic"]) if "critic" in out else None,
            ref_logprobs=ref_logprobs,
            truncated=truncated,
            rollout_logprobs=engine_lp if pi_old is None else None,
        )
        return Scored(exp, parts, keep, logs)


def advantages(
    scored: Scored, p: PPOConfig, kl_coef: float, engine_logprobs: torch.Tensor | None = None
) -> tuple[Experience, dict[str, float]]:
    """Rewards -> penalties and clip -> group shaping -> token rewards (KL penalty ``kl_coef``, the KL controller's
    value, with ``algo.kl_in_reward``) -> GAE, or the returns (critic-free: the advantage is the return). Samples
    dropped by the reward function's ``keep`` or ``algo.dynamic_filter`` lose their action tokens.
    ``engine_logprobs``: (B, T-1) the engines' log-probs (NaN where none), for the off-policy correction's weights
    (``algo.is_correction``, ``is_correction_cap``)."""
    algo, exp = p.algo, scored.exp
    # Missing-EOS penalty after normalisation and before clipping, as OpenRLHF adds its length penalties (DAPO
    # overlong, ProRL stop-properly) to the normalised reward before compute_reward clamps it.
    scores = exp.scores
    if exp.truncated is not None:
        scores = apply_missing_eos_penalty(scores, exp.truncated, algo.missing_eos_penalty)
    scores = clip_scores(scores, *algo.reward_clip)
    n = p.rollout.n_samples_per_prompt
    keep = scored.keep if scored.keep is not None else torch.ones(exp.size, dtype=torch.bool)
    if algo.dynamic_filter:
        keep = keep & varied_groups(scores, n)
    mask = exp.action_mask
    # (B, T-1) KL to the reference on the action tokens; 0 without reference log-probs (no KL), or without old
    # log-probs (the actor measures it in its training forward; such a step has no KL in its rewards)
    if exp.ref_logprobs is None or exp.old_logprobs is None:
        kl = torch.zeros(mask.shape)
    else:
        kl = approx_kl(exp.old_logprobs, exp.ref_logprobs, mask, algo.kl_estimator)
    # Without a KL (kl_coef 0, no target) the controller's value is 0: the penalty is 0 either way.
    penalty = kl_coef if algo.kl_in_reward else 0.0
    rewards = token_rewards(shape_scores(scores, n, algo.advantage_estimator), kl, mask, penalty)
    if algo.advantage_estimator == "gae":
        assert exp.values is not None, "gae needs the critic's values"
        exp = exp.with_advantages(*gae(rewards, exp.values, mask, algo.gamma, algo.lam))
    else:
        returns = cumulative_returns(rewards, mask, algo.gamma)
        exp = exp.with_advantages(returns, returns)
    is_logs: dict[str, float] = {}
    correction = is_correction_setting(algo.is_correction, algo.is_correction_threshold, algo.is_correction_cap)
    # without old log-probs the actor weighs its loss from its training forward's log-probs
    if correction is not None and engine_logprobs is not None and exp.old_logprobs is not None:
        weights, is_logs = is_correction_weights(exp.old_logprobs, engine_logprobs, mask, *correction)
        exp = dataclasses.replace(exp, is_weights=weights)
    if not bool(keep.all()):
        exp = dataclasses.replace(exp, action_mask=mask * keep.unsqueeze(1).to(mask.dtype))
    truncated = exp.truncated if exp.truncated is not None else torch.zeros(exp.size, dtype=torch.bool)
    logs = {
        "reward": scores.mean().item(),
        **{SOURCE_LOGS[key]: part.mean().item() for key, part in scored.parts.items()},
        "kl": (kl * mask).sum(1).mean().item(),  # per-sequence sum, mean over the batch
        # OpenRLHF's units (what the adaptive controller reads): each sequence's token mean, mean over the batch
        "kl_token_mean": masked_mean(kl, mask, dim=1).mean().item(),
        "response_len": mask.sum(1).float().mean().item(),
        "truncated_frac": truncated.float().mean().item(),
        "kl_coef": kl_coef,
        **is_logs,
    }
    if algo.dynamic_filter or scored.keep is not None:
        logs["filtered_frac"] = 1.0 - keep.float().mean().item()
    return exp, logs
