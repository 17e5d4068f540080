"""Real gate decisions for the tests that promote (issue #45: promote derives the verdict again from the
evidence a decision names, so a hand-written decision no longer promotes).

``decide(root, checkpoint, export)`` writes what `mars evaluate` would (``root/eval.json`` and the per-item
outputs under ``root/eval``) for a candidate "mars" against "ar_control", then runs the gate on it
(:func:`mars.evaluation.gate.run_gate`, absolute paths, with the export) and returns ``root/gate.json``.
The lower-level :func:`write_evaluation` and :func:`config` serve the flow test's toy project, which
copies this file in.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from mars.core.atomic import write_json, write_jsonl
from mars.core.digest import sha256_tree
from mars.evaluation.gate import GateConfig, Override, run_gate
from mars.evaluation.metric_key import MetricKey

CANDIDATE, BASELINE = "mars", "ar_control"


def scores(passing: bool, n: int = 40) -> tuple[list[float], list[float]]:
    """(candidate, baseline) per-item scores: the same items right (passes: no drop), or none of the
    baseline's half right (fails: a drop of 0.5 on every one of them)."""
    baseline = [1.0] * (n // 2) + [0.0] * (n - n // 2)
    return (list(baseline) if passing else [0.0] * n), baseline


def write_evaluation(metrics_path: str | Path, eval_dir: str | Path, checkpoint: str | Path,
                     candidate: list[float], baseline: list[float], *, speed_tau: float | None = None,
                     benchmark: str = "a") -> None:
    """eval.json and the per-item outputs behind it, as `mars evaluate` writes them: the candidate (whose
    entries record ``sha256_tree(checkpoint)``) and the baseline at tau 1.0, and the candidate at
    ``speed_tau`` (the same scores) where given."""
    sha = {CANDIDATE: sha256_tree(checkpoint), BASELINE: hashlib.sha256(BASELINE.encode()).hexdigest()}
    entries = [(CANDIDATE, 1.0, candidate), (BASELINE, 1.0, baseline)]
    if speed_tau is not None:
        entries.append((CANDIDATE, float(speed_tau), candidate))
    metrics = {}
    for name, tau, items in entries:
        key = MetricKey(name, benchmark, tau)
        write_jsonl(key.outputs_path(eval_dir), [{"id": f"{benchmark}-{i}", "score": s} for i, s in enumerate(items)])
        metrics[key.format()] = {"score": math.fsum(items) / len(items), "tokens": 100 * len(items),
                                 "forwards": 100 * len(items), "n": len(items), "tau": tau,
                                 "checkpoint_sha256": sha[name]}
    write_json(metrics_path, metrics)


def config(speed_tau: float | None = None, override: Override | None = None, **over) -> GateConfig:
    """The gate's rule for these outcomes: no tolerance, the score check at ``speed_tau`` where given."""
    return GateConfig(**{"candidate": CANDIDATE, "baseline": BASELINE, "tolerance": 0.0, "speed_tau": speed_tau,
                         "max_score_drop": None if speed_tau is None else 0.0,
                         "override": override or Override(), **over})


def decide(root: str | Path, checkpoint: str | Path, export: str | Path, *, passing: bool = True,
           speed_tau: float | None = None, override: Override | None = None) -> Path:
    """``root/gate.json``: `mars gate --export EXPORT` on an evaluation of ``checkpoint`` that passes (or
    fails) against the baseline, recorded with ``override`` where given."""
    root = Path(root).absolute()
    candidate, baseline = scores(passing)
    write_evaluation(root / "eval.json", root / "eval", checkpoint, candidate, baseline, speed_tau=speed_tau)
    out = root / "gate.json"
    run_gate(root / "eval.json", out, config(speed_tau, override), eval_dir=root / "eval",
             export=Path(export).absolute())
    return out
