"""The run folder's names (``rlhf_core.run_layout``) and the one-line error helpers (``rlhf_core.errors``)."""

import re

import pytest

from rlhf_core import run_layout
from rlhf_core.errors import first_line, one_line
from rlhf_core.jobs import pipeline
from rlhf_core.storage import ObjectStore
from rlhf_core.types import CheckpointRef
from tests.conftest import TINY


def test_checkpoint_names_sort_by_step():
    names = [run_layout.checkpoint("sft", step) for step in (9, 10, 100)]
    assert names == sorted(names)
    assert names[0] == "sft/checkpoints/step_00000009"


def test_bookkeeping_and_half_written_folders_are_not_stages():
    assert run_layout.is_stage_dir("sft_b")
    for name in ("_leases", "_prefect", ".cache", "sft.next"):
        assert not run_layout.is_stage_dir(name), name


def test_summary_metrics_keep_the_list_order_and_drop_missing_values():
    metrics = {"steps": 4, "loss_end": 0.5, "loss_start": 1.0, "eval_loss": None, "lr": 1e-3}
    assert list(run_layout.summary_metrics(metrics).items()) == [("loss_start", 1.0), ("loss_end", 0.5), ("steps", 4)]


def test_committed_ref_needs_a_complete_output(tmp_path):
    store = ObjectStore(str(tmp_path))
    assert run_layout.committed_ref(store, "sft") is None
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "w.bin").write_bytes(b"x")
    store.put_artifact(tmp_path / "work", "sft", stage="sft", config_hash="abc", metrics={"steps": 3})
    assert run_layout.committed_ref(store, "sft") == CheckpointRef(store.uri("sft"), "sft", 3, "abc", {"steps": 3})
    assert run_layout.existing_output(store, "sft", "abc") is not None
    assert run_layout.existing_output(store, "sft", "other") is None


def test_first_line_of_an_error():
    assert first_line(ValueError("bad value\nmore")) == "ValueError: bad value"
    assert (
        first_line(ValueError("while loading:\n  the file is gone")) == "ValueError: while loading: the file is gone"
    )
    assert first_line(KeyError()) == "KeyError"
    assert first_line(ValueError("x" * 300)) == "ValueError: " + "x" * 200
    assert first_line(ValueError("x" * 300), limit=None) == "ValueError: " + "x" * 300
    assert one_line("a\n  b\tc ") == "a b c"


def test_the_in_process_pipeline_refuses_bad_input_in_one_redacted_line(monkeypatch, capsys):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sEcReT123")
    with pytest.raises(SystemExit) as e:  # a credential given as a config value: named redacted, before any stage
        pipeline.main(["--config", str(TINY), "sft.train.max_steps=sEcReT123"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: [^\n]*'\*\*\*'[^\n]*'sft\.train\.max_steps'[^\n]*\n", err), err
