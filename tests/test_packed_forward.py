"""Padding removal inside the forwards (rlhf_core.models.forward): packed and padded runs compute the same thing, no
token attends across the samples of a packed row, and the log-probs never hold full-vocabulary logits at every
position.

Model-level checks run a tiny Llama in this process; the PPO roles' checks (slow) run the real role classes: the
trained actor and critic in one-rank Ray groups, the frozen reward and reference models as plain objects.
"""

from __future__ import annotations

import dataclasses
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlhf_core.algos.batching import make_sequences
from rlhf_core.algos.losses import masked_mean, token_logprobs
from rlhf_core.algos.packing import plan_packing
from rlhf_core.algos.ppo import policy_loss
from rlhf_core.config import StrategyConfig
from rlhf_core.data.examples import pad_right
from rlhf_core.jobs.reward_model import RewardModelTrainer
from rlhf_core.jobs.sft import SFTTrainer
from rlhf_core.models.builders import ScalarHeadModel, build_causal_lm, build_scalar_model, load_tokenizer
from rlhf_core.models.forward import causal_lm_logprobs, scalar_values

TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def lm(tok):
    return build_causal_lm("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa").eval()


@pytest.fixture(scope="module")
def scalar(tok):
    return ScalarHeadModel(build_scalar_model("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")).eval()


def mixed_batch(tok, n: int = 8, seed: int = 0):
    """Prompt + response rows of lengths 3..24 (about half of the (n, T) batch is padding)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 1000, (2 + (7 * i) % 9,), generator=gen).tolist() for i in range(n)]
    responses = [torch.randint(5, 1000, ((5 * i) % 16,), generator=gen).tolist() for i in range(n)]
    return make_sequences(prompts, responses, tok.pad_token_id)


def test_the_mixed_batch_really_packs(tok):
    seq = mixed_batch(tok)
    p = plan_packing(seq.attention_mask)
    assert p.packed_shape[0] < seq.size and p.packed_shape[1] <= seq.input_ids.size(1)
    assert (p.position_ids == 0).sum(1).max() >= 2  # a row holds several samples


@pytest.mark.parametrize("pack", [True, False])
def test_a_batch_with_nothing_scored_still_backpropagates_zeros_to_every_parameter(tok, pack):
    """A micro-batch whose rows were all filtered out (dynamic filtering): its loss must still have a graph, or
    DeepSpeed refuses the backward, and with several ranks every rank's gradient collectives must run."""
    model = build_causal_lm("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
    seq = mixed_batch(tok)
    nothing = torch.zeros_like(seq.action_mask)
    logp, entropy = causal_lm_logprobs(model, seq.input_ids, seq.attention_mask, nothing, pack=pack, with_entropy=True)
    assert not logp.any() and not entropy.any() and logp.grad_fn is not None
    (logp.sum() + entropy.sum()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and not g.any() for g in grads.values()), [n for n, g in grads.items() if g is None]


def test_packed_and_padded_log_probs_values_and_scores_agree(tok, lm, scalar):
    seq = mixed_batch(tok)
    mask = seq.action_mask.bool()
    with torch.no_grad():
        reference = token_logprobs(
            lm(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits, seq.input_ids
        )
        packed = causal_lm_logprobs(lm, seq.input_ids, seq.attention_mask, seq.action_mask, temperature=0.7)
        padded = causal_lm_logprobs(
            lm, seq.input_ids, seq.attention_mask, seq.action_mask, temperature=0.7, pack=False
        )
        hot = token_logprobs(lm(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits, seq.input_ids, 0.7)
        torch.testing.assert_close(packed[mask], hot[mask], **TOL)
        torch.testing.assert_close(padded[mask], hot[mask], **TOL)
        assert packed[~mask].abs().max() == 0  # only the scored positions are computed
        one = causal_lm_logprobs(lm, seq.input_ids, seq.attention_mask, seq.action_mask)
        torch.testing.assert_close(one[mask], reference[mask], **TOL)

        real = seq.attention_mask.bool()
        v_packed = scalar_values(scalar, seq.input_ids, seq.attention_mask)
        v_padded = scalar_values(scalar, seq.input_ids, seq.attention_mask, pack=False)
        torch.testing.assert_close(v_packed[real], v_padded[real], **TOL)
        scores = ScalarHeadModel.last_values(v_packed, seq.attention_mask)
        torch.testing.assert_close(scores, ScalarHeadModel.last_values(v_padded, seq.attention_mask), **TOL)


def test_packed_and_padded_training_losses_and_gradients_agree(tok, lm):
    """The PPO policy loss, SFT loss and reward-model loss, and their gradients, packed versus padded."""
    seq = mixed_batch(tok)
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(seq.action_mask.shape, generator=gen)
    old = torch.zeros(seq.action_mask.shape)

    def policy(pack: bool):
        lm.zero_grad()
        logp = causal_lm_logprobs(lm, seq.input_ids, seq.attention_mask, seq.action_mask, pack=pack)
        loss, _ = policy_loss(logp, old + logp.detach() - 0.1, adv, seq.action_mask, 0.2)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}

    (l1, g1), (l2, g2) = policy(True), policy(False)
    torch.testing.assert_close(l1, l2, **TOL)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], **TOL)

    examples = [{"input_ids": ids, "loss_mask": [0] * 2 + [1] * (len(ids) - 2)} for ids in _rows(seq)]
    trainers = [SFTTrainer(_packing(p), [], []) for p in (True, False)]
    batch = trainers[0].collate(examples, tok.pad_token_id)
    sft = [trainer.loss(lm, batch)[0] for trainer in trainers]
    torch.testing.assert_close(sft[0], sft[1], **TOL)
    # by hand: the SFT loss is the negative mean log-prob of the loss-mask tokens
    with torch.no_grad():
        lp = token_logprobs(
            lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["input_ids"]
        )
    torch.testing.assert_close(sft[0].detach(), -masked_mean(lp, batch["loss_mask"][:, 1:]), **TOL)

    rm_model = ScalarHeadModel(build_scalar_model("builtin:tiny", tok, seed=2, dtype=torch.float32, attn="sdpa"))
    pairs = [{"chosen_ids": a, "rejected_ids": b} for a, b in zip(_rows(seq)[:4], _rows(seq)[4:])]
    trainers = [RewardModelTrainer(_packing(p), [], [], margin=0.0) for p in (True, False)]
    rm = [trainer.loss(rm_model, trainers[0].collate(pairs, 0))[0] for trainer in trainers]
    torch.testing.assert_close(rm[0], rm[1], **TOL)


def _packing(packing: bool) -> SimpleNamespace:
    """The part of a stage's ``StageContext`` that its loss reads: ``strategy.packing`` (and no MoE auxiliary loss)."""
    return SimpleNamespace(strategy=StrategyConfig(packing=packing), aux_loss_coef=0.0)


def _rows(seq) -> list[list[int]]:
    return [ids[: int(m.sum())].tolist() for ids, m in zip(seq.input_ids, seq.attention_mask)]


def test_packed_samples_do_not_attend_to_each_other(tok, lm):
    """Two samples share a packed row. Changing every token of the first leaves the second's log-probs as they were
    (it would not, had the row been one causal sequence: the control below)."""
    a, b = [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25]
    a2 = [t + 300 for t in a]
    ids = pad_right([a, b, a + b], tok.pad_token_id)
    mask = pad_right([[1] * 6, [1] * 5, [1] * 11], 0)
    score = torch.zeros(3, ids.size(1) - 1, dtype=torch.long)
    score[1, :4] = 1  # every next token of sample b
    # Budget = the longest sample (11): rows [the 11-token sample], [a, b].
    assert plan_packing(mask).position_ids[1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    with torch.no_grad():
        alone = causal_lm_logprobs(lm, ids[1:2], mask[1:2], score[1:2], pack=False)[0, :4]
        shared = causal_lm_logprobs(lm, ids, mask, score, pack=True)
        changed = causal_lm_logprobs(lm, pad_right([a2, b, a + b], tok.pad_token_id), mask, score, pack=True)
    torch.testing.assert_close(shared[1, :4], alone, **TOL)
    torch.testing.assert_close(changed[1, :4], alone, **TOL)
    # Control: the same row as one causal sequence (positions 0..10, no restart) sees a: b's log-probs move.
    with torch.no_grad():
        row = torch.tensor([a + b]), torch.tensor([a2 + b])
        hot = [token_logprobs(lm(input_ids=r, position_ids=torch.arange(11)[None]).logits, r)[0, 6:10] for r in row]
    assert (hot[0] - alone).abs().max() > 1e-3 and (hot[0] - hot[1]).abs().max() > 1e-3


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors created inside the mode that are alive, and their peak: every op's outputs are
    counted once per storage until the last tensor viewing that storage is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors]

    def _free(self, ptr: int) -> None:
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                entry = self.storages.setdefault(ptr, [size, 0])
                if entry[1] == 0:
                    self.live += size
                    self.peak = max(self.peak, self.live)
                entry[1] += 1
                weakref.finalize(t, self._free, ptr)
        return out


def test_log_prob_memory_does_not_grow_with_vocabulary_times_positions():
    """Peak memory of the log-prob computation of a batch, full-vocabulary log_softmax (the old way) against the
    chosen-token chunks, at 4x the positions and 4x the vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    peaks = {}
    for vocab in (4096, 16384):
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        for width in (64, 256):
            ids = torch.randint(0, vocab, (4, width))
            mask = torch.ones_like(ids)
            score = torch.zeros(4, width - 1, dtype=torch.long)
            score[:, width // 2 :] = 1  # the response half
            with torch.no_grad():
                with LiveBytes() as old:
                    token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids)
                with LiveBytes() as new:
                    causal_lm_logprobs(model, ids, mask, score, chunk_elements=2**18)  # 1 MiB of fp32 per chunk
            peaks[vocab, width] = old.peak / 2**20, new.peak / 2**20
    print(
        "\npeak MiB (full log_softmax, chosen-token chunks):",
        {k: tuple(round(x, 2) for x in v) for k, v in peaks.items()},
    )
    # The old way holds (B, T, V) fp32 logits and their log_softmax: 16x the smallest case at 4x T and 4x V.
    assert peaks[16384, 256][0] > 12 * peaks[4096, 64][0]
    # The chunks: 4x the positions costs less than 1.5x at either vocabulary (the hidden states grow, by H per
    # position); what grows with the vocabulary is at most one copy of the LM head's (V, H) fp32 weight (the CPU
    # matmul's), never positions x V; and it stays far below the old way.
    for vocab in (4096, 16384):
        assert peaks[vocab, 256][1] < 1.5 * peaks[vocab, 64][1]
    head_growth = (16384 - 4096) * 64 * 4 / 2**20
    assert peaks[16384, 256][1] - peaks[4096, 256][1] < 1.2 * head_growth
    assert peaks[16384, 256][1] < peaks[16384, 256][0] / 10


# -- the PPO roles --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_ppo_role_gives_the_same_outputs_packed_and_padded(ray_cluster, tmp_path, tok):
    from rlhf_core.distributed import launcher
    from rlhf_core.distributed.actor import PolicyActor
    from rlhf_core.distributed.critic import CriticActor
    from rlhf_core.distributed.reference import ReferencePolicy
    from rlhf_core.distributed.reward import RewardScorer
    from rlhf_core.distributed.role_base import TrainableRole
    from tests.distributed.test_roles import experience, role_context

    seq = mixed_batch(tok, n=8, seed=3)
    mask, real = seq.action_mask.bool(), seq.attention_mask[:, :-1].bool()
    cfg = StrategyConfig(num_workers=1, cpus_per_worker=0.5)
    groups = {}
    for cls, role in ((PolicyActor, "actor"), (CriticActor, "critic")):
        for pack in (True, False):
            strategy = StrategyConfig(num_workers=1, zero_stage=2, precision="fp32", packing=pack)
            ctx = role_context(tmp_path / f"{role}{pack}", micro=4, window=8, role=role, strategy=strategy)
            groups[role, pack] = launcher.RayWorkerGroup(
                cfg, cls, dataclasses.replace(ctx, micro_rollout_batch_size=4)
            )
    try:
        launcher.wait([ref for g in groups.values() for ref in g.call_async(TrainableRole.setup)])
        out = {}
        for pack in (True, False):
            (logp,) = groups["actor", pack].call_each(PolicyActor.logprobs, [seq])
            (values,) = groups["critic", pack].call_each(CriticActor.values, [seq])
            exp = experience(values, seq)
            exp = exp.with_advantages(exp.returns * 0.5 - 0.2 * exp.action_mask, exp.returns)
            exp = dataclasses.replace(exp, old_logprobs=logp - 0.05 * seq.action_mask)
            actor_stats = groups["actor", pack].call_each(PolicyActor.fit, [exp], 0)[0]
            critic_stats = groups["critic", pack].call_each(CriticActor.fit, [exp], 0)[0]
            out[pack] = {
                "logp": logp,
                "values": values,
                "actor": actor_stats,
                "critic": critic_stats,
                "actor_state": groups["actor", pack].call(PolicyActor.trainable_state)[0],
                "critic_state": groups["critic", pack].call(CriticActor.trainable_state)[0],
            }
    finally:
        for g in groups.values():
            g.shutdown()
    torch.testing.assert_close(out[True]["logp"][mask], out[False]["logp"][mask], **TOL)
    torch.testing.assert_close(out[True]["values"][real], out[False]["values"][real], **TOL)
    for key in ("policy_loss",):
        assert out[True]["actor"][key] == pytest.approx(out[False]["actor"][key], abs=1e-5)
    assert out[True]["critic"]["critic_loss"] == pytest.approx(out[False]["critic"]["critic_loss"], abs=1e-5)
    for role in ("actor_state", "critic_state"):
        gap = max((out[True][role][k] - out[False][role][k]).abs().max().item() for k in out[True][role])
        assert gap < 1e-5, (role, gap)

    scores, ref_logp = {}, {}
    for pack in (True, False):
        rm = RewardScorer("builtin:tiny", 4, "fp32", init_seed=5, packing=pack)
        scores[pack] = rm.scores(seq)
        ref = ReferencePolicy("builtin:tiny", 4, "fp32", 3, temperature=0.7, packing=pack)
        ref_logp[pack] = ref.logprobs(seq)
    torch.testing.assert_close(scores[True], scores[False], **TOL)
    torch.testing.assert_close(ref_logp[True][mask], ref_logp[False][mask], **TOL)
