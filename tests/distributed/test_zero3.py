"""Models bigger than one device (ZeRO-3): partitioned construction that keeps the fixed-seed weights, each rank's
memory during construction, the frozen roles as ZeRO-3 inference engines, and resume downloads of one rank's shards.

Ranks are two real processes joined by gloo (``torch.multiprocessing`` spawn) or a real two-worker Ray group."""

import gc
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlhf_core.algos.batching import make_sequences
from rlhf_core.config import OptimConfig, PPOAlgoConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed import launcher
from rlhf_core.distributed.checkpoints import rank_files
from rlhf_core.distributed.critic import CriticActor
from rlhf_core.distributed.reference import ReferencePolicy
from rlhf_core.distributed.reward import RewardScorer
from rlhf_core.distributed.role_base import RoleContext
from rlhf_core.distributed.strategy import DeepSpeedStrategy
from rlhf_core.models.builders import build_causal_lm, build_scalar_model, init_from_config, load_tokenizer
from rlhf_core.storage import ObjectStore
from tests.ray_cluster import free_port

# About 337M parameters, 1.35 GB in fp32: larger than a rank may hold while it is built.
BIG_LLAMA = dict(
    vocab_size=8192,
    hidden_size=2048,
    intermediate_size=5504,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=128,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _zero3_strategy() -> DeepSpeedStrategy:
    cfg = StrategyConfig(num_workers=2, zero_stage=3, precision="fp32", threads_per_worker=1)
    return DeepSpeedStrategy(cfg, OptimConfig(), TrainConfig(train_batch_size=2, micro_train_batch_size=1))


def _own_peak_rss() -> int:
    """This process's peak RSS in bytes (Linux ``VmHWM``: the high-water mark of its own address space). Not
    ``ru_maxrss``: across exec, Linux keeps in it the peak of the process this one was forked from, so a spawned rank
    of a large test session would report the session's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rank_main(rank: int, port: int, queue, jobs: tuple[str, ...]) -> None:
    """One rank: build under ``DeepSpeedStrategy.model_init()`` for each of ``jobs`` and report to the parent."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        RLHF_DEVICE="cpu",
    )
    torch.set_num_threads(1)
    import deepspeed

    strategy = _zero3_strategy()
    strategy.init_distributed()
    results = {job: _build_job(job, rank, strategy, deepspeed) for job in jobs}
    queue.put(results)
    strategy.barrier()


def _head_job(rank: int, strategy: DeepSpeedStrategy) -> dict:
    """Log-probs of a frozen ZeRO-3 engine in chunks of 3 positions without autograd (the head's weight read once),
    and with autograd on a head made trainable (the head module called per chunk, as a trained head is): how often
    the head module runs in each, and the largest difference between the two."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhf_core.models.forward import causal_lm_logprobs

    # a 512 x 256 head: above DeepSpeed's persistence threshold (1e5 elements), so it stays partitioned and each
    # call of the module fetches it
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with strategy.model_init():
        model = init_from_config(AutoModelForCausalLM, config, seed=rank, dtype=torch.float32)
    engine = strategy.prepare_frozen(model)
    head = model.get_output_embeddings()
    calls = [0]
    head.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids = torch.randint(5, 512, (3, 10), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    score = torch.zeros(3, 9, dtype=torch.long)
    score[:, 2:6] = 1  # 12 scored positions: 4 chunks of 3
    out = {"persist": bool(head.weight.ds_persist), "scored": int(score.sum())}
    with torch.no_grad():
        once = causal_lm_logprobs(engine, ids, mask, score, chunk_elements=3 * 512)
    out["calls_read_once"], calls[0] = calls[0], 0
    head.weight.requires_grad_(True)
    with torch.enable_grad():
        per_chunk = causal_lm_logprobs(engine, ids, mask, score, chunk_elements=3 * 512).detach()
    out["calls_per_chunk"] = calls[0]
    out["max_diff"] = (per_chunk - once).abs().max().item()
    out["status_after"] = head.weight.ds_status.name  # released again after the read
    return out


def _moe_job(rank: int, strategy: DeepSpeedStrategy) -> dict:
    """Two training steps of the tiny Qwen3-MoE under ZeRO-3 with different tokens on each rank, so that the ranks
    route to different experts: the losses, the leaf classes marked, and whether the experts moved."""
    tok = load_tokenizer("builtin:tiny")
    with strategy.model_init():
        model = build_causal_lm("builtin:tiny-moe", tok, seed=0, dtype=torch.float32, attn="sdpa")
    engine = strategy.prepare(model, total_steps=4)
    ids = torch.randint(5, 1000, (1, 12), generator=torch.Generator().manual_seed(10 + rank))
    losses = []
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    leaf = sorted({type(m).__name__ for m in model.modules() if getattr(m, "_z3_leaf", False)})
    return {"losses": losses, "leaf": leaf}


def _build_job(job: str, rank: int, strategy: DeepSpeedStrategy, deepspeed) -> dict | None:
    if job == "moe":
        return _moe_job(rank, strategy)
    if job == "head":
        return _head_job(rank, strategy)
    if job == "tiny":  # the gathered weights of both builtin builders, for comparison with the plain build
        tok = load_tokenizer("builtin:tiny")
        out = {}
        for kind, build in (("lm", build_causal_lm), ("rm", build_scalar_model)):
            with strategy.model_init():
                model = build("builtin:tiny", tok, seed=3, dtype=torch.float32, attn="sdpa")
            for name, p in model.named_parameters():
                assert p.ds_tensor.numel() < p.ds_numel, f"{name} is not partitioned"
                with deepspeed.zero.GatheredParameters([p]):
                    out[f"{kind}:{name}"] = p.data.clone().numpy()
        result = out if rank == 0 else None
    else:  # the big model: peak memory of this process while the model is built
        import psutil
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(**BIG_LLAMA)
        proc = psutil.Process()
        gc.collect()
        base = proc.memory_info().rss
        peak, done = [base], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                done.wait(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with strategy.model_init():
            model = init_from_config(AutoModelForCausalLM, config, seed=0, dtype=torch.float32)
        done.set()
        sampler.join()
        peak[0] = max(peak[0], proc.memory_info().rss)
        maxrss = _own_peak_rss()
        params = list(model.parameters())
        result = {
            "rank": rank,
            "full_bytes": sum(p.ds_numel * p.ds_tensor.element_size() for p in params),
            "num_params": sum(p.ds_numel for p in params),
            "held_bytes": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params),
            "peak_delta_sampled": peak[0] - base,
            "peak_delta_maxrss": maxrss - base,  # an upper bound: the process's peak, minus the RSS before
        }
    return result


def _run_two_ranks(jobs: tuple[str, ...], port: int) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, queue, jobs)) for rank in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return results


@pytest.fixture(scope="module")
def two_rank_builds() -> list[dict]:
    """Both construction jobs in one pair of rank processes (one start-up of DeepSpeed and gloo): the big model
    first, so that the peak RSS (VmHWM) it reports is its own."""
    return _run_two_ranks(("big", "tiny", "head", "moe"), free_port())


@pytest.mark.slow
def test_zero3_construction_keeps_the_fixed_seed_weights_of_the_plain_build(two_rank_builds):
    """Built partitioned over 2 ranks, the builtin causal LM and the scalar model (fresh head included) gather to
    exactly the weights of the plain single-process build with the same seed."""
    tok = load_tokenizer("builtin:tiny")
    plain = {
        f"lm:{n}": p
        for n, p in build_causal_lm("builtin:tiny", tok, seed=3, dtype=torch.float32, attn="sdpa").named_parameters()
    }
    plain.update(
        {
            f"rm:{n}": p
            for n, p in build_scalar_model(
                "builtin:tiny", tok, seed=3, dtype=torch.float32, attn="sdpa"
            ).named_parameters()
        }
    )
    gathered = next(r["tiny"] for r in two_rank_builds if r["tiny"] is not None)
    assert gathered.keys() == plain.keys()
    worst = max((p.detach() - torch.from_numpy(gathered[n])).abs().max().item() for n, p in plain.items())
    assert worst <= 1e-7, worst


@pytest.mark.slow
def test_zero3_construction_of_a_1gb_model_stays_well_under_its_size_on_each_rank(two_rank_builds):
    """A 337M-parameter (1.35 GB fp32) Llama built from config under ZeRO-3 on 2 CPU ranks: each rank holds half the
    parameters and its memory never grows by anything near the full model while it is built."""
    results = sorted((r["big"] for r in two_rank_builds), key=lambda r: r["rank"])
    full = results[0]["full_bytes"]
    assert results[0]["num_params"] >= 270e6 and full >= 1e9
    for r in results:
        print(
            f"rank {r['rank']}: full model {full / 2**30:.2f} GiB ({r['num_params'] / 1e6:.0f}M params), held "
            f"{r['held_bytes'] / 2**30:.2f} GiB, peak RSS growth during construction "
            f"{r['peak_delta_sampled'] / 2**30:.2f} GiB (sampled), "
            f"<= {r['peak_delta_maxrss'] / 2**30:.2f} GiB (VmHWM)"
        )
        assert r["held_bytes"] <= 0.51 * full
        assert r["peak_delta_maxrss"] < 0.75 * full
    assert sum(r["held_bytes"] for r in results) >= full


@pytest.mark.slow
def test_zero3_frozen_log_probs_gather_the_lm_head_once_not_per_chunk(two_rank_builds):
    """Without autograd, a ZeRO-3 engine's chunked log-probs read the head's weight once: the head module runs once
    (the forward's empty call for its last hidden state) instead of once more per chunk, and the log-probs are the
    same."""
    for r in two_rank_builds:
        h = r["head"]
        assert h["persist"] is False and h["scored"] == 12
        assert h["calls_per_chunk"] == 1 + 4  # each a fetch of the partitioned head
        assert h["calls_read_once"] == 1
        assert h["max_diff"] == 0.0
        assert h["status_after"] == "NOT_AVAILABLE"


@pytest.mark.slow
def test_zero3_trains_an_moe_model_on_two_ranks_that_route_differently(two_rank_builds):
    """The MoE blocks are ZeRO-3 leaf modules (strategy.moe_leaf_modules): two ranks whose tokens go to different
    experts train two steps without hanging, and the loss falls on each."""
    for r in two_rank_builds:
        m = r["moe"]
        assert m["leaf"] == ["Qwen3MoeSparseMoeBlock"]
        assert m["losses"][1] < m["losses"][0], m


def _sequences(tok, rows: int):
    prompts = [[5 + i, 6 + i, 7] for i in range(rows)]
    responses = [[20 + j for j in range(1 + (3 * i) % 7)] for i in range(rows)]
    return make_sequences(prompts, responses, tok.pad_token_id)


@pytest.mark.slow
@pytest.mark.extended  # make test: 2-worker ZeRO-3 in SFT and the PPO actor; frozen.zero_stage in the key probes
def test_frozen_roles_as_zero3_engines_match_plain_replicas(ray_cluster, tmp_path):
    """Reference log-probs (builtin:tiny, built from config) and reward scores (a saved reward model, loaded with
    from_pretrained) from 2-worker ZeRO-3 groups, with uneven shards (3 and 1 micro-batches) and parameter offload
    for the reward, equal the plain replicas' within 1e-5."""
    tok = load_tokenizer("builtin:tiny")
    rm_dir = tmp_path / "rm"
    build_scalar_model("builtin:tiny", tok, seed=5, dtype=torch.float32, attn="sdpa").save_pretrained(str(rm_dir))
    tok.save_pretrained(str(rm_dir))
    seq = _sequences(tok, 8)
    shards = [seq.split(6)[0], seq.split(6)[1]]  # 6 and 2 rows, micro-batches of 2: 3 and 1 forwards

    plain_ref = ReferencePolicy("builtin:tiny", 2, "fp32", 3, temperature=0.7).logprobs(seq)
    plain_rm = RewardScorer(str(rm_dir), 2, "fp32").scores(seq)

    cfg = StrategyConfig(num_workers=2, cpus_per_worker=0.5, threads_per_worker=1, device="cpu")
    ref = launcher.RayWorkerGroup(cfg, ReferencePolicy, "builtin:tiny", 2, "fp32", 3, temperature=0.7, zero_stage=3)
    try:
        z3_ref = torch.cat(ref.call_each(ReferencePolicy.logprobs, shards))
    finally:
        ref.shutdown()
    rm = launcher.RayWorkerGroup(cfg, RewardScorer, str(rm_dir), 2, "fp32", zero_stage=3, offload=True)
    try:
        z3_rm = torch.cat(rm.call_each(RewardScorer.scores, shards))
        empty = rm.call_each(RewardScorer.scores, [seq, seq.split(8)[0].select_rows(torch.zeros(0, dtype=torch.long))])
    finally:
        rm.shutdown()
    mask = seq.action_mask.bool()
    assert (z3_ref - plain_ref)[mask].abs().max().item() <= 1e-5
    assert (z3_rm - plain_rm).abs().max().item() <= 1e-5
    assert torch.allclose(empty[0], plain_rm, atol=1e-5) and empty[1].numel() == 0  # a rank with no rows pads


def _critic_context(tmp_path: Path) -> RoleContext:
    return RoleContext(
        stage="z3",
        role="critic",
        model_path="builtin:tiny",
        tokenizer_path=None,
        init_seed=3,
        strategy=StrategyConfig(
            num_workers=2, zero_stage=3, precision="fp32", threads_per_worker=1, cpus_per_worker=0.5, device="cpu"
        ),
        optim=OptimConfig(lr=1e-3),
        batch=TrainConfig(train_batch_size=2, micro_train_batch_size=1),
        micro_rollout_batch_size=2,
        total_optimizer_steps=2,
        algo=PPOAlgoConfig(),
        seed=7,
        run_uri=str(tmp_path / "run"),
        storage_options={},
        work_dir=str(tmp_path / "work"),
    )


@pytest.mark.slow
def test_zero3_resume_downloads_only_each_ranks_own_shards(ray_cluster, tmp_path):
    """A 2-rank ZeRO-3 critic (built under zero.Init) saves its shards; on resume each rank downloads its own
    partition files and RNG state, none of the other rank's, and restores from them alone."""
    group = launcher.RayWorkerGroup(_critic_context(tmp_path).strategy, CriticActor, _critic_context(tmp_path))
    try:
        group.call(CriticActor.setup)
        before = group.call(CriticActor.trainable_state)[0]
        files = group.call(CriticActor.save_shards, "z3/checkpoints/step_00000001")[0]
        store = ObjectStore(str(tmp_path / "run"))
        store.commit("z3/checkpoints/step_00000001", stage="z3", config_hash="h", files=files)
        group.call(CriticActor.load_shards, "z3/checkpoints/step_00000001")  # only this rank's files are local
        after = group.call(CriticActor.trainable_state)[0]
    finally:
        group.shutdown()
    assert any("zero_pp_rank_1_" in f for f in files) and "critic/rng_rank1.pt" in files
    for rank in range(2):
        local = tmp_path / f"dl{rank}"
        store.download_artifact("z3/checkpoints/step_00000001", local, only="critic", keep=rank_files(rank))
        got = sorted(str(p.relative_to(local)) for p in local.rglob("*.pt"))
        other = 1 - rank
        assert got and all(f"rank_{rank}_" in f or f"rank{rank}." in f for f in got), got
        assert not any(f"rank_{other}_" in f or f"rank{other}." in f for f in got), got
        assert len(got) < len([f for f in files if f.endswith(".pt")])
    assert before is not None and after is not None
    assert all(torch.equal(before[k], after[k]) for k in before)
