"""``mars gate``: params ``gate`` (+ ``--override``) and metrics/eval.json -> :func:`mars.evaluation.gate.run_gate`.

Exits 1 when the gate does not pass, so ``dvc repro`` and the flow stop there.
"""

from __future__ import annotations

import argparse
import sys

from mars.cli.options import add_params_arguments, params_from_args
from mars.config import section
from mars.errors import ConfigError


def check_line(c: dict) -> str:
    """One line of a check: verdict, paired difference +- SE, adjusted p and what it could detect."""
    verdict = {True: "ok  ", False: "FAIL", None: "    "}[c["passed"]]
    if c.get("delta") is not None:
        p = f", p {c['p_holm']:.3g} (Holm)" if c.get("p_holm") is not None else ""
        detect = f", detects drops >= {c['mdd']:.4f}" if c.get("mdd") is not None else ""
        se = "n/a" if c.get("se") is None else f"{c['se']:.4f}"  # under two paired items
        return (f"{verdict} {c['name']}: {c['candidate']:.4f} vs {c['baseline']:.4f}, paired delta {c['delta']:+.4f} "
                f"+- {se} (n {c['n']}{p}{detect}){'' if c['gated'] else ' [reported]'}")
    if "value" in c:
        return f"{verdict} {c['name']}: {c['value']:.4f} (limit {c['limit']:.4f})"
    return f"{verdict} {c['name']}: {c.get('message') or ''}"


def main(argv: list[str], verb: str = "gate") -> int:
    from mars.evaluation import gate

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=gate.__doc__.split("\n\n")[0])
    add_params_arguments(parser)
    parser.add_argument("--metrics", default="metrics/eval.json", help="evaluation metrics (mars evaluate)")
    parser.add_argument("--out", default="metrics/gate.json", help="where the decision goes")
    parser.add_argument("--eval-dir", default="eval",
                        help="mars evaluate's per-item outputs, which the rule decides from (default: eval)")
    parser.add_argument("--export", help="the export made from the candidate (its sha256 goes into the decision)")
    parser.add_argument("--override", metavar="REASON", help="pass the gate anyway, recording REASON")
    parser.add_argument("--override-by", metavar="WHO", help="who overrides (required with --override)")
    args = parser.parse_args(argv)
    cfg = section(params_from_args(args), "gate", gate.GateConfig)
    if args.override is not None or args.override_by is not None:
        if not (args.override or "").strip() or not (args.override_by or "").strip():
            raise ConfigError("--override REASON needs --override-by WHO (and the other way round): an override "
                              "records why and who")
        cfg.override = gate.Override(True, args.override, args.override_by)
    decision = gate.run_gate(args.metrics, args.out, cfg, eval_dir=args.eval_dir, export=args.export)
    for c in decision["checks"]:
        print(check_line(c))
    rule = decision["rule"]
    print(f"rule: {rule['tests']} test(s), alpha {rule['alpha']} over all (Holm); minimum detectable drops at "
          f"power {rule['power']}")
    if decision["overridden"]:
        print(f"gate OVERRIDDEN by {cfg.override.by}: {cfg.override.reason}", file=sys.stderr)
    elif not decision["passed"]:
        print("gate FAILED:\n  " + "\n  ".join(decision["failures"]), file=sys.stderr)
    else:
        print(f"gate passed: {cfg.candidate} vs {cfg.baseline} at tau={cfg.tau}")
    return 0 if decision["passed"] else 1
