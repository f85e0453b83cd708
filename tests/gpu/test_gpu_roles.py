"""On one CUDA GPU: a bf16 ZeRO-3 actor and critic step, zero.Init construction memory, a CUDA-IPC weight handoff
into another process, and attention on padded rows (sdpa, flash_attention_2), via scripts/gpu_check.py's checks
with plans small enough for any recent GPU (a 4-layer model of Qwen2-0.5B's width)."""

import pytest
import torch

PLAN = dict(model="qwen2_0.5b_4l", precision="bf16", rows=4, seq=256, prompt=64, micro=2, steps=1)


@pytest.fixture
def plan(gpu_check):
    gpu_check.MODEL_SPECS["qwen2_0.5b_4l"] = {**gpu_check.MODEL_SPECS["qwen2_0.5b"], "num_hidden_layers": 4}
    return dict(PLAN)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_bf16_zero3_step_on_cuda(gpu_check, plan, cuda_world, tmp_path, role):
    actor_cls, critic_cls = gpu_check.make_roles(gpu_check.MODEL_SPECS[plan["model"]])
    record = gpu_check.check_train(role, actor_cls if role == "actor" else critic_cls, plan, "cuda", tmp_path, 4)
    assert record["ok"], record
    assert record["device"] == "cuda" and record["precision"] == "bf16"
    assert record["tokens_per_s"] > 0 and 0 < record["mfu"] < 1
    assert record["train_peak_bytes"] > 0


def test_zero_init_construction_stays_within_one_shard(gpu_check, plan, cuda_world):
    record = gpu_check.check_zero_init(plan, "cuda")
    assert record["ok"], record
    assert record["partition_dtypes"] == ["bfloat16"]
    assert record["construct_peak_bytes"] is not None


def test_cuda_ipc_handoff_into_another_process(gpu_check, plan):
    record = gpu_check.check_ipc(plan, "cuda", bucket_mb=64, reps=2)
    assert record["ok"] and record["checksum_match"] and record["receiver_started_different"], record
    assert record["transport"] == "cuda_ipc" and record["buckets"] > 1 and record["gb_per_s"] > 0


@pytest.mark.parametrize("impl,precision", [("sdpa", "fp32"), ("sdpa", "bf16"), ("flash_attention_2", "bf16")])
def test_padded_rows_match_unpadded(gpu_check, plan, impl, precision):
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn")
    record = gpu_check.check_attention(impl, plan, "cuda", precision)
    assert record["ok"], record
    assert max(record["max_abs_diff_right_pad"], record["max_abs_diff_left_pad"]) <= record["tol"]
    assert record["unmasked_control_diff"] > record["tol"]


def test_cuda_is_really_used():
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
