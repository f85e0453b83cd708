"""The ``rlhf`` command line.

    rlhf run PRESET [key=value ...] [--run-name NAME] [--run-uri URI]    the whole pipeline
    rlhf resume RUN_NAME [--run-uri URI]                                 rerun a run with its saved parameters
    rlhf stage NAME PRESET [key=value ...] [--run-name NAME]             one stage instance (its inputs must exist)
    rlhf compare RUN_A RUN_B [...] [--out DIR]                           overlay the runs' curves, final metrics
    rlhf model smollm2 [--out DIR]                                       SmolLM2-135M-Instruct as a model folder

Each run starts one Ray for its stage jobs and stops it at the end (``shared_ray``); ``--no-shared-ray`` (run,
stage): each job starts its own.

Without PREFECT_API_URL it uses Prefect's temporary local server; with it, the runs appear on that server.
Progress (``flows.console``): live bars per stage when stdout is a terminal, plain step lines otherwise, above or
beside the flow's log; the summary is printed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlhf_core.config import ConfigError


def _params(args: argparse.Namespace, **extra):
    from flows.rlhf_pipeline import PipelineParams

    run_uri = args.run_uri
    if run_uri and "://" not in run_uri:
        run_uri = str(Path(run_uri).resolve())
    return PipelineParams(
        preset=args.preset, overrides=args.overrides, run_name=args.run_name, run_uri=run_uri, **extra
    )


def _saved_params(run_name: str, run_uri: str | None):
    from flows.rlhf_pipeline import ROOT, PipelineParams
    from rlhf_core.run_layout import PARAMS
    from rlhf_core.storage import ObjectStore, storage_options_for

    uri = run_uri or str(ROOT / "runs" / run_name)
    store = ObjectStore(uri, storage_options_for(uri))
    if not store.exists(PARAMS):
        raise ConfigError(f"no run named {run_name!r} at {uri} ({PARAMS} missing); give --run-uri")
    return PipelineParams(**store.read_json(PARAMS))


def main(argv: list[str] | None = None) -> None:
    assert __doc__ is not None  # the module docstring (absent only under python -OO, which also drops asserts)
    parser = argparse.ArgumentParser(prog="rlhf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run the pipeline")
    run_p.add_argument("preset")
    run_p.add_argument("overrides", nargs="*")
    resume_p = sub.add_parser("resume", help="rerun a run: finished stages are skipped, a failed one resumes")
    resume_p.add_argument("run_name")
    stage_p = sub.add_parser("stage", help="run one stage")
    stage_p.add_argument("stage", help="a stage instance of the preset, e.g. ppo")
    stage_p.add_argument("preset")
    stage_p.add_argument("overrides", nargs="*")
    compare_p = sub.add_parser("compare", help="overlay the curves of runs and put their final metrics side by side")
    compare_p.add_argument("runs", nargs="+", help="run names (runs/<name>), folders or URIs (s3://...)")
    compare_p.add_argument("--out", default=None, help="report folder (default runs/_compare/<names>)")
    model_p = sub.add_parser("model", help="write a bundled model as a model folder, offline (once; then cached)")
    model_p.add_argument("name", choices=["smollm2"], help="smollm2: SmolLM2-135M-Instruct, from its GGUF (Q4_1)")
    model_p.add_argument("--out", default="models/SmolLM2-135M-Instruct", help="the folder (default %(default)s)")
    for p in (run_p, resume_p, stage_p):
        p.add_argument("--run-uri", default=None, help="where artifacts go (default runs/<run name>)")
    for p in (run_p, stage_p):
        p.add_argument("--run-name", default=None, help="default: the preset's name")
        p.add_argument(
            "--shared-ray",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="one Ray for the run's stage jobs, started and stopped by the run (shared_ray; "
            "--no-shared-ray: each job starts its own)",
        )
    args = parser.parse_args(argv)

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if args.command == "compare":
        from flows.compare import compare_command

        try:
            report = compare_command(args.runs, args.out)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"report: {report}")
        return
    if args.command == "model":
        from rlhf_core.models.smollm2 import ModelFolderError, make_folder

        try:
            folder = make_folder(Path(args.out))
        except ModelFolderError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"model: {folder.resolve()}")
        return
    from flows.console import StageConsole
    from flows.report import summary_markdown
    from flows.rlhf_pipeline import rlhf_pipeline
    from tasks import progress

    try:
        if args.command == "resume":
            params = _saved_params(args.run_name, args.run_uri)
            params = params.model_copy(update={"run_uri": args.run_uri or params.run_uri})
        else:
            args.run_name = args.run_name or Path(args.preset).stem
            extra = {"stages": [args.stage]} if args.command == "stage" else {}
            params = _params(args, shared_ray=args.shared_ray, **extra)
        with StageConsole() as display:
            unsubscribe = progress.subscribe(display)
            try:
                summary = rlhf_pipeline(params)
            finally:
                unsubscribe()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print("\n" + summary_markdown(summary))


if __name__ == "__main__":
    main()
