"""The PPO stage beyond GAE and a reward model, as real jobs on the session's Ray: a critic-free estimator (no critic
actor, no critic output; its controller's TensorBoard scalars read back), a remote reward server on loopback (an
outage fails the stage, naming the server; the stage then resumes from its checkpoint), and reward-function files
refused before any worker starts."""

import json
import subprocess
import sys
import threading
import time

import pytest

from rlhf_core.config import ConfigError
from rlhf_core.remote_reward import RemoteRewardError
from rlhf_core.storage import ObjectStore
from tests.conftest import ROOT
from tests.jobs.conftest import TENSORBOARD, run_ppo
from tests.test_rewards import free_port
from tests.test_tracking import scalars

pytestmark = pytest.mark.slow

SHORT = ("ppo.train.eval_prompts=0", "ppo.train.max_steps=2")
GRPO = (
    "ppo.critic.model=null",
    "ppo.algo.advantage_estimator=grpo",
    "ppo.rollout.n_samples_per_prompt=4",
    "ppo.train.train_batch_size=32",
    "ppo.algo.kl_mode=loss",
    "ppo.algo.kl_estimator=k3",
)


def ray_actor_names() -> set[str]:
    """Every actor of the session's Ray cluster, alive or dead, by name (what `ray list actors` shows)."""
    import ray._private.state

    return {a["Name"] for a in ray._private.state.actors().values() if a.get("Name")}


def test_a_critic_free_run_starts_no_critic_actor_and_writes_no_critic(run_dir):
    before = ray_actor_names()
    # async training on the Hugging Face engine: a thread generates the next step's rollout while this one trains
    ref = run_ppo(run_dir, *GRPO, *SHORT, "ppo.train.save_steps=1", TENSORBOARD, "ppo.train.async_enable=true")
    started = {name.split(":")[0] for name in ray_actor_names() - before}
    assert started == {"PolicyActor", "ReferencePolicy", "RewardScorer"}, started  # and the rollout engine
    assert ref.metrics["steps"] == 2
    out = json.loads((run_dir / "ppo" / "metrics.json").read_text())
    assert out["roles"]["critic"] == 0 and out["roles"]["actor"] == 1
    assert not (run_dir / "ppo" / "critic").exists()
    store = ObjectStore(str(run_dir))
    manifest = store.read_manifest("ppo/checkpoints/step_00000001")
    assert manifest.extra["workers"] == {"actor.strategy.num_workers": 1}
    assert manifest.files and not any(f.startswith("critic") for f in manifest.files)
    # each rollout at most async_queue_size (1) weight updates old, and sampled by one version (no partial rollout)
    assert [h["rollout_staleness"] <= 1 and h["rollout_version_span"] == 0 for h in out["history"]] == [True] * 2
    last = out["history"][-1]
    assert "critic_loss" not in last and "critic_lr" not in last and last["kl_loss"] >= 0
    assert "timing/critic_train_s" not in last and "timing/experience_critic_s" not in last
    # TensorBoard: the controller logged every step (log_steps=1), read back; and the stage's curves
    got = scalars(run_dir / "tensorboard" / "ppo")
    for name in ("reward", "kl", "policy_loss"):
        assert [s for s, _ in got[name]] == [1, 2], name
        assert [v for _, v in got[name]] == pytest.approx([h[name] for h in out["history"]]), name
    assert (run_dir / "ppo" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "reward_server.py"), "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert "listening on" in proc.stdout.readline()
    return proc


def test_a_remote_reward_server_scores_ppo_and_an_outage_fails_then_resumes(run_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    overrides = (
        "ppo.reward.model=null",
        f"ppo.remote_rm_url={url}",
        "ppo.remote_rm.retries=1",
        "ppo.remote_rm.backoff_s=0.1",
        "ppo.remote_rm.timeout_s=5",
        "ppo.train.eval_prompts=0",
        "ppo.train.max_steps=4",
        "ppo.train.save_steps=1",
    )
    store = ObjectStore(str(run_dir))
    server = _server(port)

    def stop_after_first_checkpoint() -> None:
        deadline = time.monotonic() + 600
        while not store.is_complete("ppo/checkpoints/step_00000001") and time.monotonic() < deadline:
            time.sleep(0.05)
        server.kill()

    watcher = threading.Thread(target=stop_after_first_checkpoint, daemon=True)
    watcher.start()
    try:
        with pytest.raises(RemoteRewardError) as failed:
            run_ppo(run_dir, *overrides)
    finally:
        server.kill()
        watcher.join()
    message = str(failed.value)
    assert "'ppo.remote_rm_url'" in message and url in message and "after 2 tries" in message, message
    assert not store.is_complete("ppo")  # the stage failed: no output committed
    done = sorted(store.list_dirs("ppo/checkpoints"))
    assert done and done[-1] != "step_00000004"

    server = _server(port)  # the server is back, on the same address
    try:
        ref = run_ppo(run_dir, *overrides)
    finally:
        server.kill()
    assert ref.metrics["resumed_from_step"] == int(done[-1].split("_")[1]) >= 1
    history = json.loads((run_dir / "ppo" / "metrics.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert all("remote_rm_score" in h and "rm_score" not in h for h in history)
    assert ref.metrics["remote_rm_score"] == history[-1]["remote_rm_score"]


def test_bad_reward_functions_and_an_unreachable_server_are_refused_before_any_actor(run_dir, tmp_path, no_actors):
    raises = tmp_path / "raises.py"
    raises.write_text("def score(prompts, responses):\n    return 1 / 0\n")
    with pytest.raises(ConfigError, match=rf"'ppo.reward_fn' = '{raises}:score' raised ZeroDivisionError"):
        run_ppo(run_dir, *GRPO, *SHORT, f"ppo.reward_fn={raises}:score", cluster=no_actors)
    short = tmp_path / "short.py"
    short.write_text("def score(prompts, responses):\n    return [0.0]\n")
    with pytest.raises(ConfigError, match=rf"'ppo.reward_fn' = '{short}:score' returned 1 scores for 2 rows"):
        run_ppo(run_dir, *GRPO, *SHORT, f"ppo.reward_fn={short}:score", cluster=no_actors)
    with pytest.raises(ConfigError, match=rf"'ppo.reward_fn' = '{short}:missing': .* has no attribute 'missing'"):
        run_ppo(run_dir, *GRPO, *SHORT, f"ppo.reward_fn={short}:missing", cluster=no_actors)
    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RemoteRewardError, match=rf"'ppo.remote_rm_url': .*{url}.*cannot connect"):
        run_ppo(run_dir, *GRPO, *SHORT, f"ppo.remote_rm_url={url}", "ppo.remote_rm.retries=0", cluster=no_actors)
    assert not (run_dir / "ppo").exists()


EVERY_THIRD_CALL_FLAT = '''
import json
import os

calls = 0


def score(prompts, responses, *, labels):
    """The response's length, except on every third call: 0.0 for every row, so that dynamic filtering drops the
    whole batch. Each (prompt, label) pair it is given is appended to $LABELS_SEEN."""
    global calls
    calls += 1
    with open(os.environ["LABELS_SEEN"], "a") as f:
        f.writelines(json.dumps([p, lb]) + "\\n" for p, lb in zip(prompts, labels))
    return [0.0 if calls % 3 == 0 else float(len(r)) for r in responses]
'''


def test_async_rollout_on_the_real_engine_keeps_its_bound_and_survives_batches_filtered_to_empty(
    run_dir, tmp_path, monkeypatch
):
    """Async training on the Hugging Face engine, 40 steps with a queue of 2, killed after its checkpoint at step 20
    and resumed: every rollout at most 2 weight updates old and sampled by one version, some filtered to empty by
    dynamic filtering (no deadlock, no NaN), the run trains every prompt batch in order, and every sample reaches
    the reward function with its own prompt's label (``data.label_key``), before and after the resume."""
    from rlhf_core.data.sampler import global_batch

    fn = tmp_path / "flat.py"
    fn.write_text(EVERY_THIRD_CALL_FLAT)
    prompts = tmp_path / "labelled.jsonl"  # the bundled prompts, each labelled with its own text reversed
    rows = [json.loads(line) for line in (ROOT / "rlhf_core/assets/data/synthetic/prompts_train.jsonl").open()]
    prompts.write_text("".join(json.dumps({**r, "label": r["prompt"][::-1]}) + "\n" for r in rows))
    seen = tmp_path / "labels_seen.jsonl"
    monkeypatch.setenv("LABELS_SEEN", str(seen))
    overrides = (
        *GRPO,
        "ppo.train.eval_prompts=0",
        "ppo.train.max_steps=40",
        "ppo.train.rollout_batch_size=8",
        "ppo.train.log_steps=10",
        "ppo.train.save_steps=20",
        "ppo.reward.model=null",
        f"ppo.reward_fn={fn}:score",
        f"ppo.data.train_path={prompts}",
        "ppo.data.label_key=label",
        "ppo.algo.dynamic_filter=true",
        "ppo.train.async_enable=true",
        "ppo.train.async_queue_size=2",
    )
    monkeypatch.setenv("RLHF_FAIL_AFTER_STEP", "20")
    with pytest.raises(RuntimeError, match="injected failure after checkpoint at step 20"):
        run_ppo(run_dir, *overrides)
    monkeypatch.delenv("RLHF_FAIL_AFTER_STEP")
    ref = run_ppo(run_dir, *overrides)
    assert ref.metrics["steps"] == 40 and ref.metrics["resumed_from_step"] == 20
    pairs = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(pairs) >= 40 * 8 * 4 and all(label == prompt[::-1] for prompt, label in pairs)
    history = json.loads((run_dir / "ppo" / "metrics.json").read_text())["history"]
    staleness = [h["rollout_staleness"] for h in history]
    assert max(staleness) <= 2 and max(staleness) >= 1, staleness
    assert all(h["rollout_version_span"] == 0 for h in history)
    empty = [h["step"] for h in history if h["filtered_frac"] == 1.0]
    assert len(empty) >= 5, [h["filtered_frac"] for h in history]
    assert all(h["policy_loss"] == h["policy_loss"] for h in history)  # no NaN from an empty batch
    assert [h["prompts"] for h in history] == [global_batch(1000, 8, s, seed=42) for s in range(40)]
    print(f"\nasync, queue 2, 40 steps: staleness {staleness}, filtered to empty at steps {empty}")
