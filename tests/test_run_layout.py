"""The run folder's names (``rlhf_core.run_layout``) and the one-line error helpers (``rlhf_core.errors``)."""

import pytest

from rlhf_core import run_layout
from rlhf_core.config import ConfigError
from rlhf_core.errors import first_line, one_line
from rlhf_core.jobs import pipeline
from rlhf_core.storage import ObjectStore
from rlhf_core.types import CheckpointRef


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

    def refuse(*args, **kwargs):
        raise ConfigError("bad key\nstorage.secret = sEcReT123")

    monkeypatch.setattr(pipeline, "load_config", refuse)
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", "any.yaml"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: bad key storage.secret = ***\n"
