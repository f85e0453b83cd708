"""The bad-input harness: run a stage job's command line in this process and check what a user relies on when the
input is wrong.

``refused(kind, *overrides, match=...)`` runs ``python -m rlhf_core.jobs.<kind> --config <preset> run_uri=<run>
<overrides>`` through the job's own ``main`` and asserts:

- exit status 2;
- exactly one line on stderr, ``error: ...``, matching ``match`` (it names the file and row, the key, or the
  location);
- no traceback anywhere in the output;
- no Ray started and no worker (the job runs on a ``NoRay`` cluster, which refuses both);
- every file that was in the run folder before (a committed ``sft`` output, the saved config) is unchanged, and
  nothing was added to it;
- no scratch folder left behind (``RLHF_WORK_DIR`` is a folder of the test's own).

It returns the error line. ``run_dir`` is the run folder (pre-filled) and ``work_dir`` the scratch root.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import re
from pathlib import Path

import pytest

from rlhf_core.storage import ObjectStore
from tests.clusters import NoRay
from tests.conftest import TINY


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``folder``."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run folder holding a committed ``sft`` output and a saved config, as after an earlier run."""
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights of an earlier run")
    run = tmp_path / "run"
    store = ObjectStore(str(run))
    store.put_artifact(str(out), "sft", stage="sft", config_hash="earlier", metrics={"steps": 3})
    store.write_text("config.yaml", "earlier: config\n")
    return run


@pytest.fixture
def work_dir(tmp_path, monkeypatch) -> Path:
    work = tmp_path / "scratch"
    work.mkdir()
    monkeypatch.setenv("RLHF_WORK_DIR", str(work))
    return work


@pytest.fixture
def no_ray():
    """The cluster the jobs run on: every way a job starts Ray or its workers fails the test."""
    return NoRay()


@pytest.fixture
def refused(run_dir, work_dir, no_ray, capsys):
    def check(kind: str, *overrides: str, match: str, config: str | Path = TINY, stage: str | None = None) -> str:
        before = snapshot(run_dir)
        job = importlib.import_module(f"rlhf_core.jobs.{kind}")
        from rlhf_core.jobs import process

        argv = ["--config", str(config), *(["--stage", stage] if stage else []), f"run_uri={run_dir}", *overrides]
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            process.main(kind, functools.partial(job.run, cluster=no_ray), argv)
        out, err = capsys.readouterr()
        assert exited.value.code == 2, f"exit status {exited.value.code}, stderr:\n{err}"
        assert "Traceback" not in out + err, out + err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, f"expected one error line, got:\n{err}"
        assert lines[0].startswith("error: "), lines[0]
        assert re.search(match, lines[0]), f"{match!r} not in {lines[0]!r}"
        assert snapshot(run_dir) == before, "the refused run changed the run folder"
        left = sorted(p.name for p in (work_dir / "rlhf-pipeline").glob("*"))
        assert not left, f"scratch folders left behind: {left}"
        return lines[0]

    return check
