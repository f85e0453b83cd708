"""The PPO roles as plain classes behind typed Ray handles: the driver-side call checks, the critic's value scale and
the token weighting of the loss over a gradient-accumulation window."""

import dataclasses

import pytest
import torch

from rlhf_core.algos.batching import make_sequences
from rlhf_core.algos.experience import Experience, SequenceBatch
from rlhf_core.config import OptimConfig, PPOAlgoConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed import launcher
from rlhf_core.distributed.actor import PolicyActor
from rlhf_core.distributed.critic import CriticActor
from rlhf_core.distributed.role_base import RoleContext, TrainableRole
from rlhf_core.models.builders import ScalarHeadModel, build_scalar_model, load_tokenizer

REWARD_STATS = (0.5, 2.0)


def test_call_checks_refuse_foreign_methods_names_and_bad_arguments():
    """Pure driver-side checks (no Ray): what ``RayWorkerGroup`` runs before sending anything."""
    batch = make_sequences([[1, 2, 3]], [[4, 5]], 0)
    launcher.check_call(CriticActor, CriticActor.values, (batch,), {})
    launcher.check_call(CriticActor, TrainableRole.save_shards, ("rel",), {})  # inherited, not overridden
    launcher.check_call(PolicyActor, PolicyActor.logprobs, (batch,), {"temperature": 1.0})
    with pytest.raises(TypeError, match=r"PolicyActor.logprobs is not a method of CriticActor"):
        launcher.check_call(CriticActor, PolicyActor.logprobs, (batch,), {})
    with pytest.raises(TypeError, match=r"TrainableRole.build_model is not a method of CriticActor.*another function"):
        launcher.check_call(CriticActor, TrainableRole.build_model, (None, torch.float32, "sdpa"), {})
    with pytest.raises(TypeError, match=r"pass a method of CriticActor as the function object"):
        launcher.check_call(CriticActor, "values", (batch,), {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"CriticActor.fit\(self, exp: 'Experience', step: 'int'\).*step"):
        launcher.check_call(CriticActor, CriticActor.fit, (batch,), {})
    with pytest.raises(TypeError, match=r"PolicyActor.logprobs.*unexpected keyword argument 'temp'"):
        launcher.check_call(PolicyActor, PolicyActor.logprobs, (batch,), {"temp": 1.0})
    with pytest.raises(TypeError, match=r"RoleContext"):
        launcher.check_constructor(CriticActor, (), {"context": None})


def role_context(tmp_path, micro: int, window: int, **changes) -> RoleContext:
    ctx = RoleContext(
        stage="roles_test",
        role="critic",
        model_path="builtin:tiny",
        tokenizer_path=None,
        init_seed=3,
        strategy=StrategyConfig(num_workers=1, zero_stage=2, precision="fp32", threads_per_worker=1),
        optim=OptimConfig(lr=1e-3, lr_warmup_ratio=0.0, lr_scheduler="constant_with_warmup", weight_decay=0.0),
        batch=TrainConfig(train_batch_size=window, micro_train_batch_size=micro),
        micro_rollout_batch_size=2,
        total_optimizer_steps=4,
        algo=PPOAlgoConfig(ppo_epochs=1, value_clip=None),
        seed=7,
        run_uri=str(tmp_path / "run"),
        storage_options={},
        work_dir=str(tmp_path / "work"),
        reward_stats=REWARD_STATS,
    )
    return dataclasses.replace(ctx, **changes)


def experience(critic_values: torch.Tensor, seq: SequenceBatch) -> Experience:
    returns = torch.linspace(-1.0, 2.0, seq.action_mask.numel()).reshape(seq.action_mask.shape) * seq.action_mask
    exp = Experience.from_sequences(
        seq, old_logprobs=torch.zeros_like(critic_values), values=critic_values, scores=torch.zeros(seq.size)
    )
    return exp.with_advantages(torch.zeros_like(critic_values), returns)


@pytest.mark.slow  # Ray role actors: make test, not test-fast
def test_critic_groups_normalise_values_and_weigh_every_window_token_alike(ray_cluster, tmp_path):
    """One-rank critic groups: values on the normalised reward scale, typed calls checked before sending, and one
    window of 4 rows as 2 micro-batches of 2 (unequal token counts) gives the same update as 1 micro-batch of 4."""
    tok = load_tokenizer("builtin:tiny")
    # responses of very different lengths: a per-micro-batch mean would weigh the short ones' tokens up
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]
    responses = [[20], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32], [33, 34], [35, 36, 37, 38, 39, 40, 41]]
    seq = make_sequences(prompts, responses, tok.pad_token_id)
    cfg = StrategyConfig(num_workers=1, cpus_per_worker=0.5)
    split = launcher.RayWorkerGroup(cfg, CriticActor, role_context(tmp_path / "a", micro=2, window=4))
    whole = launcher.RayWorkerGroup(cfg, CriticActor, role_context(tmp_path / "b", micro=4, window=4))
    try:
        launcher.wait(split.call_async(CriticActor.setup) + whole.call_async(CriticActor.setup))

        # A wrong call fails on the driver, at once, and the group still works after it.
        with pytest.raises(TypeError, match="is not a method of CriticActor"):
            split.call_each(PolicyActor.logprobs, [seq])
        with pytest.raises(TypeError, match="missing a required argument: 'step'"):
            split.call_each(CriticActor.fit, [seq])
        with pytest.raises(ValueError, match="2 shards for the 1 workers"):
            split.call_each(CriticActor.values, seq.split(2))

        # D. values = (raw head - reward_mean) / reward_std
        (values,) = split.call_each(CriticActor.values, [seq])
        hf = build_scalar_model("builtin:tiny", tok, seed=3, dtype=torch.float32, attn="sdpa")
        with torch.no_grad():
            raw = ScalarHeadModel(hf).eval()(seq.input_ids, seq.attention_mask)[:, :-1]
        mean, std = REWARD_STATS
        real = seq.attention_mask[:, :-1].bool()  # packed forwards compute no value on padding
        torch.testing.assert_close(values[real], ((raw - mean) / std)[real], atol=1e-5, rtol=1e-5)
        assert (values - raw).abs().max() > 0.1  # not the raw scale

        # H. the same window, split in two micro-batches or not: the same token-mean gradient, the same update
        exp = experience(values, seq)
        before = split.call(CriticActor.trainable_state)[0]
        stats_split = split.call_each(CriticActor.fit, [exp], 0)[0]
        stats_whole = whole.call_each(CriticActor.fit, [exp], 0)[0]
        after_split = split.call(CriticActor.trainable_state)[0]
        after_whole = whole.call(CriticActor.trainable_state)[0]
        moved = max((after_whole[k] - before[k]).abs().max().item() for k in before)
        assert moved > 5e-4, moved  # Adam's first step moves each weight by about lr
        gap = max((after_split[k] - after_whole[k]).abs().max().item() for k in before)
        assert gap < 1e-6, gap
        assert stats_split["critic_loss"] == pytest.approx(stats_whole["critic_loss"], rel=1e-5)
        print(f"\nwindow of 2 micro-batches vs 1: max weight gap {gap:.2e} (update size {moved:.2e})")
    finally:
        split.shutdown()
        whole.shutdown()


def test_checkpointed_rng_state_includes_cuda_when_available(monkeypatch):
    """On a GPU machine each rank's checkpoint also carries the CUDA generators (checked here without one: the
    calls torch.cuda would get are recorded)."""
    from rlhf_core.distributed import checkpoints

    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([7], dtype=torch.uint8)])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.update({device: state}))
    state = checkpoints.rng_state()
    assert [s.tolist() for s in state["cuda"]] == [[7]]
    checkpoints.set_rng_state(state)
    assert list(restored) == [0] and restored[0].tolist() == [7]
