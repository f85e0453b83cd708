import pytest
import yaml

from rlhf_core.config import ConfigError, PipelineConfig, describe, load_config, stage_hash, to_yaml
from tests.conftest import TINY

BASE = ["run_uri=/tmp/x", "sft.model.name_or_path=builtin:tiny", "sft.data.train_path=a.jsonl"]


def test_tiny_preset_loads_with_stage_sections():
    cfg = load_config(TINY)
    assert cfg.stage("sft").model.name_or_path == "builtin:tiny"
    assert cfg.stage("reward_model").model.name_or_path == "stage:sft"
    assert cfg.stage("critic_init").model.name_or_path == "stage:reward_model"
    assert cfg.stage("sft").strategy.precision == "fp32"


def test_overrides_are_typed_and_win_over_yaml():
    cfg = load_config(TINY, ["sft.optim.lr=1e-4", "sft.strategy.zero_stage=3", "run_uri=s3://b/run"])
    assert (
        cfg.stage("sft").optim.lr == 1e-4 and cfg.stage("sft").strategy.zero_stage == 3 and cfg.run_uri == "s3://b/run"
    )


def test_partial_section_keeps_the_stage_defaults():
    cfg = load_config(
        None,
        [
            "run_uri=/x",
            "reward_model.model.name_or_path=m",
            "reward_model.data.train_path=a",
            "reward_model.data.eval_path=b",
            "reward_model.optim.max_norm=0.5",
        ],
    )
    assert cfg.stage("reward_model").optim.lr == 9e-6  # the RM's default, not the SFT one
    assert cfg.stage("reward_model").optim.max_norm == 0.5


@pytest.mark.parametrize(
    "override, message",
    [
        ("sft.optim.lrr=1", r"unknown config key 'sft.optim.lrr'.*did you mean 'sft.optim.lr'"),
        ("sft.strategy.zero_stage=5", r"'sft.strategy.zero_stage'"),
        ("sft.strategy.precision=fp16", r"invalid value 'fp16' for 'sft.strategy.precision': choose one of bf16"),
        ("sft.train.max_epochs=two", r"invalid value 'two' for 'sft.train.max_epochs': expected an integer"),
        ("sft.train.train_batch_size=12", r"'sft.train.train_batch_size'.*multiple of micro_train_batch_size"),
        ("sft.data.input_template=no-slot", r"'sft.data.input_template'"),
        ("sft.data.prompt_template=no-slot", r"'sft.data.prompt_template'"),
        ("bogus=1", r"unknown config key 'bogus'"),
    ],
)
def test_invalid_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, BASE + [override])


def test_missing_required_key_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="missing required config key 'sft.data.train_path'"):
        load_config(None, ["run_uri=/x", "sft.model.name_or_path=m", "sft.data.max_len=10"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_uri: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="reward_model.data.eval_path"):
        load_config(None, ["run_uri=/x", "reward_model.model.name_or_path=m", "reward_model.data.train_path=a"])


def test_secrets_are_redacted_and_not_hashed():
    cfg = load_config(TINY, ["storage.key=AKIDSECRET", "storage.secret=hunter2-very-secret"])
    text = to_yaml(cfg)
    assert "hunter2-very-secret" not in text and "AKIDSECRET" not in text
    assert yaml.safe_load(text)["storage"]["secret"] == "***"


def test_stage_hash_tracks_semantics_not_bookkeeping():
    a = load_config(TINY)
    b = load_config(TINY, ["sft.train.keep_last=9", "sft.train.save_steps=3", "sft.strategy.num_workers=2"])
    c = load_config(TINY, ["sft.optim.lr=0.1"])
    assert stage_hash(a.stage("sft")) == stage_hash(b.stage("sft"))
    assert stage_hash(a.stage("sft")) != stage_hash(c.stage("sft"))
    assert stage_hash(a.stage("sft"), {"sft": "x"}) != stage_hash(a.stage("sft"), {"sft": "y"})


def test_every_field_is_documented():
    rows = describe(PipelineConfig)
    assert len(rows) > 40
    assert all(help_text for _, _, help_text in rows), [k for k, _, h in rows if not h]


def test_override_of_an_anchored_section_changes_only_that_stage():
    # tiny.yaml shares one strategy mapping between stages through a YAML anchor.
    cfg = load_config(TINY, ["sft.strategy.num_workers=2"])
    assert cfg.stage("sft").strategy.num_workers == 2 and cfg.stage("reward_model").strategy.num_workers == 1


def test_seed_per_prompt_defaults_to_prompts_on_cpu_and_the_engine_on_gpu():
    from rlhf_core.config.sections import RolloutConfig

    assert RolloutConfig().seeds_each_prompt("cpu") is True  # exact, reproducible batches where sampling is cheap
    assert RolloutConfig().seeds_each_prompt("cuda") is False  # vLLM's batched sampler
    assert RolloutConfig(seed_per_prompt=True).seeds_each_prompt("cuda") is True
    assert RolloutConfig(seed_per_prompt=False).seeds_each_prompt("cpu") is False


def test_nccl_weight_sync_with_colocated_engines_is_refused_naming_both_keys():
    # colocate_all puts the engines on the actor's GPUs: an NCCL group of actor rank 0 and an engine worker on one GPU
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["ppo.rollout.weight_sync_backend=nccl", "ppo.placement.colocate_all=true"])
    assert str(e.value) == (
        "'ppo.rollout.weight_sync_backend=nccl' cannot be used with 'ppo.placement.colocate_all=true' "
        "(NCCL refuses two ranks on one GPU): use cuda_ipc or auto"
    )
    for allowed in (["ppo.rollout.weight_sync_backend=nccl"], ["ppo.placement.colocate_all=true"]):
        load_config(TINY, allowed)


def test_dynamic_batch_needs_a_positive_budget_and_leaves_the_default_hash_alone():
    for stage in ("ppo", "critic_warmup"):
        with pytest.raises(ConfigError, match=rf"'{stage}.train.max_tokens_per_micro_batch': must be > 0 with"):
            load_config(TINY, [f"{stage}.train.dynamic_batch=true", f"{stage}.train.max_tokens_per_micro_batch=0"])
    base = load_config(TINY).stage("ppo")
    off = load_config(TINY, ["ppo.train.dynamic_batch=false", "ppo.train.max_tokens_per_micro_batch=16384"])
    assert stage_hash(off.stage("ppo")) == stage_hash(base)  # hashing._OFF_BY_DEFAULT: as before the keys existed
    on = load_config(TINY, ["ppo.train.dynamic_batch=true"]).stage("ppo")
    assert on.train.dynamic_batch and on.train.max_tokens_per_micro_batch == 16384
    assert stage_hash(on) != stage_hash(base)
