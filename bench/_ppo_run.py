"""What bench.ppo_step and bench.sync share: one PPO stage run as the real job (``python -m rlhf_core.jobs.ppo``) at a
fixed size, on this checkout or on a baseline revision (a ``git worktree`` of it under /tmp), and what its steps took.

The size (the defaults): builtin:medium (the 24M Llama) as actor, reference, critic and reward model, 16 prompts per
step, 64 new tokens, 4 PPO epochs, a separate (not colocated) critic, fp32, the tiny preset's other settings (HF
generate engine, 2 samples per prompt). Step 1 is the warm-up: the steady state is the mean over steps 2 and on.
``--grpo``: GRPO at the same size instead: the actor alone (no critic, no reward model, no reference: no KL), 4 samples
per prompt scored by the synthetic task's gold rule as ``reward_fn``, one optimizer step per batch, vLLM engines.

Both versions print ``[ppo] step k/N ... (X.Xs)`` per step, and metrics.json's history has ``response_len`` (mean
action tokens per row) and the step's ``prompts``; the per-phase ``timing/<phase>_s`` entries exist only in the code
that has them (not in the baseline, whose step seconds come from the step line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET = "deployments/configs/tiny.yaml"
BASELINE_REV = "d3d2d8d"
# --grpo's baseline: BASELINE_REV has neither the critic-free estimators nor reward functions.
GRPO_BASELINE_REV = "0a1aecd"
# The gold rule as a batch reward function; relative, so that each run reads the one of its own code (its cwd).
GOLD_REWARD_FN = "rlhf_core/assets/reward_fns/gold.py:gold_rewards"
# The phases in the order a step runs them (metrics.json's keys come sorted); concurrent ones after their phase.
PHASE_ORDER = [
    "offload_states",
    "generation",
    "experience",
    "experience_actor",
    "experience_reference",
    "experience_critic",
    "experience_reward",
    "advantages",
    "train",
    "critic_train",
    "actor_train",
    "weight_sync",
    "checkpoint",
]
STEP_LINE = re.compile(r"^\[ppo\] step (\d+)/(\d+) .*\(([0-9.]+)s\)\s*$")


def add_size_args(parser: argparse.ArgumentParser) -> None:
    """The run's size and length, the same for every run of one benchmark."""
    parser.add_argument(
        "--grpo",
        action="store_true",
        help="GRPO instead of PPO: the actor alone, a reward function (the gold rule), no KL, one optimizer step "
        "per batch, 4 samples per prompt, vLLM engines",
    )
    parser.add_argument(
        "--model", default="builtin:medium", help="actor, reference, critic and reward model (--grpo: the actor)"
    )
    parser.add_argument("--steps", type=int, default=3, help="PPO steps (step 1 is the warm-up, not measured)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (train.rollout_batch_size)")
    parser.add_argument("--new-tokens", type=int, default=64, help="rollout.max_new_tokens")
    parser.add_argument("--epochs", type=int, help="algo.ppo_epochs (default 4; --grpo: 1)")
    parser.add_argument(
        "--samples-per-prompt", type=int, help="rollout.n_samples_per_prompt (default: the preset's, 2; --grpo: 4)"
    )
    parser.add_argument(
        "--backend", choices=["hf", "vllm"], help="rollout.backend (default: the preset's, hf; --grpo: vllm)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another override for every run, e.g. --set ppo.rollout.num_engines=2",
    )
    parser.add_argument(
        "--new-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for this checkout's run only (keys the baseline may not know), e.g. "
        "--new-set ppo.train.async_enable=true",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories and job logs")


def overrides(args: argparse.Namespace) -> list[str]:
    """Overrides of the tiny preset's ``ppo`` stage for the benchmark's size (no upstream stages needed); with
    ``--grpo``, GRPO's (keys that GRPO_BASELINE_REV knows too: the baseline run gets the same)."""
    roles = ("actor",) if args.grpo else ("actor", "critic", "reward")
    out = [f"ppo.{role}.model.name_or_path={args.model}" for role in roles]
    epochs = args.epochs if args.epochs is not None else 1 if args.grpo else 4
    out += [
        "ppo.algo.normalize_reward=false",  # a builtin reward model has no stored reward statistics
        f"ppo.train.rollout_batch_size={args.prompts}",
        f"ppo.rollout.max_new_tokens={args.new_tokens}",
        f"ppo.algo.ppo_epochs={epochs}",
        f"ppo.train.max_steps={args.steps}",
        "ppo.train.eval_prompts=0",
        "ppo.train.save_steps=0",
        "ppo.train.log_steps=1",
        "ppo.actor.strategy.precision=fp32",
        "ppo.critic.strategy.precision=fp32",
        "ppo.placement.colocate_all=false",
        "ppo.placement.colocate_actor_ref=false",
        "ppo.placement.colocate_critic_reward=false",
    ]
    samples, backend = args.samples_per_prompt, args.backend
    if args.grpo:
        samples = samples if samples is not None else 4
        backend = backend if backend is not None else "vllm"
        out += [
            "ppo.algo.advantage_estimator=grpo",
            "ppo.critic.model=null",  # the critic-free estimator refuses one
            "ppo.reward.model=null",
            f"ppo.reward_fn={GOLD_REWARD_FN}",
            # No KL, so no reference model is built (algo.needs_kl); kl_mode stays reward, as kl_mode=loss
            # refuses a zero coefficient.
            "ppo.algo.kl_coef=0",
            f"ppo.train.train_batch_size={args.prompts * samples}",  # the whole batch: one optimizer step per epoch
        ]
    if samples is not None:
        out.append(f"ppo.rollout.n_samples_per_prompt={samples}")
    if backend is not None:
        out.append(f"ppo.rollout.backend={backend}")
    return out + list(args.set)


def baseline_tree(rev: str) -> Path:
    """A detached worktree of ``rev`` at /tmp/bench-base-<rev> (made once, reused after)."""
    path = Path(tempfile.gettempdir()) / f"bench-base-{rev}"
    if not (path / "rlhf_core").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return path


@dataclass
class Step:
    step: int
    seconds: float  # timing/step_s where logged, else the step line's
    rows: int
    tokens: float  # generated tokens: response_len x rows
    timing: dict[str, float] = field(default_factory=dict)  # timing/<phase>_s
    logs: dict = field(default_factory=dict)  # the step's history entry


@dataclass
class Run:
    label: str
    steps: list[Step]
    startup_s: float  # job start to the first step's start (from the wall clock here)
    wall_s: float
    final: dict

    @property
    def measured(self) -> list[Step]:
        """The steady-state steps: all but the first (the warm-up), unless there is only one."""
        return self.steps[1:] or self.steps

    def mean(self, key: str) -> float:
        """Mean of a history entry (e.g. ``timing/generation_s``, ``weight_sync_s``) over the measured steps."""
        values = [s.logs[key] for s in self.measured if key in s.logs]
        return sum(values) / len(values) if values else float("nan")

    @property
    def step_s(self) -> float:
        return sum(s.seconds for s in self.measured) / len(self.measured)

    @property
    def gen_tok_s(self) -> float:
        """Generated tokens per second of the whole step (steady state)."""
        return sum(s.tokens for s in self.measured) / sum(s.seconds for s in self.measured)

    def phases(self) -> dict[str, float]:
        """{phase: mean seconds over the measured steps} of every ``timing/<phase>_s``, in the step's order (step
        last); {} without timing."""
        names = [k[len("timing/") : -len("_s")] for k in self.measured[0].timing]
        if not names:
            return {}
        order = [p for p in PHASE_ORDER if p in names] + sorted(set(names) - {*PHASE_ORDER, "step"}) + ["step"]
        return {name: self.mean(f"timing/{name}_s") for name in order}


def run_ppo(args: argparse.Namespace, label: str, code: Path = ROOT, extra: list[str] | None = None) -> Run:
    """The ppo stage of the tiny preset, at the benchmark's size and with the ``extra`` overrides, as the job of the
    code at ``code``; its step lines are echoed here as they come."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-ppo-{label}-"))
    log_path = run_dir / "job.log"
    cmd = [
        sys.executable,
        "-m",
        "rlhf_core.jobs.ppo",
        "--config",
        PRESET,
        "--stage",
        "ppo",
        f"run_uri={run_dir / 'run'}",
        *overrides(args),
        *(extra or []),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0",
    }
    env.pop("RAY_ADDRESS", None)  # a Ray of its own, as a job on this machine
    env.pop("RLHF_EVENTS_FILE", None)
    print(f"[{label}] {' '.join(cmd[1:])} (in {code}; log {log_path})", flush=True)
    started = time.time()
    first_line: float | None = None
    printed: dict[int, float] = {}
    # The job in a session of its own: stopped with its Ray (GCS, raylet, workers) if this process is stopped.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    with open(log_path, "w", buffering=1) as log:
        proc = subprocess.Popen(
            cmd,
            cwd=code,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                m = STEP_LINE.match(line)
                if m:
                    printed[int(m.group(1))] = float(m.group(3))
                    first_line = first_line if first_line is not None else time.time()
                    print(f"[{label}] step {m.group(1)}/{m.group(2)}: {m.group(3)} s", flush=True)
            rc = proc.wait()
        except BaseException:
            _stop_tree(proc.pid)
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
    wall = time.time() - started
    if rc != 0:
        tail = log_path.read_text().splitlines()[-30:]
        raise SystemExit(f"[{label}] the job failed (exit code {rc}); the end of {log_path}:\n" + "\n".join(tail))
    out = json.loads((run_dir / "run" / "ppo" / "metrics.json").read_text())
    n = samples_per_prompt(args)
    steps = []
    for h in out["history"]:
        timing = {k: float(v) for k, v in h.items() if k.startswith("timing/")}
        rows = len(h["prompts"]) * n
        seconds = timing.get("timing/step_s", printed.get(h["step"], float("nan")))
        steps.append(Step(h["step"], seconds, rows, h["response_len"] * rows, timing, h))
    if not steps:
        raise SystemExit(f"[{label}] the job ran no step ({log_path})")
    startup = (first_line - started - printed[steps[0].step]) if first_line is not None else float("nan")
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return Run(label, steps, startup, wall, out["final"])


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_tree(pid: int) -> None:
    """SIGTERM, then SIGKILL, to the job, everything below it and its session's process group."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        _, procs = psutil.wait_procs(procs, timeout=10)
        if not procs:
            break


def samples_per_prompt(args: argparse.Namespace) -> int:
    """rollout.n_samples_per_prompt of the runs: the preset with the benchmark's overrides, resolved."""
    from rlhf_core.config import load_config

    return load_config(str(ROOT / PRESET), overrides(args)).stage("ppo").rollout.n_samples_per_prompt


def fmt(value: float) -> str:
    return f"{value:.4g}"
