"""Declare the pipeline's deployments on a process work pool, each with a cron schedule and a parameter preset.

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect work-pool create rlhf --type process
    python deployments/deploy.py --pool rlhf                 # tiny-nightly and demo-nightly, 02:00 UTC
    prefect worker start --pool rlhf
    prefect deployment run 'rlhf-pipeline/demo-nightly'

The flow's code is taken from this checkout (``from_source`` on the repository folder), so the worker must run on
a machine that has it, with the project's virtual environment.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = "flows/rlhf_pipeline.py:rlhf_pipeline"

# deployment name -> flow parameters (PipelineParams fields)
PRESETS = {
    "tiny-nightly": {"preset": "tiny", "run_name": "tiny-nightly"},
    "demo-nightly": {"preset": "demo", "run_name": "demo-nightly"},
}


def deploy(pool: str, cron: str = "0 2 * * *", names: list[str] | None = None, overrides: dict | None = None) -> list:
    """Create or update the deployments; returns their ids. ``overrides`` updates every preset's parameters."""
    from prefect import flow

    source = flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)
    ids = []
    for name in names or list(PRESETS):
        params = {**PRESETS[name], **(overrides or {})}
        ids.append(
            source.deploy(
                name=name,
                work_pool_name=pool,
                cron=cron,
                parameters={"params": params},
                concurrency_limit=1,
                description=f"RLHF pipeline, preset {params['preset']}",
                print_next_steps=False,
            )
        )
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", default="rlhf", help="process work pool name")
    parser.add_argument("--cron", default="0 2 * * *", help="schedule (UTC)")
    parser.add_argument("--name", action="append", choices=sorted(PRESETS), help="only these deployments")
    args = parser.parse_args()
    for deployment_id in deploy(args.pool, args.cron, args.name):
        print(f"deployment {deployment_id}")


if __name__ == "__main__":
    main()
