"""Method quality: per alignment method, the gold reward of the SFT policy and of the policy the method trains from it.

    python -m bench.quality [--methods dpo,kto,...] [--root DIR] [--keep]

Each method's tiny preset (``deployments/configs/tiny-<method>.yaml``; PPO: ``tiny.yaml``) runs as ``python -m
rlhf_core.jobs.pipeline`` runs it: each stage kind's ``run`` in ``cfg.order()``, in this process, on one local Ray
started for the whole benchmark, each preset in its own run folder ``<root>/<method>``. The presets share their
upstream: a stage that an earlier method's run already made with the same section from the same inputs (``sft``,
``eval_sft``, ``reward_model``, the loops' ``generate_1``) is copied into the folder first and then found complete
for the same config hash, so it is trained once (``run_preset``, which tests/jobs/test_methods_raise_gold.py can
share).

The ``grpo_*`` rows are tiny-grpo with a training option of its grpo stage turned on by overrides
(``Method.overrides``: async rollout, partial rollout, the engine's log-probs as the old ones, GSPO, the
engine-to-trainer IS correction, token-budget micro-batches): they take over the grpo row's sft, reward_model and
eval_sft, and train and evaluate their own grpo stage (its section differs from the grpo row's), so each option's
rise compares with the plain grpo row's on the same SFT policy.

Gold before: the SFT policy's gold reward (``eval_sft``: 256 responses to 128 held-out prompts, the task's gold rule;
standard error of the mean about 0.01); gold after: the same evaluation of the method's final policy
(``eval_<method>``, the loops' ``eval_2``), with its KL to the SFT policy where that evaluation measures it. PPO has
no evaluation stage: its numbers are the ppo stage's own evaluation before and after training (64 held-out prompts,
one response each, 16 new tokens) of tiny.yaml's own SFT policy, so they are not on the same footing as the others.
Seconds: the method's own stages (all but ``sft`` and ``eval_sft``); a stage copied from an earlier run counts with
the seconds it took there, a stage found complete in a folder left by an earlier ``--keep`` run with the seconds it
takes to find it.

The real-model rows (``REAL_MODEL``: SmolLM2-135M-Instruct, ``smollm2-*`` presets) run only when ``--methods``
names them (``--methods real`` for all of them), since each takes up to half an hour on two cores; ``all`` and the
default leave them out. Their "gold" columns are the held-out greedy accuracy (before and after training, the
stage's own evaluation, judged by math-verify against each row's answer) and the model folder is made first
(``rlhf model smollm2``).

A method raises the gold reward when its rise exceeds 0.05 (the margin the test suite held the methods to); one that
does not is marked in its row, and the benchmark still exits 0 (it is a measurement). The last line is the summary:

    quality: min_rise=<smallest rise> <method>_rise=<..> ... all_raise=<true|false>
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "deployments" / "configs"
RISE = 0.05  # a method raises the gold reward when after - before > RISE (about five standard errors)
BASELINE = ("sft", "eval_sft")  # the SFT policy and its evaluation: not counted in any method's seconds


@dataclass(frozen=True)
class Method:
    """Where a method's numbers are: (stage, metric) of the gold reward before and after, and of the KL to the
    reference after (None: its evaluation does not measure it); ``overrides`` of its preset (a training option)."""

    preset: str
    before: tuple[str, str]
    after: tuple[str, str]
    kl: tuple[str, str] | None
    note: str = ""
    overrides: tuple[str, ...] = ()


def _evaluated(preset: str, stage: str) -> Method:
    """A method whose SFT policy and final policy are both sampled by a generate stage with the gold rule."""
    return Method(preset, ("eval_sft", "gold_reward"), (stage, "gold_reward"), (stage, "kl_to_ref"))


def _grpo_with(note: str, *overrides: str) -> Method:
    """The grpo row with training options of its stage on: the grpo row's sft, reward_model and eval_sft (taken
    over by ``plan_reuse``), its own grpo and eval_grpo (the grpo section differs, so neither is taken over)."""
    return replace(_evaluated("tiny-grpo", "eval_grpo"), overrides=overrides, note=note)


METHODS = {
    "dpo": _evaluated("tiny-dpo", "eval_dpo"),
    "kto": _evaluated("tiny-kto", "eval_kto"),
    "rejection_sampling": _evaluated("tiny-rejection-sampling", "eval_2"),
    "iterative_dpo": _evaluated("tiny-iterative-dpo", "eval_2"),
    "grpo": _evaluated("tiny-grpo", "eval_grpo"),
    "grpo_async": _grpo_with(
        "grpo with train.async_enable: the next batch generated while this one trains", "grpo.train.async_enable=true"
    ),
    "grpo_partial": _grpo_with(
        "grpo_async with train.partial_rollout_enable on vLLM engines",
        "grpo.train.async_enable=true",
        "grpo.train.partial_rollout_enable=true",
        "grpo.rollout.backend=vllm",
    ),
    "grpo_rollout_logprobs": _grpo_with(
        "grpo with algo.use_rollout_logprobs: the engine's log-probs as the old ones (2 optimizer steps per batch)",
        "grpo.algo.use_rollout_logprobs=true",
    ),
    "grpo_gspo": _grpo_with(
        "grpo with algo.policy_loss=gspo (sequence-level ratio) and loss_agg=seq_mean",
        "grpo.algo.policy_loss=gspo",
        "grpo.algo.loss_agg=seq_mean",
    ),
    "grpo_is_correction": _grpo_with(
        "grpo_async with algo.is_correction=tis: each token weighed by the trainer-to-engine ratio clamped to "
        "is_correction_threshold [0.5, 5] (in lockstep the engines sample the trained policy and the ratio is 1)",
        "grpo.train.async_enable=true",
        "grpo.algo.is_correction=tis",
    ),
    "grpo_dynamic_batch": _grpo_with(
        "grpo with train.dynamic_batch: micro-batches of at most 128 prompt + response tokens (4 rows or more of "
        "this task's ~8-token prompts and 16 new tokens) instead of 8 rows",
        "grpo.train.dynamic_batch=true",
        "grpo.train.max_tokens_per_micro_batch=128",
    ),
    "reinforce": _evaluated("tiny-reinforce", "eval_reinforce"),
    "rloo": _evaluated("tiny-rloo", "eval_rloo"),
    "rlvr": _evaluated("tiny-rlvr", "eval_rlvr"),
    "qlora_dpo": _evaluated("tiny-qlora-dpo", "eval_dpo"),
    "jamba": _evaluated("tiny-jamba", "eval_grpo"),
    "ppo": Method(
        "tiny",
        ("ppo", "gold_reward_before"),
        ("ppo", "gold_reward_after"),
        ("ppo", "kl_to_ref_after"),
        note="the ppo stage's own evaluation (64 prompts, 1 response each, 16 new tokens) of tiny.yaml's own SFT "
        "policy (512 SFT samples), not eval_sft",
    ),
    "lora": Method(
        "tiny-lora",
        ("ppo", "gold_reward_before"),
        ("ppo", "gold_reward_after"),
        ("ppo", "kl_to_ref_after"),
        note="PPO with LoRA actor and critic, evaluated as ppo but on 128 held-out prompts",
    ),
    "smollm2_rlvr": Method(
        "smollm2-rlvr",
        ("rlvr", "accuracy_greedy_before"),
        ("rlvr", "accuracy_greedy_after"),
        ("rlvr", "kl_to_ref_after"),
        note="SmolLM2-135M-Instruct, GRPO with math-verify on 2-digit addition: held-out greedy accuracy (200 rows), "
        "not a gold reward",
    ),
    "smollm2_ppo": Method(
        "smollm2-ppo",
        ("ppo", "accuracy_greedy_before"),
        ("ppo", "accuracy_greedy_after"),
        ("ppo", "kl_to_ref_after"),
        note="SmolLM2-135M-Instruct, the five PPO stages on pairs the pipeline verified itself: held-out greedy "
        "accuracy (200 rows) of the SFT policy and of PPO's, judged by math-verify",
    ),
    "smollm2_dpo": Method(
        "smollm2-dpo",
        ("eval_sft", "gold_reward"),
        ("eval_dpo", "gold_reward"),
        ("eval_dpo", "kl_to_ref"),
        note="SmolLM2-135M-Instruct, DPO on the same verified pairs: held-out greedy accuracy (200 rows, "
        "math_gold) of the SFT policy and of DPO's",
    ),
    "moe": Method(
        "tiny-moe",
        ("ppo", "gold_reward_before"),
        ("ppo", "gold_reward_after"),
        ("ppo", "kl_to_ref_after"),
        note="PPO on the tiny Qwen3-MoE builtin from its own SFT policy, evaluated as ppo",
    ),
}


# rows on a real pretrained model: run only when named (or by ``real``)
REAL_MODEL = ("smollm2_rlvr", "smollm2_ppo", "smollm2_dpo")


def select_methods(text: str | None) -> list[str]:
    """The methods named in ``--methods`` (comma-separated; ``-`` reads as ``_``; ``real``: every ``REAL_MODEL``
    row), in the benchmark's order; for None or ``all`` every method but the real-model rows. A ValueError names an
    unknown one and lists the known."""
    if text is None or text.strip() == "all":
        return [m for m in METHODS if m not in REAL_MODEL]
    asked = [name.strip().replace("-", "_") for name in text.split(",") if name.strip()]
    asked = [m for name in asked for m in (REAL_MODEL if name == "real" else (name,))]
    unknown = [name for name in asked if name not in METHODS]
    if unknown or not asked:
        raise ValueError(
            f"unknown method {', '.join(map(repr, unknown)) or repr(text)} in --methods (known: {', '.join(METHODS)})"
        )
    return [name for name in METHODS if name in asked]


# -- running the presets ------------------------------------------------------------------------------------------
@dataclass
class StageRun:
    """One stage's committed output: where it was made, from what (to be found again by another preset that has
    the same stage), how long it took and its metrics."""

    name: str
    kind: str
    section: Any
    upstream: dict[str, str]  # the upstream stages it read -> their config hashes
    config_hash: str
    run_dir: Path
    seconds: float
    metrics: dict


def plan_reuse(cfg, earlier: Iterable[StageRun]) -> dict[str, StageRun]:
    """The stages of ``cfg`` that an earlier run already made: same name, kind and section, and made from the same
    upstream outputs (each of them reused too). Those have the same config hash, so the stage's ``run`` finds a
    copy of the earlier output complete and does not run again."""
    earlier = list(earlier)
    plan: dict[str, StageRun] = {}
    for name in cfg.order():
        spec = cfg.spec(name)
        inputs = spec.upstream_names()
        if any(u not in plan for u in inputs):
            continue
        want = {u: plan[u].config_hash for u in inputs}
        for done in earlier:
            if (done.name, done.kind, done.section, done.upstream) == (name, spec.kind, spec.section, want):
                plan[name] = done
                break
    return plan


def run_preset(
    preset: str, run_dir: Path, *overrides: str, reuse: Iterable[StageRun] = (), log: Callable[[str], None] = print
) -> dict[str, StageRun]:
    """Run ``deployments/configs/<preset>.yaml`` in ``run_dir`` as ``python -m rlhf_core.jobs.pipeline`` does (each
    kind's ``run`` in ``cfg.order()``, on the Ray already up or one each stage starts), first copying in the stages
    that ``reuse`` (earlier runs) already made (``plan_reuse``). Returns each stage's output by name; a copied one
    as it was made (its folder and seconds are the earlier run's)."""
    from rlhf_core.config import load_config
    from rlhf_core.jobs.pipeline import runner
    from rlhf_core.run_layout import existing_output, open_store

    cfg = load_config(PRESETS / f"{preset}.yaml", [f"run_uri={run_dir}", *overrides])
    copied = plan_reuse(cfg, reuse)
    store = open_store(cfg)
    for name, done in copied.items():
        if not (run_dir / name).exists():
            shutil.copytree(done.run_dir / name, run_dir / name)
        assert existing_output(store, name, done.config_hash), f"{preset}: the copy of {name} is not complete"
    out: dict[str, StageRun] = {}
    for name in cfg.order():
        started = time.perf_counter()
        ref = runner(cfg.kind(name))(cfg, name)
        seconds = time.perf_counter() - started
        if name in copied:
            # the copy is complete for this hash (checked above): the same hash here means it was not run again
            assert ref.config_hash == copied[name].config_hash, (
                f"{preset}: {name} ran again (config {ref.config_hash}) instead of taking the copy from "
                f"{copied[name].run_dir} (config {copied[name].config_hash})"
            )
            out[name] = copied[name]
            log(f"[quality] {preset}: {name} copied from {copied[name].run_dir.name}")
            continue
        upstream = {u: out[u].config_hash for u in cfg.spec(name).upstream_names()}
        out[name] = StageRun(
            name, cfg.kind(name), cfg.stage(name), upstream, ref.config_hash, run_dir, seconds, ref.metrics
        )
        log(f"[quality] {preset}: {name} {seconds:.1f} s")
    return out


# -- reporting ----------------------------------------------------------------------------------------------------
@dataclass
class Quality:
    method: str
    before: float  # gold reward of the SFT policy
    after: float  # gold reward of the method's final policy
    kl: float | None  # its KL to the reference; None when not measured
    seconds: float  # the method's own stages

    @property
    def rise(self) -> float:
        return self.after - self.before

    @property
    def raises(self) -> bool:
        return self.rise > RISE


def quality(method: str, metrics: dict[str, dict], seconds: float) -> Quality:
    """The method's numbers from its run's metrics by stage (``{stage: ref.metrics}``)."""
    m = METHODS[method]

    def get(where: tuple[str, str]) -> float:
        stage, key = where
        assert key in metrics.get(stage, {}), f"{method}: no {key} in the {stage} stage's metrics ({m.preset})"
        return float(metrics[stage][key])

    kl = None if m.kl is None else metrics.get(m.kl[0], {}).get(m.kl[1])
    return Quality(method, get(m.before), get(m.after), None if kl is None else float(kl), seconds)


def own_seconds(runs: dict[str, StageRun]) -> float:
    return sum(run.seconds for name, run in runs.items() if name not in BASELINE)


NAME_WIDTH = max(18, *map(len, METHODS))
HEADER = (
    f"{'method':{NAME_WIDTH}s} {'gold_before':>11s} {'gold_after':>10s} {'rise':>7s} {'kl_to_ref':>9s} {'wall_s':>7s}"
)


def format_row(q: Quality) -> str:
    kl = "-" if q.kl is None else f"{q.kl:.3f}"
    flag = "" if q.raises else f"  <- does NOT raise the gold reward (rise <= {RISE})"
    return f"{q.method:{NAME_WIDTH}s} {q.before:11.3f} {q.after:10.3f} {q.rise:+7.3f} {kl:>9s} {q.seconds:7.1f}{flag}"


def summary(results: list[Quality]) -> str:
    rises = " ".join(f"{q.method}_rise={q.rise:.3f}" for q in results)
    all_raise = "true" if all(q.raises for q in results) else "false"
    return f"quality: min_rise={min(q.rise for q in results):.3f} {rises} all_raise={all_raise}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", help=f"comma-separated, default all: {','.join(METHODS)}")
    parser.add_argument("--root", help="the run folders go to <root>/<method> (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders this run made (default: deleted)")
    args = parser.parse_args(argv)
    try:
        methods = select_methods(args.methods)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    from rlhf_core.config import load_config
    from rlhf_core.distributed.launcher import one_ray
    from rlhf_core.jobs.stage_setup import ray_cpus

    root = Path(args.root).resolve() if args.root else Path(tempfile.mkdtemp(prefix="bench-quality-"))
    os.chdir(ROOT)  # the presets name the bundled data relative to the repository root
    if any(m in REAL_MODEL for m in methods):
        from rlhf_core.models.smollm2 import make_folder

        make_folder(ROOT / "models" / "SmolLM2-135M-Instruct")  # what the smollm2 presets name; cached
    cfgs = [
        load_config(PRESETS / f"{METHODS[m].preset}.yaml", [f"run_uri={root / m}", *METHODS[m].overrides])
        for m in methods
    ]
    fresh = [m for m in methods if not (root / m).exists()]  # deleted afterwards unless --keep
    cpus = [c for cfg in cfgs for c in (ray_cpus(cfg.stage(name)) for name in cfg.order()) if c is not None]
    made: list[StageRun] = []
    results = []
    try:
        with one_ray(min_cpus=max(cpus, default=1)):  # one Ray for every stage of every method
            for method in methods:
                runs = run_preset(METHODS[method].preset, root / method, *METHODS[method].overrides, reuse=made)
                made += runs.values()
                results.append(quality(method, {n: r.metrics for n, r in runs.items()}, own_seconds(runs)))
    finally:
        if not args.keep:
            for method in fresh:
                shutil.rmtree(root / method, ignore_errors=True)
            if not args.root:
                shutil.rmtree(root, ignore_errors=True)
    print(f"\n{HEADER}")
    for q in results:
        print(format_row(q))
    for method in methods:
        if METHODS[method].note:
            print(f"({method}: {METHODS[method].note})")
    print(
        f"(wall_s: the method's own stages, without {' and '.join(BASELINE)}; run folders: "
        f"{root if args.keep else 'deleted'})"
    )
    print(summary(results))


if __name__ == "__main__":
    main()
