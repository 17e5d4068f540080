"""The promotion gate: MARS at tau = 1.0 must not be worse than the AR baseline (``mars gate``).

Checks, on ``metrics/eval.json`` (written by ``mars evaluate``):

1. per benchmark: ``candidate@tau`` >= ``baseline@tau`` - ``tolerance`` (tau = ``gate.tau``, 1.0);
2. on average over those benchmarks: the same with ``average_tolerance``;
3. optionally, at ``speed_tau`` (a tau < 1 where MARS is meant to be used): the candidate's average
   tokens/forward is at least ``min_tokens_per_forward``, and its average score is at most
   ``max_score_drop`` below the baseline's at ``tau``. An AR model never trained with masks decodes
   exactly like the baseline at tau = 1.0 but is confidently wrong below it; check 3 is what stops it.

The decision and every number it used go to ``metrics/gate.json``; the verb exits 1 when the gate does
not pass, so ``dvc repro`` and the flow stop. An explicit override (``gate.override`` in params, or
``--override REASON``) passes it anyway and is recorded as such.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mars.core.atomic import read_json, write_json
from mars.core.digest import sha256_file
from mars.config import add_params_arguments, params_from_args, section
from mars.errors import ConfigError, MarsError


@dataclass
class Override:
    enabled: bool = False
    reason: str = ""
    by: str = ""

    def __post_init__(self):
        if self.enabled and not self.reason.strip():
            raise ConfigError("override.reason: an override needs a reason")


@dataclass
class GateConfig:
    """The ``gate:`` section of params.yaml."""

    candidate: str = "mars"
    baseline: str = "ar_control"  # or "sft"
    tau: float = 1.0
    tolerance: float = 0.02  # score points (scores are 0..1) the candidate may trail per benchmark
    average_tolerance: float | None = None  # None: same as tolerance
    benchmarks: list[str] = field(default_factory=list)  # empty: every benchmark both have at tau
    speed_tau: float | None = None  # None: no check below tau = 1.0
    min_tokens_per_forward: float | None = None
    max_score_drop: float | None = None
    override: Override = field(default_factory=Override)

    def __post_init__(self):
        if self.baseline == self.candidate:
            raise ConfigError(f"baseline: must differ from the candidate ({self.candidate!r})")
        if self.tolerance < 0 or (self.average_tolerance is not None and self.average_tolerance < 0):
            raise ConfigError("tolerance: must be >= 0")
        if (self.min_tokens_per_forward is not None or self.max_score_drop is not None) and self.speed_tau is None:
            raise ConfigError("speed_tau: min_tokens_per_forward / max_score_drop need the tau they apply at")
        if self.speed_tau is not None and not 0 < self.speed_tau <= 1:
            raise ConfigError(f"speed_tau: must be in (0, 1], got {self.speed_tau}")


def metric_key(checkpoint: str, benchmark: str, tau: float) -> str:
    """The key of one evaluation in metrics/eval.json."""
    return f"{checkpoint}/{benchmark}/tau={float(tau)}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def decide(metrics: dict, cfg: GateConfig) -> dict:
    """The gate decision (JSON-ready) for eval metrics ``metrics``; pure: no files."""
    checks: list[dict] = []
    failures: list[str] = []

    def check(name: str, kind: str, value: float, limit: float, ok: bool, message: str, **extra) -> None:
        checks.append({"name": name, "kind": kind, "value": value, "limit": limit, "passed": ok, **extra})
        if not ok:
            failures.append(message)

    def entry(ckpt: str, bench: str, tau: float) -> dict | None:
        return metrics.get(metric_key(ckpt, bench, tau))

    def benchmarks_at(ckpt: str, tau: float) -> set[str]:
        suffix = f"/tau={float(tau)}"
        return {k[len(ckpt) + 1: -len(suffix)] for k in metrics if k.startswith(ckpt + "/") and k.endswith(suffix)}

    cand, base = cfg.candidate, cfg.baseline
    names = cfg.benchmarks or sorted(benchmarks_at(cand, cfg.tau) | benchmarks_at(base, cfg.tau))
    compared: list[tuple[str, float, float]] = []
    for bench in names:
        c, b = entry(cand, bench, cfg.tau), entry(base, bench, cfg.tau)
        if c is None or b is None:
            missing = [metric_key(x, bench, cfg.tau) for x, e in ((cand, c), (base, b)) if e is None]
            check(bench, "missing", float("nan"), float("nan"), False, f"{bench}: no metrics for {', '.join(missing)}")
            continue
        limit = b["score"] - cfg.tolerance
        ok = c["score"] >= limit - 1e-12
        check(bench, "benchmark", c["score"], limit, ok,
              f"{bench}: {cand} {c['score']:.4f} < {base} {b['score']:.4f} - tolerance {cfg.tolerance}",
              candidate=c["score"], baseline=b["score"], delta=c["score"] - b["score"], n=c.get("n"))
        compared.append((bench, c["score"], b["score"]))
    if not names:
        check("benchmarks", "missing", float("nan"), float("nan"), False,
              f"no benchmark has metrics for {cand} or {base} at tau={float(cfg.tau)}")

    avg_tol = cfg.tolerance if cfg.average_tolerance is None else cfg.average_tolerance
    if compared:
        c_avg, b_avg = _mean([c for _, c, _ in compared]), _mean([b for _, _, b in compared])
        check("average", "average", c_avg, b_avg - avg_tol, c_avg >= b_avg - avg_tol - 1e-12,
              f"average: {cand} {c_avg:.4f} < {base} {b_avg:.4f} - tolerance {avg_tol}",
              candidate=c_avg, baseline=b_avg, delta=c_avg - b_avg, benchmarks=[n for n, _, _ in compared])

    if cfg.speed_tau is not None and compared:
        fast = {bench: entry(cand, bench, cfg.speed_tau) for bench, _, _ in compared}
        absent = [metric_key(cand, b, cfg.speed_tau) for b, e in fast.items() if e is None]
        if absent:
            check("speed", "missing", float("nan"), float("nan"), False, f"speed: no metrics for {', '.join(absent)}")
        else:
            tokens = sum(e["tokens"] for e in fast.values())
            forwards = sum(e["forwards"] for e in fast.values())
            tpf = tokens / forwards if forwards else 0.0
            if cfg.min_tokens_per_forward is not None:
                check("tokens_per_forward", "speed", tpf, cfg.min_tokens_per_forward, tpf >= cfg.min_tokens_per_forward,
                      f"speed: {cand} at tau={cfg.speed_tau} makes {tpf:.3f} tokens/forward "
                      f"< {cfg.min_tokens_per_forward}", tau=cfg.speed_tau)
            if cfg.max_score_drop is not None:
                fast_avg = _mean([e["score"] for e in fast.values()])
                b_avg = _mean([b for _, _, b in compared])
                limit = b_avg - cfg.max_score_drop
                check("score_at_speed_tau", "speed", fast_avg, limit, fast_avg >= limit - 1e-12,
                      f"speed: {cand} at tau={cfg.speed_tau} averages {fast_avg:.4f} < {base} {b_avg:.4f} "
                      f"- max_score_drop {cfg.max_score_drop}", tau=cfg.speed_tau, candidate=fast_avg, baseline=b_avg)

    checks_passed = not failures
    overridden = cfg.override.enabled and not checks_passed
    return {
        "passed": checks_passed or cfg.override.enabled,
        "checks_passed": checks_passed,
        "overridden": overridden,
        "override": asdict(cfg.override),
        "candidate": cand,
        "baseline": base,
        "tau": cfg.tau,
        "tolerance": cfg.tolerance,
        "average_tolerance": avg_tol,
        "speed_tau": cfg.speed_tau,
        "min_tokens_per_forward": cfg.min_tokens_per_forward,
        "max_score_drop": cfg.max_score_drop,
        "checks": checks,
        "failures": failures,
    }


def read_metrics(path: str | Path) -> dict:
    path = Path(path)
    data = read_json(path, "no evaluation metrics: run `mars evaluate` first")
    if not isinstance(data, dict):
        raise MarsError(f"{path}: expected an object of '<checkpoint>/<benchmark>/tau=<tau>' entries")
    for key, value in data.items():
        if not isinstance(value, dict) or not {"score", "tokens", "forwards"} <= set(value):
            raise MarsError(f"{path}: entry {key!r} lacks score/tokens/forwards")
    return data


def run_gate(metrics_path: str | Path, out: str | Path, cfg: GateConfig) -> dict:
    decision = decide(read_metrics(metrics_path), cfg)  # raises first when the file is missing or malformed
    decision["metrics"] = str(metrics_path)
    decision["metrics_sha256"] = sha256_file(metrics_path)
    write_json(out, decision)
    return decision


def cli(argv: list[str], verb: str = "gate") -> int:
    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=__doc__.split("\n\n")[0])
    add_params_arguments(parser)
    parser.add_argument("--metrics", default="metrics/eval.json", help="evaluation metrics (mars evaluate)")
    parser.add_argument("--out", default="metrics/gate.json", help="where the decision goes")
    parser.add_argument("--override", metavar="REASON", help="pass the gate anyway, recording REASON")
    parser.add_argument("--override-by", metavar="WHO", help="who overrides (default: the current user)")
    args = parser.parse_args(argv)
    cfg = section(params_from_args(args), "gate", GateConfig)
    if args.override is not None:
        cfg.override = Override(True, args.override, args.override_by or getpass.getuser())
    elif cfg.override.enabled and not cfg.override.by:
        raise ConfigError("gate.override.by: an override must say who made it")
    decision = run_gate(args.metrics, args.out, cfg)
    for c in decision["checks"]:
        print(f"{'ok  ' if c['passed'] else 'FAIL'} {c['name']}: {c['value']:.4f} (limit {c['limit']:.4f})")
    if decision["overridden"]:
        print(f"gate OVERRIDDEN by {cfg.override.by}: {cfg.override.reason}", file=sys.stderr)
    elif not decision["passed"]:
        print("gate FAILED:\n  " + "\n  ".join(decision["failures"]), file=sys.stderr)
    else:
        print(f"gate passed: {cfg.candidate} vs {cfg.baseline} at tau={cfg.tau}")
    return 0 if decision["passed"] else 1
