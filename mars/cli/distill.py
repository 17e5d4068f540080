"""``mars distill``: params ``distill`` and ``tasks`` + the base model -> :func:`mars.training.distill.distill`."""

from __future__ import annotations

import argparse

from mars.cli.options import add_params_arguments, params_from_args
from mars.config import section


def main(argv: list[str], verb: str = "distill") -> int:
    from mars.training import distill
    from mars.training.tasks import TasksConfig

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=distill.__doc__.split("\n\n")[0])
    add_params_arguments(parser)
    parser.add_argument("--base", default="models/base", help="the generator: base model dir from `mars base`")
    parser.add_argument("--out", default="data/distilled", help="train.jsonl + manifest.json (default: data/distilled)")
    parser.add_argument("--work", default="data/distill_work", help="resumable shards (default: data/distill_work)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    params = params_from_args(args)
    cfg = section(params, "distill", distill.DistillConfig)
    manifest = distill.distill(cfg, section(params, "tasks", TasksConfig), args.base, args.out, args.work,
                               progress=not args.no_progress)
    if not manifest["enabled"]:
        print(f"distill: off (distill.enabled: false) -> {args.out}/manifest.json")
        return 0
    hit = manifest["hit_limit"]
    print(f"distill: {manifest['rows']} rows of {manifest['prompts']} prompts ({hit['count']} hit max_new_tokens "
          f"{hit['max_new_tokens']}: {'kept' if hit['policy'] == 'keep' else 'dropped'}; {manifest['empty_dropped']} empty "
          f"dropped), {manifest['decoding']['dtype']}, mean {manifest['response_tokens_mean']} tokens -> {args.out}")
    return 0
