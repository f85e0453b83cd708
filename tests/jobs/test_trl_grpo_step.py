"""One GRPO optimizer step of the project's actor equals one of TRL's ``GRPOTrainer``, from the same weights on the
same batch: the same 2 prompts x 4 responses and rewards, GRPO advantages (group mean, divided by the group's
Bessel-corrected std), no KL, one PPO epoch on policy (ratio 1: nothing clipped), temperature 1, AdamW (betas
0.9/0.999, eps 1e-8, no weight decay) at a constant learning rate of 1e-3, no gradient clipping, fp32 on CPU.

The project's side is the real ``PolicyActor`` (DeepSpeed ZeRO-2, one rank in this process: ``LocalCluster``), its
context built from a ``ppo`` section of the tiny preset as ``ppo.run`` builds it, and its advantages from the PPO
job's own advantage phase (``jobs.ppo.experience.advantages``). TRL's side is ``GRPOTrainer`` with a ``rollout_func``
that returns the fixed responses and a reward function that looks their rewards up; a subclass only records the
advantages, the loss and the row order TRL computed.

Each aggregation of the actor loss is checked against its TRL twin: ``algo.loss_agg`` token_mean = TRL ``dapo`` (and
``bnpo``: one micro-batch per step), seq_mean = ``grpo``, seq_sum_norm with ``rollout.max_new_tokens`` = ``dr_grpo``
with ``max_completion_length``. What differs by design, with no setting on the project's side, is replicated here:
TRL adds 1e-4 to the group std where the project adds 1e-9; the test asserts both formulas on the batch, then gives
the actor TRL's advantages (see "Compared with TRL" in docs/rl-algorithms.md).

Adam's first step is lr x g / (|g| + eps) per weight whatever its betas (they cannot show in one step) and almost
whatever the scale of the gradient, so the loss values are compared as well: they carry the scale that the update
hides. Written against TRL 1.16: its ``rollout_func`` hook and the batch ``_generate_and_score_completions`` returns.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.algos.advantages import shape_scores
from rlhf_core.algos.batching import make_sequences
from rlhf_core.algos.experience import Experience
from rlhf_core.config import PPOConfig, as_ppo, load_config
from rlhf_core.distributed.actor import PolicyActor
from rlhf_core.distributed.cluster import LocalCluster
from rlhf_core.jobs import stage_setup
from rlhf_core.jobs.ppo.experience import advantages
from rlhf_core.jobs.ppo.roles import role_context
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.rewards import Scored
from rlhf_core.storage import ObjectStore
from tests.conftest import TINY

pytestmark = [pytest.mark.slow, pytest.mark.extended]

LR = 1e-3
GROUP = 4  # responses per prompt
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12]]  # one length: TRL left-pads prompts, the project right-pads rows
EOS = -1  # stands for the tokenizer's EOS in RESPONSES
# responses of unequal lengths, so that token_mean, seq_mean and seq_sum_norm weigh their tokens differently
RESPONSES = [
    [20, 21, EOS],
    [22, EOS],
    [23, 24, 25, 26, 27, 28, 29],
    [30, 31, 32, EOS],
    [33, EOS],
    [34, 35, 36, 37, 38, 39, EOS],
    [40],
    [41, 42, 43],
]
REWARDS = [1.0, 0.0, 0.5, 0.25, 0.9, 0.1, 0.0, 0.3]
MAX_NEW_TOKENS = 8
TRL_STD_EPS, PROJECT_STD_EPS = 1e-4, 1e-9  # added to the group std (trl GRPOTrainer; advantages.shape_scores)
# the project's algo.loss_agg and TRL's loss_type that aggregate the per-token loss alike
PAIRS = [("token_mean", "dapo"), ("token_mean", "bnpo"), ("seq_mean", "grpo"), ("seq_sum_norm", "dr_grpo")]


def _responses(eos: int) -> list[list[int]]:
    return [[eos if t == EOS else t for t in r] for r in RESPONSES]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama of ``builtin:tiny`` (seed 3) and the bundled tokenizer, saved: both sides load these weights."""
    out = tmp_path_factory.mktemp("tiny-llama")
    tok = load_tokenizer("builtin:tiny")
    model = build_causal_lm("builtin:tiny", tok, seed=3, dtype=torch.float32, attn="sdpa")
    assert model.config.attention_dropout == 0.0  # a Llama has no other dropout: training forwards are deterministic
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _group_advantages(eps: float) -> torch.Tensor:
    """(B,) (r - mean(group)) / (std(group) + eps), Bessel's std, in float64."""
    g = torch.tensor(REWARDS, dtype=torch.float64).view(-1, GROUP)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).reshape(-1)


def ppo_section(tmp_path, model_dir, loss_agg: str, lr: float = LR, seed: int = 7) -> PPOConfig:
    """The tiny preset's ``ppo`` section set up as GRPO on the batch: critic-free, no KL, one epoch, one optimizer step
    over the whole batch in one micro-batch, AdamW at a constant ``lr`` without clipping."""
    overrides = [
        f"run_uri={tmp_path / 'run'}",
        "ppo.critic.model=null",
        f"ppo.actor.model.name_or_path={model_dir}",
        "ppo.algo.advantage_estimator=grpo",
        "ppo.algo.kl_coef=0.0",
        f"ppo.algo.loss_agg={loss_agg}",
        "ppo.algo.ppo_epochs=1",
        f"ppo.rollout.n_samples_per_prompt={GROUP}",
        "ppo.rollout.temperature=1.0",
        f"ppo.rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"ppo.train.rollout_batch_size={len(PROMPTS)}",
        f"ppo.train.train_batch_size={len(RESPONSES)}",
        f"ppo.train.micro_train_batch_size={len(RESPONSES)}",
        f"ppo.train.micro_rollout_batch_size={len(RESPONSES)}",
        f"ppo.actor.optim.lr={lr}",
        "ppo.actor.optim.adam_betas=[0.9,0.999]",
        "ppo.actor.optim.weight_decay=0.0",
        "ppo.actor.optim.max_norm=0.0",
        "ppo.actor.optim.lr_scheduler=constant_with_warmup",
        "ppo.actor.optim.lr_warmup_ratio=0.0",
        f"ppo.train.seed={seed}",
    ]
    return as_ppo(load_config(TINY, overrides).stage("ppo"))


def job_experience(p: PPOConfig, tok) -> Experience:
    """The batch as the PPO job's advantage phase leaves it (``jobs.ppo.experience.advantages``), the rewards given as
    a reward function's. No old log-probs: a batch of one optimizer step takes the training forward's (ratio 1)."""
    expanded = [ids for ids in PROMPTS for _ in range(GROUP)]
    seq = make_sequences(expanded, _responses(tok.eos_token_id), tok.pad_token_id)
    scores = torch.tensor(REWARDS)
    exp = Experience.from_sequences(seq, old_logprobs=None, scores=scores)
    exp, _ = advantages(Scored(exp, {"reward_fn": scores}), p, kl_coef=0.0)
    return exp


def actor_step(tmp_path, p: PPOConfig, model_dir, exp: Experience):
    """One ``PolicyActor.fit`` (DeepSpeed, one rank in this process) on ``exp``, the actor's context as ``ppo.run``
    builds it: (weights before, after, the actor's stats)."""
    models = {"actor": str(model_dir)}
    store = ObjectStore(str(tmp_path / "run"))
    setup = stage_setup.StageSetup(
        "ppo", p, store, str(tmp_path / "work"), models, {}, "test", None, sources=models, kind="ppo"
    )
    ctx = role_context("ppo", p, setup, "actor", True, 1, 1, None)
    cluster = LocalCluster()
    cluster.start()
    group = cluster.group(p.actor.strategy, PolicyActor, ctx, name="actor")
    try:
        group.call(PolicyActor.setup)
        before = group.call(PolicyActor.trainable_state)[0]
        (stats,) = group.call_each(PolicyActor.fit, [exp], 0)
        after = group.call(PolicyActor.trainable_state)[0]
    finally:
        group.shutdown()
        cluster.stop()
    assert before is not None and after is not None  # rank 0
    return before, after, stats


def trl_step(tmp_path, model_dir, loss_type: str, lr: float = LR, seed: int = 7):
    """One optimizer step of TRL's GRPOTrainer on the batch: (weights before, after, what it recorded: ``rows``, the
    index in RESPONSES of each of its rows (it shuffles them), and its ``advantages`` (B,) and ``loss``)."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tok = load_tokenizer(str(model_dir))
    responses = _responses(tok.eos_token_id)
    names = [f"prompt {i}" for i in range(len(PROMPTS))]
    row_of = {tuple(r): i for i, r in enumerate(responses)}
    assert len(row_of) == len(responses), "each response must be unique: rewards are looked up by response"

    def rollout(prompts: list[str], trainer) -> dict:
        """The fixed responses: the k-th time a prompt comes, its k-th response."""
        seen: dict[int, int] = {}
        prompt_ids, completion_ids = [], []
        for text in prompts:
            i = names.index(text)
            k = seen[i] = seen.get(i, -1) + 1
            prompt_ids.append(PROMPTS[i])
            completion_ids.append(responses[i * GROUP + k])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def fixed_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [REWARDS[row_of[tuple(ids)]] for ids in completion_ids]

    class Recording(GRPOTrainer):
        recorded: dict = {}

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            rows = []
            for ids, mask in zip(out["completion_ids"].tolist(), out["completion_mask"].tolist(), strict=True):
                rows.append(row_of[tuple(t for t, m in zip(ids, mask, strict=True) if m)])
            self.recorded.update(rows=rows, advantages=out["advantages"].detach().clone())
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.recorded["loss"] = loss.item()
            return loss

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(RESPONSES),
        num_generations=GROUP,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=1,
        max_completion_length=MAX_NEW_TOKENS,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=0.0,  # the Trainer clips only when > 0
        beta=0.0,
        loss_type=loss_type,
        scale_rewards="group",
        epsilon=0.2,
        temperature=1.0,
        use_vllm=False,
        bf16=False,
        use_cpu=True,
        disable_dropout=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        trainer = Recording(
            model=model,
            reward_funcs=fixed_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": names}),
            processing_class=tok,
            rollout_func=rollout,
        )
        trainer.train()
    finally:  # the Accelerator's process state is a singleton: leave none behind for later tests
        AcceleratorState._reset_state(reset_partial_state=True)
    after = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return before, after, dict(Recording.recorded)


def expected_loss(loss_agg: str, adv: torch.Tensor, mask: torch.Tensor) -> float:
    """The loss at ratio 1, where each token's loss is -A: (B,) advantages, (B, T-1) action mask."""
    per_row, lengths = adv.double() * mask.sum(1), mask.sum(1).double()
    if loss_agg == "token_mean":
        return -(per_row.sum() / lengths.sum()).item()
    if loss_agg == "seq_mean":
        return -(per_row / lengths).mean().item()
    return -(per_row.sum() / (len(adv) * MAX_NEW_TOKENS)).item()  # seq_sum_norm


# fp32 noise, measured over 4 seeds (row orders) per pair: TRL against itself with its rows in another order moves a
# weight apart by up to 5.3e-3 x lr, and the whole model by 1.7e-5 of the update's norm; the project against TRL by
# as much (5.3e-3, 1.6e-5). Adam's first step is lr x g / (|g| + 1e-8) per weight: where g is about 1e-8, float noise
# in g becomes a visible move. A learning rate 0.1% off moves the model by 1e-3 of the update's norm.
MAX_DIFF_OF_LR = 2e-2
NORM_DIFF = 1e-4


@pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")
@pytest.mark.parametrize(("loss_agg", "loss_type"), PAIRS)
def test_one_grpo_step_moves_the_weights_as_trl_grpo_trainer(tmp_path, model_dir, loss_agg, loss_type):
    tok = load_tokenizer(str(model_dir))
    p = ppo_section(tmp_path / "project", model_dir, loss_agg)
    exp = job_experience(p, tok)
    mask = exp.action_mask
    t_before, t_after, trl_rec = trl_step(tmp_path / "trl", model_dir, loss_type)
    trl_adv = torch.empty(len(RESPONSES))
    trl_adv[torch.tensor(trl_rec["rows"])] = trl_rec["advantages"]  # TRL's rows in the project's order

    # 1. advantages: both (r - group mean) / (group std + eps), Bessel's std; eps differs by design
    project_adv = _group_advantages(PROJECT_STD_EPS).float()
    torch.testing.assert_close(exp.advantages, project_adv[:, None] * mask, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(trl_adv, _group_advantages(TRL_STD_EPS).float(), atol=1e-6, rtol=1e-6)
    assert (trl_adv - project_adv).abs().max() > 1e-5  # 1e-4 against 1e-9: visible on this batch
    # the project's shaping with TRL's eps gives TRL's advantages: the actor trains on those
    same_adv = shape_scores(torch.tensor(REWARDS), GROUP, "grpo", eps=TRL_STD_EPS)
    torch.testing.assert_close(same_adv, trl_adv, atol=1e-6, rtol=1e-6)

    # 2. one optimizer step from the same weights
    p_before, p_after, stats = actor_step(
        tmp_path / "project", p, model_dir, exp.with_advantages(same_adv[:, None] * mask, None)
    )
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0  # on policy: ratio 1
    assert p_before.keys() == t_before.keys()
    for name in t_before:
        assert torch.equal(p_before[name], t_before[name]), f"{name}: the two sides start from other weights"

    # 3. the loss (the scale that Adam's step hides) and the move of every weight
    want = expected_loss(loss_agg, same_adv, mask)
    assert stats["policy_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert trl_rec["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    worst, diff_sq, update_sq = 0.0, 0.0, 0.0
    for name in t_before:
        ours, theirs = p_after[name] - p_before[name], t_after[name] - t_before[name]
        assert theirs.abs().max() > 0.5 * LR, f"{name} hardly moved"
        diff = (ours - theirs).abs().max().item() / LR
        assert diff < MAX_DIFF_OF_LR, f"{name}: moved {diff:.2e} x lr away from TRL's move"
        worst = max(worst, diff)
        diff_sq += (ours - theirs).double().square().sum().item()
        update_sq += theirs.double().square().sum().item()
    norm = (diff_sq / update_sq) ** 0.5
    assert norm < NORM_DIFF, f"the weights moved {norm:.2e} of the update's norm away from TRL's move"
    print(
        f"\n{loss_agg} vs TRL {loss_type}: loss {stats['policy_loss']:.8f} vs {trl_rec['loss']:.8f}; weights: max "
        f"diff {worst:.1e} x lr, {norm:.1e} of the update's norm"
    )
