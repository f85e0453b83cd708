"""On one CUDA GPU: a bf16 ZeRO-3 actor and critic step, zero.Init construction memory, a weight sync through the
project's cuda_ipc transport into another process, attention on padded rows and packed log-probs (sdpa,
flash_attention_2), the HF rollout engine, and a ZeRO-3 checkpoint round trip, via scripts/gpu_check/'s checks with
plans small enough for any recent GPU and for the GPU check's time limit on ``pytest_gpu``: a 2-layer model of
Qwen2-0.5B's width with a 32k vocabulary (59M parameters)."""

import pytest
import torch

SMALL = dict(model="qwen2_2l_32k", checkpoint_model="qwen2_2l_32k", rows=4, seq=256, prompt=64, micro=2, steps=1)


@pytest.fixture
def plan(gpu_check):
    specs = gpu_check.MODEL_SPECS
    specs["qwen2_2l_32k"] = {**specs["qwen2_0.5b"], "num_hidden_layers": 2, "vocab_size": 32768}
    return {**gpu_check.PLANS["gpu"], **SMALL, "sync_bucket_bytes": 16 << 20}


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_bf16_zero3_step_on_cuda(gpu_check, plan, cuda_world, tmp_path, role):
    actor_cls, critic_cls = gpu_check.make_roles(gpu_check.MODEL_SPECS[plan["model"]])
    record = gpu_check.check_train(role, actor_cls if role == "actor" else critic_cls, plan, "cuda", tmp_path, 4)
    assert record["ok"], record
    assert record["device"] == "cuda" and record["precision"] == "bf16"
    assert record["tokens_per_s"] > 0 and 0 < record["mfu"] < 1
    assert record["train_peak_bytes"] > 0
    assert record["offload_round_trip_ok"] and record["offload_freed_bytes"] >= record["offload_state_bytes"] // 2


def test_zero_init_construction_stays_within_one_shard(gpu_check, plan, cuda_world):
    record = gpu_check.check_zero_init(plan, "cuda")
    assert record["ok"], record
    assert record["partition_dtypes"] == ["bfloat16"]
    assert record["construct_peak_bytes"] is not None


def test_cuda_ipc_weight_sync_into_another_process(gpu_check, plan):
    record = gpu_check.check_weight_sync(plan, "cuda")
    assert record["ok"], record
    assert record["transport"] == "cuda_ipc" and record["buckets"] > 1
    assert [s["equal"] for s in record["syncs"]] == [True, True] and record["tensors_changed_by_step"] > 0
    assert all(s["transfers"] == record["buckets"] and s["gb_per_s"] > 0 for s in record["syncs"])


@pytest.mark.parametrize("impl,precision", [("sdpa", "fp32"), ("sdpa", "bf16"), ("flash_attention_2", "bf16")])
def test_padded_rows_match_unpadded(gpu_check, plan, impl, precision):
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn")
    record = gpu_check.check_attention(impl, plan, "cuda", precision)
    assert record["ok"], record
    assert max(record["max_abs_diff_right_pad"], record["max_abs_diff_left_pad"]) <= record["tol"]
    assert record["unmasked_control_diff"] > record["tol"]


@pytest.mark.parametrize("impl,precision", [("sdpa", "fp32"), ("sdpa", "bf16"), ("flash_attention_2", "bf16")])
def test_packed_logprobs_match_padded(gpu_check, plan, impl, precision):
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn")
    record = gpu_check.check_packing(impl, plan, "cuda", precision)
    assert record["ok"], record
    assert record["max_abs_diff"] <= record["tol"] < record["cross_sample_control_diff"]
    if impl == "flash_attention_2":
        assert record["packed_shape"][0] == 1  # flash-attention packs everything into one row


def test_hf_engine_generates_and_reloads_on_cuda(gpu_check, plan):
    record = gpu_check.check_hf_generate(plan, "cuda")
    assert record["ok"], record
    assert record["device"].startswith("cuda") and record["matches_reference"] and record["differs_from_before_load"]
    assert record["generated_tokens"] > 0 and record["tokens_per_s"] > 0


def test_zero3_checkpoint_round_trip_on_cuda(gpu_check, plan, cuda_world, tmp_path):
    record = gpu_check.check_ds_checkpoint(plan, "cuda", tmp_path, 4)
    assert record["ok"], record
    assert record["states_restored_exactly"] and record["bytes"] > 0
    assert record["replay_rel_l2"] <= record["replay_tol"] and record["loss_after_load"] == pytest.approx(
        record["loss_after_save"], rel=1e-6
    )


def test_cuda_is_really_used():
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
