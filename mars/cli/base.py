"""``mars base``: params ``model`` and ``seed`` -> :func:`mars.training.base.make_base`."""

from __future__ import annotations

import argparse

from mars.cli.options import add_params_arguments, params_from_args, seed_of
from mars.config import section


def main(argv: list[str], verb: str = "base") -> int:
    from mars.training import base

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=base.__doc__.split("\n\n")[0])
    add_params_arguments(parser)
    parser.add_argument("--out", default="models/base", help="output directory (default: models/base)")
    args = parser.parse_args(argv)
    params = params_from_args(args)
    cfg = section(params, "model", base.ModelConfig)
    meta = base.make_base(cfg, seed_of(params), args.out)
    mask = meta["mask_token"]
    print(
        f"base {cfg.source}: {meta['num_parameters']:,} parameters, vocab {meta['vocab_size']} "
        f"(embedding rows {meta['embedding_rows']}), mask {mask['token']!r} id {mask['token_id']}"
        f"{' (embedding resized)' if mask['resized'] else ''} -> {args.out}"
    )
    return 0
