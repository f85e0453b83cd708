"""Score stage: score (prompt, response) rows with a reward model or a reward function, then keep all of them, the
best response per prompt (best-of-n, rejection sampling) or a (best, worst) pair per prompt (iterative DPO).

Reads ``score.data.train_path`` (usually ``stage:<generate stage>``; ``prompt_key``, ``response_key``,
``max_samples``). The scores are either a reward model's (``score.reward``: raw scores of rendered prompt +
response + EOS, tokenized as the reward-model stage trained it, on a Ray group of ``score.strategy.num_workers``
``RewardScorer`` workers, ``micro_batch_size`` rows per forward) or a function's (``score.reward_fn``:
``module:function`` or ``path/to/file.py:function``, relative to the working directory, called once as
``fn(prompts, responses)`` -> one finite float per row; e.g. ``rlhf_core/assets/reward_fns/gold.py:gold_rewards``).

Writes ``<run_uri>/<stage>/data.<output_format>`` committed by its manifest (``rlhf_core.data.datasets``) and
``<run_uri>/<stage>/metrics.json``. Selection: ``rlhf_core.data.selection``.

    python -m rlhf_core.jobs.score --config PRESET score.select=pairs
"""

from __future__ import annotations

import shutil
from typing import Any

from rlhf_core import run_layout
from rlhf_core.config import ConfigError, PipelineConfig, ScoreConfig
from rlhf_core.data.datasets import write_dataset
from rlhf_core.data.examples import encode, render_prompt
from rlhf_core.data.loading import DataError, load_rows, require_keys
from rlhf_core.data.selection import select_all, select_best, select_pairs, selection_metrics
from rlhf_core.distributed.cluster import Cluster, RayCluster
from rlhf_core.jobs import process, stage_setup
from rlhf_core.rewards import Columns, call_reward_fn, load_reward_fn
from rlhf_core.types import CheckpointRef

KIND = "score"


# ---------------------------------------------------------------------------------------------------------------------
# Rows and reward-model scores


def load_scored_rows(s: ScoreConfig, stage: str, storage_options: dict | None) -> list[dict]:
    """The rows to score (``max_samples`` of them), each with a usable prompt and a string response (possibly
    empty: a sampled response can be); a DataError naming the file and row otherwise."""
    d = s.data
    if d.prompt_key is None:
        raise ConfigError(f"'{stage}.data.prompt_key' is null: the score stage needs a prompt key")
    source = d.train_path
    rows = load_rows(source, split=d.train_split, storage_options=storage_options, max_rows=d.max_samples)
    require_keys(rows, [d.prompt_key], source)
    if d.label_key is not None:
        require_keys(rows, [d.label_key], source, {d.label_key: "label"})
    for i, row in enumerate(rows, start=1):
        if d.response_key not in row:
            present = ", ".join(map(str, row)) or "none"
            raise DataError(f"missing (row has keys: {present})", source=source, row=i, key=d.response_key)
        if not isinstance(row[d.response_key], str):
            kind = type(row[d.response_key]).__name__
            raise DataError(f"value is not a string (got {kind})", source=source, row=i, key=d.response_key)
    return rows


def row_columns(rows: list[dict], s: ScoreConfig, stage: str) -> Columns:
    """What the reward function may take of each row besides its prompt and response: ``data.label_key``'s value as
    its label, and the other columns by name."""
    d = s.data
    skip = {d.prompt_key, d.response_key}
    examples = [
        {"columns": {k: v for k, v in row.items() if k not in skip}}
        | ({"label": row[d.label_key]} if d.label_key is not None else {})
        for row in rows
    ]
    return Columns.of(examples, f"{stage}.data.label_key")


def reward_model_scores(st: stage_setup.StageSetup, rows: list[dict], cluster: Cluster) -> list[float]:
    """Raw reward-model scores of rendered prompt + response + EOS (``encode``, as the reward-model stage trains),
    on ``strategy.num_workers`` ``RewardScorer`` workers of ``cluster``."""
    from rlhf_core.algos.batching import make_sequences
    from rlhf_core.distributed.launcher import check_resources
    from rlhf_core.distributed.reward import RewardScorer
    from rlhf_core.models.builders import load_tokenizer

    s: ScoreConfig = st.section
    assert s.reward is not None
    d = s.data
    tokenizer = load_tokenizer(st.paths["reward"], s.reward.tokenizer, trust_remote_code=s.reward.trust_remote_code)
    prompts, responses = [], []
    for i, row in enumerate(rows, start=1):
        text = render_prompt(row[d.prompt_key], tokenizer, d)
        ids, prompt_len = encode(tokenizer, text, row[d.response_key], d.max_len, f"{d.train_path} row {i}")
        prompts.append(ids[:prompt_len])
        responses.append(ids[prompt_len:])
    workers = s.strategy.num_workers
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    cpus = workers * s.strategy.cpus_per_worker
    cluster.start(min_cpus=cpus)
    group = None
    try:
        if s.strategy.resources:
            check_resources(
                {f"{st.stage}.strategy.resources": (workers, s.strategy.cpus_per_worker, s.strategy.resources)},
                cluster.nodes(),
            )
        have = cluster.resources().get("CPU", 0)
        if cpus > have:
            raise ConfigError(
                f"'{st.stage}.strategy.num_workers' x cpus_per_worker = {cpus:g} CPUs, but the Ray cluster has "
                f"{have:g}"
            )
        group = cluster.group(
            s.strategy,
            RewardScorer,
            st.sources["reward"],
            s.micro_batch_size,
            s.strategy.precision,
            tokenizer_path=s.reward.tokenizer,
            init_seed=s.reward.init_seed,
            trust_remote_code=s.reward.trust_remote_code,
            packing=s.strategy.packing,
            name="reward",
        )
        ranks = len(group)
        extra = (-len(rows)) % ranks  # every rank gets as many rows: repeat the first, dropped after
        batch = make_sequences(prompts + prompts[:1] * extra, responses + responses[:1] * extra, pad_id)
        parts = group.call_each(RewardScorer.scores, batch.shard(ranks))
    finally:
        if group is not None:
            group.shutdown()
        cluster.stop()
    return [float(v) for part in parts for v in part.tolist()][: len(rows)]


# ---------------------------------------------------------------------------------------------------------------------
# Entry point


def select(s: ScoreConfig, stage: str, rows: list[dict], scores: list[float]) -> tuple[list[dict], dict[str, Any]]:
    """The output rows for ``s.select`` and the metrics; a clear error when nothing would be kept."""
    d = s.data
    assert d.prompt_key is not None
    dropped = 0
    if s.select == "all":
        out = select_all(rows, scores)
    elif s.select == "best":
        out, dropped = select_best(rows, scores, d.prompt_key, d.response_key, s.threshold)
        if not out:
            raise ConfigError(
                f"'{stage}.threshold' = {s.threshold} drops every prompt of {d.train_path} (best score "
                f"{max(scores):.4g}): lower it or set it to null"
            )
    else:
        out, dropped = select_pairs(rows, scores, d.prompt_key, d.response_key)
        if not out:
            raise DataError(
                "no prompt has two responses with different scores and texts: no pair to make (sample more "
                "responses per prompt, or use select=best)",
                source=d.train_path,
            )
    return out, selection_metrics(rows, scores, out, dropped, d.prompt_key, s.select)


def run(cfg: PipelineConfig, stage: str = KIND, cluster: Cluster | None = None) -> CheckpointRef:
    """The stage on ``cluster`` (default: Ray, started only for a reward model)."""
    # 1. inputs: the reward function (checked before anything starts), config hash, finished output, reward model
    s: ScoreConfig = cfg.stage(stage)
    fn = load_reward_fn(s.reward_fn, f"{stage}.reward_fn") if s.reward_fn is not None else None
    st = stage_setup.setup_stage(cfg, stage, {"reward": s.reward} if s.reward is not None else {})
    if st.done is not None:
        return st.done
    s = st.section  # stage:<name> data paths resolved to the committed file
    try:
        # 2. rows, checked before any worker starts
        rows = load_scored_rows(s, stage, st.store.fs.storage_options)
        # 3. scores
        if fn is not None:
            assert s.reward_fn is not None and s.data.prompt_key is not None
            prompts = [row[s.data.prompt_key] for row in rows]
            responses = [row[s.data.response_key] for row in rows]
            columns = row_columns(rows, s, stage)
            scores = call_reward_fn(fn, s.reward_fn, f"{stage}.reward_fn", prompts, responses, columns)
        else:
            scores = reward_model_scores(st, rows, RayCluster() if cluster is None else cluster)
        # 4. selection and commit
        out, metrics = select(s, stage, rows, scores)
        write_dataset(
            st.store,
            stage,
            out,
            s.output_format,
            config_hash=st.config_hash,
            metrics=metrics,
            extra={"upstream": st.upstream, "select": s.select, "scorer": "reward_fn" if fn else "reward_model"},
        )
        st.store.write_json(run_layout.metrics(stage), {"final": metrics})
    finally:
        if st.work:
            shutil.rmtree(st.work, ignore_errors=True)
    print(f"[{stage}] {metrics['rows_out']} of {metrics['rows_in']} rows kept (select={s.select})", flush=True)
    return CheckpointRef(st.store.uri(stage), stage, 0, st.config_hash, metrics)


if __name__ == "__main__":
    process.main(KIND, run)
