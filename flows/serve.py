"""One-process deployment: ``python -m flows.serve`` schedules and runs the pipeline flow itself.

No work pool or worker is needed: this process registers the deployment ``mars-pipeline/<name>`` with
the Prefect server (``PREFECT_API_URL``, or a local ephemeral one), runs it on ``flow.cron`` from
params.yaml, and executes runs triggered from the UI or ``prefect deployment run``. Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import sys

from prefect.schedules import Cron

from flows import project
from flows.pipeline import load_flow_config, mars_pipeline


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", default=".", help="the DVC project to run (default: the current directory)")
    parser.add_argument("--name", default="served", help="deployment name (default: served)")
    parser.add_argument("--profile", help="params.yaml profile for every scheduled run (default: the file's own)")
    parser.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="param override for every scheduled run (repeatable)")
    parser.add_argument("--no-promote", action="store_true", help="stop after the gate")
    parser.add_argument("--no-schedule", action="store_true", help="serve without the cron schedule (manual runs only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = project.find_root(args.project)
    cfg = load_flow_config(root)
    parameters = {"project_dir": str(root), "profile": args.profile, "overrides": args.overrides,
                  "promote": False if args.no_promote else cfg.promote}
    schedules = [] if args.no_schedule else [Cron(cfg.cron, timezone=cfg.timezone)]
    mars_pipeline.serve(name=args.name, schedules=schedules, parameters=parameters, global_limit=1,
                        description=f"MARS pipeline of {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
