"""Shared job fixtures: one SFT run (2 workers, ZeRO-2) and, on top of it, the inputs of the PPO stages."""

import shutil

import pytest
from safetensors.torch import load_file

from rlhf_core.config import load_config
from rlhf_core.jobs import critic_init, critic_warmup, ppo, reward_model, sft
from tests.clusters import NoWorkers
from tests.conftest import TINY

# 2 workers x micro 8 = global batch 16 (no accumulation); 256 rows -> 16 steps; checkpoints every 4 steps.
SFT_2W = ["sft.strategy.num_workers=2", "sft.data.max_samples=256", "sft.train.save_steps=4", "sft.train.keep_last=2"]
RM_2W = ["reward_model.strategy.num_workers=2", "reward_model.train.micro_train_batch_size=8"]
CRITIC_WARMUP = ["critic_warmup.train.save_steps=1"]  # a checkpoint after step 1 of 2 (its frozen actor has none)
UPSTREAM = [*SFT_2W, *RM_2W, *CRITIC_WARMUP]
TENSORBOARD = "tracking.tensorboard=true"  # rank 0 / the controller log each logged step to <run_uri>/tensorboard/


def cfg_for(run_dir, *overrides):
    return load_config(TINY, [f"run_uri={run_dir}", *overrides])


def weights(run_dir, stage):
    return load_file(str(run_dir / stage / "model.safetensors"))


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory, ray_cluster):
    run_dir = tmp_path_factory.mktemp("sft-zero2")
    ref = sft.run(cfg_for(run_dir, *SFT_2W, TENSORBOARD))  # trackers are not part of a stage's config hash
    return run_dir, ref


@pytest.fixture(scope="session")
def ppo_inputs(sft_run):
    """SFT -> reward model -> critic init -> critic warm-up in one run directory (stages already done are reused)."""
    run_dir = sft_run[0]
    cfg = cfg_for(run_dir, *UPSTREAM)
    refs = {
        name: job.run(cfg)
        for name, job in (
            ("reward_model", reward_model),
            ("critic_init", critic_init),
            ("critic_warmup", critic_warmup),
        )
    }
    return run_dir, refs


@pytest.fixture
def run_dir(ppo_inputs, tmp_path):
    """A private copy of the upstream stages, so that each PPO run has its own output and checkpoints."""
    target = tmp_path / "run"
    shutil.copytree(ppo_inputs[0], target, ignore=shutil.ignore_patterns("checkpoints", "ppo"))
    return target


def run_ppo(run_dir, *overrides, cluster=None):
    return ppo.run(cfg_for(run_dir, *UPSTREAM, *overrides), cluster=cluster)


@pytest.fixture
def no_actors():
    """A cluster on which any worker group or rollout engine started fails the test (run_ppo(..., cluster=it)): a
    mistake must be refused before."""
    return NoWorkers("a Ray actor was started despite a bad config")
