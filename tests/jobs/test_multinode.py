"""Multi-node runs: stage models reach each node from the object store (one download per node, never a driver path),
roles and engines are pinned to nodes by Ray custom resources, and the jobs run on an existing cluster (RAY_ADDRESS).

The fast tests check the node cache and the resource checks without Ray. The slow one starts a real 2-node Ray
cluster on this machine (a head and a second raylet, each with its own --temp-dir and custom resource), runs the tiny
PPO on it through RAY_ADDRESS with the roles split over both nodes, and reads each node's cache log.
"""

import json
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError
from rlhf_core.distributed import launcher, node_files
from rlhf_core.distributed.node_files import StageModel, local_model_path, read_log, stage_model
from rlhf_core.distributed.placement import RoleSet, check_fits, resource_demand
from rlhf_core.storage import ArtifactError, ObjectStore
from tests.conftest import ROOT, TINY
from tests.conftest_s3 import s3_storage_options
from tests.jobs.conftest import cfg_for
from tests.ray_cluster import cluster_env, local_cluster, status

PY = str(Path(sys.executable))
RAY = str(Path(sys.executable).with_name("ray"))


# ---------------------------------------------------------------------------------------------------------------------
# The node cache, without Ray


def _artifact(store: ObjectStore, tmp: Path, rel: str, text: str) -> StageModel:
    src = tmp / f"src-{rel}-{abs(hash(text))}"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"text": text}))
    (src / "sub" / "weights.bin").write_bytes(text.encode() * 1000)
    store.put_artifact(str(src), rel, stage=rel, config_hash="h")
    return stage_model(store, rel)


FETCH = """
import pickle, sys
from rlhf_core.distributed.node_files import local_model_path
print(local_model_path(pickle.loads(open(sys.argv[1], "rb").read()), cache=sys.argv[2]))
"""


def test_plain_model_sources_pass_through():
    for source in ("builtin:tiny", "/models/llama", "org/model-name"):
        assert local_model_path(source) == source


def test_concurrent_workers_on_a_node_download_once_and_each_node_gets_its_own_copy(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    ref = _artifact(store, tmp_path, "sft", "weights v1")
    (tmp_path / "ref.pkl").write_bytes(pickle.dumps(ref))
    for node in ("node_a", "node_b"):
        # four worker processes of one node start at once
        cmd = [PY, "-c", FETCH, str(tmp_path / "ref.pkl"), str(tmp_path / node)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(4)]
        paths = {p.communicate(timeout=120)[0].splitlines()[-1] for p in procs}  # after the downloader's log line
        assert all(p.returncode == 0 for p in procs)
        (path,) = paths  # every worker of the node got the same copy
        assert Path(path).parent == tmp_path / node
        assert (Path(path) / "sub" / "weights.bin").read_bytes() == b"weights v1" * 1000
        log = read_log(tmp_path / node)
        assert [e["event"] for e in log].count("download") == 1
        assert len({e["pid"] for e in log if e["event"] == "use"}) == 4
    assert not list((tmp_path / "node_a").glob("*.partial-*"))


def test_a_changed_artifact_is_fetched_again_and_a_stale_reference_refused(tmp_path):
    store, cache = ObjectStore(str(tmp_path / "store")), tmp_path / "node"
    old = _artifact(store, tmp_path, "reward_model", "v1")
    first = local_model_path(old, cache=cache)
    assert local_model_path(old, cache=cache) == first  # cached: no second download
    new = _artifact(store, tmp_path, "reward_model", "v2")
    assert new.content_hash != old.content_hash
    second = local_model_path(new, cache=cache)
    assert second != first and json.loads((Path(second) / "config.json").read_text()) == {"text": "v2"}
    assert [e["event"] for e in read_log(cache)].count("download") == 2
    # A node that has not fetched the old content yet gets the rewritten artifact: refused, not mixed in.
    with pytest.raises(ArtifactError, match="changed since the job read its manifest"):
        local_model_path(old, cache=tmp_path / "late-node")


def test_stage_model_never_shows_its_storage_options():
    ref = StageModel("s3://bucket/run", "sft", "ab" * 32, {"key": "AKIAEXAMPLEKEY", "secret": "s3cr3t-value"})
    shown = f"{ref} {ref!r}"
    assert "s3cr3t-value" not in shown and "AKIAEXAMPLEKEY" not in shown and "s3://bucket/run/sft" in shown
    assert pickle.loads(pickle.dumps(ref)).storage_options["secret"] == "s3cr3t-value"  # it travels to the workers


@pytest.mark.slow
@pytest.mark.extended  # a 2-node cluster: the PPO run below (make test-all)
def test_a_node_fetches_from_s3_with_the_credentials_it_was_handed_and_shows_none(s3_server, tmp_path, capfd):
    store = ObjectStore(f"s3://{s3_server.bucket}/node-cache/{tmp_path.name}", s3_storage_options(s3_server))
    ref = _artifact(store, tmp_path, "sft", "weights on s3")
    travelled = pickle.loads(pickle.dumps(ref))  # what a Ray worker on another node receives
    path = local_model_path(travelled, cache=tmp_path / "node")
    assert (Path(path) / "sub" / "weights.bin").read_bytes() == b"weights on s3" * 1000
    shown = capfd.readouterr()
    texts = [shown.out, shown.err, (tmp_path / "node" / node_files.LOG_NAME).read_text(), str(ref), repr(ref)]
    assert not [t for t in texts if s3_server.secret in t or s3_server.key in t]


def test_node_cache_env_overrides_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(node_files.CACHE_ENV, str(tmp_path / "cache"))
    assert node_files.node_cache_dir() == tmp_path / "cache"


# ---------------------------------------------------------------------------------------------------------------------
# Resource checks, before any worker starts

PINNED = [
    "ppo.actor.strategy.resources={node_a: 1}",
    "ppo.rollout.resources={node_a: 1}",
    "ppo.critic.strategy.resources={node_b: 1}",
    "ppo.reward.resources={node_b: 1}",
    "ppo.reference.resources={node_b: 1}",
]
NODE_A = {"CPU": 3.0, "node_a": 100.0}
NODE_B = {"CPU": 3.0, "node_b": 100.0}


def test_pinned_roles_ask_ray_for_their_resources(tmp_path):
    p = cfg_for(tmp_path, *PINNED).stage("ppo")
    demand = resource_demand(p, RoleSet.of(p), "cpu")
    assert demand["node_a"] == 2 and demand["node_b"] == 3  # actor + engine; critic + reward + reference
    check_fits("ppo", p, RoleSet.of(p), "cpu", {"CPU": 6, "node_a": 100, "node_b": 100}, [NODE_A, NODE_B])


def test_missing_or_scarce_resources_are_refused_naming_the_key(tmp_path):
    p = cfg_for(tmp_path, *PINNED).stage("ppo")
    node_b_keys = r"'ppo.critic.strategy.resources', 'ppo.reward.resources', 'ppo.reference.resources'"
    with pytest.raises(ConfigError, match=node_b_keys + r" ask for Ray resource 'node_b', which no node"):
        check_fits("ppo", p, RoleSet.of(p), "cpu", {"CPU": 6, "node_a": 100}, [NODE_A, {"CPU": 3.0}])
    with pytest.raises(
        ConfigError,
        match=r"'ppo.actor.strategy.resources', 'ppo.rollout.resources' ask for 2 "
        r"'node_a' in all .* has 1",
    ):
        check_fits("ppo", p, RoleSet.of(p), "cpu", {}, [{"CPU": 3.0, "node_a": 1.0}, NODE_B])
    with pytest.raises(ConfigError, match=r"pinned to 'node_b' need 2 CPU but the nodes with 'node_b' have 1"):
        check_fits("ppo", p, RoleSet.of(p), "cpu", {}, [NODE_A, {"CPU": 1.0, "node_b": 100.0}])
    # without per-node figures, the cluster's totals
    boxed = cfg_for(tmp_path, "ppo.rollout.resources={gpu_box: 1}").stage("ppo")
    with pytest.raises(ConfigError, match="'ppo.rollout.resources' ask for Ray resource 'gpu_box'"):
        check_fits("ppo", boxed, RoleSet.of(boxed), "cpu", {"CPU": 64})
    with pytest.raises(ConfigError, match="'sft.strategy.resources' names CPU"):
        launcher.check_resources({"sft.strategy.resources": (1, 1.0, {"CPU": 2.0})}, [NODE_A])
    colocated = cfg_for(
        tmp_path, "ppo.placement.colocate_critic_reward=true", "ppo.critic.strategy.resources={node_b: 1}"
    )
    placed = colocated.stage("ppo")
    with pytest.raises(ConfigError, match="'ppo.critic.strategy.resources' pins a colocated role"):
        check_fits("ppo", placed, RoleSet.of(placed), "cpu", {"CPU": 64, "node_b": 100})


# ---------------------------------------------------------------------------------------------------------------------
# A real 2-node cluster on this machine


def _cluster_env() -> dict[str, str]:
    return cluster_env(drop=(node_files.CACHE_ENV, "RLHF_WORK_DIR"))


def _status(address: str) -> subprocess.CompletedProcess:
    return status(address, _cluster_env())


@pytest.fixture(scope="module")
def two_nodes():
    """A head with {node_a: 100} and a second raylet with {node_b: 100}, each under its own --temp-dir."""
    started = time.time()
    with local_cluster([(3, {"node_a": 100}), (3, {"node_b": 100})], _cluster_env()) as (address, dirs):
        print(f"\n2-node Ray cluster up in {time.time() - started:.0f}s")
        yield address, {"node_a": dirs[0], "node_b": dirs[1]}


def _node_log(temp_dir: Path) -> list[dict]:
    caches = [p for p in temp_dir.glob("session_2*/rlhf-models") if p.is_dir()]
    assert len(caches) <= 1, caches
    return read_log(caches[0]) if caches else []


def _job(kind: str, address: str, work: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(_cluster_env(), RAY_ADDRESS=address, RLHF_WORK_DIR=str(work))
    cmd = [PY, "-m", f"rlhf_core.jobs.{kind}", "--config", str(TINY), *overrides]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _downloads(log: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in log:
        if e["event"] == "download":
            out[e["rel"]] = out.get(e["rel"], 0) + 1
    return out


@pytest.mark.slow
# make test: node-local model files, pins and refusals (the tests above); a real 2-node cluster's run: test-all
@pytest.mark.extended
def test_ppo_on_an_existing_two_node_cluster_with_node_local_models(ppo_inputs, two_nodes, tmp_path):
    address, temp_dirs = two_nodes
    run = tmp_path / "run"
    shutil.copytree(ppo_inputs[0], run, ignore=shutil.ignore_patterns("checkpoints", "ppo"))
    driver_work = tmp_path / "driver"
    started = time.time()
    # actor + engine on node_a; critic, reward and reference on node_b; one PPO step, no evaluation
    job = _job(
        "ppo", address, driver_work, f"run_uri={run}", "ppo.train.max_steps=1", "ppo.train.eval_prompts=0", *PINNED
    )
    ppo_s = time.time() - started
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    assert ObjectStore(str(run)).is_complete("ppo")
    final = json.loads((run / "ppo" / "metrics.json").read_text())["final"]
    assert final["steps"] == 1

    logs = {node: _node_log(d) for node, d in temp_dirs.items()}
    print(f"\nPPO on 2 nodes in {ppo_s:.0f}s; downloads per node: { {n: _downloads(log) for n, log in logs.items()} }")
    # Each node downloaded each model it needed exactly once, from the store, into its own cache ...
    assert _downloads(logs["node_a"]) == {"sft": 1}  # actor and engine: the SFT policy
    assert _downloads(logs["node_b"]) == {"critic_warmup": 1, "reward_model": 1, "sft": 1}  # critic, reward, reference
    # ... and every role process loaded its node's copy: none opened the driver's download.
    for node, log in logs.items():
        uses = [e for e in log if e["event"] == "use"]
        assert all(Path(e["path"]).is_relative_to(temp_dirs[node]) for e in uses), uses
        assert not any(str(driver_work) in e["path"] for e in log)
        pids = {e["pid"] for e in uses}
        assert len(pids) == (2 if node == "node_a" else 3), uses  # one process per role (and engine) on the node
    # The job only disconnected: the cluster still runs with both nodes.
    status = _status(address)
    assert status.returncode == 0 and "node_a" in status.stdout and "node_b" in status.stdout

    # A supervised job on the same cluster: the reward model from stage:sft, pinned to node_b, reuses that node's copy.
    started = time.time()
    job = _job(
        "reward_model",
        address,
        driver_work,
        f"run_uri={run}",
        "reward_model.train.max_steps=1",
        "reward_model.data.max_samples=64",
        "reward_model.strategy.resources={node_b: 1}",
    )
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    print(f"reward model on node_b in {time.time() - started:.0f}s")
    log_b = _node_log(temp_dirs["node_b"])
    assert _downloads(log_b) == {"critic_warmup": 1, "reward_model": 1, "sft": 1}  # no new download
    assert len([e for e in log_b if e["event"] == "use" and e["rel"] == "sft"]) == 2  # reference, then the RM rank

    # Pins the cluster cannot serve are refused before any worker starts, from the nodes Ray reports.
    check = _python(address, CHECK, f"run_uri={run}", "ppo.reward.resources={node_c: 1}")
    assert check.returncode == 0, check.stdout + check.stderr
    nodes, error = check.stdout.strip().splitlines()[-2:]
    assert sorted(json.loads(nodes)) == [["node_a"], ["node_b"]]  # each custom resource on its own node
    assert error.startswith("ConfigError: 'ppo.reward.resources' ask for Ray resource 'node_c', which no node"), error


CHECK = """
import json, sys
from rlhf_core.config import ConfigError, load_config
from rlhf_core.distributed import launcher
from rlhf_core.distributed.placement import RoleSet, check_fits
p = load_config(sys.argv[1], sys.argv[2:]).stage("ppo")
launcher.init_ray()
nodes = launcher.node_resources()
print(json.dumps([[k for k in n if k.startswith("node_")] for n in nodes]))
try:
    check_fits("ppo", p, RoleSet.of(p), "cpu", launcher.cluster_resources(), nodes)
except ConfigError as e:
    print(f"ConfigError: {e}")
"""


def _python(address: str, script: str, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(_cluster_env(), RAY_ADDRESS=address)
    cmd = [PY, "-c", script, str(TINY), *overrides]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
