"""The held-out evaluation of a PPO-kind stage, before and after training, and the stage's summary metrics.

One sampled response per held-out prompt (``train.eval_prompts`` rows of ``data.eval_path``), scored like the
training's experience: each reward source's mean, the KL to the reference and, with ``train.gold_reward``, the task's
gold reward. ``HeldOut.evaluate`` samples on the engines and scores through the experience phase
(``ExperienceMaker``), its batch padded for the roles, and turns the scored batch into metrics. ``probe_logprobs``
gives the weight sync's proof, one fixed sequence scored by the engines and the actor, and ``summary_metrics`` sums
up the step history, both evaluations and the probes for the stage's final metrics.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch

from rlhf_core import timing
from rlhf_core.algos.batching import make_sequences
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.ppo import approx_kl
from rlhf_core.config import PPOConfig
from rlhf_core.data.examples import prompt_examples
from rlhf_core.distributed.actor import PolicyActor
from rlhf_core.distributed.cluster import WorkerGroup
from rlhf_core.distributed.rollout.engine import SamplingConfig
from rlhf_core.jobs.ppo.experience import ExperienceMaker
from rlhf_core.rewards import SOURCE_LOGS, load_gold


@dataclasses.dataclass
class HeldOut:
    """The held-out prompts (``prompt_examples`` rows: ``prompt``, ``prompt_ids``; none without ``eval_prompts``)
    and the gold-reward function (None without ``train.gold_reward``)."""

    examples: list[dict]
    gold: Callable[[str, str], float] | None = None

    @classmethod
    def load(cls, p: PPOConfig, tokenizer: Any, storage_options: dict) -> HeldOut:
        rows = p.train.eval_prompts
        examples = prompt_examples(p.data, tokenizer, "eval", storage_options, max_rows=rows) if rows > 0 else []
        return cls(examples, load_gold(p.train.gold_reward))

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [e["prompt_ids"] for e in self.examples]

    def sampling(self, p: PPOConfig) -> SamplingConfig:
        """One response per prompt at the rollout's settings, with a fixed seed: before and after sample alike."""
        rollout = p.rollout
        return SamplingConfig(
            n=1,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            max_new_tokens=rollout.max_new_tokens,
            seed=p.train.seed + 1,
        )

    def batch(self, responses: list[list[int]], multiple: int) -> tuple[list, list, list]:
        """Prompt ids, responses and raw prompts, padded with copies of the first row to a multiple of ``multiple``
        rows, so that every role can split the batch; ``metrics`` reads the held-out rows only."""
        ids, raw = self.prompt_ids, [e["prompt"] for e in self.examples]
        extra = (-len(ids)) % multiple
        return ids + ids[:1] * extra, responses + responses[:1] * extra, raw + raw[:1] * extra

    def metrics(
        self, exp: Experience, parts: dict[str, torch.Tensor], responses: list[list[int]], tokenizer: Any
    ) -> dict[str, float]:
        """Each reward source's mean score, their weighted sum (with more than one source), the KL to the reference
        (k1 summed per response; left out without reference log-probs) and the mean gold reward."""
        count = len(self.examples)
        out = {SOURCE_LOGS[key]: part[:count].mean().item() for key, part in parts.items()}
        if len(parts) > 1:
            out["reward"] = exp.scores[:count].mean().item()
        if exp.ref_logprobs is not None and exp.old_logprobs is not None:  # as experience.advantages reads them
            mask = exp.action_mask[:count]
            kl = approx_kl(exp.old_logprobs[:count], exp.ref_logprobs[:count], mask, "k1")
            out["kl_to_ref"] = (kl * mask).sum(1).mean().item()
        if self.gold is not None:
            texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
            prompts = [e["prompt"] if isinstance(e["prompt"], str) else json.dumps(e["prompt"]) for e in self.examples]
            out["gold_reward"] = sum(self.gold(pr, tx) for pr, tx in zip(prompts, texts)) / count
        return out

    def evaluate(self, engines: Any, maker: ExperienceMaker, multiple: int) -> dict[str, float]:
        """One sampled response per held-out prompt (a fixed seed: before and after alike), scored as in training;
        ``multiple``: the rows every role can split the batch by (``placement.row_multiple``)."""
        if not self.examples:
            return {}
        responses = engines.generate(self.prompt_ids, self.sampling(maker.p))
        scored = maker.make(*self.batch(responses, multiple))
        return self.metrics(scored.exp, scored.parts, responses, maker.tokenizer)


def probe_logprobs(
    engines: Any, actor: WorkerGroup[PolicyActor], prompt_ids: list[int], tokenizer: Any, pad_id: int
) -> tuple[list[float], list[float]]:
    """Log-probs of one fixed sequence (``prompt_ids``, then a fixed text) from the first engine and from the actor
    (rank 0's copy), both of the raw logits (temperature 1: the engines' prompt log-probs do not see the sampling
    temperature)."""
    text = "The garden is calm and lovely today."
    probe = prompt_ids + tokenizer(text, add_special_tokens=False)["input_ids"]
    engine_lp = engines.sequence_logprobs(probe)
    rows = len(actor)
    # every token after the first is scored (the actor's log-probs cover the action tokens)
    batch = make_sequences([probe[:1]] * rows, [probe[1:]] * rows, pad_id)
    actor_lp = actor.call_each(PolicyActor.logprobs, batch.shard(rows), 1.0)[0][0].tolist()
    return engine_lp, actor_lp


def summary_metrics(
    history: list[dict], before: dict, after: dict, probes: tuple[list[float], list[float], list[float]]
) -> dict[str, Any]:
    """The weight sync's proof from ``probes`` (a fixed sequence's log-probs from the engines and the actor after
    training, and from the engines before it), the largest rollout log-prob gap of the steps, the evaluations as
    ``<metric>_before`` / ``_after``, the last step's KL, rewards and losses, and the seconds per phase of a step,
    mean and total over the steps (``timing/<phase>_s_mean``, ``_total``; ``timing/steps``)."""
    engine_lp, actor_lp, engine_lp_start = probes
    out: dict[str, Any] = {
        "sync_engine_vs_actor_max_diff": max(abs(a - b) for a, b in zip(engine_lp, actor_lp)),
        "sync_engine_change_max": max(abs(a - b) for a, b in zip(engine_lp, engine_lp_start)),
    }
    gaps = [h["rollout_logprob_max_diff"] for h in history if "rollout_logprob_max_diff" in h]
    if gaps:
        out["rollout_logprob_max_diff"] = max(gaps)
    out.update({f"{k}_before": v for k, v in before.items()})
    out.update({f"{k}_after": v for k, v in after.items()})
    last = history[-1] if history else {}
    kept = ("kl", "kl_token_mean", "reward", *SOURCE_LOGS.values(), "policy_loss", "critic_loss")
    out.update({k: last[k] for k in kept if k in last})
    out.update(timing.summarize(history))
    return out
