"""Seconds per phase of a PPO (or GRPO) step at 24M, and generated tokens/s, against a baseline revision, in one run.

    python -m bench.ppo_step [--steps 3] [--baseline-rev d3d2d8d | --no-baseline] [--model builtin:medium]
                             [--new-set ppo.train.async_enable=true ...]
    python -m bench.ppo_step --grpo [--backend hf] [--baseline-rev 0a1aecd | --no-baseline] [...]

The size (bench._ppo_run): builtin:medium (24M) actor, reference, critic and reward model, 16 prompts, 64 new
tokens, 4 PPO epochs, separate critic, fp32. Each version runs the ppo stage as its real job
(``python -m rlhf_core.jobs.ppo``), one after the other: first the baseline (a ``git worktree`` of the revision at
/tmp/bench-base-<rev>, reused when there), then this checkout. Step 1 is the warm-up; the numbers are means over
steps 2 and on. Generated tokens/s: generated tokens (``response_len`` x rows) per second of the whole step. The
phases come from this checkout's ``timing/<phase>_s`` (the baseline has none: only its step seconds, from its step
lines). The last line is the summary:

    ppo_step: speedup=<x> gen_tok_s=<..> base_gen_tok_s=<..> step_s=<..> base_step_s=<..> <phase>_s=<..> ...

(``speedup``: this checkout's generated tokens/s over the baseline's; without a baseline the line starts at
``gen_tok_s``.) With train.async_enable it also has ``rollout_generate_s`` (the seconds the generator thread took
for a step's rollout) and ``overlap`` (the share of them the step did not wait for: 1 - generation_s /
rollout_generate_s). On a shared machine the load drifts between the two runs: compare runs made at a quiet time.

``--grpo`` measures a GRPO step instead (algo.advantage_estimator=grpo) at the same size: the builtin:medium actor
alone, 16 prompts x 4 samples, 64 new tokens, one optimizer step per batch (ppo_epochs 1, train_batch_size = all 64
samples), no KL (kl_coef 0: no reference model), the synthetic task's gold rule as reward function (no reward model,
no critic), vLLM engines (``--backend hf``: HF generate). The step is generation, the reward function, the group
advantages, one actor update and the weight sync, plus the actor's old-log-prob forward where the code runs one (the
baseline does; this checkout skips it at one optimizer step per batch). Its baseline defaults to 0a1aecd (d3d2d8d has
no GRPO), and the summary line starts ``grpo_step:`` with the same fields.
"""

from __future__ import annotations

import argparse
import math
import os

from bench import _ppo_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ppo_run.add_size_args(parser)
    parser.add_argument(
        "--baseline-rev",
        help=f"the revision to compare against (default {_ppo_run.BASELINE_REV}, --grpo {_ppo_run.GRPO_BASELINE_REV})",
    )
    parser.add_argument("--no-baseline", action="store_true", help="run this checkout only")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    rev = args.baseline_rev or (_ppo_run.GRPO_BASELINE_REV if args.grpo else _ppo_run.BASELINE_REV)
    base = None
    if not args.no_baseline:
        base = _ppo_run.run_ppo(args, f"base-{rev}", _ppo_run.baseline_tree(rev))
    new = _ppo_run.run_ppo(args, "new", extra=args.new_set)

    f = _ppo_run.fmt
    phases = new.phases()
    for run in (base, new):
        if run is None:
            continue
        measured = ", ".join(str(s.step) for s in run.measured)
        print(
            f"[{run.label}] start-up {run.startup_s:.1f} s, step {run.step_s:.2f} s (steps {measured}), "
            f"{run.measured[0].rows} rows x {run.mean('response_len'):.1f} tokens, {run.gen_tok_s:.1f} generated "
            f"tokens/s, job {run.wall_s:.0f} s"
        )
    if phases:
        step = phases["step"]
        for name, seconds in phases.items():
            print(f"[new] {name:<22} {seconds:8.3f} s  {100 * seconds / step:5.1f} %")
    generation = phases.get("generation")
    fields = {"gen_tok_s": new.gen_tok_s}
    if base is not None:
        fields = {"speedup": new.gen_tok_s / base.gen_tok_s, **fields, "base_gen_tok_s": base.gen_tok_s}
    fields["step_s"] = new.step_s
    if base is not None:
        fields["base_step_s"] = base.step_s
    fields.update({f"{name}_s": s for name, s in phases.items() if name != "step"})
    if generation:  # the engines' own rate: generated tokens per second of the generation phase
        fields["generation_tok_s"] = sum(s.tokens for s in new.measured) / (generation * len(new.measured))
    generate = new.mean("rollout_generate_s")  # async: how much of the generator's time the step did not wait for
    if not math.isnan(generate) and generation is not None:
        fields.update(rollout_generate_s=generate, overlap=max(0.0, 1 - generation / generate))
    fields["startup_s"] = new.startup_s
    if base is not None:
        fields["base_startup_s"] = base.startup_s
    print(("grpo_step: " if args.grpo else "ppo_step: ") + " ".join(f"{k}={f(v)}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
