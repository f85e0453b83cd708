import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest_plugins = ["tests.conftest_s3"]

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "deployments" / "configs" / "tiny.yaml"


def pytest_collection_modifyitems(items):
    """With pytest-xdist (``make test``: -n 2 --dist loadgroup), the job tests share session fixtures (an SFT run,
    the PPO inputs) and the flow tests a Prefect server and worker: each folder runs in one worker."""
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in ("jobs", "flows"):
            item.add_marker(pytest.mark.xdist_group(folder))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session (the jobs reuse an initialised Ray instead of starting their own)."""
    import ray

    # address="local": a Ray of this test process (another pytest worker has its own); logical CPUs: roles share
    # the 2 cores
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    # Presets name bundled data relative to the repository root, as the README's commands do.
    monkeypatch.chdir(ROOT)
