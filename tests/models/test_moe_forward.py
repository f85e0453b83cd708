"""The MoE load-balancing loss from the log-prob forward (``causal_lm_logprobs(aux_loss=...)``) on the tiny Qwen3-MoE:
packed rows end in filler tokens that the router still routes; the loss counts the real tokens only, so packed and
padded forwards give the same loss, which is transformers' own with the attention mask."""

import pytest
import torch

from rlhf_core.algos.moe import load_balancing_loss
from rlhf_core.algos.packing import plan_packing
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.models.forward import causal_lm_logprobs


@pytest.fixture(scope="module")
def moe():
    tok = load_tokenizer("builtin:tiny")
    return build_causal_lm("builtin:tiny-moe", tok, seed=0, dtype=torch.float32, attn="sdpa")


def _batch():
    ids = torch.randint(5, 1000, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # 9, 12 and 5 real tokens
    mask[2, 5:] = 0
    score = mask[:, 1:].clone()
    score[:, :2] = 0
    return ids, mask, score


def test_the_aux_loss_counts_the_real_tokens_packed_or_padded(moe):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    ids, mask, score = _batch()
    packed_aux, padded_aux = [], []
    with torch.no_grad():
        packed = causal_lm_logprobs(moe, ids, mask, score, pack=True, aux_loss=packed_aux)
        padded = causal_lm_logprobs(moe, ids, mask, score, pack=False, aux_loss=padded_aux)
        assert torch.allclose(packed, causal_lm_logprobs(moe, ids, mask, score, pack=True), atol=0)
        out = moe(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert torch.allclose(packed, padded, atol=1e-5)
    expected = load_balancing_loss_func(out.router_logits, 4, 2, mask)
    assert torch.allclose(padded_aux[0], expected, atol=1e-6)
    assert torch.allclose(packed_aux[0], expected, atol=1e-5)
    # the packed rows do hold filler, and counted as real it would change the loss
    packing = plan_packing(mask)
    rows, length = packing.packed_shape
    assert rows * length > int(mask.sum())
    with torch.no_grad():
        routed = moe(
            input_ids=packing.pack(ids), position_ids=packing.position_ids, output_router_logits=True
        ).router_logits
    with_filler = load_balancing_loss(routed, 2, torch.ones(rows * length))
    assert abs(with_filler.item() - expected.item()) > 1e-4


def test_a_dense_model_has_no_aux_loss():
    tok = load_tokenizer("builtin:tiny")
    dense = build_causal_lm("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
    ids, mask, score = _batch()
    with pytest.raises(ValueError, match="LlamaForCausalLM returned no router logits"):
        causal_lm_logprobs(dense, torch.clamp(ids, max=500), mask, score, aux_loss=[])


def test_an_aux_loss_on_a_dense_model_is_refused_naming_the_key_before_any_worker_starts(tmp_path):
    from rlhf_core.config import ConfigError, load_config
    from rlhf_core.jobs import stage_setup
    from tests.conftest import TINY

    cfg = load_config(TINY, [f"run_uri={tmp_path}", "sft.model.aux_loss_coef=0.01"])
    with pytest.raises(ConfigError, match=r"'sft.model.aux_loss_coef' is the load-balancing loss of a Mixture-of-Exp"):
        stage_setup.setup_stage(cfg, "sft")
    moe = load_config(
        TINY, [f"run_uri={tmp_path}", "sft.model.aux_loss_coef=0.01", "sft.model.name_or_path=builtin:tiny-moe"]
    )
    assert stage_setup.setup_stage(moe, "sft").context().aux_loss_coef == 0.01
