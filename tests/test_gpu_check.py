"""scripts/gpu_check.sh --dry-run: the GPU check's code paths on CPU (tiny models, gloo, fp32), with the JSON lines
it reports; its per-check time limits (a hung check, a crashed worker); its argument errors; and the wheel folder it
installs from on the GPU machine: which wheels it installs where (scripts/gpu_check_install.py), and that the
folder installs into another Python (3.12)."""

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def load(name: str):
    """scripts/<name>.py, or the package scripts/<name>/, as the module ``name`` (registered: its dataclasses look
    themselves up there, and a package's modules import each other through it)."""
    if name in sys.modules:
        return sys.modules[name]
    folder = ROOT / "scripts" / name
    if folder.is_dir():
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
    else:
        spec = importlib.util.spec_from_file_location(name, folder.with_suffix(".py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


install = load("gpu_check_install")


def run(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # the GPU check's own script on CPU, in make test: the GPU machine gets code that ran here
def test_dry_run_reports_every_check_and_passes():
    proc = run("--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = records(proc.stdout)
    by_check = {r["check"]: r for r in lines if "check" in r}
    summary = lines[-1]
    assert summary["summary"] == "gpu_check dry run (CPU)" and summary["ok"] is True and summary["failed"] == []
    assert summary["passed"] == [
        "train_actor",
        "train_critic",
        "zero_init",
        "weight_sync",
        "attention_sdpa",
        "packing_sdpa",
        "hf_generate",
        "ds_checkpoint",
    ]
    assert summary["skipped"] == ["attention_flash_attention_2", "packing_flash_attention_2", "pytest_gpu"]
    assert lines[0]["check"] == "environment" and lines[0]["device"] == "cpu"
    for role in ("actor", "critic"):
        r = by_check[f"train_{role}"]
        assert r["zero_stage"] == 3 and r["device"] == "cpu" and r["flops_formula"] == "6*N_matmul*tokens"
        assert r["tokens_per_step"] == 4 * 48 and r["tokens_per_s"] > 0 and r["params"] > 100_000
        assert r["mfu"] is None  # no peak to compare with on CPU
        # placement.offload_states_during_rollout's round trip on a ZeRO-3 engine with torch's AdamW (DeepSpeed's own
        # offload_states refuses its master weights and Adam states unless the optimizer is FusedAdam): the fp32
        # master partitions and both Adam moments come back bit for bit, and training goes on from them
        assert r["offload_round_trip_ok"] is True and r["offload_state_bytes"] == 3 * 4 * r["params"]
    # MFU's N: the matmul weights. The tiny spec (vocab 512, hidden 64, 2 layers, tied embeddings): left out are the
    # 5 norms' weights (5 x 64) and the q/k/v biases (2 x 128), and for the critic also the 512 x 64 embedding, which
    # the actor counts once, as its LM head's weight; the critic has a 64 x 1 value head instead
    actor, critic = by_check["train_actor"], by_check["train_critic"]
    assert actor["params"] - actor["params_matmul"] == 5 * 64 + 2 * 128
    assert critic["params"] - critic["params_matmul"] == 512 * 64 + 5 * 64 + 2 * 128
    assert actor["params_matmul"] - critic["params_matmul"] == 512 * 64 - 64
    z = by_check["zero_init"]
    assert z["partition_bytes"] == z["full_model_bytes"] == z["shard_bytes"] and z["partition_dtypes"] == ["float32"]

    # the project's WeightSender -> make_receiver_transport + receive_into_module in a spawned process, over gloo, in
    # 64 KiB buckets (the 428 KiB model: the 128 KiB embedding alone, the rest in 64 KiB ones): both syncs bit-exact,
    # the second carrying the weights an AdamW step changed; the receiver had other weights to begin with
    ws = by_check["weight_sync"]
    assert ws["transport"] == "gloo" and ws["bytes"] == z["full_model_bytes"] and ws["buckets"] > 1
    assert [s["equal"] for s in ws["syncs"]] == [True, True] and [s["sync_id"] for s in ws["syncs"]] == [0, 1]
    assert all(s["buckets"] == s["transfers"] == ws["buckets"] and s["gb_per_s"] > 0 for s in ws["syncs"])
    assert ws["tensors_changed_by_step"] == ws["tensors"] and ws["receiver_tensors_different_before"] > 0

    att = by_check["attention_sdpa"]
    assert (
        max(att["max_abs_diff_right_pad"], att["max_abs_diff_left_pad"]) <= att["tol"] < att["unmasked_control_diff"]
    )
    assert by_check["attention_flash_attention_2"]["skipped"] == "flash_attention_2 needs CUDA"
    # causal_lm_logprobs packed vs padded: 4 ragged rows (24, 14, 7 and 6 real tokens) packed into 3 rows of 24 (the
    # 14- and 7-token samples share one); without the position restarts the shared row leaks
    pack = by_check["packing_sdpa"]
    assert pack["real_tokens_per_row"] == [24, 14, 7, 6] and pack["packed_shape"] == [3, 24]
    assert pack["max_abs_diff"] <= pack["tol"] == 1e-4 * max(1.0, pack["logprob_scale"])
    assert pack["tol"] < pack["cross_sample_control_diff"]
    assert by_check["packing_flash_attention_2"]["skipped"] == "flash_attention_2 needs CUDA"

    hf = by_check["hf_generate"]
    assert hf["device"] == "cpu" and hf["matches_reference"] and hf["differs_from_before_load"]
    assert hf["generated_tokens"] > 0 and hf["tokens_per_s"] > 0
    # save_shards, a step, load_shards: the states come back bit for bit and the step replays bit for bit on CPU
    ck = by_check["ds_checkpoint"]
    assert ck["states_restored_exactly"] and ck["step_update_max"] > 0 and ck["bytes"] > ck["files"] > 0
    assert ck["replay_max_diff"] == ck["replay_rel_l2"] == ck["replay_tol"] == 0.0
    assert ck["loss_after_load"] == ck["loss_after_save"] and ck["global_steps"] == 1
    # python -m pytest tests/gpu ran (collected without tests/conftest.py) and its tests skipped themselves
    pg = by_check["pytest_gpu"]
    assert pg["returncode"] == 0 and pg["tests_skipped"] > 0
    assert pg["tests_passed"] == pg["tests_failed"] == pg["tests_errors"] == 0
    assert pg["skipped"] == f"tests/gpu needs CUDA: its {pg['tests_skipped']} tests skipped themselves"


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:3]
    except FileNotFoundError:
        return False


@pytest.mark.slow  # the script's own processes (about 7 s)
def test_a_hung_check_is_cut_at_its_limit_and_a_dead_worker_is_reported_and_the_summary_comes_last():
    # test-only checks: test_hang starts a child and waits forever, test_crash's worker kills itself
    env = dict(os.environ, GPU_CHECK_TEST_CHECKS="1", GPU_CHECK_LIMIT_TEST_HANG="15")
    start = time.monotonic()
    proc = run("--dry-run", "--only", "test_hang,test_crash", timeout=120, env=env)
    assert time.monotonic() - start < 60
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    lines = records(proc.stdout)
    assert [r.get("check") for r in lines] == ["environment", "test_hang", "test_crash", None]
    # the limit from GPU_CHECK_LIMIT_TEST_HANG, not the default 10 s (it counts from the worker's launch: 15 s leave
    # time to import torch and start the child, also beside the other test stream; 4 s did not, once)
    assert lines[1] == {"check": "test_hang", "ok": False, "error": "timed out after 15 s"}
    # a new worker ran the next check; its death is reported with its last output line
    assert lines[2] == {
        "check": "test_crash",
        "ok": False,
        "error": "crashed (killed by SIGKILL): test_crash: the worker kills itself",
    }
    summary = lines[-1]
    assert summary["ok"] is False and summary["failed"] == ["test_hang", "test_crash"] and summary["passed"] == []
    # the hung check's whole process group was killed, its child too
    said = re.search(r"test_hang: child pid (\d+)", proc.stderr)
    assert said, "the hung check did not get to start its child within its limit"
    assert not _alive(int(said.group(1)))


@pytest.mark.slow  # the script's own processes
def test_bad_arguments_are_refused_with_one_line():
    proc = run("--dry-run", "--bogus", timeout=30)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr
    proc = run("--dry-run", "--only", "train,nope", timeout=120)
    assert proc.returncode == 2 and "--only: unknown check(s) nope" in proc.stderr
    # the test-only checks exist only with GPU_CHECK_TEST_CHECKS=1
    proc = run("--dry-run", "--only", "test_hang", timeout=120, env={**os.environ, "GPU_CHECK_TEST_CHECKS": ""})
    assert proc.returncode == 2 and "--only: unknown check(s) test_hang" in proc.stderr
    # --help: the header comment, up to its last line, and no code
    proc = run("--help", timeout=30)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("what is left of it).")
    assert "GPU_CHECK_LIMIT_<CHECK>" in proc.stdout and "set -euo" not in proc.stdout
    assert all(f" {name}" in proc.stdout for name in load("gpu_check").CHECKS)  # --only's list is complete


def test_pytest_summary_counts():
    gpu_check = load("gpu_check")
    counts = gpu_check.pytest_counts
    assert counts("....\n1 failed, 3 passed, 2 skipped, 1 error in 2.01s\n") == dict(
        passed=3, failed=1, skipped=2, errors=1
    )
    assert counts("ssss\n8 skipped in 0.01s") == dict(passed=0, failed=0, skipped=8, errors=0)
    assert counts("ERROR tests/gpu/x.py\n2 errors in 0.3s") == dict(passed=0, failed=0, skipped=0, errors=2)
    assert counts("no tests ran in 0.01s") == dict(passed=0, failed=0, skipped=0, errors=0)


def test_the_gpu_limits_fit_the_gpu_machines_8_minutes(monkeypatch):
    gpu_check = load("gpu_check")
    total = sum(limit for _, limit, _ in gpu_check.CHECKS.values())
    assert total <= 450 and f"The GPU limits sum to {total:g} s" in gpu_check.__doc__
    assert gpu_check.limit_of("hf_generate", dry=False) == gpu_check.CHECKS["hf_generate"][1]
    # a check's limit from its environment variable, on the GPU and on the dry run
    monkeypatch.setenv("GPU_CHECK_LIMIT_HF_GENERATE", "12.5")
    assert gpu_check.limit_of("hf_generate", dry=True) == gpu_check.limit_of("hf_generate", dry=False) == 12.5


def test_gpu_run_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is False


# -- the wheels: which to install -------------------------------------------------------------------------------------
REQUIREMENTS = """\
deepspeed<0.20,>=0.19  # required by rlhf-pipeline
torch==2.13.0  # required by rlhf-pipeline
transformers<5.20,>=5.16.1  # required by rlhf-pipeline
psutil>=5  # required by rlhf-pipeline
pydantic>=2  # required by rlhf-pipeline
msgpack  # required by deepspeed
pydantic>=2.0.0  # required by deepspeed
annotated-types>=0.6.0  # required by pydantic
pydantic-core==2.50.5  # required by pydantic
typing-inspection>=0.4.4  # required by pydantic
exceptiongroup>=1; python_version < "3.0"  # required by pytest
einops==0.8.2  # carried version
"""
CARRIED = {
    "rlhf-pipeline": "0.1.0",
    "deepspeed": "0.19.8",
    "psutil": "7.2.2",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "msgpack": "1.2.4",
    "einops": "0.8.2",
}


def decide(have: dict[str, str], requires: dict[str, list[str]] | None = None) -> dict[str, tuple[str, str]]:
    """dist -> (action, log line) for an image with the distributions ``have`` (and their ``requires``)."""
    lines = install.parse_requirements(REQUIREMENTS)
    decisions = install.decide(lines, CARRIED, have.get, lambda name: (requires or {}).get(name))
    return {d.dist: (d.action, d.log()) for d in decisions}


def test_the_target_image_keeps_its_torch_and_transformers_and_gets_what_is_missing():
    # the GPU image: torch 2.11 (the project pins 2.13.0 for CPU), transformers 5.17, accelerate's psutil, no pydantic
    got = decide({"torch": "2.11.0", "transformers": "5.17.0", "psutil": "5.9.8", "msgpack": "1.0.0"})
    assert "torch" not in got  # never a requirement here: the image's CUDA build is the one to use
    assert got["transformers"] == ("ok", "keeping transformers 5.17.0 (need <5.20,>=5.16.1; not carried)")
    assert got["psutil"] == ("keep", "keeping psutil 5.9.8 (need >=5)")
    assert got["msgpack"] == ("keep", "keeping msgpack 1.0.0 (need any version)")
    assert got["rlhf-pipeline"] == ("install", "installing rlhf-pipeline 0.1.0 (always from the wheels)")
    assert got["deepspeed"][0] == "install"
    assert got["pydantic"] == ("install", "installing pydantic 2.14.4 (have none, need >=2)")
    assert got["pydantic-core"] == ("install", "installing pydantic-core 2.50.5 (have none, need ==2.50.5)")
    assert got["einops"] == ("install", "installing einops 0.8.2 (have none, need ==0.8.2)")
    assert "exceptiongroup" not in got  # its marker is false here


def test_a_version_that_does_not_fit_is_replaced_and_a_kept_one_brings_its_own_requirements():
    # pydantic 1.x does not satisfy >=2: the carried pydantic and the pydantic-core it pins are installed
    got = decide({"pydantic": "1.10.13", "pydantic-core": "2.27.2", "transformers": "4.46.0"})
    assert got["pydantic"] == ("install", "installing pydantic 2.14.4 (have 1.10.13, need >=2)")
    assert got["pydantic-core"] == ("install", "installing pydantic-core 2.50.5 (have 2.27.2, need ==2.50.5)")
    # transformers is only checked (not carried): a warning, and the checks will show what fails
    assert got["transformers"] == (
        "warn",
        "warning: transformers 4.46.0 does not satisfy <5.20,>=5.16.1, and no wheel of it is carried",
    )
    # a pydantic 2.10 that fits is kept: then ITS requirements apply (pydantic-core 2.27.2, no typing-inspection),
    # not those of the carried pydantic 2.14.4
    have = {"pydantic": "2.10.6", "pydantic-core": "2.27.2", "annotated-types": "0.7.0"}
    requires = {"pydantic": ["annotated-types>=0.6.0", "pydantic-core==2.27.2", 'email-validator; extra == "email"']}
    got = decide(have, requires)
    assert got["pydantic"][0] == got["pydantic-core"][0] == got["annotated-types"][0] == "keep"
    assert got["pydantic-core"][1] == "keeping pydantic-core 2.27.2 (need ==2.27.2)"
    assert got["typing-inspection"][0] == "skip" and "not needed" in got["typing-inspection"][1]
    # the same image with a pydantic-core that does not match the kept pydantic: the installed pydantic's pin decides
    got = decide({**have, "pydantic-core": "2.33.0"}, requires)
    assert got["pydantic-core"] == ("install", "installing pydantic-core 2.50.5 (have 2.33.0, need ==2.27.2)")
    # a version that is not PEP 440 cannot be shown to fit: replaced
    assert decide({"psutil": "5.9.8-custom"})["psutil"][0] == "install"


def _wheel(folder: Path, name: str, version: str, tag: str, requires: list[str]) -> Path:
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-{tag}.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            f"{dist}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}"
        )
    return path


def test_requirements_file_and_wheel_choice(tmp_path):
    project = [
        "torch==2.13.0",
        "deepspeed<0.20,>=0.19",
        "ray[default]<2.61,>=2.60",
        "transformers<5.20,>=5.16.1",
        "pydantic>=2",
        'pytest>=9; extra == "test"',
        'ruff==0.17.6; extra == "test"',
    ]
    _wheel(tmp_path, "rlhf-pipeline", "0.1.0", "py3-none-any", project)
    _wheel(tmp_path, "deepspeed", "0.19.8", "py3-none-any", ["msgpack", "pydantic>=2.0.0", "torch>=2.0.0"])
    _wheel(tmp_path, "pydantic", "2.14.4", "py3-none-any", ["pydantic-core==2.50.5"])
    core = {
        v: _wheel(tmp_path, "pydantic-core", "2.50.5", f"cp{v}-cp{v}-manylinux2014_x86_64", [])
        for v in ("311", "312", "313")
    }
    abi3 = _wheel(tmp_path, "msgpack", "1.2.4", "cp38-abi3-manylinux2014_x86_64", [])
    _wheel(tmp_path, "pytest", "9.2.0", "py3-none-any", ['tomli>=1; python_version < "3.11"'])
    _wheel(tmp_path, "hjson", "3.1.0", "py3-none-any", [])
    assert install.requirement_lines(tmp_path) == [
        "deepspeed<0.20,>=0.19  # required by rlhf-pipeline",  # torch never; Ray not carried nor imported
        "transformers<5.20,>=5.16.1  # required by rlhf-pipeline",
        "pydantic>=2  # required by rlhf-pipeline",
        "pytest>=9  # required by rlhf-pipeline",  # the test extra, chosen here
        "msgpack  # required by deepspeed",
        "pydantic>=2.0.0  # required by deepspeed",
        "pydantic-core==2.50.5  # required by pydantic",
        'tomli>=1; python_version < "3.11"  # required by pytest',  # for the GPU machine's Python to decide
        "hjson==3.1.0  # carried version",
    ]
    from packaging.tags import compatible_tags, cpython_tags

    platforms = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"]
    tags = list(cpython_tags((3, 12), platforms=platforms)) + list(compatible_tags((3, 12), "cp312", platforms))
    assert install.pick_wheel(list(core.values()), tags) == core["312"]
    assert install.pick_wheel([abi3], tags) == abi3
    assert install.pick_wheel([core["311"], core["313"]], tags) is None


def _python312() -> str | None:
    """A CPython 3.12 to install into: pyenv's (its shim does not help shutil.which), else uv's."""
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found = sorted(glob.glob(f"{root}/versions/3.12*/bin/python3.12"))
    if found:
        return found[-1]
    if uv := shutil.which("uv"):
        proc = subprocess.run([uv, "python", "find", "3.12"], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip()
    return None


@pytest.mark.slow  # builds the wheel folder and a Python 3.12 venv
@pytest.mark.extended  # make test: the GPU check's code on CPU (test_dry_run_reports_every_check_and_passes)
def test_the_wheel_folder_installs_into_python_312(tmp_path):
    python = _python312()
    if python is None:
        pytest.skip("no CPython 3.12 here (pyenv's versions/3.12*, uv python find 3.12)")
    wheels = tmp_path / "gpu_wheels"
    build = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_gpu_wheels.sh"), str(wheels)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    size = sum(p.stat().st_size for p in wheels.iterdir())
    assert size < 32 << 20  # well under the 64 MiB carry limit
    for v in ("310", "311", "312", "313"):
        assert len(list(wheels.glob(f"pydantic_core-*-cp{v}-cp{v}-*.whl"))) == 1
    venv = tmp_path / "py312"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    plan = subprocess.run(
        [py, str(ROOT / "scripts" / "gpu_check_install.py"), "plan", str(wheels)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    chosen = [Path(line).name for line in plan.stdout.split()]
    # an empty venv: every carried distribution is missing, so each is installed, the binary ones as cp312 wheels
    assert len(chosen) == len({install.parse_wheel_filename(p.name)[0] for p in wheels.glob("*.whl")})
    assert any(n.startswith("pydantic_core-") and "-cp312-cp312-" in n for n in chosen)
    assert any(n.startswith("msgpack-") and "-cp312-cp312-" in n for n in chosen)
    assert "gpu_check: installing pydantic-core 2.50.5 (have none, need ==2.50.5)" in plan.stderr
    site = tmp_path / "site"
    pip = subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--ignore-requires-python",
            "--target",
            str(site),
            *plan.stdout.split(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    probe = subprocess.run(
        [
            py,
            "-c",
            "import sys, pydantic, pydantic_core, msgpack, psutil, pytest, rlhf_core; "
            "print(sys.version_info[:2], pydantic_core.__version__, msgpack.unpackb(msgpack.packb([1, 2])))",
        ],
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=tmp_path,  # not the checkout: rlhf_core from the installed wheel
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split("\n")[0] == "(3, 12) 2.50.5 [1, 2]"
