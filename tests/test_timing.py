"""Per-phase step timing: PhaseTimer's keys, the final summary and the Prefect timing table made of it, and the
per-group completion times of concurrently dispatched Ray calls (launcher.wait_timed)."""

import time

import pytest

from rlhf_core import timing
from rlhf_core.distributed import launcher


def test_phase_timer_logs_every_declared_phase_and_the_step():
    t = timing.PhaseTimer(["generation", "train", "checkpoint"])
    with t.phase("generation"):
        time.sleep(0.02)
    t.add("train", 0.5)
    t.add("train", 0.25)  # a phase run twice: summed
    logs = t.as_logs()
    assert list(logs) == ["timing/generation_s", "timing/train_s", "timing/checkpoint_s", "timing/step_s"]
    assert logs["timing/generation_s"] >= 0.02 and logs["timing/train_s"] == 0.75
    assert logs["timing/checkpoint_s"] == 0.0  # declared, never run
    assert logs["timing/step_s"] >= logs["timing/generation_s"]
    assert timing.phase_of("timing/generation_s") == "generation" and timing.phase_of("kl") is None


def test_summary_and_phase_rows():
    history = [
        {"step": 1, "kl": 0.1, "timing/generation_s": 3.0, "timing/train_s": 1.0, "timing/step_s": 5.0},
        {"step": 2, "kl": 0.2, "timing/generation_s": 1.0, "timing/train_s": 1.0, "timing/step_s": 3.0},
    ]
    summary = timing.summarize(history)
    assert summary == {
        "timing/generation_s_mean": 2.0,
        "timing/generation_s_total": 4.0,
        "timing/train_s_mean": 1.0,
        "timing/train_s_total": 2.0,
        "timing/step_s_mean": 4.0,
        "timing/step_s_total": 8.0,
        "timing/steps": 2.0,
    }
    assert timing.summarize([{"step": 1, "loss": 1.0}]) == {}
    rows = timing.phase_rows({"steps": 2, "kl": 0.2, **summary})
    assert rows == [
        {"phase": "generation", "mean_s": 2.0, "total_s": 4.0, "share_of_step": 0.5},
        {"phase": "train", "mean_s": 1.0, "total_s": 2.0, "share_of_step": 0.25},
        {"phase": "step", "mean_s": 4.0, "total_s": 8.0, "share_of_step": 1.0},
    ]
    assert timing.phase_rows({"steps": 2, "loss": 1.0}) == []


@pytest.mark.slow  # Ray tasks: make test, not test-fast
def test_wait_timed_gives_each_group_its_time_to_completion(ray_cluster):
    import ray

    @ray.remote
    def nap(seconds: float, value: int) -> int:
        time.sleep(seconds)
        return value

    # one warm worker per task below before the clock starts: a cold worker start (about 1 s on a busy 2-core
    # machine) would otherwise land on whichever group got the new worker
    ray.get([nap.remote(0.3, 0) for _ in range(3)])
    started = time.perf_counter()
    groups = {
        "slow": [nap.remote(2.0, 1), nap.remote(0.1, 2)],
        "fast": [nap.remote(0.1, 3)],
        "none": [],
        "local": [4, 5],
    }
    results, seconds = launcher.wait_timed(groups, started)
    assert results == {"slow": [1, 2], "fast": [3], "none": [], "local": [4, 5]}
    assert seconds["slow"] >= 2.0 and seconds["fast"] < seconds["slow"] and seconds["none"] == 0.0
    assert 0.0 < seconds["local"] < seconds["fast"]  # values are ready when wait_timed is called

    @ray.remote
    def fails() -> None:
        raise ValueError("boom")

    with pytest.raises(Exception, match="boom"):
        launcher.wait_timed({"ok": [nap.remote(0.1, 1)], "bad": [fails.remote()]})
