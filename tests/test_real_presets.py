"""The presets for real models (deployments/configs/qwen2.5-0.5b-1gpu.yaml, llama3-8b-8gpu.yaml) load and validate on
CPU, and PPO's resource check places them on the GPU count they claim and refuses them, naming a key, on fewer."""

import pytest

from rlhf_core.config import ConfigError, as_ppo, load_config, validate
from rlhf_core.distributed.placement import RoleSet, check_fits, resource_demand
from tests.conftest import ROOT

CONFIGS = ROOT / "deployments" / "configs"
# preset -> GPUs it claims, Ray CPUs of the machine it is written for
PRESETS = {"qwen2.5-0.5b-1gpu": (1, 8), "llama3-8b-8gpu": (8, 64)}
MODEL_PATHS = {
    "qwen2.5-0.5b-1gpu": "/models/Qwen2.5-0.5B-Instruct",
    "llama3-8b-8gpu": "/models/Meta-Llama-3-8B-Instruct",
}
RL_STAGES = ("critic_warmup", "ppo")


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_validates_and_chains_all_five_stages(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    validate(cfg)
    assert [s.kind for s in cfg.stages.values()] == ["sft", "reward_model", "critic_init", "critic_warmup", "ppo"]
    # the only model path: everything after SFT reads an upstream stage
    assert cfg.stage("sft").model.name_or_path == MODEL_PATHS[name]
    assert cfg.stage("reward_model").model.name_or_path == "stage:sft"
    for stage in RL_STAGES:
        p = cfg.stage(stage)
        assert p.actor.model.name_or_path == "stage:sft" and p.reward.model.name_or_path == "stage:reward_model"
        assert p.train.gold_reward is None  # the synthetic task's gold reward does not apply to real data
        assert p.placement.colocate_all and p.rollout.enable_sleep and p.placement.offload_states_during_rollout
        assert (
            p.rollout.backend == "vllm" and p.actor.strategy.zero_stage == 3 and p.actor.strategy.precision == "bf16"
        )
    assert cfg.stage("ppo").actor.strategy.gradient_checkpointing


@pytest.mark.parametrize("name", PRESETS)
def test_resource_check_accepts_the_claimed_gpus_and_refuses_fewer(name):
    gpus, cpus = PRESETS[name]
    cfg = load_config(CONFIGS / f"{name}.yaml")
    for stage in RL_STAGES:
        p = as_ppo(cfg.stage(stage))  # the warm-up's section run as PPO's, as its job and jobs.stage_setup.ray_cpus do
        roles = RoleSet.of(p)
        assert resource_demand(p, roles, "cuda")["GPU"] == gpus
        check_fits(stage, p, roles, "cuda", {"CPU": cpus, "GPU": gpus})
        with pytest.raises(
            ConfigError, match=rf"need {gpus} GPU but the Ray cluster has {gpus - 1}.*'{stage}\.rollout"
        ):
            check_fits(stage, p, roles, "cuda", {"CPU": cpus, "GPU": gpus - 1})
        # vLLM sleep mode is CUDA-only: the same preset on a CPU machine is refused by key
        with pytest.raises(ConfigError, match=rf"'{stage}\.rollout\.enable_sleep' needs a GPU"):
            check_fits(stage, p, roles, "cpu", {"CPU": cpus})


def test_8gpu_preset_refuses_more_engine_gpus_than_actor_bundles():
    cfg = load_config(CONFIGS / "llama3-8b-8gpu.yaml", ["ppo.rollout.num_engines=8"])
    with pytest.raises(ConfigError, match=r"'ppo\.rollout\.num_engines' x tensor_parallel_size = 16 exceeds the 8"):
        check_fits("ppo", cfg.stage("ppo"), RoleSet.of(cfg.stage("ppo")), "cuda", {"CPU": 64, "GPU": 16})
