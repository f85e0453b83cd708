"""Generate stage: sample ``rollout.n_samples_per_prompt`` responses per prompt from a policy and commit them as a
dataset (the input of a score stage: best-of-n, rejection sampling, iterative DPO).

Reads the policy (``generate.model``, e.g. ``stage:sft``) and prompts (``generate.data``: ``input_key``,
``max_samples``, the prompt rendering keys); the rollout engines are PPO's (``generate.rollout``: backend vllm or
hf, num_engines, tensor_parallel_size, cpus_per_engine, kv_cache_gib, gpu_memory_utilization, enforce_eager,
resources; precision and device from ``generate.strategy``), sampling with temperature, top_p, max_new_tokens and
``generate.seed``. A ``builtin:`` policy with the vLLM backend is saved once to the driver's scratch directory for
vLLM to load (the engines must then run on the driver's machine).

Each row: ``prompt`` (the raw prompt value), ``response`` (decoded, special tokens skipped), ``prompt_index``,
``sample_index``, ``response_tokens`` (sampled tokens, EOS included), ``finish_reason`` (``stop``: ended with EOS;
``length``: cut at max_new_tokens), ``gold_reward`` with ``generate.gold_reward``, and ``kl_to_ref`` with
``generate.reference``: KL(policy || reference) of the response, k1 summed over its tokens, sum(logp_policy -
logp_ref) at the rollout temperature, both log-probs from frozen ``ReferencePolicy`` groups of
``strategy.num_workers`` workers.

Writes ``<run_uri>/<stage>/data.<output_format>`` committed by its manifest (``rlhf_core.data.datasets``) and
``<run_uri>/<stage>/metrics.json``.

    python -m rlhf_core.jobs.generate --config PRESET generate.rollout.backend=hf generate.rollout.max_new_tokens=64
"""

from __future__ import annotations

import shutil
from typing import Any

import torch

from rlhf_core import run_layout
from rlhf_core.algos.accuracy import mean_and_se
from rlhf_core.config import ConfigError, GenerateConfig, PipelineConfig
from rlhf_core.data.datasets import write_dataset
from rlhf_core.data.examples import prompt_examples
from rlhf_core.distributed.cluster import Cluster, RayCluster, WorkerGroup
from rlhf_core.distributed.placement import engine_kwargs, generate_groups
from rlhf_core.jobs import input_checks, process, stage_setup
from rlhf_core.models.builders import load_tokenizer, stop_ids
from rlhf_core.rewards import call_gold, load_gold
from rlhf_core.types import CheckpointRef

KIND = "generate"
KL_MICRO_BATCH = 16  # rows per forward of the KL log-prob workers


def check_fits(stage: str, g: GenerateConfig, available: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """Refuse what the Ray cluster cannot place, naming the keys, before any actor starts."""
    from rlhf_core.distributed.launcher import check_resources

    groups = generate_groups(stage, g)
    check_resources({k: v for k, v in groups.items() if v[0] and v[2]}, nodes)
    cpus = sum(n * c for n, c, _ in groups.values())
    if cpus > available.get("CPU", 0):
        raise ConfigError(
            f"{stage}: the engines and log-prob workers need {cpus:g} CPUs but the Ray cluster has "
            f"{available.get('CPU', 0):g}; lower '{stage}.rollout.num_engines', '{stage}.rollout.cpus_per_engine' "
            f"or '{stage}.strategy.num_workers'"
        )


def kl_to_reference(
    st: stage_setup.StageSetup,
    g: GenerateConfig,
    prompt_ids: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    groups: tuple[WorkerGroup[Any], WorkerGroup[Any]],
    cluster: Cluster,
) -> list[float]:
    """Per response, sum over its tokens of logp_policy - logp_ref (k1), at the rollout temperature."""
    from rlhf_core.algos.batching import make_sequences
    from rlhf_core.distributed.reference import ReferencePolicy

    policy, reference = groups
    workers = len(policy)
    n = len(responses) // len(prompt_ids)
    expanded = [ids for ids in prompt_ids for _ in range(n)]
    extra = (-len(responses)) % workers  # every worker gets as many rows: repeat the first, dropped after
    seq = make_sequences(expanded + expanded[:1] * extra, responses + responses[:1] * extra, pad_id)
    refs = {
        "policy": policy.call_each_async(ReferencePolicy.logprobs, seq.shard(workers)),
        "reference": reference.call_each_async(ReferencePolicy.logprobs, seq.shard(workers)),
    }
    out = {name: torch.cat(cluster.wait(r)) for name, r in refs.items()}
    mask = seq.action_mask.to(out["policy"].dtype)
    return ((out["policy"] - out["reference"]) * mask).sum(1)[: len(responses)].tolist()


def logprob_groups(
    st: stage_setup.StageSetup, g: GenerateConfig, cluster: Cluster
) -> tuple[WorkerGroup[Any], WorkerGroup[Any]]:
    """Two frozen ``ReferencePolicy`` groups of ``strategy.num_workers``: the policy's and the reference's (they
    start in the background while the engines generate)."""
    from rlhf_core.distributed.reference import ReferencePolicy

    assert g.reference is not None
    made = []
    for role, model in (("model", g.model), ("reference", g.reference)):
        group = cluster.group(
            g.strategy,
            ReferencePolicy,
            st.sources[role],
            KL_MICRO_BATCH,
            g.strategy.precision,
            model.init_seed,
            temperature=g.rollout.temperature,
            tokenizer_path=model.tokenizer,
            trust_remote_code=model.trust_remote_code,
            packing=g.strategy.packing,
            name=f"logprobs_{role}",
        )
        made.append(group)
    return made[0], made[1]


def run(cfg: PipelineConfig, stage: str = KIND, cluster: Cluster | None = None) -> CheckpointRef:
    """The stage on ``cluster`` (default: Ray)."""
    from rlhf_core.distributed.rollout.engine import SamplingConfig

    cluster = RayCluster() if cluster is None else cluster
    # 1. inputs: config hash (with upstream hashes), finished output, then the models
    g: GenerateConfig = cfg.stage(stage)
    models = {"model": g.model, **({"reference": g.reference} if g.reference is not None else {})}
    gold = load_gold(g.gold_reward, f"{stage}.gold_reward")
    st = stage_setup.setup_stage(cfg, stage, models)
    if st.done is not None:
        return st.done
    g = st.section
    r = g.rollout
    engines: Any = None
    groups: tuple[WorkerGroup[Any], WorkerGroup[Any]] | None = None
    started = False
    try:
        # 2. prompts, checked before any actor starts
        tokenizer = load_tokenizer(st.model_path, g.model.tokenizer, trust_remote_code=g.model.trust_remote_code)
        prompts = prompt_examples(g.data, tokenizer, "train", st.store.fs.storage_options)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stops = stop_ids(st.model_path, tokenizer)  # a response ending on one of them stopped; else it hit the length

        # 3. engines (and the log-prob groups), then sampling
        demand = sum(n * c for n, c, _ in generate_groups(stage, g).values())
        cluster.start(min_cpus=demand)
        started = True
        device = cluster.device(g.strategy.device)
        input_checks.check_engine_backend(f"{stage}.rollout.backend", r.backend, device, st.model_path)
        check_fits(stage, g, cluster.resources(), cluster.nodes())
        kwargs = engine_kwargs(r, g.model, g.strategy.precision, device, g.seed, g.data.max_len)
        engines = cluster.engines(
            r.num_engines,
            stage_setup.engine_model(st, "model", g.rollout.backend, g.model.init_seed, tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            backend=r.backend,
            resources=r.resources,
            tensor_parallel_size=r.tensor_parallel_size,
            num_cpus_per_engine=r.cpus_per_engine,
            **kwargs,
        )
        if g.reference is not None:
            groups = logprob_groups(st, g, cluster)
        engines.wait_ready()
        prompt_ids = [e["prompt_ids"] for e in prompts]
        sampling = SamplingConfig(
            n=r.n_samples_per_prompt,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            seed=g.seed,
            seed_per_prompt=r.seeds_each_prompt(device),
        )
        responses = engines.generate(prompt_ids, sampling)
        n = r.n_samples_per_prompt
        if len(responses) != n * len(prompts):
            raise RuntimeError(f"the engines returned {len(responses)} responses for {len(prompts)} prompts x {n}")
        engines.shutdown()
        engines = None
        kl = kl_to_reference(st, g, prompt_ids, responses, pad_id, groups, cluster) if groups is not None else None

        # 4. rows, metrics, commit
        rows, label_key = [], g.data.label_key
        texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in responses]
        golds = None  # each row's gold reward, in one call (its label with it)
        if gold is not None:
            labels = [prompts[k // n]["label"] for k in range(len(texts))] if label_key is not None else None
            golds = call_gold(gold, [prompts[k // n]["prompt"] for k in range(len(texts))], texts, labels)
        for k, tokens in enumerate(responses):
            i, j = divmod(k, n)
            row = {
                "prompt": prompts[i]["prompt"],
                "response": texts[k],
                "prompt_index": i,
                "sample_index": j,
                "response_tokens": len(tokens),
                "finish_reason": "stop" if tokens and tokens[-1] in stops else "length",
            }
            if label_key is not None:  # the prompt's label, under its own key, for a score stage to pass on
                row[label_key] = prompts[i]["label"]
            if golds is not None:
                row["gold_reward"] = golds[k]
            if kl is not None:
                row["kl_to_ref"] = kl[k]
            rows.append(row)
        metrics: dict[str, Any] = {
            "prompts": len(prompts),
            "responses": len(rows),
            "responses_per_prompt": len(rows) / len(prompts),
            "response_tokens_mean": sum(row["response_tokens"] for row in rows) / len(rows),
            "truncated": sum(row["finish_reason"] == "length" for row in rows) / len(rows),
        }
        if gold is not None:
            # the standard error of the mean (for a 0/1 verifier as gold: the accuracy's)
            metrics["gold_reward"], metrics["gold_reward_se"] = mean_and_se([row["gold_reward"] for row in rows])
        if kl is not None:
            metrics["kl_to_ref"] = sum(kl) / len(kl)
        write_dataset(
            st.store,
            stage,
            rows,
            g.output_format,
            config_hash=st.config_hash,
            metrics=metrics,
            extra={"upstream": st.upstream, "backend": r.backend},
        )
        st.store.write_json(run_layout.metrics(stage), {"final": metrics})
    finally:
        if engines is not None:
            engines.shutdown()
        for group in groups or ():
            group.shutdown()
        if started:
            cluster.stop()
        shutil.rmtree(st.work, ignore_errors=True)
    print(f"[{stage}] {len(rows)} responses to {len(prompts)} prompts", flush=True)
    return CheckpointRef(st.store.uri(stage), stage, 0, st.config_hash, metrics)


if __name__ == "__main__":
    process.main(KIND, run)
