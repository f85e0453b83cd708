"""The Prefect pipeline against a real Prefect server: deployment on a process worker, artifacts and schedule read
back through the API, cancellation, resume of a failed run, reruns after a config change, and ``rlhf compare`` of
the deployed run with its changed rerun."""

import contextlib
import json
import shutil
import time

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.sorting import ArtifactSort
from prefect.deployments import run_deployment
from prefect.states import Cancelling

from deployments.deploy import deploy
from flows.cli import main
from flows.compare import ARTIFACT_KEY, compare_runs
from flows.report import summary_markdown
from flows.rlhf_pipeline import PipelineParams, rlhf_pipeline
from tasks._procs import head_guards
from tasks.launch import ROOT
from tests.test_compare import record_figures, section, table

pytestmark = pytest.mark.slow

# The tiny preset, a little smaller still.
FAST = [
    "sft.data.max_samples=256",
    "reward_model.data.max_samples=512",
    "ppo.train.max_steps=4",
    "ppo.train.eval_prompts=16",
]


def launches(run_dir) -> list[str]:
    files = sorted((run_dir / "_launches").glob("*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    return [json.loads(p.read_text())["stage"] for p in files]


def states(summary: dict) -> dict[str, str]:
    return {row["stage"]: row["state"] for row in summary["stages"]}


STAGES = ["sft", "reward_model", "critic_init", "critic_warmup", "ppo"]
# The tiny preset's PPO step phases (it has a KL penalty: a reference policy), besides the step itself.
ROLES = ("actor", "reference", "critic", "reward")
PPO_PHASES = [
    "generation",
    "experience",
    *(f"experience_{r}" for r in ROLES),
    "advantages",
    "train",
    "critic_train",
    "actor_train",
    "weight_sync",
    "checkpoint",
]


def ray_heads_of_runs() -> set[int]:
    """Processes of any cluster started by tasks.launch.ray_head (their command lines name its /tmp/rlhf-ray-*)."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any("/tmp/rlhf-ray-" in part for part in p.info["cmdline"] or []):
                found.add(p.pid)
    return found


def run_logs(flow_run_id) -> str:
    """Every log line of a flow run, page by page."""
    logs: list = []
    with get_client(sync_client=True) as client:
        of_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        while page := client.read_logs(log_filter=of_run, limit=200, offset=len(logs)):
            logs += page
    return "\n".join(log.message for log in logs)


@pytest.fixture(scope="module")
def deployed_run(prefect_server, work_pool, tmp_path_factory):
    """The tiny pipeline deployed and run once on the process worker, with one Ray for its stage jobs
    (``shared_ray``): (the flow run, its run folder, the Ray heads of runs that were there before it)."""
    run_dir = tmp_path_factory.mktemp("deployed") / "run"
    deploy(
        work_pool["pool"],
        cron="0 3 * * *",
        names=["tiny-nightly"],
        overrides={"run_uri": str(run_dir), "overrides": FAST, "shared_ray": True},
    )
    heads_before = ray_heads_of_runs()
    flow_run = run_deployment("rlhf-pipeline/tiny-nightly", timeout=900)
    if not flow_run.state.is_completed():  # the whole message: a state's repr is cut short
        pytest.fail(
            f"{flow_run.state.name}: {flow_run.state.message}\n--- the run's log:\n{run_logs(flow_run.id)[-6000:]}"
            f"\n--- the worker's log:\n{work_pool['worker_log'].read_text()[-3000:]}"
        )
    return flow_run, run_dir, heads_before


def test_deployed_pipeline_runs_on_a_process_worker(deployed_run):
    flow_run, run_dir, heads_before = deployed_run

    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert states(summary) == dict.fromkeys(STAGES, "Completed")
    assert launches(run_dir) == STAGES
    assert "run_uri" in (run_dir / "config.yaml").read_text()
    # Per-phase timing of every PPO step in metrics.json: each phase every step, the one-after-the-other phases
    # within the step, the concurrent ones within theirs, and each phase's mean and total in the final metrics.
    ppo_out = json.loads((run_dir / "ppo" / "metrics.json").read_text())
    phases = [*PPO_PHASES, "step"]
    for h in ppo_out["history"]:
        assert {f"timing/{p}_s" for p in phases} <= h.keys(), sorted(h)
        nested = {*(f"experience_{r}" for r in ROLES), "actor_train", "critic_train"}  # within experience, train
        assert sum(h[f"timing/{p}_s"] for p in PPO_PHASES if p not in nested) <= h["timing/step_s"]
        assert max(h[f"timing/experience_{r}_s"] for r in ROLES) <= h["timing/experience_s"]
        assert max(h["timing/actor_train_s"], h["timing/critic_train_s"]) <= h["timing/train_s"]
        assert min(h[f"timing/{p}_s"] for p in ("generation", "actor_train", "critic_train", "weight_sync")) > 0
    final = ppo_out["final"]
    assert final["timing/steps"] == len(ppo_out["history"]) == 4
    for p in phases:
        values = [h[f"timing/{p}_s"] for h in ppo_out["history"]]
        assert final[f"timing/{p}_s_total"] == pytest.approx(sum(values))
        assert final[f"timing/{p}_s_mean"] == pytest.approx(sum(values) / 4)

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
        by_key = {a.key: a for a in artifacts}
        for key in (
            "run-summary",
            "resolved-config",
            "sft-metrics",
            "reward-model-metrics",
            "ppo-metrics",
            "sft-progress",
            "ppo-progress",
            "ppo-timing",
            "critic-warmup-timing",
        ):
            assert key in by_key, sorted(by_key)
        assert by_key["sft-progress"].data == 100.0
        # PPO's timing summary in its metrics table, and one row per phase in its timing table
        assert "timing/generation_s_mean" in str(by_key["ppo-metrics"].data)
        timing_rows = by_key["ppo-timing"].data
        timing_rows = json.loads(timing_rows) if isinstance(timing_rows, str) else timing_rows
        assert [row["phase"] for row in timing_rows][-1] == "step"
        assert {row["phase"] for row in timing_rows} == set(phases)
        assert timing_rows[-1]["mean_s"] == pytest.approx(final["timing/step_s_mean"], abs=1e-3)
        assert "| ppo | Completed |" in by_key["run-summary"].data
        deployment = client.read_deployment_by_name("rlhf-pipeline/tiny-nightly")
        assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
    messages = run_logs(flow_run.id)
    # The stage job's own output, Ray workers' lines included (prefixed with the worker's role), is in the run log.
    assert "[sft] step" in messages and "SFTTrainer rank 0 pid=" in messages
    # One Ray for the run (shared_ray): each of the 4 stage jobs that use Ray (critic_init copies a model) joined the
    # head the flow started, none started a Ray of its own, and the head is gone with the run.
    assert "the stage jobs join the run's Ray at 127.0.0.1:" in messages
    port = messages.split("the stage jobs join the run's Ray at ", 1)[1].split()[0].rsplit(":", 1)[1]
    assert messages.count("Connecting to existing Ray cluster at address: ") == 4, messages[-3000:]
    assert messages.count(f":{port}...") == 4 and "Started a local Ray instance" not in messages
    assert not ray_heads_of_runs() - heads_before


CURVE_STAGES = ["sft", "reward_model", "critic_warmup", "ppo"]  # critic_init copies a model: no steps
SHOTS = ROOT / ".rlhf" / "test-outputs" / "ui"  # the screenshots, kept after the test


def test_the_prefect_ui_renders_each_stage_curves(deployed_run, prefect_server):
    """Headless Chromium opens each stage's curves artifact page on the real server: the figure is rendered (a
    decoded image of non-zero natural size); the PPO figure has one point per logged step; and while PPO ran, a
    version of its artifact held a partial curve (the newest live version, kept beside the final one)."""
    from playwright.sync_api import sync_playwright

    flow_run, run_dir, _ = deployed_run
    with get_client(sync_client=True) as client:
        keys = [f"{stage.replace('_', '-')}-curves" for stage in CURVE_STAGES]
        versions = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]), key=ArtifactFilterKey(any_=keys)
            ),
            sort=ArtifactSort.CREATED_DESC,
            limit=200,
        )[::-1]
    latest = {a.key: a for a in versions}  # oldest first: the last one of a key is its latest version
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        for stage in CURVE_STAGES:
            artifact = latest[f"{stage.replace('_', '-')}-curves"]
            page.goto(f"{prefect_server['ui']}/artifacts/artifact/{artifact.id}")
            alt = f"{stage} curves"
            page.wait_for_function(
                "alt => [...document.images].some(i => i.alt === alt && i.complete && i.naturalWidth > 0)",
                arg=alt,
                timeout=60_000,
            )
            size = page.evaluate(
                "alt => [...document.images].filter(i => i.alt === alt)"
                ".map(i => [i.naturalWidth, i.naturalHeight])[0]",
                alt,
            )
            assert min(size) > 100, (stage, size)
            page.screenshot(path=str(SHOTS / f"{stage}-curves.png"), full_page=True)
        browser.close()
    # One point per logged step (the tiny preset logs every PPO step): the final figure's table has each step.
    history = json.loads((run_dir / "ppo" / "metrics.json").read_text())["history"]
    final = latest["ppo-curves"].data
    assert "**final**: 4 logged steps, last step 4 of 4" in final
    assert [row.split(" | ")[0] for row in final.splitlines() if row.startswith("| ") and row[2].isdigit()] == [
        f"| {h['step']}" for h in history
    ]
    # While PPO ran: a version drawn from the job's step events, after at least two of them and before the last.
    # Each live version replaced the one before: the newest live one is left beside the final one.
    running = [a.data for a in versions if a.key == "ppo-curves" and "**running" in a.data]
    kept = [a.data[:90] for a in versions if a.key == "ppo-curves"]
    assert len(running) == 1 and len(kept) == 2, kept
    assert any(f"logged steps, last step {k} of 4" in running[0] for k in (2, 3)), running[0][:300]


def _run_tree(run_dir, timeout_s=180) -> list[int]:
    """Pids of the first launched job and of the run's Ray (``shared_ray``: the head's guard, ``ray start``, GCS,
    raylet, agents and workers, the guard being a child of the flow-run process like the job), once the job's first
    worker is up in that Ray."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        files = list((run_dir / "_launches").glob("*.json")) if (run_dir / "_launches").exists() else []
        if files:
            pid = json.loads(files[0].read_text())["pid"]
            try:
                job = psutil.Process(pid)
                guards = head_guards(job.parent().pid)
                tree = [job, *job.children(recursive=True)]
                tree += [q for g in guards for q in (g, *g.children(recursive=True))]
                started = any(q.cmdline()[:1] and q.cmdline()[0].startswith("ray::_Shell") for q in tree)
            except psutil.NoSuchProcess:
                guards, started = [], False
            if guards and started:
                return [q.pid for q in tree]
        time.sleep(1)
    raise AssertionError("the job's workers did not start in the run's Ray in time")


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_cancelling_a_running_flow_leaves_no_job_process(prefect_server, work_pool, tmp_path):
    run_dir = tmp_path / "run"
    long_sft = [*FAST, "sft.train.max_epochs=200", "sft.train.log_steps=50"]
    deploy(work_pool["pool"], names=["tiny-nightly"], overrides={"run_uri": str(run_dir), "overrides": long_sft})
    flow_run = run_deployment("rlhf-pipeline/tiny-nightly", timeout=0)
    pids = _run_tree(run_dir)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
        deadline = time.time() + 120
        while time.time() < deadline and not client.read_flow_run(flow_run.id).state.is_final():
            time.sleep(1)
        assert client.read_flow_run(flow_run.id).state.is_cancelled()
    deadline = time.time() + 30
    while _alive(pids) and time.time() < deadline:
        time.sleep(1)
    assert not _alive(pids), [psutil.Process(p).cmdline()[:3] for p in _alive(pids)]


@pytest.fixture(scope="module")
def failed_then_resumed(deployed_run, tmp_path_factory):
    """A run whose PPO stage fails on purpose after its first checkpoint, then the same run again. It starts from the
    deployed run's committed stages with one change, the critic warm-up's learning rate: SFT, the reward model and
    the critic's initialisation are found complete for their configs (``save_steps`` is not hashed) and not launched;
    the critic warm-up and what follows it (PPO, whose inputs it is) run again."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    shutil.copytree(deployed_run[1], run_dir, ignore=shutil.ignore_patterns("ppo", "_prefect", "_launches"))
    overrides = [*FAST, "ppo.train.save_steps=2", "critic_warmup.critic.optim.lr=1e-3"]
    params = PipelineParams(
        preset="tiny", run_name="resume-test", run_uri=str(run_dir), task_retries=0, overrides=overrides
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("RLHF_FAIL_AFTER_STEP", "2")
    with pytest.raises(Exception, match="injected failure after checkpoint at step 2"):
        rlhf_pipeline(params)
    mp.undo()
    failed = json.loads((run_dir / "run_summary.json").read_text())
    launched_first = launches(run_dir)
    resumed = rlhf_pipeline(params)
    return run_dir, params, failed, launched_first, resumed


def test_changing_a_stage_config_reruns_it_and_what_follows(failed_then_resumed):
    _, _, failed, launched_first, _ = failed_then_resumed
    assert states(failed) == {**dict.fromkeys(STAGES[:3], "Cached"), "critic_warmup": "Completed", "ppo": "Failed"}
    assert launched_first == ["critic_warmup", "ppo"]


def test_rerun_of_a_failed_run_skips_finished_stages_and_resumes_ppo(failed_then_resumed):
    run_dir, _, failed, launched_first, resumed = failed_then_resumed
    assert failed["state"] == "Failed" and states(failed)["ppo"] == "Failed"
    assert states(resumed) == {**dict.fromkeys(STAGES[:4], "Cached"), "ppo": "Completed"}
    assert launches(run_dir) == launched_first + ["ppo"]  # no earlier stage's job was launched again
    ppo_row = [r for r in resumed["stages"] if r["stage"] == "ppo"][0]
    assert ppo_row["metrics"]["resumed_from_step"] == 2 and ppo_row["metrics"]["steps"] == 4


@pytest.mark.extended  # the stages parameter; make test runs whole pipelines
def test_single_stage_run_reads_upstream_outputs_from_the_run(failed_then_resumed):
    run_dir, params, *_ = failed_then_resumed
    before = len(launches(run_dir))
    overrides = [*params.overrides, "ppo.train.max_steps=2"]
    summary = rlhf_pipeline(params.model_copy(update={"stages": ["ppo"], "overrides": overrides}))
    assert states(summary) == {"ppo": "Completed"}
    assert launches(run_dir)[before:] == ["ppo"]


def test_bad_input_fails_the_stage_once_without_retries(prefect_server, tmp_path):
    run_dir = tmp_path / "run"
    params = PipelineParams(
        preset="tiny",
        run_name="bad-input",
        run_uri=str(run_dir),
        task_retries=2,
        overrides=["sft.data.train_path=/nonexistent/sft.jsonl"],
    )
    with pytest.raises(Exception, match=r"exit code 2[\s\S]*/nonexistent/sft.jsonl"):
        rlhf_pipeline(params)
    assert launches(run_dir) == ["sft"]  # refused input is not retried
    assert states(json.loads((run_dir / "run_summary.json").read_text())) == {"sft": "Failed"}


@pytest.mark.extended  # make test: a SIGKILLed job's task retry resumes (test_faults); PPO resume (test_ppo)
def test_a_task_retry_resumes_ppo_from_its_checkpoint(failed_then_resumed, tmp_path, monkeypatch):
    source, params, *_ = failed_then_resumed
    run_dir = tmp_path / "run"  # the finished upstream stages of that run, without PPO
    shutil.copytree(source, run_dir, ignore=shutil.ignore_patterns("ppo", "_prefect", "_launches"))
    monkeypatch.setenv("RLHF_FAIL_AFTER_STEP", "2")
    summary = rlhf_pipeline(
        params.model_copy(update={"run_name": "retry-test", "run_uri": str(run_dir), "task_retries": 1})
    )
    assert states(summary)["ppo"] == "Completed"
    assert launches(run_dir).count("ppo") == 2  # the failed attempt and its retry
    ppo = [r for r in summary["stages"] if r["stage"] == "ppo"][0]
    assert ppo["metrics"]["resumed_from_step"] == 2
    # at a glance in the summary artifact: retried, resumed; the upstream stages not run
    assert ppo["attempts"] == 2 and ppo["notes"] == "attempt 2 (retried), resumed from step 2"
    assert "| ppo | Completed | attempt 2 (retried), resumed from step 2 |" in summary_markdown(summary)
    assert "| sft | Cached | not run: output committed for this config |" in summary_markdown(summary)


@pytest.mark.extended  # make test: every stage of a run its own cached task (the deployed run and its reruns)
def test_two_instances_of_one_kind_are_two_cached_tasks(prefect_server, tmp_path):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from rlhf_core.storage import ObjectStore

    run_dir = tmp_path / "run"
    params = PipelineParams(preset="sft_chain", run_name="chain", run_uri=str(run_dir))
    state = rlhf_pipeline(params, return_state=True)
    first = state.result()
    assert states(first) == {"sft_a": "Completed", "sft_b": "Completed"}
    assert launches(run_dir) == ["sft_a", "sft_b"]
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    assert sorted(r.name for r in runs) == ["sft_a", "sft_b"]  # one task run per instance, named after it
    store = ObjectStore(str(run_dir))
    assert store.read_manifest("sft_b").extra["upstream"] == {"sft_a": store.read_manifest("sft_a").config_hash}

    assert states(rlhf_pipeline(params)) == {"sft_a": "Cached", "sft_b": "Cached"}
    assert launches(run_dir) == ["sft_a", "sft_b"]

    changed = rlhf_pipeline(params.model_copy(update={"overrides": ["sft_b.optim.lr=5e-4"]}))
    assert states(changed) == {"sft_a": "Cached", "sft_b": "Completed"}
    assert launches(run_dir) == ["sft_a", "sft_b", "sft_b"]


def test_compare_overlays_the_deployed_run_and_its_changed_rerun(deployed_run, failed_then_resumed, tmp_path, capsys):
    """``rlhf compare`` on two real runs of this module: the deployed run and the rerun with the critic warm-up's
    learning rate changed (``failed_then_resumed``). The report names the keys that differ, overlays both runs'
    curves per stage and shows the critic warm-up's different final losses; the ``compare-runs`` flow stores the same
    report as the ``run-comparison`` artifact on the Prefect server."""
    deployed, rerun = deployed_run[1], failed_then_resumed[0]
    with pytest.MonkeyPatch.context() as mp:
        drawn = record_figures(mp)
        out = tmp_path / "report"
        main(["compare", str(deployed), str(rerun), "--out", str(out)])
    assert capsys.readouterr().out.strip().endswith(f"report: {out}/compare.md")
    text = (out / "compare.md").read_text()
    assert text.startswith("# Run comparison: run vs run-2\n")  # both folders are named run: labels made unique

    # The two overrides of the rerun are the keys that differ.
    diffs = table(section(text, "Config differences"))
    assert diffs["key"] == ["run", "run-2"]
    assert {"`critic_warmup.critic.optim.lr`", "`ppo.train.save_steps`"} <= set(diffs), diffs
    assert not any(key.startswith(("`sft.", "`reward_model.")) for key in diffs), diffs
    low, high = diffs["`critic_warmup.critic.optim.lr`"]
    assert high == "0.001" and low != high
    # Each stage's logged curves of both runs in one image per stage; SFT's are the same run's (found complete).
    histories = {
        stage: {label: json.loads((run / stage / "metrics.json").read_text())["history"] for label, run in runs}
        for stage in CURVE_STAGES
        for runs in [[("run", deployed), ("run-2", rerun)]]
    }
    assert drawn == {f"{stage}: run vs run-2": histories[stage] for stage in CURVE_STAGES}
    assert histories["sft"]["run"] == histories["sft"]["run-2"]
    assert all((out / f"{stage}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for stage in CURVE_STAGES)
    warmup = section(text, "critic_warmup")
    assert "![critic_warmup](critic_warmup.png)" in warmup
    finals = table(warmup)
    assert finals["final metric"] == ["run", "run-2"]
    low_loss, high_loss = finals["`critic_loss`"]  # the warm-up's last critic loss
    assert low_loss != high_loss, finals

    path = compare_runs([str(deployed), str(rerun)], str(tmp_path / "flow-report"))
    assert path == f"{tmp_path}/flow-report/compare.md"
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])), sort=ArtifactSort.CREATED_DESC
        )
    artifact = found[0]  # the newest version of the key
    assert artifact.type == "markdown"
    assert artifact.data.startswith("# Run comparison: run vs run-2\n")
    assert "`critic_warmup.critic.optim.lr`" in artifact.data and "![ppo](data:image/png;base64," in artifact.data
