"""Presets as graphs of named stage instances: kinds, stage: references, dependency order, refusals, job CLI."""

import pytest
import yaml

from rlhf_core.config import STAGE_KINDS, ConfigError, load_config, to_yaml
from rlhf_core.jobs.process import stage_of_kind
from tasks.stages import expected_hash
from tests.conftest import ROOT, TINY

CHAIN = ROOT / "deployments" / "configs" / "sft_chain.yaml"


def write(tmp_path, text: str):
    path = tmp_path / "preset.yaml"
    path.write_text(text)
    return path


SFT = """
    model: {{name_or_path: "{model}"}}
    data: {{train_path: a.jsonl}}"""


def test_tiny_preset_keeps_its_five_stages_and_their_order():
    cfg = load_config(TINY)
    assert cfg.order() == ["sft", "reward_model", "critic_init", "critic_warmup", "ppo"]
    assert {name: cfg.kind(name) for name in cfg.order()} == {n: n for n in cfg.order()}
    assert cfg.spec("ppo").upstream_names() == ["critic_warmup", "reward_model", "sft"]


def test_two_instances_of_one_kind_run_in_dependency_order_whatever_the_preset_order(tmp_path):
    # sft_b reads sft_a's output but is declared first: the order follows the stage: reference.
    preset = write(
        tmp_path,
        "run_uri: /x\nstages:\n  sft_b:\n    kind: sft"
        + SFT.format(model="stage:sft_a")
        + "\n  sft_a:\n    kind: sft"
        + SFT.format(model="builtin:tiny"),
    )
    cfg = load_config(preset, ["sft_b.optim.lr=1e-4"])
    assert cfg.order() == ["sft_a", "sft_b"]
    assert cfg.kind("sft_a") == cfg.kind("sft_b") == "sft"
    assert cfg.stage("sft_b").optim.lr == 1e-4 and cfg.stage("sft_a").optim.lr == 5e-6  # the override hit one


def test_the_chain_preset_round_trips_through_its_resolved_yaml(tmp_path):
    cfg = load_config(CHAIN, [f"run_uri={tmp_path}"])
    again = load_config(write(tmp_path, to_yaml(cfg)))
    assert to_yaml(again) == to_yaml(cfg)
    assert yaml.safe_load(to_yaml(cfg))["stages"]["sft_b"]["kind"] == "sft"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "stages:\n  polish:" + SFT.format(model="builtin:tiny"),
            r"stage 'polish' has no kind: set 'polish.kind' to one of sft, reward_model",
        ),
        (
            "stages:\n  sft_a:\n    kind: sfft" + SFT.format(model="builtin:tiny"),
            r"stage 'sft_a' has unknown kind 'sfft'.*did you mean 'sft'",
        ),
        (
            "stages:\n  sft_b:\n    kind: sft"
            + SFT.format(model="stage:sft_x")
            + "\n  sft_a:\n    kind: sft"
            + SFT.format(model="builtin:tiny"),
            r"'sft_b.model.name_or_path' = stage:sft_x names no stage of this config; did you mean 'stage:sft_a'",
        ),
        (
            "stages:\n  a:\n    kind: sft"
            + SFT.format(model="stage:b")
            + "\n  b:\n    kind: sft"
            + SFT.format(model="stage:a"),
            r"the stages form a cycle \(a -> b -> a\)",
        ),
        ("stages:\n  Bad-Name:\n    kind: sft" + SFT.format(model="builtin:tiny"), r"invalid stage name 'Bad-Name'"),
        ("sft:" + SFT.format(model="builtin:tiny"), r"unknown config key 'sft' at the top level.*go under 'stages:'"),
    ],
    ids=["no-kind", "unknown-kind", "unknown-reference", "cycle", "bad-name", "old-layout"],
)
def test_graph_mistakes_are_refused_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, "run_uri: /x\n" + text))


def test_every_kind_names_a_job_module_that_exists():
    """Each kind's job runs as ``python -m <job>``: a module, or a package with a ``__main__``."""
    for kind in STAGE_KINDS.values():
        path = ROOT / kind.job.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), kind


def test_a_job_picks_its_instance_by_name_or_by_its_kind():
    chain, tiny = load_config(CHAIN), load_config(TINY)
    assert stage_of_kind(tiny, "sft", None) == "sft" and stage_of_kind(chain, "sft", "sft_b") == "sft_b"
    with pytest.raises(ConfigError, match=r"give --stage: the config has 2 stages of kind sft \(sft_a, sft_b\)"):
        stage_of_kind(chain, "sft", None)
    with pytest.raises(ConfigError, match=r"stage 'ppo' is of kind ppo, not sft"):
        stage_of_kind(tiny, "sft", "ppo")
    with pytest.raises(ConfigError, match=r"no stage named 'nope'"):
        stage_of_kind(tiny, "sft", "nope")


def test_the_task_cache_hash_follows_the_upstream_instance():
    cfg = load_config(CHAIN)
    a = expected_hash(cfg, "sft_b", {"sft_a": {"config_hash": "1"}})
    b = expected_hash(cfg, "sft_b", {"sft_a": {"config_hash": "2"}})
    assert a != b and expected_hash(cfg, "sft_a", {}) != a
