"""The DPO and KTO stages' rank code on a fixed tiny model, in this process (no Ray, no DeepSpeed).

At the start of training the policy is its own reference, so every log-ratio is 0: DPO's loss is log 2 and KTO's is
(1 - sigmoid(0)) = 1/2 per example, with zero implicit rewards. Precomputed and online reference log-probs agree, and
one optimizer step on the DPO loss raises the chosen responses' log-probs relative to the rejected ones.
"""

import copy
import math
import threading
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.config import DPOConfig, KTOConfig, load_config
from rlhf_core.jobs.dpo import DPOTrainer
from rlhf_core.jobs.kto import KTOTrainer
from rlhf_core.jobs.preference import response_logprobs, score_on_ranks, tensors
from rlhf_core.models.builders import load_tokenizer
from rlhf_core.storage import ObjectStore
from tests.conftest import ROOT

TINY_DPO = ROOT / "deployments" / "configs" / "tiny-dpo.yaml"
TINY_KTO = ROOT / "deployments" / "configs" / "tiny-kto.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:tiny")


def _ids(tokenizer, prompt: str, response: str) -> tuple[list[int], int]:
    p = tokenizer(prompt)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + r, len(p)


def _pairs(tokenizer) -> list[dict]:
    rows = [
        ("Write about the rain.", "The rain is good and kind.", "The rain is sad."),
        ("Describe the forest in one sentence.", "The forest nice.", "The forest is cruel and bad and ugly."),
        ("A sentence about the school?", "The school is wonderful.", "The school bad."),
    ]
    out = []
    for prompt, chosen, rejected in rows:
        (c, cp), (r, rp) = _ids(tokenizer, prompt, chosen), _ids(tokenizer, prompt, rejected)
        out.append({"chosen_ids": c, "chosen_prompt_len": cp, "rejected_ids": r, "rejected_prompt_len": rp})
    return out


def _section(path, kind: str, *overrides: str):
    return load_config(path, list(overrides)).stage(kind)


def _ctx():
    """The part of a rank's ``StageContext`` that building the policy reads."""
    return SimpleNamespace(
        model_dir="builtin:tiny", init_seed=0, trust_remote_code=False, lora=None, aux_loss_coef=0.0
    )


def _dpo(p: DPOConfig, reference: str | None = None) -> DPOTrainer:
    return DPOTrainer(_ctx(), [], [], p, reference)


def _kto(p: KTOConfig, reference: str | None = None) -> KTOTrainer:
    return KTOTrainer(_ctx(), [], [], p, reference)


def _policy(impl, tokenizer):
    torch.manual_seed(0)
    return impl.trainer.build_model(tokenizer, torch.float32, "sdpa")


def _own_logps(model, impl, batch) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(model, batch, impl.trainer.packing)[0]


def test_dpo_with_the_policy_as_reference_has_loss_log_2_online_and_precomputed(tokenizer):
    p: DPOConfig = _section(TINY_DPO, "dpo")
    examples = _pairs(tokenizer)
    online = _dpo(p, reference="builtin:tiny")  # a frozen copy of the same seed-0 model
    model = _policy(online, tokenizer)
    batch = online.collate(examples, tokenizer.pad_token_id)
    loss, metrics = online.loss(model, batch)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["chosen_reward"] == pytest.approx(0, abs=1e-6) and metrics["margin"] == pytest.approx(0, abs=1e-6)

    # precomputed: the numbers travel in the examples (as preference.driver_reference attaches them)
    own = _own_logps(model, online, batch)
    n = len(examples)
    for e, c, r in zip(examples, own[:n].tolist(), own[n:].tolist()):
        e["ref_chosen"], e["ref_rejected"] = c, r
    precomputed = _dpo(p)
    loss_pre, _ = precomputed.loss(model, precomputed.collate(examples, tokenizer.pad_token_id))
    assert loss_pre.item() == pytest.approx(loss.item(), abs=1e-6)


def test_one_dpo_step_raises_the_chosen_over_the_rejected(tokenizer):
    p: DPOConfig = _section(TINY_DPO, "dpo")
    impl = _dpo(p, reference="builtin:tiny")
    model = _policy(impl, tokenizer)
    batch = impl.collate(_pairs(tokenizer), tokenizer.pad_token_id)
    before = _own_logps(model, impl, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss, _ = impl.loss(model, batch)
    loss.backward()
    optimizer.step()
    after = _own_logps(model, impl, batch)
    n = len(after) // 2
    margin = lambda x: (x[:n] - x[n:]).mean().item()  # noqa: E731
    assert margin(after) > margin(before)
    loss_after, metrics = impl.loss(model, batch)
    assert loss_after.item() < math.log(2) and metrics["acc"] > 0 and metrics["margin"] > 0


def test_ipo_and_the_nll_term_change_the_loss(tokenizer):
    examples = _pairs(tokenizer)
    losses = {}
    for name, overrides in {
        "dpo": (),
        "ipo": ("dpo.loss_type=ipo",),
        "nll": ("dpo.nll_loss_coef=1.0",),
    }.items():
        impl = _dpo(_section(TINY_DPO, "dpo", *overrides), reference="builtin:tiny")
        model = _policy(impl, tokenizer)
        loss, metrics = impl.loss(model, impl.collate(examples, tokenizer.pad_token_id))
        losses[name] = (loss.item(), metrics)
    beta = 0.1
    assert losses["ipo"][0] == pytest.approx((1 / (2 * beta)) ** 2, rel=1e-5)  # logits 0: (0 - 1/(2 beta))^2 = 25
    # log 2 plus the mean NLL per chosen token, which a random tiny model puts near log(vocab)
    assert losses["nll"][0] == pytest.approx(math.log(2) + losses["nll"][1]["nll"], abs=1e-5)
    assert losses["nll"][1]["nll"] > 1.0


def test_kto_with_the_policy_as_reference_gives_one_half_and_zero_kl(tokenizer):
    p: KTOConfig = _section(TINY_KTO, "kto")
    examples = []
    pairs = _pairs(tokenizer)
    for i, pair in enumerate(pairs):
        other = pairs[(i + 1) % len(pairs)]  # another prompt's response: the mismatched (KL) sequence
        for good, key in ((True, "chosen"), (False, "rejected")):
            prompt_len = pair[f"{key}_prompt_len"]
            prompt = pair[f"{key}_ids"][:prompt_len]
            response = other[f"{key}_ids"][other[f"{key}_prompt_len"] :]
            examples.append(
                {
                    "input_ids": pair[f"{key}_ids"],
                    "prompt_len": prompt_len,
                    "desirable": good,
                    "kl_ids": prompt + response,
                    "kl_prompt_len": prompt_len,
                }
            )
    impl = _kto(p, reference="builtin:tiny")
    model = _policy(impl, tokenizer)
    batch = impl.collate(examples, tokenizer.pad_token_id)
    loss, metrics = impl.loss(model, batch)
    # r = 0 and z = 0: each example loses 1 - sigmoid(0) = 0.5, weights 1
    assert loss.item() == pytest.approx(0.5, abs=1e-6)
    assert metrics["kl"] == pytest.approx(0, abs=1e-6) and metrics["chosen_reward"] == pytest.approx(0, abs=1e-6)
    weighted = _kto(_section(TINY_KTO, "kto", "kto.desirable_weight=2.0"), reference="builtin:tiny")
    loss_w, _ = weighted.loss(_policy(weighted, tokenizer), weighted.collate(examples, tokenizer.pad_token_id))
    assert loss_w.item() == pytest.approx((3 * 2 * 0.5 + 3 * 0.5) / 6, abs=1e-6)  # 0.75


class _ThreadRanks:
    """A ``DeepSpeedStrategy`` stand-in for one of ``world`` ranks run as threads: ``all_gather_object`` meets the
    other threads at a barrier and returns every rank's object, in rank order."""

    def __init__(self, rank: int, world: int, box: list, barrier: threading.Barrier):
        self.rank, self.world_size, self.box, self.barrier = rank, world, box, barrier

    def all_gather_object(self, obj):
        self.box[self.rank] = obj
        self.barrier.wait(timeout=60)
        return list(self.box)


def test_the_training_ranks_score_the_starting_policy_each_its_share_and_rank_0_commits_the_numbers(
    tokenizer, tmp_path
):
    p: DPOConfig = _section(TINY_DPO, "dpo")
    assert p.reference is None and p.ref_logprobs == "precompute"  # the default: the starting policy's numbers
    pairs = _pairs(tokenizer)
    # 4 ranks: the 6 training sequences give shares of 2, 2, 1 and 1, the 2 held-out ones 1, 1, 0 and 0 (padded to
    # equal forwards, the padding dropped); eval_batch_size 1 = one forward per sequence
    world, splits = 4, {"train": pairs, "eval": pairs[:1]}
    ctx = SimpleNamespace(
        run_uri=str(tmp_path / "run"),
        storage_options={},
        stage="dpo",
        config_hash="h",
        train=SimpleNamespace(eval_batch_size=1),
    )
    impl = _dpo(p)
    model = _policy(impl, tokenizer)
    box, barrier = [None] * world, threading.Barrier(world)
    ranks = [copy.deepcopy(splits) for _ in range(world)]

    def score(model, strategy, splits) -> None:  # as PreferenceTrainer.fit calls it, on the model it has just built
        score_on_ranks(
            model, ctx, strategy, p, splits, impl.reference_sequences, impl.REF_KEYS, tokenizer.pad_token_id
        )

    threads = [
        threading.Thread(target=score, args=(_policy(impl, tokenizer), _ThreadRanks(r, world, box, barrier), ranks[r]))
        for r in range(world)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # What one process gets scoring everything itself: chosen rows, then rejected rows.
    for name, rows in splits.items():
        batch = tensors(rows, tokenizer.pad_token_id, impl.reference_sequences, impl.REF_KEYS)
        own = _own_logps(model, impl, batch).tolist()
        expected = [v for pair in zip(own[: len(rows)], own[len(rows) :]) for v in pair]
        for r in range(world):
            got = [e[key] for e in ranks[r][name] for key in ("ref_chosen", "ref_rejected")]
            assert got == pytest.approx(expected, abs=1e-5), (name, r)
    store = ObjectStore(ctx.run_uri)
    assert store.read_manifest("dpo/reference_logprobs", verify=True).config_hash == "h"
    committed = store.read_json("dpo/reference_logprobs/logprobs.json")
    assert {k: len(v) for k, v in committed.items()} == {"train": 6, "eval": 2}
    assert committed["train"][:2] == [ranks[0]["train"][0]["ref_chosen"], ranks[0]["train"][0]["ref_rejected"]]

    # numbers already attached (read back by the driver): nothing is scored, no rank gathers
    never = SimpleNamespace(rank=0, world_size=1, all_gather_object=lambda obj: pytest.fail("scored again"))
    score(model, never, ranks[0])
    # another reference model: its numbers come from the driver's ReferencePolicy group, not from the ranks
    other = _section(TINY_DPO, "dpo", "dpo.reference.name_or_path=builtin:tiny", "dpo.reference.init_seed=1")
    keys = impl.REF_KEYS
    score_on_ranks(
        model, ctx, never, other, copy.deepcopy(splits), impl.reference_sequences, keys, tokenizer.pad_token_id
    )
