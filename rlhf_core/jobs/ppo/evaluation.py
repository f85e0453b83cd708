"""The held-out evaluation of a PPO-kind stage, before and after training, and the stage's summary metrics.

One sampled response per held-out prompt (``train.eval_prompts`` rows of ``data.eval_path``), scored like the
training's experience: each reward source's mean, the KL to the reference and, with ``train.gold_reward``, the task's
gold reward (given each row's label when the data has labels). ``HeldOut.evaluate`` samples on the engines and
scores through the experience phase (``ExperienceMaker``), its batch padded for the roles, and turns the scored batch
into metrics. With ``train.eval_greedy`` and ``train.eval_pass_k`` it also answers each prompt greedily and k times
at the rollout temperature, and a judge (``train.eval_reward_fn``, else the stage's ``reward_fn``, with the labels)
marks each answer correct at a score of at least ``train.eval_correct_at``: ``accuracy_greedy`` and
``pass_at_<k>``, each with its standard error (``algos.accuracy``) and the row count ``eval_rows``. ``probe_logprobs``
gives the weight sync's proof, one fixed sequence scored by the engines and the actor, and ``summary_metrics`` sums
up the step history, both evaluations and the probes for the stage's final metrics; ``check_engine_sync`` fails the
stage when the probes disagree (``train.sync_check_tolerance``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlhf_core import timing
from rlhf_core.algos.accuracy import mean_pass_at_k, proportion
from rlhf_core.algos.batching import make_sequences
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.ppo import approx_kl
from rlhf_core.config import PPOConfig
from rlhf_core.data.examples import prompt_examples
from rlhf_core.distributed.actor import PolicyActor
from rlhf_core.distributed.cluster import WorkerGroup
from rlhf_core.distributed.rollout.engine import SamplingConfig
from rlhf_core.jobs.ppo.experience import ExperienceMaker
from rlhf_core.rewards import (
    SOURCE_LOGS,
    Columns,
    GoldFn,
    RewardFn,
    call_gold,
    call_reward_fn,
    load_gold,
    load_reward_fn,
)
from rlhf_core.rewards import gold_spec as resolve_gold


@dataclasses.dataclass
class HeldOut:
    """The held-out prompts (``prompt_examples`` rows: ``prompt``, ``prompt_ids``, their labels and columns; none
    without ``eval_prompts``), the gold-reward function (None without one; ``gold_spec``: which, for the log)
    and the judge of the greedy accuracy and pass@k (``judge_spec`` at ``judge_key``; None when neither is asked)."""

    examples: list[dict]
    gold: GoldFn | None = None
    gold_spec: str | None = None
    judge: RewardFn | None = None
    judge_spec: str = ""
    judge_key: str = ""
    greedy: bool = False
    pass_k: int = 0
    correct_at: float = 1.0
    columns: Columns = dataclasses.field(default_factory=Columns)

    @classmethod
    def load(cls, p: PPOConfig, tokenizer: Any, storage_options: dict, stage: str = "ppo") -> HeldOut:
        t = p.train
        rows = t.eval_prompts
        examples = prompt_examples(p.data, tokenizer, "eval", storage_options, max_rows=rows) if rows > 0 else []
        gold = resolve_gold(t.gold_reward, p.data.train_path)
        judge_key, judge_spec = f"{stage}.train.eval_reward_fn", t.eval_reward_fn
        if judge_spec is None:
            judge_key, judge_spec = f"{stage}.reward_fn", p.reward_fn
        asked = bool(examples) and (t.eval_greedy or t.eval_pass_k > 0) and judge_spec is not None
        judge = load_reward_fn(judge_spec, judge_key) if asked and judge_spec is not None else None
        columns = Columns.of(examples, f"{stage}.data.label_key")
        return cls(
            examples,
            load_gold(gold, f"{stage}.train.gold_reward"),
            gold,
            judge,
            judge_spec or "",
            judge_key,
            t.eval_greedy,
            t.eval_pass_k,
            t.eval_correct_at,
            columns,
        )

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [e["prompt_ids"] for e in self.examples]

    def described(self) -> dict[str, str]:
        """Which rewards the evaluation used, for the stage's log: the gold reward and the accuracy's judge."""
        out = {"eval_gold_reward": self.gold_spec or "none"}
        return out | ({"eval_judge": self.judge_spec} if self.judge is not None else {})

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

    def batch(self, responses: list[list[int]], multiple: int) -> tuple[list, list, list, Columns]:
        """Prompt ids, responses, raw prompts and their columns, padded with copies of the first row to a multiple
        of ``multiple`` rows, so that every role can split the batch; ``metrics`` reads the held-out rows only."""
        ids, raw = self.prompt_ids, [e["prompt"] for e in self.examples]
        extra = (-len(ids)) % multiple
        padded = ids + ids[:1] * extra, responses + responses[:1] * extra, raw + raw[:1] * extra
        return (*padded, self.columns.padded(extra))

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
            texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses[:count]]
            prompts = [e["prompt"] for e in self.examples]
            out["gold_reward"] = sum(call_gold(self.gold, prompts, texts, self.columns.labels)) / count
        return out

    def correct(self, tokenizer: Any, responses: list[list[int]], n: int) -> list[bool]:
        """Whether each of the ``n`` responses per held-out prompt (in prompt order) scores at least ``correct_at``
        by the judge, given its prompt's labels and columns."""
        assert self.judge is not None
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        prompts = [e["prompt"] for e in self.examples for _ in range(n)]
        scores = call_reward_fn(self.judge, self.judge_spec, self.judge_key, prompts, texts, self.columns.expanded(n))
        return [s >= self.correct_at for s in scores]

    def accuracy(self, engines: Any, p: PPOConfig, tokenizer: Any) -> dict[str, float]:
        """``accuracy_greedy`` (one greedy answer per prompt) and ``pass_at_<k>`` (k sampled answers per prompt,
        the unbiased estimator), each with ``_se``, and ``eval_rows``; {} when neither is asked."""
        if self.judge is None:
            return {}
        out: dict[str, float] = {"eval_rows": float(len(self.examples))}
        r = p.rollout
        if self.greedy:
            greedy = SamplingConfig(
                n=1, temperature=0.0, top_p=1.0, max_new_tokens=r.max_new_tokens, seed=p.train.seed
            )
            responses = engines.generate(self.prompt_ids, greedy)
            out["accuracy_greedy"], out["accuracy_greedy_se"] = proportion(self.correct(tokenizer, responses, 1))
        k = self.pass_k
        if k > 0:
            sampling = dataclasses.replace(self.sampling(p), n=k, seed=p.train.seed + 2)
            flags = self.correct(tokenizer, engines.generate(self.prompt_ids, sampling), k)
            per_prompt = [flags[i * k : (i + 1) * k] for i in range(len(self.examples))]
            out[f"pass_at_{k}"], out[f"pass_at_{k}_se"] = mean_pass_at_k(per_prompt, k)
        return out

    def evaluate(self, engines: Any, maker: ExperienceMaker, multiple: int) -> dict[str, float]:
        """One sampled response per held-out prompt (a fixed seed: before and after alike), scored as in training;
        ``multiple``: the rows every role can split the batch by (``placement.row_multiple``)."""
        if not self.examples:
            return {}
        responses = engines.generate(self.prompt_ids, self.sampling(maker.p))
        ids, padded, raw, columns = self.batch(responses, multiple)
        scored = maker.make(ids, padded, raw, columns=columns)
        out = self.metrics(scored.exp, scored.parts, responses, maker.tokenizer)
        return out | self.accuracy(engines, maker.p, maker.tokenizer)


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


# The least gap ``check_engine_sync`` allows in bf16: the engines' kernels and the actor's round each logit to 8 bits
# of mantissa in their own order, so their log-probs of one sequence differ by up to about 0.1 with a sound sync.
BF16_SYNC_TOLERANCE = 0.5


def check_engine_sync(stage: str, metrics: dict[str, Any], tolerance: float | None, precision: str = "fp32") -> None:
    """Raise when ``metrics``' ``sync_engine_vs_actor_max_diff`` (``summary_metrics``) is above ``tolerance``
    (``train.sync_check_tolerance``; at least ``BF16_SYNC_TOLERANCE`` with ``precision`` bf16; None: no check): the
    engines sampled the stage's rollouts from other weights than the actor's."""
    gap = metrics.get("sync_engine_vs_actor_max_diff")
    if tolerance is None or gap is None:
        return
    allowed = max(tolerance, BF16_SYNC_TOLERANCE) if precision == "bf16" else tolerance
    if not gap <= allowed:  # (a NaN gap fails too)
        raise RuntimeError(
            f"the rollout engines' log-probs differ from the actor's by {gap:.4g} after the last weight sync "
            f"(tolerance {allowed:g}{' in bf16' if allowed != tolerance else ''}, "
            f"'{stage}.train.sync_check_tolerance'): the engines do not serve the weights the actor trains"
        )
