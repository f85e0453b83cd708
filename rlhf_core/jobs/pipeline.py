"""Run a preset's stages in dependency order (tiny/demo: SFT -> reward model -> critic init -> critic warm-up -> PPO)
in this process and print each result.

This is the README's main job on the embedded default: one local Ray for all stages (started by the first stage
that needs it, ``launcher.one_ray``), a local folder as the object store. Finished stages whose output is complete
for the same config are not run again, and a stage that was interrupted resumes from its newest complete
checkpoint. (The Prefect flow chains the same ``run`` functions.)

    python -m rlhf_core.jobs.pipeline --config deployments/configs/demo.yaml [key=value ...]
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable

from rlhf_core.config import STAGE_KINDS, PipelineConfig, load_config
from rlhf_core.distributed.launcher import one_ray
from rlhf_core.jobs.process import BAD_INPUT, env_secrets, exit_bad_input
from rlhf_core.jobs.stage_setup import ray_cpus
from rlhf_core.run_layout import summary_metrics
from rlhf_core.types import CheckpointRef


def runner(kind: str) -> Callable[[PipelineConfig, str], CheckpointRef]:
    """The ``run(cfg, stage_name)`` of a stage kind's job module (``STAGE_KINDS[kind].job``)."""
    return importlib.import_module(STAGE_KINDS[kind].job).run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_core.jobs.pipeline", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--config", required=True, help="YAML preset, e.g. deployments/configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    secrets = env_secrets()
    try:
        cfg = load_config(args.config, args.overrides)
        secrets += [cfg.storage.key, cfg.storage.secret]
        results = []
        cpus = [c for c in (ray_cpus(cfg.stage(name)) for name in cfg.order()) if c is not None]
        # the stages share one Ray: started by the first that needs it, sized for the largest, stopped after the last
        with one_ray(min_cpus=max(cpus, default=1)):
            for name in cfg.order():
                started = time.time()
                ref = runner(cfg.kind(name))(cfg, name)
                results.append((name, ref, time.time() - started))
    except BAD_INPUT as e:
        exit_bad_input(e, secrets)

    print("\n=== rlhf-pipeline results ===")
    for name, ref, seconds in results:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in summary_metrics(ref.metrics).items())
        print(f"{name:13s} {seconds:6.1f}s  {shown}")
        print(f"{'':13s} model: {ref.uri}")


def _fmt(value: float | int) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
