"""The name of one evaluation: ``<checkpoint>/<benchmark>/tau=<tau>``.

It keys ``metrics/eval.json`` (written by :mod:`mars.evaluation.evaluate`, read by the gate and the
plots) and names the per-item outputs ``<out>/<checkpoint>/<benchmark>/tau=<tau>.jsonl``. tau is
written as Python writes the float (``tau=1.0``, ``tau=0.95``), so formatting a parsed key gives the
same key back.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from mars.errors import MarsError

TAU_PREFIX = "tau="


class MetricKey(NamedTuple):
    checkpoint: str
    benchmark: str
    tau: float

    def format(self) -> str:
        for what, name in (("checkpoint", self.checkpoint), ("benchmark", self.benchmark)):
            if not name or "/" in name:
                raise MarsError(f"metric key: {what} name {name!r} must be non-empty and contain no '/'")
        return f"{self.checkpoint}/{self.benchmark}/{TAU_PREFIX}{float(self.tau)}"

    def outputs_path(self, root: str | Path) -> Path:
        """Where the per-item outputs behind this entry live under ``root``."""
        return Path(root) / self.checkpoint / self.benchmark / f"{TAU_PREFIX}{float(self.tau)}.jsonl"

    @classmethod
    def parse(cls, key: str) -> MetricKey:
        parts = key.split("/") if isinstance(key, str) else []
        tau = _tau(parts[2]) if len(parts) == 3 else None
        if tau is None or not parts[0] or not parts[1]:
            raise MarsError(f"metric key {key!r}: expected '<checkpoint>/<benchmark>/tau=<tau>'")
        return cls(parts[0], parts[1], tau)


def metric_key(checkpoint: str, benchmark: str, tau: float) -> str:
    """The key of one evaluation in metrics/eval.json."""
    return MetricKey(checkpoint, benchmark, float(tau)).format()


def _tau(part: str) -> float | None:
    if not part.startswith(TAU_PREFIX):
        return None
    try:
        tau = float(part[len(TAU_PREFIX):])
    except ValueError:
        return None
    return tau if math.isfinite(tau) else None
