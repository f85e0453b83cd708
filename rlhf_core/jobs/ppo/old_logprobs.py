"""Where a PPO-kind step's old log-probs come from, the behaviour policy of its clipped ratio.

"training": a batch of one optimizer step (one epoch, one mini-batch) whose rewards carry no KL. The actor's weights
do not change between the experience phase and that one training forward, so the training forward's log-probs,
detached, are the ones the actor's forward would have given, exactly: the ratio is 1 and the gradient PPO's at
ratio 1. The experience phase runs no actor forward, and the actor measures
what the controller would have from them (``PolicyActor.fit``). With a KL penalty in the rewards
(``algo.kl_in_reward``) the rewards and advantages need them before training, so the forward stays.

"engine" (``algo.use_rollout_logprobs``, a batch of several optimizer steps): the engines' log-probs are the old ones.
The actor scores only the first micro-batch of each rank's shard; its largest gap to the engines decides: above
``algo.rollout_logprobs_max_diff``, or where an engine reported no log-prob, the step takes the actor's forward after
all. The probe is a sample: a token outside it may differ more.

"forward": the actor's experience forward, as before.

``old_logprobs`` takes the step's old log-probs from the source decided, with the actor's forward after all where
"engine" falls back.
"""

from __future__ import annotations

import time

import torch

from rlhf_core import timing
from rlhf_core.algos.experience import Experience, SequenceBatch
from rlhf_core.algos.logprob_gap import rollout_logprob_gap
from rlhf_core.config import PPOConfig
from rlhf_core.distributed.actor import PolicyActor
from rlhf_core.distributed.cluster import WorkerGroup


def old_logprobs_source(p: PPOConfig, actor_frozen: bool, ref_from_actor: bool) -> str:
    """ "training", "engine" or "forward" (the module's docstring) for a step whose actor is ``actor_frozen`` or
    trains; ``ref_from_actor``: the old log-probs are also the reference's (the critic warm-up)."""
    a = p.algo
    one_step = (
        a.ppo_epochs == 1 and p.train.train_batch_size == p.train.rollout_batch_size * p.rollout.n_samples_per_prompt
    )
    if not actor_frozen and one_step and not a.kl_in_reward and not ref_from_actor:
        return "training"
    return "engine" if a.use_rollout_logprobs else "forward"


def probe_rows(size: int, ranks: int, micro: int) -> torch.Tensor:
    """(K,) the rows of a batch of ``size`` rows the actor scores in "engine" mode: the first ``micro`` rows of each
    of the ``ranks`` contiguous shards (``TensorBatch.shard``), what each rank's first forward micro-batch holds."""
    per = size // ranks
    return torch.cat([torch.arange(r * per, r * per + min(micro, per)) for r in range(ranks)])


def engine_old_logprobs(
    seq: SequenceBatch, engine_lp: torch.Tensor, probed: torch.Tensor, probe_lp: torch.Tensor, bound: float
) -> tuple[torch.Tensor | None, dict[str, float], str]:
    """The engines' log-probs as the old ones (B, T-1), 0 off the action tokens, or None with the reason when the step
    must take the actor's forward; and the metrics: the probe's ``rollout_logprob_max_diff``.

    Args:
        seq: the step's sequences (B rows).
        engine_lp: (B, T-1) the engines' log-probs, NaN where none (``engine_logprob_tensor``).
        probed: (K,) the rows the actor scored (``probe_rows``); probe_lp: (K, T-1) its log-probs of them.
        bound: ``algo.rollout_logprobs_max_diff``.
    """
    probe = Experience.from_sequences(seq.select_rows(probed), old_logprobs=probe_lp, scores=torch.zeros(len(probed)))
    gap = rollout_logprob_gap(probe, engine_lp[probed])
    logs = {"rollout_logprob_max_diff": gap}
    mask = seq.action_mask.bool()
    if bool((engine_lp.isnan() & mask).any()):
        return None, logs, "tokens without engine log-probs"
    if gap > bound:
        return None, logs, f"rollout_logprob_max_diff {gap:.4f} > algo.rollout_logprobs_max_diff {bound}"
    return torch.where(mask, engine_lp, torch.zeros_like(engine_lp)), logs, ""


def old_logprobs(
    stage: str,
    p: PPOConfig,
    actor: WorkerGroup[PolicyActor],
    seq: SequenceBatch,
    old: str,
    engine_lp: torch.Tensor | None,
    actor_out: list[torch.Tensor] | None,
    timer: timing.PhaseTimer | None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The old log-probs (B, T-1) from ``old`` (``old_logprobs_source``; None: "training") and their metrics:
    ``old_logprob_forward_rows`` (rows the actor's experience forward scored), ``old_logprobs_engine`` (1: the
    engines' are the old ones). ``actor_out``: the experience forward's per-rank log-probs (the probe's, for
    "engine"). A fallen-back "engine" step's whole forward counts in ``experience_actor``."""
    if old == "training":
        return None, {"old_logprob_forward_rows": 0.0, "old_logprobs_engine": 0.0}
    assert actor_out is not None
    if old == "engine":
        assert engine_lp is not None
        probed = probe_rows(seq.size, len(actor), p.train.micro_rollout_batch_size)
        bound = p.algo.rollout_logprobs_max_diff
        engine_old, logs, why = engine_old_logprobs(seq, engine_lp, probed, torch.cat(actor_out), bound)
        if engine_old is not None:
            return engine_old, {**logs, "old_logprob_forward_rows": float(len(probed)), "old_logprobs_engine": 1.0}
        print(f"[{stage}] {why}: the actor's forward gives this step's old log-probs", flush=True)
        started = time.perf_counter()
        actor_out = actor.call_each(PolicyActor.logprobs, seq.shard(len(actor)))
        if timer is not None:
            timer.add("experience_actor", time.perf_counter() - started)
    return torch.cat(actor_out), {"old_logprob_forward_rows": float(seq.size), "old_logprobs_engine": 0.0}
