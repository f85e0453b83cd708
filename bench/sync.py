"""Weight-sync time as a share of a PPO step at 24M (goal: at most 5 %).

    python -m bench.sync [--steps 3] [--baseline-rev REV] [--model builtin:medium]

The same run as bench.ppo_step (bench._ppo_run: builtin:medium actor, reference, critic and reward model, 16
prompts, 64 new tokens, 4 PPO epochs, separate critic, fp32), this checkout's ppo stage as its real job. Step 1 is
the warm-up; the numbers are means over steps 2 and on. ``weight_sync_s``: the controller's ``timing/weight_sync_s``
(waking the engines and the actor's push, as the step waits for it); ``sender_s``: rank 0's own ``weight_sync_s``
(its transfers). The last line is the summary:

    sync: share=<weight_sync_s / step_s> weight_sync_s=<..> step_s=<..> sender_s=<..> buckets=<n>

``--baseline-rev``: also run that revision (a ``git worktree`` under /tmp) and add ``base_share`` (its rank-0
``weight_sync_s`` over its step seconds: it has no controller-side timing).
"""

from __future__ import annotations

import argparse
import os

from bench import _ppo_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ppo_run.add_size_args(parser)
    parser.add_argument("--baseline-rev", help="also measure this revision (default: this checkout only)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    base = None
    if args.baseline_rev:
        base = _ppo_run.run_ppo(args, f"base-{args.baseline_rev}", _ppo_run.baseline_tree(args.baseline_rev))
    new = _ppo_run.run_ppo(args, "new", extra=args.new_set)

    sync_s, step_s = new.mean("timing/weight_sync_s"), new.step_s
    if sync_s != sync_s:  # NaN: the code on the path has no controller-side timing
        raise SystemExit("this checkout's history has no timing/weight_sync_s")
    sender_s, buckets = new.mean("weight_sync_s"), new.mean("weight_sync_buckets")
    print(
        f"[new] weight sync {sync_s:.3f} s of a {step_s:.2f} s step (rank 0's transfers {sender_s:.3f} s, "
        f"{buckets:.0f} buckets)"
    )
    f = _ppo_run.fmt
    fields = {
        "share": sync_s / step_s,
        "weight_sync_s": sync_s,
        "step_s": step_s,
        "sender_s": sender_s,
        "buckets": buckets,
    }
    if base is not None:
        fields["base_share"] = base.mean("weight_sync_s") / base.step_s
        fields["base_step_s"] = base.step_s
    print("sync: " + " ".join(f"{k}={f(v)}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
