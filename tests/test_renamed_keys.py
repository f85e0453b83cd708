"""The PPO-kind sections are grouped by role (``actor: {model, strategy, optim}``, ``reward: {model, workers,
resources}``, ...). Every key of the earlier flat spelling is refused with one line naming its new spelling, so that an
old preset or override fails before any worker starts and tells the user what to write instead.

``data/renamed_ppo_keys.txt`` lists each old key (as ``python -m rlhf_core.config`` listed it) and its new spelling."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, PipelineConfig, describe, load_config

TINY = "deployments/configs/tiny.yaml"  # a critic_warmup stage named critic_warmup, a ppo stage named ppo
RENAMED = [line.split() for line in (Path(__file__).parent / "data" / "renamed_ppo_keys.txt").read_text().splitlines()]


def test_the_list_covers_both_kinds_and_every_new_key_exists():
    listed = {row[0] for row in describe(PipelineConfig)}
    old, new = {o for o, _ in RENAMED}, {n for _, n in RENAMED}
    assert len(RENAMED) == 117 and {k.split(".")[0] for k in old} == {"ppo", "critic_warmup"}
    assert new <= listed, sorted(new - listed)
    assert not old & listed, sorted(old & listed)


@pytest.mark.parametrize(("old", "new"), RENAMED, ids=[o for o, _ in RENAMED])
def test_an_old_key_is_refused_with_its_new_spelling(old, new):
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, [f"{old}=1"])
    assert str(refused.value).startswith(f"'{old}' is now '{new}'"), str(refused.value)


def test_an_old_section_in_a_preset_is_refused_naming_the_key_set(tmp_path):
    preset = Path(TINY).read_text().replace("  ppo:\n", "  ppo:\n    critic_optim: {lr: 1.0e-5}\n", 1)
    path = tmp_path / "old.yaml"
    path.write_text(preset)
    with pytest.raises(ConfigError, match=r"^'ppo.critic_optim.lr' is now 'ppo.critic.optim.lr'"):
        load_config(path)


def test_a_key_the_warmup_never_had_stays_unknown():
    """The critic warm-up's actor does not train: its old actor_optim has no new spelling, it is an unknown key."""
    with pytest.raises(ConfigError, match=r"^unknown config key 'critic_warmup.actor_optim'"):
        load_config(TINY, ["critic_warmup.actor_optim.lr=1e-4"])
