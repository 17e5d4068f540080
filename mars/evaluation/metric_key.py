"""The name of one evaluation: ``<checkpoint>/<benchmark>/tau=<tau>``, or ``<checkpoint>/<benchmark>/lossless``.

It keys ``metrics/eval.json`` (written by :mod:`mars.evaluation.evaluate`, read by the gate and the
plots) and names the per-item outputs ``<out>/<checkpoint>/<benchmark>/<point>.jsonl``. tau is
written as Python writes the float (``tau=1.0``, ``tau=0.95``), so formatting a parsed key gives the
same key back. The lossless decoding mode (:mod:`mars.decoding.accept`) has no threshold: its key holds
``tau=None`` and reads ``lossless``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from mars.errors import MarsError

TAU_PREFIX = "tau="
LOSSLESS = "lossless"


class MetricKey(NamedTuple):
    checkpoint: str
    benchmark: str
    tau: float | None  # None: the lossless mode

    @property
    def mode(self) -> str:
        """The decoding mode of this evaluation: ``"tau"`` or ``"lossless"``."""
        return LOSSLESS if self.tau is None else "tau"

    @property
    def point(self) -> str:
        """The last part of the key: ``tau=<tau>`` or ``lossless``."""
        return LOSSLESS if self.tau is None else f"{TAU_PREFIX}{float(self.tau)}"

    def format(self) -> str:
        for what, name in (("checkpoint", self.checkpoint), ("benchmark", self.benchmark)):
            if not name or "/" in name:
                raise MarsError(f"metric key: {what} name {name!r} must be non-empty and contain no '/'")
        return f"{self.checkpoint}/{self.benchmark}/{self.point}"

    def outputs_path(self, root: str | Path) -> Path:
        """Where the per-item outputs behind this entry live under ``root``."""
        return Path(root) / self.checkpoint / self.benchmark / f"{self.point}.jsonl"

    @classmethod
    def parse(cls, key: str) -> MetricKey:
        parts = key.split("/") if isinstance(key, str) else []
        point = _point(parts[2]) if len(parts) == 3 else None
        if point is None or not parts[0] or not parts[1]:
            raise MarsError(f"metric key {key!r}: expected '<checkpoint>/<benchmark>/tau=<tau>' "
                            f"or '<checkpoint>/<benchmark>/{LOSSLESS}'")
        return cls(parts[0], parts[1], point[0])


def metric_key(checkpoint: str, benchmark: str, tau: float | None) -> str:
    """The key of one evaluation in metrics/eval.json (``tau=None``: the lossless mode)."""
    return MetricKey(checkpoint, benchmark, None if tau is None else float(tau)).format()


def sweep_order(tau: float | None) -> tuple[bool, float]:
    """Sort key of an evaluation point: the tau sweep from 1.0 down, then the lossless mode."""
    return (tau is None, 0.0 if tau is None else -float(tau))


def _point(part: str) -> tuple[float | None] | None:
    """``(tau,)`` of a key's last part (``(None,)`` for lossless); None when it is neither form."""
    if part == LOSSLESS:
        return (None,)
    if not part.startswith(TAU_PREFIX):
        return None
    try:
        tau = float(part[len(TAU_PREFIX):])
    except ValueError:
        return None
    return (tau,) if math.isfinite(tau) else None
