"""``mars evaluate``: ``--checkpoint NAME=DIR`` and params ``evaluate`` (+ ``tasks``) -> :func:`mars.evaluation.evaluate.run`."""

from __future__ import annotations

import argparse

from mars.cli.options import add_params_arguments, params_from_args
from mars.config import section
from mars.errors import ConfigError


def parse_checkpoints(values: list[str]) -> dict[str, str]:
    """``NAME=DIR`` flags as ``{name: dir}``; names are unique and contain no '/' (they are metric key parts)."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--checkpoint {value!r}: expected NAME=DIR (e.g. mars=checkpoints/mars/final)")
        if "/" in name or name in out:
            raise ConfigError(f"--checkpoint {value!r}: names must be unique and contain no '/'")
        out[name] = path
    return out


def main(argv: list[str], verb: str = "evaluate") -> int:
    from mars.evaluation import evaluate
    from mars.training.tasks import TasksConfig

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=evaluate.__doc__.split("\n\n")[0])
    add_params_arguments(parser)
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="a checkpoint to evaluate (repeatable): sft=..., ar_control=..., mars=...")
    parser.add_argument("--data", help="prepared data directory (for the held-out suite)")
    parser.add_argument("--out", default="eval", help="per-item outputs, plots and report.md")
    parser.add_argument("--metrics", default="metrics/eval.json", help="the metrics file")
    parser.add_argument("--train-metrics", default="metrics", help="folder of train_<stage>.tsv for the curves")
    parser.add_argument("--work", help="keep each finished decoding here; a rerun reuses those of the same "
                        "checkpoint and settings (an interrupted evaluation resumes)")
    args = parser.parse_args(argv)
    params = params_from_args(args)
    cfg = section(params, "evaluate", evaluate.EvalConfig)
    evaluate.run(parse_checkpoints(args.checkpoint), cfg, data_dir=args.data, out_dir=args.out,
                 metrics_path=args.metrics, train_metrics_dir=args.train_metrics,
                 tasks=section(params, "tasks", TasksConfig), work=args.work)
    return 0
