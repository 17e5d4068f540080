"""``mars export``: params ``export`` and a MARS checkpoint -> :func:`mars.release.export.export_checkpoint`."""

from __future__ import annotations

import argparse

from mars.cli.options import add_params_arguments, params_from_args
from mars.config import section


def main(argv: list[str], verb: str = "export") -> int:
    from mars.release import export

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=export.__doc__.splitlines()[0])
    add_params_arguments(parser)
    parser.add_argument("--checkpoint", default="checkpoints/mars/final",
                        help="MARS checkpoint directory (default: checkpoints/mars/final)")
    parser.add_argument("--out", default="exports/mars", help="export directory to write (default: exports/mars)")
    args = parser.parse_args(argv)
    cfg = section(params_from_args(args), "export", export.ExportConfig)
    export.export_checkpoint(args.checkpoint, args.out, cfg)
    return 0
