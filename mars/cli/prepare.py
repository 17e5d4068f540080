"""``mars prepare``: params ``data`` -> :func:`mars.training.data.prepare`, and a summary of its stats."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mars.cli.options import add_params_arguments, params_from_args
from mars.config import section


def print_summary(meta: dict, stats_path: Path, seconds: float) -> None:
    from mars.training.data import SPLITS

    stats = json.loads(stats_path.read_text())["splits"]
    for split in SPLITS:
        s = stats[split]
        tok = s["tokens"].get("total", {})
        skipped = ", ".join(f"{k} {v}" for k, v in s["skipped"].items()) or "none"
        blank = f" (+ {s['blank_lines']} blank lines)" if s.get("blank_lines") else ""
        print(f"{split}: {s['kept']} examples from {s['rows_read']} rows{blank}; tokens mean {tok.get('mean')} "
              f"max {tok.get('max')}; truncated {s['truncated']}; skipped: {skipped}")
    print(f"prepared {meta['source']} in {seconds:.1f}s (mask id {meta['mask_token_id']}, "
          f"max_length {meta['max_length']})")


def main(argv: list[str], verb: str = "prepare") -> int:
    from mars.training import data

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=data.__doc__.split("\n\n")[0])
    add_params_arguments(parser)
    parser.add_argument("--base", default="models/base", help="base model dir from `mars base` (its tokenizer)")
    parser.add_argument("--out", default="data/prepared", help="output directory (default: data/prepared)")
    args = parser.parse_args(argv)
    cfg = section(params_from_args(args), "data", data.DataConfig)
    start = time.perf_counter()
    meta = data.prepare(cfg, args.base, args.out)
    print_summary(meta, Path(args.out) / "stats.json", time.perf_counter() - start)
    return 0
