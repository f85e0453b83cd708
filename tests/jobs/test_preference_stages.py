"""The DPO and KTO stage jobs: bad preference data refused before anything starts (file, row, key), reference
log-probs of the starting policy computed once by the training rank, without a reference group, and stored with the
stage (a rerun reads them back), online and precomputed references
training alike, and the loss at the start of training (policy = reference) at its known value."""

import json
import math
import subprocess
import sys

import pytest

from rlhf_core import run_layout
from rlhf_core.config import load_config
from rlhf_core.data.loading import DataError
from rlhf_core.jobs import dpo, kto
from rlhf_core.storage import ObjectStore
from tests.clusters import NoWorkers
from tests.conftest import ROOT
from tests.jobs.test_rl_family import ray_actor_names

PRESETS = ROOT / "deployments" / "configs"
# no upstream SFT output needed; 32 pairs in batches of 16: 2 steps
SMALL = ["model.name_or_path=builtin:tiny", "data.max_samples=32", "data.eval_path=null"]


def cfg_for(kind: str, run_dir, *overrides):
    return load_config(
        PRESETS / f"tiny-{kind}.yaml", [f"run_uri={run_dir}", *(f"{kind}.{o}" for o in SMALL), *overrides]
    )


@pytest.fixture
def no_workers():
    """A cluster that fails the test if a job gets as far as starting any Ray actor (its reference group or its
    training group)."""
    return NoWorkers("the job started workers despite bad input")


def pairs_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"prompt": "Write about the rain.", "chosen": "The rain is good.", "rejected": "The rain is sad."}
BAD_ROWS = {
    "missing key": ({"prompt": "Write about the sea.", "chosen": "The sea is kind."}, r"row 2.*'rejected'"),
    "chosen equal to rejected": (
        {"prompt": "Write about the sea.", "chosen": "The sea is calm.", "rejected": "The sea is calm."},
        r"row 2 keys 'chosen' and 'rejected': chosen and rejected are the same",
    ),
    "empty response": (
        {"prompt": "Write about the sea.", "chosen": "The sea is kind.", "rejected": "  "},
        r"row 2.*key 'rejected'.*empty",
    ),
}


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_preference_data_is_refused_before_training_with_file_and_row(tmp_path, no_workers, kind, case):
    row, message = BAD_ROWS[case]
    data = pairs_file(tmp_path / "pairs.jsonl", [GOOD, row, GOOD])
    cfg = cfg_for(kind, tmp_path / "run", f"{kind}.data.train_path={data}")
    job = dpo if kind == "dpo" else kto
    with pytest.raises(DataError, match=rf"{tmp_path / 'pairs.jsonl'}.*{message}"):
        job.run(cfg, kind, cluster=no_workers)
    assert not (tmp_path / "run" / kind).exists()  # nothing written


@pytest.mark.slow  # a job process; the refusals themselves run in test-fast
def test_the_job_cli_refuses_bad_pairs_with_one_line_and_status_2(tmp_path):
    data = pairs_file(tmp_path / "pairs.jsonl", [GOOD, BAD_ROWS["chosen equal to rejected"][0]])
    preset = PRESETS / "tiny-dpo.yaml"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_core.jobs.dpo",
            "--config",
            str(preset),
            f"run_uri={tmp_path / 'run'}",
            *(f"dpo.{o}" for o in SMALL),
            f"dpo.data.train_path={data}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"{data} row 2" in lines[0] and "same" in lines[0], out.stderr[-2000:]


@pytest.mark.slow
def test_dpo_reference_log_probs_are_stored_once_and_reused_and_match_online(tmp_path, ray_cluster, capsys):
    run_dir = tmp_path / "run"
    before = ray_actor_names()
    ref = dpo.run(cfg_for("dpo", run_dir), "dpo")
    # the reference is the starting policy: the training rank scored it before its first step, no reference group
    assert {name.split(":")[0] for name in ray_actor_names() - before} == {"DPOTrainer"}
    store = ObjectStore(str(run_dir))
    rel = run_layout.reference_logprobs("dpo")
    stored = store.read_manifest(rel, verify=True)
    assert stored.config_hash == ref.config_hash and stored.extra["sequences"] == {"train": 64}  # 32 pairs x 2
    assert ref.metrics["loss_start"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference at step 1
    assert ref.metrics["steps"] == 2

    # a rerun of the stage (its output gone, e.g. a retry after a crash) reads the stored numbers back
    store.prepare("dpo", clear=False)  # un-commit the stage's output; its reference_logprobs/ stays
    capsys.readouterr()
    again = dpo.run(cfg_for("dpo", run_dir), "dpo")
    assert f"reference log-probs from {store.uri(rel)}" in capsys.readouterr().out
    assert store.read_manifest(rel).created_at == stored.created_at
    assert again.metrics["loss_end"] == pytest.approx(ref.metrics["loss_end"], abs=1e-6)

    # online: a frozen reference on the rank, no stored numbers, the same training
    online = dpo.run(cfg_for("dpo", tmp_path / "online", "dpo.ref_logprobs=online"), "dpo")
    assert not ObjectStore(str(tmp_path / "online")).exists(f"{rel}/manifest.json")
    for key in ("loss_start", "loss_end"):
        assert online.metrics[key] == pytest.approx(ref.metrics[key], abs=1e-5)


@pytest.mark.slow
def test_kto_from_pairs_starts_at_one_half_and_reports_its_reference_point(tmp_path, ray_cluster):
    held_out = "kto.data.eval_path=rlhf_core/assets/data/synthetic/pref_eval.jsonl"
    ref = kto.run(cfg_for("kto", tmp_path / "run", held_out), "kto")
    m = ref.metrics
    assert m["train_samples"] == 64  # 32 pairs: a desirable and an undesirable example each -> 4 steps of 16
    assert m["steps"] == 4 and m["loss_start"] == pytest.approx(0.5, abs=1e-5)
    assert m["eval_examples"] == 600 and {"eval_kl", "eval_chosen_reward", "eval_rejected_reward"} <= set(m)
