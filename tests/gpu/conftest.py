"""Tests under tests/gpu need a CUDA GPU: marked ``gpu`` and skipped when torch sees none (they are still collected,
so an import error shows on CPU machines too). On a GPU machine: ``pytest tests/gpu -m gpu``; the GPU check runs them
as ``python -m pytest tests/gpu --confcutdir=tests/gpu`` (its ``pytest_gpu`` check), so nothing here may need more
than torch, transformers, DeepSpeed and the project: no Ray, no Prefect, no vLLM, and not tests/conftest.py."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_check():
    """The package scripts/gpu_check/: the tests run its checks with smaller plans. Imported by name from scripts/
    (on sys.path, which spawned processes inherit), so that the weight-sync check's receiver, a function of its
    module ``gpu_check.weight_sync``, can be started in a spawned process."""
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import gpu_check

    return gpu_check


@pytest.fixture
def cuda_world(monkeypatch):
    """The single-process NCCL world the roles join (DeepSpeedStrategy.init_distributed reads these)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(
        MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", RLHF_DEVICE="cuda"
    ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(port))  # unused once the first test has made the process group
