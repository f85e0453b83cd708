"""The loop section: K iterations of a group of stages (rejection sampling, iterative DPO) expanded into named
instances <name>_<i>, their references rewired, overrides per loop stage or per instance, and refusals."""

import pytest

from rlhf_core.config import ConfigError, load_config, to_yaml
from tasks.stages import expected_hash
from tests.conftest import ROOT

PRESETS = ROOT / "deployments" / "configs"
ITER_DPO = PRESETS / "tiny-iterative-dpo.yaml"
REJECTION = PRESETS / "tiny-rejection-sampling.yaml"


def test_iterations_become_named_instances_in_dependency_order():
    cfg = load_config(ITER_DPO)
    loop = ["generate", "score", "dpo", "eval"]
    assert cfg.order() == ["sft", "reward_model", "eval_sft"] + [f"{s}_{i}" for i in (1, 2) for s in loop]
    assert cfg.iterations == {f"{s}_{i}": i for i in (1, 2) for s in loop}
    # iteration 1 starts from loop.policy; iteration 2 from iteration 1's next_policy stage
    assert cfg.stage("generate_1").model.name_or_path == "stage:sft"
    assert cfg.stage("dpo_1").reference.name_or_path == "stage:sft"
    assert cfg.stage("generate_2").model.name_or_path == "stage:dpo_1"
    assert cfg.stage("dpo_2").model.name_or_path == cfg.stage("dpo_2").reference.name_or_path == "stage:dpo_1"
    # references to loop stages stay inside the iteration; references to outer stages are left alone
    assert cfg.stage("score_2").data.train_path == "stage:generate_2"
    assert cfg.stage("score_2").reward.name_or_path == "stage:reward_model"
    assert cfg.stage("eval_2").reference.name_or_path == "stage:sft"
    assert cfg.spec("dpo_2").upstream_names() == ["dpo_1", "score_2"]


def test_the_data_a_stage_reads_from_another_is_part_of_its_hash():
    cfg = load_config(REJECTION)
    upstream = {name: {"config_hash": name} for name in cfg.order()}
    changed = dict(upstream, generate_1={"config_hash": "other"})
    assert expected_hash(cfg, "score_1", upstream) != expected_hash(cfg, "score_1", changed)
    assert expected_hash(cfg, "score_2", upstream) == expected_hash(cfg, "score_2", changed)


def test_overrides_reach_every_iteration_or_one_instance():
    cfg = load_config(ITER_DPO, ["dpo.beta=0.3", "dpo_2.beta=0.5", "loop.iterations=3"])
    assert [cfg.stage(f"dpo_{i}").beta for i in (1, 2, 3)] == [0.3, 0.5, 0.3]
    assert cfg.stage("generate_3").model.name_or_path == "stage:dpo_2"


def test_the_resolved_yaml_loads_again_without_the_loop(tmp_path):
    cfg = load_config(ITER_DPO, [f"run_uri={tmp_path}"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(path)
    assert again.order() == cfg.order() and to_yaml(again) == to_yaml(cfg) and again.iterations == {}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loop.next_policy=dpox"], r"invalid value 'dpox' for 'loop.next_policy'.*generate, score, dpo, eval"),
        (["loop.iterations=-1"], r"'loop.iterations': must be >= 0"),
        (["loop.iterations=0"], r"'loop.stages' is set but 'loop.iterations' is 0"),
        (["loop.policy=''"], r"'loop.policy' is required"),
        (["loop.stages.sft={kind: sft}"], r"loop stage 'sft' has the name of a stage under 'stages'"),
        (["score.reward_fn=x:y"], r"give exactly one of 'score_1.reward.name_or_path'"),
        (["dpo.label_smoothing=0.5"], r"invalid value 0.5 for 'dpo_1.label_smoothing': must be in \[0, 0.5\)"),
        (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], r"'dpo_1.label_smoothing' applies to loss_type=sigmoid"),
    ],
)
def test_bad_loops_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ITER_DPO, overrides)


def test_editing_the_reward_function_file_changes_the_score_stage_hash(tmp_path):
    # a cached score stage must not outlive a change to the code that made its scores
    fn = tmp_path / "reward.py"
    fn.write_text("def score(prompts, responses):\n    return [len(r) for r in responses]\n")
    overrides = ["score.reward=null", f"score.reward_fn={fn}:score"]
    upstream = {name: {"config_hash": name} for name in load_config(ITER_DPO, overrides).order()}
    before = expected_hash(load_config(ITER_DPO, overrides), "score_1", upstream)
    assert expected_hash(load_config(ITER_DPO, overrides), "score_1", upstream) == before  # stable
    fn.write_text("def score(prompts, responses):\n    return [-len(r) for r in responses]\n")
    assert expected_hash(load_config(ITER_DPO, overrides), "score_1", upstream) != before
