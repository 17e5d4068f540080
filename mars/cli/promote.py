"""``mars promote`` and ``mars pull``: params ``store`` (+ ``--store``) -> :mod:`mars.release.promote`."""

from __future__ import annotations

import argparse
import getpass
import socket

from mars.cli.options import add_params_arguments, add_store_argument, params_from_args, store_config


def _pull_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mars pull", description="Fetch a promoted release, verified, into a directory.")
    parser.add_argument("name", help="release name (e.g. mars)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--stage", help="stage pointer to follow (default: store.stage)")
    which.add_argument("--version", help="a specific release version (e.g. v3) instead of a stage")
    parser.add_argument("--to", required=True, help="destination directory (replaced atomically)")
    return parser


def _promote_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mars promote", description="Publish a gated release to the artifact store and move the stage pointer to it.")
    parser.add_argument("--gate", default="metrics/gate.json", help="gate decision (default: metrics/gate.json)")
    parser.add_argument("--export", default="exports/mars", help="export directory (default: exports/mars)")
    parser.add_argument("--checkpoint", default="checkpoints/mars/final", help="MARS checkpoint directory")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the tokenizer files of the checkpoint)")
    parser.add_argument("--name", help="release name (default: store.name)")
    parser.add_argument("--stage", help="stage pointer to move (default: staging; the production stage, store.stage, "
                                        "only when named here; inside `dvc exp run` only staging)")
    parser.add_argument("--by", help="who publishes or rolls back, recorded in the release and the pointer "
                                     "(default: USER@HOST)")
    parser.add_argument("--tau", type=float, help="default decoding threshold recorded in the release "
                                                  "(default: the gate's speed_tau if it checked one, else its tau)")
    parser.add_argument("--rollback", metavar="VERSION", help="move the stage back to an earlier release instead")
    return parser


def main(argv: list[str], verb: str = "promote") -> int:
    from mars.release.promote import STAGING, guard_experiment, promote, pull, rollback
    from mars.release.store import open_store

    parser = _pull_parser() if verb == "pull" else _promote_parser()
    add_params_arguments(parser)
    add_store_argument(parser)
    args = parser.parse_args(argv)
    cfg = store_config(params_from_args(args), args.store)
    store = open_store(cfg)
    if verb == "pull":
        pull(store, args.name, args.to, stage=args.stage or cfg.stage if args.version is None else None,
             version=args.version)
        return 0
    name, stage = args.name or cfg.name, args.stage or STAGING
    guard_experiment(stage)  # inside `dvc exp run` only staging moves (promote and rollback check it too)
    by = args.by or f"{getpass.getuser()}@{socket.gethostname()}"
    if args.rollback:
        rollback(store, version=args.rollback, name=name, stage=stage, by=by)
        return 0
    promote(store, gate=args.gate, export=args.export, checkpoint=args.checkpoint, tokenizer=args.tokenizer,
            name=name, stage=stage, tau=args.tau, by=by)
    return 0
