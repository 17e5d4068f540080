"""``mars train``: params ``train`` and ``seed`` + the prepared data -> :func:`mars.training.trainer.train`."""

from __future__ import annotations

import argparse
import os
import subprocess

from mars.cli.options import add_params_arguments, params_from_args, seed_of
from mars.config import section


def main(argv: list[str], verb: str = "train") -> int:
    from mars.training import launch, trainer

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=trainer.__doc__.split("\n\n")[0])
    parser.add_argument("--stage", required=True, choices=trainer.STAGES)
    parser.add_argument("--init", required=True, help="checkpoint to start from (base model or SFT final)")
    parser.add_argument("--data", required=True, help="prepared data folder (mars prepare)")
    parser.add_argument("--out", required=True, help="run folder: steps/ checkpoints and final/ model")
    parser.add_argument("--resume", default="auto", help="no | auto (latest step checkpoint in OUT) | PATH")
    parser.add_argument("--metrics", help="per-step TSV (default metrics/train_<stage>.tsv)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_params_arguments(parser)
    args = parser.parse_args(argv)
    params = params_from_args(args)
    cfg = section(params, "train", trainer.TrainConfig)
    relaunch = launch.command(cfg.launch, ["mars.cli", verb, *argv])
    if relaunch is not None:  # train.launch.num_processes > 1: this same command, once per process
        return subprocess.call(relaunch)
    examples, meta = trainer.load_examples(args.data, cfg.max_length)
    result = trainer.train(cfg, stage=args.stage, init=args.init, examples=examples, out=args.out,
                           resume=args.resume, metrics_path=args.metrics, seed=seed_of(params),
                           progress=not args.no_progress, data_meta=meta)
    if int(os.environ.get("RANK", "0")) == 0:  # one line per run, not per process
        print(f"train {result.stage}: {result.steps} steps, final loss {result.final_loss:.4f}, "
              f"{result.seconds:.1f} s, {result.tokens_per_s:.0f} tokens/s -> {result.final_dir}")
    return 0
