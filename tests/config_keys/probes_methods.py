"""Probes of the dpo, kto, generate and score kinds, on their own preset (``harness.METHODS``), mostly without Ray:
their jobs run on this process as the cluster (``fakes.RecordingCluster``) with their worker groups local, the test
session's resources and the rollout engines recorded; a DPO/KTO job's training group is replaced by its first step on
the policy (``fakes.first_step``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhf_core.config import PipelineConfig
from rlhf_core.data.datasets import read_dataset
from rlhf_core.run_layout import open_store
from tests.config_keys.fakes import RecordingCluster
from tests.config_keys.harness import DATA, Probe, close, content_key, job_module, outcome, probe
from tests.config_keys.probes_ppo import PROMPT_ROWS, PROMPT_SPLITS, QUESTIONS, REWARD_FNS
from tests.config_keys.probes_training import (
    PREFERENCE_KEYS,
    TRAINING_SECTION,
    data_probes,
    group_report,
    train_examples,
)

# ---------------------------------------------------------------------------------------------------------------------
# Observers of the dpo, kto, generate and score jobs run in this process (fakes.RecordingCluster)


_IN_PROCESS: dict[str, Any] = {}


def in_process_job(cfg: PipelineConfig, stage: str) -> Any:
    """The stage's job (dpo / kto / generate / score .run) on a ``RecordingCluster``, once per distinct config: the
    CPUs it asks its cluster for, its worker groups, the engines it starts and what it gives them, and what it commits
    (a dataset's file and rows; the DPO/KTO first step and reference_logprobs/), with its metrics."""
    key = content_key(cfg, stage)
    if key not in _IN_PROCESS:

        def run():
            cluster = RecordingCluster()
            ref = job_module(cfg, stage).run(cfg, stage, cluster=cluster)
            record = cluster.record
            store = open_store(cfg)
            out = {
                "init_ray": record["init_ray"],
                "groups": [g.record for g in record["groups"]],
                "strategies": [g.cfg for g in record["groups"]],
                "engines": record["engines"],
                "generate": record["generate"],
                "metrics": ref.metrics,
            }
            if cfg.kind(stage) in ("dpo", "kto"):
                out["reference_logprobs"] = store.is_complete(f"{stage}/{preference_rel()}")
            else:
                out["file"] = store.read_manifest(stage, verify=False).extra["dataset"]
                out["rows"] = read_dataset(store, stage)
            return out

        _IN_PROCESS[key] = outcome(run)
    return _IN_PROCESS[key]


def preference_rel() -> str:
    from rlhf_core.run_layout import REFERENCE_LOGPROBS

    return REFERENCE_LOGPROBS


def in_process_part(*path: str | int, doc: str):
    """An observer of one part of ``in_process_job`` (the whole outcome when the job raised)."""

    def observe(cfg: PipelineConfig, stage: str) -> Any:
        out = in_process_job(cfg, stage)
        if isinstance(out, tuple):  # ("raised", ...)
            return out
        for part in path:
            out = out[part]
        return out

    observe.__name__ = "in_process_job:" + ".".join(map(str, path))
    observe.__doc__ = doc
    return observe


first_step_of = in_process_part(
    "metrics", doc="dpo/kto run in-process: the first step's loss, metrics, reference and forwards (first_step)."
)
job_output = in_process_part("rows", doc="The rows the job committed as its dataset (read back, verified).")
job_file = in_process_part("file", doc="The dataset file the job committed.")


def job_workers(cfg: PipelineConfig, stage: str) -> Any:
    """A real Ray group started with the strategy the job (run in this process) gave its worker groups: what each rank
    got."""
    out = in_process_job(cfg, stage)
    return out if isinstance(out, tuple) else group_report(out["strategies"][0])


# ---------------------------------------------------------------------------------------------------------------------
# The table: dpo and kto (TRAINING_SECTION, the preference data probes, their losses), generate, score


def _raised_then_ran(a: Any, b: Any) -> bool:
    return a[0] == "raised" and isinstance(b, dict)


KTO_ROWS = f"{DATA / 'kto_unpaired.jsonl'}"  # pairs (chosen/rejected) and unpaired rows (response, answer, label)
# KTO makes two examples of a pair: half the pairs give the job runs' 96 examples (6 steps, as JOB_BASE's 96 pairs)
KTO_JOB = ("{stage}.data.max_samples=48",)
# The score stage's reward from a function (the response's length) instead of its reward model
SCORE_BY_LENGTH = ("{stage}.reward=null", "{stage}.reward_fn=tests/data/config_keys/reward_fn.py:response_length")


def _preference_section(kind: str) -> dict[str, Probe]:
    """What dpo and kto share: TRAINING_SECTION, the preference data probes, the reference and ref_logprobs."""
    out = {**TRAINING_SECTION, **data_probes("pref", PREFERENCE_KEYS)}
    if kind == "kto":
        for key in ("train.save_steps", "train.keep_last", "train.log_steps", "train.eval_batch_size"):
            out[key] = dataclasses.replace(out[key], base=out[key].base + KTO_JOB)
    out |= {
        "reference.name_or_path": probe("{stage}.reference.name_or_path=builtin:small", observe=first_step_of),
        "reference.tokenizer": probe("{stage}.reference.tokenizer={alt_tokenizer}", observe=first_step_of),
        "reference.init_seed": probe("{stage}.reference.init_seed=2", observe=first_step_of),
        "reference.trust_remote_code": probe(
            "{stage}.reference.trust_remote_code=true",
            observe=first_step_of,
            base=("{stage}.reference.name_or_path={remote_code_model}",),
            expect=_raised_then_ran,
        ),
        "ref_logprobs": probe(  # the same numbers, from an online copy on the rank instead of reference_logprobs/
            "{stage}.ref_logprobs=online",
            observe=in_process_part(
                doc="dpo/kto run in-process: reference_logprobs/ committed, the first step's loss and reference."
            ),
            expect=lambda a, b: (
                a["reference_logprobs"]
                and not b["reference_logprobs"]
                and len(a["groups"]) == 1  # the preset's reference is another model: a ReferencePolicy group
                and not b["groups"]
                and (a["metrics"]["online_reference"], b["metrics"]["online_reference"]) == (False, True)
                and close(a["metrics"]["loss"], b["metrics"]["loss"])
            ),
        ),
        "beta": probe(
            "{stage}.beta=0.2",
            observe=first_step_of,
            expect=lambda a, b: close(2 * a["step_metrics"]["chosen_reward"], b["step_metrics"]["chosen_reward"]),
        ),
    }
    return out


DPO_SECTION = {
    **_preference_section("dpo"),
    # the implicit rewards stay, the loss of them changes
    "loss_type": probe(
        "{stage}.loss_type=ipo",
        observe=first_step_of,
        expect=lambda a, b: a["step_metrics"] == b["step_metrics"] and a["loss"] != b["loss"],
    ),
    "label_smoothing": probe(
        "{stage}.label_smoothing=0.2",
        observe=first_step_of,
        expect=lambda a, b: a["step_metrics"] == b["step_metrics"] and a["loss"] != b["loss"],
    ),
    "nll_loss_coef": probe(
        "{stage}.nll_loss_coef=1.0",
        observe=first_step_of,
        expect=lambda a, b: "nll" not in a["step_metrics"] and close(b["loss"], a["loss"] + b["step_metrics"]["nll"]),
    ),
}
KTO_SECTION = {
    **_preference_section("kto"),
    "data.label_key": probe(  # the same file: 8 pairs (16 examples) -> 8 labelled rows
        "{stage}.data.label_key=label",
        observe=train_examples,
        base=(f"{{stage}}.data.train_path={KTO_ROWS}",),
        expect=lambda a, b: len(a) == 16 and [e["desirable"] for e in b] == [True, False] * 4,
    ),
    "data.response_key": probe(
        "{stage}.data.response_key=answer",
        observe=train_examples,
        base=(f"{{stage}}.data.train_path={KTO_ROWS}", "{stage}.data.label_key=label"),
    ),
    "desirable_weight": probe(
        "{stage}.desirable_weight=2.0", observe=first_step_of, expect=lambda a, b: b["loss"] > a["loss"]
    ),
    "undesirable_weight": probe(
        "{stage}.undesirable_weight=2.0", observe=first_step_of, expect=lambda a, b: b["loss"] > a["loss"]
    ),
}

# generate: the HF engines, two samples per prompt of 8 tokens at most, and a reference (KL to it: log-prob groups)
GENERATE_BASE = (
    "{stage}.rollout.backend=hf",
    "{stage}.rollout.max_new_tokens=8",
    "{stage}.rollout.n_samples_per_prompt=2",
    "{stage}.reference.name_or_path=builtin:tiny",
    "{stage}.reference.init_seed=1",
)
VLLM = ("{stage}.rollout.backend=vllm",)
engines_asked = in_process_part("engines", 0, doc="The engines generate starts (EngineGroup.create's arguments).")
engine_kwargs_of = in_process_part("engines", 0, "kwargs", doc="The constructor kwargs generate gives its engines.")
sampling_of = in_process_part("generate", 0, "sampling", doc="The SamplingConfig generate gives its engines.")
prompts_of = in_process_part("generate", 0, "prompt_ids", doc="The prompts (token ids) generate gives its engines.")
kl_groups = in_process_part("groups", doc="generate's log-prob groups (policy, reference): what each got, computed.")
cpus_asked = in_process_part("init_ray", doc="The CPUs the job asks its cluster for (cluster.start(min_cpus)).")


def _kl(rows: Any) -> Any:
    return rows if isinstance(rows, tuple) else [r["kl_to_ref"] for r in rows]


def kl_to_ref(cfg: PipelineConfig, stage: str) -> Any:
    """The kl_to_ref of each row generate committed (its log-prob groups on the fixed responses)."""
    return _kl(job_output(cfg, stage))


# What generate's log-prob groups and score's reward-model workers were given, from a real job run (slow)
FROZEN_WORKERS: dict[str, Probe] = {
    "strategy.threads_per_worker": probe(
        "{stage}.strategy.threads_per_worker=2",
        observe=job_workers,
        slow=True,
        expect=lambda a, b: b[0]["torch_threads"] == 2,
    ),
    "strategy.resources": probe(
        "{stage}.strategy.resources={{probe_node: 2}}",
        observe=job_workers,
        slow=True,
        expect=lambda a, b: a[0]["custom"] == {} and b[0]["custom"] == {"probe_node": 2.0},
    ),
}

GENERATE_SECTION: dict[str, Probe] = {
    "model.name_or_path": probe(
        "{stage}.model.name_or_path=builtin:small",
        observe=engines_asked,
        expect=lambda a, b: b["model"] == "builtin:small",
    ),
    "model.tokenizer": probe(
        "{stage}.model.tokenizer={alt_tokenizer}", observe=engine_kwargs_of, expect=lambda a, b: b["tokenizer"]
    ),
    "model.init_seed": probe(  # the HF engines build a builtin: policy; for vLLM it is built and saved first
        "{stage}.model.init_seed=1", observe=engines_asked, expect=lambda a, b: b["kwargs"]["init_seed"] == 1
    ),
    "model.trust_remote_code": probe(
        "{stage}.model.trust_remote_code=true",
        observe=in_process_part(doc="generate run in-process."),
        base=("{stage}.model.name_or_path={remote_code_model}",),
        expect=lambda a, b: _raised_then_ran(a, b) and b["engines"][0]["kwargs"]["trust_remote_code"],
    ),
    "data.train_path": probe(f"{{stage}}.data.train_path={PROMPT_ROWS}", observe=job_output),
    "data.train_split": probe(
        "{stage}.data.train_split=dev", observe=job_output, base=(f"{{stage}}.data.train_path={PROMPT_SPLITS}",)
    ),
    "data.max_len": probe(  # vLLM's context: prompt plus response
        "{stage}.data.max_len=24",
        observe=engine_kwargs_of,
        base=VLLM,
        expect=lambda a, b: a["max_model_len"] - b["max_model_len"] == 8,
    ),
    "data.max_samples": probe(
        "{stage}.data.max_samples=2", observe=job_output, expect=lambda a, b: 2 * len(b) == len(a) == 8
    ),
    "data.input_key": probe(
        "{stage}.data.input_key=question", observe=job_output, base=(f"{{stage}}.data.train_path={PROMPT_ROWS}",)
    ),
    "data.label_key": probe(  # each prompt's question, copied to each of its response rows
        "{stage}.data.label_key=question",
        observe=job_output,
        base=(f"{{stage}}.data.train_path={PROMPT_ROWS}",),
        expect=lambda a, b: (
            "question" not in a[0]
            and len(b) == 8
            and [r["question"] for r in b] == [QUESTIONS[r["prompt"]] for r in b]
        ),
    ),
    "data.input_template": probe("{stage}.data.input_template='Q: {{}} A:'", observe=prompts_of),
    "data.prompt_template": probe("{stage}.data.prompt_template='Q: {{}} A:'", observe=prompts_of),
    "data.apply_chat_template": probe("{stage}.data.apply_chat_template=false", observe=prompts_of),
    "reference.name_or_path": probe("{stage}.reference.name_or_path=builtin:small", observe=kl_to_ref),
    "reference.tokenizer": probe("{stage}.reference.tokenizer={alt_tokenizer}", observe=kl_to_ref),
    "reference.init_seed": probe("{stage}.reference.init_seed=2", observe=kl_to_ref),
    "reference.trust_remote_code": probe(
        "{stage}.reference.trust_remote_code=true",
        observe=kl_to_ref,
        base=("{stage}.reference.name_or_path={remote_code_model}",),
        expect=lambda a, b: a[0] == "raised" and isinstance(b, list),
    ),
    "strategy.num_workers": probe(
        "{stage}.strategy.num_workers=2",
        observe=kl_groups,
        expect=lambda a, b: [g["shards"] for g in a] == [[[8]]] * 2 and [g["shards"] for g in b] == [[[4, 4]]] * 2,
    ),
    "strategy.precision": probe(
        "{stage}.strategy.precision=bf16", observe=engine_kwargs_of, expect=lambda a, b: b["dtype"] == "bfloat16"
    ),
    "strategy.device": probe(  # the workers' device; vLLM without CUDA graphs on the CPU only
        "{stage}.strategy.device=cuda",
        observe=in_process_part(doc="generate run in-process."),
        base=VLLM,
        expect=lambda a, b: (
            {g["device"] for g in b["groups"]} == {"cuda"}
            and (a["engines"][0]["kwargs"]["enforce_eager"], b["engines"][0]["kwargs"]["enforce_eager"])
            == (True, False)
        ),
    ),
    "strategy.cpus_per_worker": probe(
        "{stage}.strategy.cpus_per_worker=2.0", observe=cpus_asked, expect=lambda a, b: b[0] - a[0] == 2 * 1.0
    ),
    **FROZEN_WORKERS,
    "strategy.packing": probe(
        "{stage}.strategy.packing=false",
        observe=kl_groups,
        expect=lambda a, b: (
            all(p for g in a for _, p in g["forwards"]) and not any(p for g in b for _, p in g["forwards"])
        ),
    ),
    "rollout.backend": probe(
        "{stage}.rollout.backend=vllm",
        observe=engines_asked,
        expect=lambda a, b: (a["backend"], b["backend"]) == ("hf", "vllm"),
    ),
    "rollout.num_engines": probe(
        "{stage}.rollout.num_engines=2",
        observe=in_process_part(doc="generate run in-process."),
        expect=lambda a, b: b["engines"][0]["count"] == 2 and b["init_ray"][0] == a["init_ray"][0] + 1,
    ),
    "rollout.tensor_parallel_size": probe(
        "{stage}.rollout.tensor_parallel_size=2", observe=engines_asked, base=VLLM, expect=lambda a, b: b["tp"] == 2
    ),
    "rollout.cpus_per_engine": probe(
        "{stage}.rollout.cpus_per_engine=2.0", observe=cpus_asked, expect=lambda a, b: b[0] == a[0] + 1
    ),
    "rollout.kv_cache_gib": probe(
        "{stage}.rollout.kv_cache_gib=2",
        observe=engine_kwargs_of,
        base=VLLM,
        expect=lambda a, b: b["kv_cache_gib"] == 2,
    ),
    "rollout.gpu_memory_utilization": probe(
        "{stage}.rollout.gpu_memory_utilization=0.4",
        observe=engine_kwargs_of,
        base=VLLM,
        expect=lambda a, b: b["gpu_memory_utilization"] == 0.4,
    ),
    "rollout.enforce_eager": probe(
        "{stage}.rollout.enforce_eager=false",
        observe=engine_kwargs_of,
        base=VLLM,
        expect=lambda a, b: (a["enforce_eager"], b["enforce_eager"]) == (True, False),
    ),
    "rollout.resources": probe(
        "{stage}.rollout.resources={{probe_node: 1}}",
        observe=engines_asked,
        expect=lambda a, b: (a["resources"], b["resources"]) == ({}, {"probe_node": 1.0}),
    ),
    "rollout.n_samples_per_prompt": probe(
        "{stage}.rollout.n_samples_per_prompt=3", observe=job_output, expect=lambda a, b: 2 * len(b) == 3 * len(a)
    ),
    "rollout.temperature": probe(  # the engines sample at it, the log-prob groups divide the logits by it
        "{stage}.rollout.temperature=0.5",
        observe=in_process_part(doc="generate run in-process."),
        expect=lambda a, b: b["generate"][0]["sampling"]["temperature"] == 0.5 and _kl(a["rows"]) != _kl(b["rows"]),
    ),
    "rollout.top_p": probe("{stage}.rollout.top_p=0.5", observe=sampling_of, expect=lambda a, b: b["top_p"] == 0.5),
    "rollout.seed_per_prompt": probe(  # null on this CPU machine: per prompt
        "{stage}.rollout.seed_per_prompt=false",
        observe=sampling_of,
        expect=lambda a, b: (a["seed_per_prompt"], b["seed_per_prompt"]) == (True, False),
    ),
    "rollout.max_new_tokens": probe(
        "{stage}.rollout.max_new_tokens=4", observe=sampling_of, expect=lambda a, b: b["max_new_tokens"] == 4
    ),
    "seed": probe(
        "{stage}.seed=7",
        observe=in_process_part(doc="generate run in-process."),
        expect=lambda a, b: b["generate"][0]["sampling"]["seed"] == 7 == b["engines"][0]["kwargs"]["seed"],
    ),
    "gold_reward": probe(
        "{stage}.gold_reward=rlhf_core.data.synthetic:gold_reward",
        observe=job_output,
        expect=lambda a, b: "gold_reward" not in a[0] and all(isinstance(r["gold_reward"], float) for r in b),
    ),
    "output_format": probe(
        "{stage}.output_format=parquet", observe=job_file, expect=lambda a, b: (a, b) == ("data.jsonl", "data.parquet")
    ),
}

# score: the rows of 4 prompts x 3 responses; scored by builtin:tiny as a reward model, or by their length
SCORED_ROWS = DATA / "generated_splits"
scores_of = in_process_part("rows", doc="The rows score committed: each with its score (select all).")
scorer_groups = in_process_part("groups", doc="score's reward-model group: what it got, its forwards.")


def scores(cfg: PipelineConfig, stage: str) -> Any:
    """The score of each row score committed (select all)."""
    rows = scores_of(cfg, stage)
    return rows if isinstance(rows, tuple) else [round(r["score"], 5) for r in rows]


SCORE_SECTION: dict[str, Probe] = {
    "data.train_path": probe(f"{{stage}}.data.train_path={SCORED_ROWS / 'train.jsonl'}", observe=scores_of),
    "data.train_split": probe(
        "{stage}.data.train_split=dev", observe=scores_of, base=(f"{{stage}}.data.train_path={SCORED_ROWS}",)
    ),
    "data.max_len": probe("{stage}.data.max_len=16", observe=scores),
    "data.max_samples": probe(
        "{stage}.data.max_samples=6", observe=scores_of, expect=lambda a, b: (len(a), len(b)) == (12, 6)
    ),
    "data.prompt_key": probe("{stage}.data.prompt_key=query", observe=scores_of),
    "data.response_key": probe("{stage}.data.response_key=answer", observe=scores_of),
    "data.label_key": probe(  # each row's answer reaches the reward function as its label
        "{stage}.data.label_key=answer",
        observe=scores_of,
        base=("{stage}.reward=null", f"{{stage}}.reward_fn={REWARD_FNS}:label_length"),
        expect=lambda a, b: (
            {r["score"] for r in a} == {0.0} and [r["score"] for r in b] == [float(len(r["answer"])) for r in b]
        ),
    ),
    "data.input_template": probe("{stage}.data.input_template='Q: {{}} A:'", observe=scores),
    "data.prompt_template": probe("{stage}.data.prompt_template='Q: {{}} A:'", observe=scores),
    "data.apply_chat_template": probe("{stage}.data.apply_chat_template=false", observe=scores),
    "reward.name_or_path": probe("{stage}.reward.name_or_path={rm_seed1}", observe=scores),
    "reward.tokenizer": probe("{stage}.reward.tokenizer={alt_tokenizer}", observe=scores),
    "reward.init_seed": probe("{stage}.reward.init_seed=1", observe=scores),
    "reward.trust_remote_code": probe(
        "{stage}.reward.trust_remote_code=true",
        observe=scores,
        base=("{stage}.reward.name_or_path={remote_code_rm}",),
        expect=lambda a, b: a[0] == "raised" and isinstance(b, list),
    ),
    "reward_fn": probe(
        *SCORE_BY_LENGTH,
        observe=in_process_part(doc="score run in-process."),
        expect=lambda a, b: (
            not b["groups"] and [r["score"] for r in b["rows"]] == [len(r["response"]) for r in b["rows"]]
        ),
    ),
    "strategy.num_workers": probe(
        "{stage}.strategy.num_workers=2",
        observe=scorer_groups,
        expect=lambda a, b: (a[0]["shards"], b[0]["shards"]) == ([[12]], [[6, 6]]),
    ),
    "strategy.precision": probe("{stage}.strategy.precision=fp32", observe=scores),
    "strategy.device": probe(
        "{stage}.strategy.device=cuda", observe=scorer_groups, expect=lambda a, b: b[0]["device"] == "cuda"
    ),
    "strategy.cpus_per_worker": probe(
        "{stage}.strategy.cpus_per_worker=0.5", observe=cpus_asked, expect=lambda a, b: (a, b) == ([1.0], [0.5])
    ),
    **FROZEN_WORKERS,
    "strategy.packing": probe(
        "{stage}.strategy.packing=false",
        observe=scorer_groups,
        expect=lambda a, b: all(p for _, p in a[0]["forwards"]) and not any(p for _, p in b[0]["forwards"]),
    ),
    "micro_batch_size": probe(
        "{stage}.micro_batch_size=4",
        observe=scorer_groups,
        expect=lambda a, b: len(a[0]["forwards"]) == 1 and len(b[0]["forwards"]) == 3,
    ),
    "select": probe(  # the longest response of each of the 4 prompts
        "{stage}.select=best",
        observe=scores_of,
        base=SCORE_BY_LENGTH,
        expect=lambda a, b: len(b) == 4 and all("lovely" in r["response"] for r in b),
    ),
    "threshold": probe(  # the best responses are 32 to 35 characters long
        "{stage}.threshold=34",
        observe=in_process_part("metrics", doc="score's metrics."),
        base=(*SCORE_BY_LENGTH, "{stage}.select=best"),
        expect=lambda a, b: (a["prompts_dropped"], b["prompts_dropped"]) == (0, 2),
    ),
    "output_format": probe(
        "{stage}.output_format=parquet", observe=job_file, expect=lambda a, b: (a, b) == ("data.jsonl", "data.parquet")
    ),
}
