"""scripts/gpu_check.sh --dry-run: the GPU check's code paths on CPU (tiny models, gloo, fp32), with the JSON lines
it reports; its argument errors; the fallback bucket packing of its IPC check."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


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
    assert summary["passed"] == ["train_actor", "train_critic", "zero_init", "weight_ipc", "attention_sdpa"]
    assert summary["skipped"] == ["attention_flash_attention_2"]
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
    ipc = by_check["weight_ipc"]
    assert ipc["checksum_match"] and ipc["receiver_started_different"] and ipc["transport"].startswith("cpu_shared")
    att = by_check["attention_sdpa"]
    assert (
        max(att["max_abs_diff_right_pad"], att["max_abs_diff_left_pad"]) <= att["tol"] < att["unmasked_control_diff"]
    )
    assert by_check["attention_flash_attention_2"]["skipped"] == "flash_attention_2 needs CUDA"


@pytest.mark.slow  # the script's own processes
def test_bad_arguments_are_refused_with_one_line():
    proc = run("--dry-run", "--bogus", timeout=30)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr
    proc = run("--dry-run", "--only", "train,nope", timeout=120)
    assert proc.returncode == 2 and "--only: unknown check(s) nope" in proc.stderr


def test_fallback_packing_round_trips_every_tensor():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in [(4, 3), (5,), (64, 64), (2, 2)]] + [torch.ones(3).bfloat16()]
    buckets = gpu_check._pack_plain(tensors, bucket_bytes=200)
    # 48+20 bytes fit in one bucket, the 16 KiB tensor gets its own, the small one after it a new one, bf16 its own
    assert [[e[0] for e in entries] for _, entries in buckets] == [[0, 1], [2], [3], [4]]
    for flat, entries in buckets:
        for i, offset, numel, shape in entries:
            assert torch.equal(flat[offset : offset + numel].view(shape), tensors[i])


def test_gpu_run_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is False
