"""The end-of-stage check of the weight sync (``evaluation.check_engine_sync``, ``train.sync_check_tolerance``): a
PPO-kind stage whose engines end up computing other log-probs than its actor fails, naming the gap and the key."""

import pytest

from rlhf_core.config import load_config
from rlhf_core.jobs.ppo.evaluation import BF16_SYNC_TOLERANCE, check_engine_sync
from tests.conftest import TINY


def test_the_sync_check_passes_below_the_tolerance_and_fails_above_it_naming_the_key():
    check_engine_sync("ppo", {"sync_engine_vs_actor_max_diff": 2e-6}, 1e-3)
    check_engine_sync("ppo", {"sync_engine_vs_actor_max_diff": 1e-3}, 1e-3)  # at the tolerance: passes
    with pytest.raises(RuntimeError) as e:
        check_engine_sync("ppo", {"sync_engine_vs_actor_max_diff": 0.0112}, 1e-3)
    assert str(e.value) == (
        "the rollout engines' log-probs differ from the actor's by 0.0112 after the last weight sync (tolerance "
        "0.001, 'ppo.train.sync_check_tolerance'): the engines do not serve the weights the actor trains"
    )
    with pytest.raises(RuntimeError, match=r"by nan .*'critic_warmup\.train\.sync_check_tolerance'"):
        check_engine_sync("critic_warmup", {"sync_engine_vs_actor_max_diff": float("nan")}, 1e-3)


def test_bf16_allows_its_rounding_and_null_turns_the_check_off():
    check_engine_sync("ppo", {"sync_engine_vs_actor_max_diff": 0.2}, 1e-3, "bf16")
    with pytest.raises(RuntimeError, match=r"by 0\.7 after .* \(tolerance 0\.5 in bf16, 'ppo\.train\."):
        check_engine_sync("ppo", {"sync_engine_vs_actor_max_diff": 0.7}, 1e-3, "bf16")
    with pytest.raises(RuntimeError, match=r"by 2 after .* \(tolerance 1, 'ppo\.train\."):  # above the bf16 floor
        check_engine_sync("ppo", {"sync_engine_vs_actor_max_diff": 2.0}, 1.0, "bf16")
    assert BF16_SYNC_TOLERANCE == 0.5
    check_engine_sync("ppo", {"sync_engine_vs_actor_max_diff": 5.0}, None)
    check_engine_sync("ppo", {}, 1e-3)  # no probe, nothing to check


def test_the_tolerance_key_defaults_to_1e_3_and_takes_null():
    def tolerance(stage, *overrides):
        return load_config(TINY, list(overrides)).stage(stage).train.sync_check_tolerance

    for stage in ("ppo", "critic_warmup"):
        assert tolerance(stage) == 1e-3
        assert tolerance(stage, f"{stage}.train.sync_check_tolerance=null") is None
        assert tolerance(stage, f"{stage}.train.sync_check_tolerance=1e-4") == 1e-4
