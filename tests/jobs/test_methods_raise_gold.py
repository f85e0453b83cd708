"""Each alignment method's tiny preset raises the gold reward of the SFT policy on the bundled task: DPO, KTO,
rejection sampling (2 iterations), iterative DPO (2 iterations), critic-free GRPO with the reward model and RLVR
(GRPO on the gold rule as a reward function, no reward model), every policy evaluated alike by a generate stage
(256 responses to 128 held-out prompts, gold rule; standard error of the mean about 0.01). ``python -m bench.quality``
measures these and the other estimators' presets (REINFORCE++, RLOO) for docs/results.md.

The stages run as ``python -m rlhf_core.jobs.pipeline`` runs them (each kind's ``run`` in dependency order), on the
session's Ray. The four presets share their SFT, reward-model and eval_sft sections (and the two loops their first
generate stage), so those are computed once, in the rejection-sampling run: the other runs start from a copy of its
committed outputs, which they find complete for the same config hash."""

import shutil

import pytest

from rlhf_core.config import load_config
from rlhf_core.jobs.pipeline import runner
from tests.conftest import ROOT

# make test-all only: method quality is measured by `python -m bench.quality`; make test keeps each method's real-
# engine test (test_preference_stages, test_loops, test_rl_family, test_generate_score) and PPO's gold test
pytestmark = [pytest.mark.slow, pytest.mark.extended]

PRESETS = ROOT / "deployments" / "configs"
SHARED = ("sft", "reward_model", "eval_sft", "generate_1")
RISE = 0.05  # measured rises: 0.105 (rejection sampling) to 0.25 (KTO)
NO_KL = ("eval.reference=null",)  # the loops' evaluations without their KL to the SFT policy (two Ray groups fewer)


def run_preset(name: str, run_dir, *overrides: str) -> dict[str, dict]:
    cfg = load_config(PRESETS / f"{name}.yaml", [f"run_uri={run_dir}", *overrides])
    return {stage: runner(cfg.kind(stage))(cfg, stage).metrics for stage in cfg.order()}


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory, ray_cluster):
    run_dir = tmp_path_factory.mktemp("methods") / "rejection-sampling"
    return run_dir, run_preset("tiny-rejection-sampling", run_dir, *NO_KL)


def from_shared(shared_run, tmp_path, name: str, *overrides: str) -> dict[str, dict]:
    source, done = shared_run
    run_dir = tmp_path / name
    for stage in SHARED:
        shutil.copytree(source / stage, run_dir / stage)
    metrics = run_preset(name, run_dir, *overrides)
    assert metrics["sft"] == done["sft"]  # the shared SFT output, found complete, not trained again
    return metrics


def test_dpo_raises_the_gold_reward(shared_run, tmp_path):
    m = from_shared(shared_run, tmp_path, "tiny-dpo")
    assert m["dpo"]["loss_start"] == pytest.approx(0.6931, abs=1e-4) and m["dpo"]["eval_accuracy"] > 0.9
    assert m["eval_dpo"]["gold_reward"] > m["eval_sft"]["gold_reward"] + RISE
    assert m["eval_dpo"]["kl_to_ref"] > 0


def test_kto_raises_the_gold_reward(shared_run, tmp_path):
    m = from_shared(shared_run, tmp_path, "tiny-kto", "eval_kto.reference=null")
    assert m["kto"]["loss_start"] == pytest.approx(0.5, abs=1e-4)
    assert m["eval_kto"]["gold_reward"] > m["eval_sft"]["gold_reward"] + RISE


def _two_iterations(m: dict[str, dict], trained: str) -> None:
    sft = m["eval_sft"]["gold_reward"]
    assert m["eval_1"]["gold_reward"] > sft
    assert m["eval_2"]["gold_reward"] > sft + RISE
    assert m[f"{trained}_2"]["steps"] > 0 and m["generate_2"]["responses"] == 4 * 256


def test_rejection_sampling_raises_the_gold_reward_in_two_iterations(shared_run):
    _two_iterations(shared_run[1], "sft_best")


def test_iterative_dpo_raises_the_gold_reward_in_two_iterations(shared_run, tmp_path):
    _two_iterations(from_shared(shared_run, tmp_path, "tiny-iterative-dpo", *NO_KL), "dpo")


def test_grpo_without_a_critic_raises_the_gold_reward(shared_run, tmp_path):
    m = from_shared(shared_run, tmp_path, "tiny-grpo")
    assert m["grpo"]["steps"] == 12 and "critic_loss" not in m["grpo"]
    assert m["eval_grpo"]["gold_reward"] > m["eval_sft"]["gold_reward"] + RISE
    assert m["eval_grpo"]["kl_to_ref"] > 0


def test_rlvr_with_the_gold_rule_and_no_reward_model_raises_the_gold_reward(shared_run, tmp_path):
    m = from_shared(shared_run, tmp_path, "tiny-rlvr")
    assert "reward_model" not in m and m["rlvr"]["reward_fn_score"] > -1
    assert m["eval_rlvr"]["gold_reward"] > m["eval_sft"]["gold_reward"] + RISE
