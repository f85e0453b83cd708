"""A tiny run with ``tracking.tensorboard=true``: the SFT trainer's rank 0 and the PPO controller write TensorBoard
event files with one point per logged step, and each stage writes ``curves.png`` beside its ``metrics.json``."""

import json

import pytest

from rlhf_core.jobs import ppo, sft
from tests.jobs.conftest import cfg_for
from tests.test_tracking import scalars

pytestmark = pytest.mark.slow

# SFT: 2 steps; PPO on it with the gold-rule reward function and REINFORCE++ (no reward model, no critic): 2 steps.
OVERRIDES = ["tracking.tensorboard=true", "sft.data.max_samples=32", "sft.train.max_steps=2", "ppo.critic=null",
             "ppo.reward=null", "ppo.reward_fn=rlhf_core/assets/reward_fns/gold.py:gold_rewards",
             "ppo.algo.advantage_estimator=reinforce++", "ppo.train.max_steps=2",
             "ppo.train.eval_prompts=0"]  # fmt: skip


def test_stages_log_to_tensorboard_and_draw_their_curves(tmp_path, ray_cluster):
    run_dir = tmp_path / "run"
    cfg = cfg_for(run_dir, *OVERRIDES)
    sft.run(cfg)
    ppo.run(cfg)
    assert sorted(p.name for p in (run_dir / "tensorboard").iterdir()) == ["ppo", "sft"]
    got = scalars(run_dir / "tensorboard" / "ppo")
    history = json.loads((run_dir / "ppo" / "metrics.json").read_text())["history"]
    logged = [h["step"] for h in history]  # log_steps=1: every step
    assert logged == [1, 2]
    for name in ("reward", "kl"):
        assert [s for s, _ in got[name]] == logged, name
        assert [v for _, v in got[name]] == pytest.approx([h[name] for h in history]), name
    assert [s for s, _ in scalars(run_dir / "tensorboard" / "sft")["loss"]] == [1, 2]  # step 1 and the last
    for stage in ("sft", "ppo"):
        assert (run_dir / stage / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stage
