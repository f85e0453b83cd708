"""The supervised stages as real jobs: Ray groups of DeepSpeed workers on CPU, checkpoints in a local folder.

One SFT run (2 workers, ZeRO-2, logging to TensorBoard) serves as the baseline for the ZeRO-3 run, the resume test
and the reward model.
"""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_core.config import ConfigError
from rlhf_core.jobs import critic_init, reward_model, sft
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.storage import ObjectStore
from tests.jobs.conftest import RM_2W, SFT_2W, cfg_for, weights
from tests.test_tracking import scalars

pytestmark = pytest.mark.slow


def initial_weights():
    tok = load_tokenizer("builtin:tiny")
    model = build_causal_lm("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_trained(run_dir, ref):
    assert ref.metrics["steps"] == 16
    assert ref.metrics["loss_end"] < ref.metrics["loss_start"] - 0.5, ref.metrics
    final = weights(run_dir, "sft")
    start = initial_weights()
    unchanged = [k for k, v in start.items() if torch.equal(v, final[k])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "sft"))
    assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for v in start.values())
    assert ObjectStore(str(run_dir)).is_complete("sft")


def test_sft_zero2_two_workers(sft_run):
    run_dir, ref = sft_run
    assert_trained(run_dir, ref)
    assert ref.metrics["resumed_from_step"] == 0
    # keep_last=2 of the checkpoints at steps 4, 8, 12
    assert sorted(p.name for p in (run_dir / "sft" / "checkpoints").iterdir()) == ["step_00000008", "step_00000012"]
    # TensorBoard (the fixture's tracking.tensorboard): rank 0 logged each logged step, read back; and the curves
    history = {h["step"]: h for h in json.loads((run_dir / "sft" / "metrics.json").read_text())["history"]}
    loss = scalars(run_dir / "tensorboard" / "sft")["loss"]
    assert [s for s, _ in loss] == [1, 8, 16]  # the first step and every log_steps=8 (16: also the last)
    assert [v for _, v in loss] == pytest.approx([history[s]["loss"] for s, _ in loss])
    assert (run_dir / "sft" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sft_zero3_two_workers_with_cpu_adam_and_recomputation(tmp_path, ray_cluster, sft_run):
    ref = sft.run(
        cfg_for(
            tmp_path,
            *SFT_2W,
            "sft.strategy.zero_stage=3",
            "sft.strategy.offload_optimizer=true",
            "sft.strategy.gradient_checkpointing=true",
        )
    )
    assert_trained(tmp_path, ref)
    # Same data order, same seed, fp32: ZeRO-3 (with the optimizer in CPU Adam and recomputation) learns what ZeRO-2
    # learns.
    baseline = weights(sft_run[0], "sft")
    for name, value in weights(tmp_path, "sft").items():
        torch.testing.assert_close(value, baseline[name], atol=1e-4, rtol=1e-3)


def test_sft_resumes_from_checkpoint_and_matches_uninterrupted_run(tmp_path, ray_cluster, sft_run, monkeypatch):
    cfg = cfg_for(tmp_path, *SFT_2W)
    monkeypatch.setenv("RLHF_FAIL_AFTER_STEP", "8")
    with pytest.raises(Exception, match="injected failure after checkpoint at step 8"):
        sft.run(cfg)
    store = ObjectStore(str(tmp_path))
    assert not store.is_complete("sft")
    assert store.is_complete("sft/checkpoints/step_00000008")
    monkeypatch.delenv("RLHF_FAIL_AFTER_STEP")
    # Its ZeRO shards were written by 2 ranks: a rerun on 1 is refused before any worker starts, naming the key.
    with pytest.raises(
        ConfigError,
        match=r"'sft.strategy.num_workers' = 1, but the checkpoint .*step_00000008.* "
        r"was written by 2 ranks: set sft.strategy.num_workers=2",
    ):
        sft.run(cfg_for(tmp_path, *SFT_2W, "sft.strategy.num_workers=1"))
    assert store.is_complete("sft/checkpoints/step_00000008")

    ref = sft.run(cfg)
    assert ref.metrics["resumed_from_step"] == 8
    assert ref.metrics["loss_start"] == pytest.approx(sft_run[1].metrics["loss_start"], abs=1e-6)
    baseline = weights(sft_run[0], "sft")
    resumed = weights(tmp_path, "sft")
    worst = max((resumed[k] - baseline[k]).abs().max().item() for k in baseline)
    assert worst <= 1e-6, f"resumed weights differ from the uninterrupted run by {worst}"

    # A third start finds the output complete for this config and trains nothing.
    again = sft.run(cfg)
    assert again.config_hash == ref.config_hash and again.metrics["resumed_from_step"] == 8


def test_reward_model_learns_the_gold_preference_and_stores_stats(sft_run):
    run_dir, sft_ref = sft_run
    ref = reward_model.run(cfg_for(run_dir, *SFT_2W, *RM_2W))
    assert ref.metrics["eval_accuracy"] >= 0.9, ref.metrics
    assert ref.metrics["loss_end"] < ref.metrics["loss_start"]
    config = AutoConfig.from_pretrained(str(run_dir / "reward_model"))
    assert config.reward_mean == pytest.approx(ref.metrics["reward_mean"])
    assert config.reward_std == pytest.approx(ref.metrics["reward_std"]) and config.reward_std > 0
    model = AutoModelForSequenceClassification.from_pretrained(str(run_dir / "reward_model"))
    assert model.config.num_labels == 1
    # The RM started from the SFT model: its manifest names that upstream.
    manifest = ObjectStore(str(run_dir)).read_manifest("reward_model")
    assert manifest.extra["upstream"] == {"sft": sft_ref.config_hash}

    # Critic init: a copy of the RM, backbone and value head, not re-initialised.
    critic_ref = critic_init.run(cfg_for(run_dir, *SFT_2W, *RM_2W))
    rm_weights, critic_weights = weights(run_dir, "reward_model"), weights(run_dir, "critic_init")
    assert rm_weights.keys() == critic_weights.keys() and "score.weight" in critic_weights
    for name, value in rm_weights.items():
        assert torch.equal(value, critic_weights[name]), name
    assert critic_ref.metrics["reward_mean"] == pytest.approx(ref.metrics["reward_mean"])
    critic_config = AutoConfig.from_pretrained(str(run_dir / "critic_init"))
    assert critic_config.reward_std == pytest.approx(ref.metrics["reward_std"])


@pytest.mark.extended  # bf16 on CPU; make test trains fp32 (ZeRO-2, ZeRO-3, offload)
def test_sft_bf16_one_worker(tmp_path, ray_cluster, monkeypatch):
    # Also: the rank-0 worker reports its steps as structured events (Ray workers see RLHF_EVENTS_FILE), and its
    # checkpoints record the ranks that wrote them.
    events_file = tmp_path / "events.jsonl"
    monkeypatch.setenv("RLHF_EVENTS_FILE", str(events_file))
    run_dir = tmp_path / "run"
    overrides = [
        "sft.strategy.precision=bf16",
        "sft.data.max_samples=64",
        "sft.train.save_steps=1",
        "sft.train.log_steps=1",
    ]
    ref = sft.run(cfg_for(run_dir, *overrides))
    assert ref.metrics["loss_end"] < ref.metrics["loss_start"]
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "sft"))
    assert model.config.dtype == torch.bfloat16

    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [(e["stage"], e["step"], e["total"]) for e in steps] == [("sft", k, 4) for k in range(1, 5)]
    assert set(steps[0]["metrics"]) >= {"loss", "lr"} and isinstance(steps[0]["metrics"]["loss"], float)
    history = json.loads((run_dir / "sft" / "metrics.json").read_text())["history"]
    assert [e["metrics"]["loss"] for e in steps] == [h["loss"] for h in history]
    manifest = ObjectStore(str(run_dir)).read_manifest("sft/checkpoints/step_00000003")
    assert manifest.extra == {"step": 3, "workers": {"strategy.num_workers": 1}}
