"""The stage task's curves artifact: when it is redrawn from step events, and what its last version is drawn from.
Prefect's create_markdown_artifact is replaced by a recorder here; tests/flows/test_pipeline.py reads the real
artifacts back from a real server and renders them in Chromium."""

import pytest

from rlhf_core.storage import ObjectStore
from tasks import live_curves


class Versions(list):
    """The (key, markdown) of each artifact version created, its id its index; ``deleted``: the ids deleted."""

    def __init__(self):
        super().__init__()
        self.deleted: list[int] = []

    def create(self, markdown, key, description):
        self.append((key, markdown))
        return len(self) - 1


@pytest.fixture
def published(monkeypatch):
    versions = Versions()
    monkeypatch.setattr(live_curves, "create_markdown_artifact", versions.create)
    monkeypatch.setattr(live_curves, "delete_artifact", versions.deleted.append)
    return versions


def step(k: int, total: int = 6) -> dict:
    return {"event": "step", "stage": "ppo", "step": k, "total": total, "metrics": {"reward": 0.1 * k}}


def test_drawn_once_two_steps_are_logged_then_at_most_every_interval(published):
    live = live_curves.LiveCurves("ppo", "ppo", "ppo", every_s=3600)
    for k in (1, 2, 3, 4):
        live.add(step(k))
    assert [key for key, _ in published] == ["ppo-curves"]  # at step 2; steps 3 and 4 fall inside the interval
    assert "2 logged steps, last step 2 of 6" in published[0][1]
    eager = live_curves.LiveCurves("ppo", "ppo", "ppo", every_s=0)
    for k in (1, 2, 3):
        eager.add(step(k))
    assert len(published) == 3 and "last step 3 of 6" in published[-1][1]


def test_a_long_stage_keeps_only_its_newest_live_version_and_the_final_one(published, tmp_path):
    live = live_curves.LiveCurves("ppo", "ppo", "ppo", every_s=0)
    for k in (1, 2, 3, 4):
        live.add(step(k))  # live versions 0, 1, 2 (steps 2, 3, 4)
    live.finish(ObjectStore(str(tmp_path)))  # final version 3, from the logged steps (no metrics.json here)
    assert published.deleted == [0, 1]  # each live version replaced by the next; the last stays beside the final
    assert "**final**" in published[3][1]
    live.add(step(6))  # the last step: not drawn live, the final version is drawn when the job ends
    assert len(published) == 4


def test_a_live_drawing_that_fails_stops_live_drawing_without_raising(monkeypatch, capsys):
    def down(markdown, key, description):
        raise ConnectionError("the Prefect API is down")

    monkeypatch.setattr(live_curves, "create_markdown_artifact", down)
    live = live_curves.LiveCurves("ppo", "ppo", "ppo", every_s=0)
    for k in (1, 2, 3):
        live.add(step(k))  # must not raise: the caller also moves the progress bar and the terminal display
    assert capsys.readouterr().err.count("no longer drawn live") == 1


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(live_curves.EVERY_ENV, "2.5")
    assert live_curves.LiveCurves("ppo", "ppo", "ppo").every_s == 2.5
    monkeypatch.delenv(live_curves.EVERY_ENV)
    assert live_curves.LiveCurves("ppo", "ppo", "ppo").every_s == live_curves.DEFAULT_EVERY_S


def test_the_last_version_is_drawn_from_the_jobs_metrics_json(published, tmp_path):
    """After a resume the task saw steps 5 and 6 only; metrics.json has all six."""
    store = ObjectStore(str(tmp_path))
    store.write_json("ppo/metrics.json", {"history": [{"step": k, "reward": 0.1 * k} for k in range(1, 7)]})
    live = live_curves.LiveCurves("ppo", "ppo", "ppo", every_s=3600)
    live.add(step(5))
    live.add(step(6))
    live.finish(store)
    assert "**final**: 6 logged steps, last step 6 of 6" in published[-1][1]


def test_a_failed_job_gets_the_steps_it_logged_and_a_drawing_error_is_only_a_warning(published, tmp_path, capsys):
    store = ObjectStore(str(tmp_path))
    live = live_curves.LiveCurves("ppo", "ppo", "ppo", every_s=3600)
    live.add(step(1))
    live.finish(store, failed=True)
    assert "**the job failed here**: 1 logged step, last step 1 of 6" in published[-1][1]
    store.write_text("ppo/metrics.json", "{not json")
    live.finish(store)  # must not raise: the stage trained
    assert "the ppo curves were not drawn" in capsys.readouterr().err
