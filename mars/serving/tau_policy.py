"""Which tau a row without its own tau decodes at: ``fixed`` (the release's default) or ``adaptive``.

Lower tau only pays while a wider window costs little: a tau < 1 step forwards B slots per row instead
of one, and on a CPU that costs 1.1x-1.8x more per step depending on the batch (FACTS.md), so "lower
tau as the queue grows" alone can lose throughput at peak. The adaptive policy is goodput-driven:

* it measures online the cost of a decoding step per (batch size, window) (:meth:`observe`, the
  median of the last ``cost_samples`` seconds per engine iteration: robust to a neighbour's burst on
  a shared CPU), where the window is the slots read per row:
  1 when every row decodes at tau = 1, B when some row reads masks (its window then holds the tokens
  accepted last step + B-1 masks); and the tokens each tau yields per row and forward;
* before each step it picks, among candidate taus between the floor (the lowest tau the release's gate
  accepted) and the ceiling (the gate's lossless tau, 1.0), the one that maximises the predicted
  generated tokens per second of the whole batch: sum over rows of tokens/forward at the row's tau,
  divided by the step cost at the batch size and the window that tau needs. Rows that named their tau
  keep it; they count in the prediction as they are.

Unmeasured candidates are tried first (each for a few steps), and every ``explore_every``-th decision
re-measures the candidate measured longest ago, so the estimates follow the load. A step cost not yet
measured at this batch size is estimated from the nearest batch sizes measured (:meth:`AdaptiveTau.step_cost`).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal, Sequence

from mars.errors import ConfigError

POLICIES = ("fixed", "adaptive")


@dataclass(frozen=True)
class TauRange:
    default: float  # the fixed policy's tau, and what a release vouches for
    floor: float  # the lowest tau the gate accepted
    ceiling: float = 1.0

    def __post_init__(self):
        if not 0.0 < self.floor <= self.default <= self.ceiling <= 1.0:
            raise ConfigError(f"tau range: need 0 < floor ({self.floor}) <= default ({self.default}) <= ceiling "
                              f"({self.ceiling}) <= 1")

    def candidates(self, steps: int = 2) -> list[float]:
        """The floor, the default, the ceiling and ``steps - 1`` points evenly between floor and ceiling."""
        between = [round(self.floor + (self.ceiling - self.floor) * k / steps, 4) for k in range(1, steps)]
        return sorted({self.floor, self.default, self.ceiling, *between})


class FixedTau:
    name = "fixed"

    def __init__(self, taus: TauRange):
        self.taus = taus
        self.tau = taus.default

    def choose(self, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
               masks: bool = False) -> float:
        return self.tau

    def observe(self, batch: int, slots: int, seconds: float | None, accepted: dict[float, tuple[int, int]]) -> None:
        pass

    def snapshot(self) -> dict:
        return {"policy": self.name, "tau": self.tau, "step_seconds": {}, "tokens_per_forward": {}}


class AdaptiveTau:
    """See the module docstring. Not thread-safe: the engine's stepping thread calls it."""

    name = "adaptive"

    def __init__(self, taus: TauRange, *, alpha: float = 0.2, cost_samples: int = 15, explore_steps: int = 3,
                 explore_every: int = 150, candidates: Sequence[float] | None = None):
        self.taus = taus
        self.candidates = sorted(candidates) if candidates else taus.candidates()
        self.alpha, self.cost_samples = alpha, cost_samples  # alpha: the tokens/forward moving average's rate
        self.explore_steps, self.explore_every = explore_steps, explore_every
        self.cost: dict[tuple[int, int], float] = {}  # (batch, slots) -> seconds per step (median of recent)
        self._recent: dict[tuple[int, int], deque] = {}
        self.tpf: dict[float, float] = {1.0: 1.0}  # tau -> tokens per row and forward (tau = 1: exactly 1)
        self.last_seen: dict[float, int] = {}  # decision count when each candidate last ran
        self.decisions = 0
        self.tau = taus.default
        self._exploring: tuple[float, int] | None = None  # (tau, steps left)

    # -- measurements ------------------------------------------------------------------------------
    def observe(self, batch: int, slots: int, seconds: float | None, accepted: dict[float, tuple[int, int]]) -> None:
        """One iteration of ``batch`` rows reading ``slots`` slots each took ``seconds`` (None: a step with a
        joining prompt, whose cost is not a decoding step's); ``accepted[tau] = (tokens, rows)`` for the rows
        at each tau."""
        if seconds is not None:
            recent = self._recent.setdefault((batch, slots), deque(maxlen=self.cost_samples))
            recent.append(seconds)
            self.cost[(batch, slots)] = statistics.median(recent)
        for tau, (tokens, rows) in accepted.items():
            if rows and tau < 1.0 and tau in self.candidates:  # a request's own tau is not a candidate
                old = self.tpf.get(tau)
                value = tokens / rows
                weight = min(1.0, rows * self.alpha / 4)  # a busy batch moves the average faster
                self.tpf[tau] = value if old is None else old + weight * (value - old)

    def step_cost(self, batch: int, slots: int) -> float | None:
        """The measured cost, else this batch size's cost at the other window scaled by the two windows'
        ratio at the nearest batch size where both were measured, else the nearest batch size's at this window."""
        if (batch, slots) in self.cost:
            return self.cost[(batch, slots)]
        for (b, w), seconds in self.cost.items():
            if b == batch:
                both = [(abs(b2 - batch), b2) for b2, w2 in self.cost if w2 == slots and (b2, w) in self.cost]
                if both:
                    near = min(both)[1]
                    return seconds * self.cost[(near, slots)] / self.cost[(near, w)]
        near = [(abs(b - batch), b) for b, w in self.cost if w == slots]
        return self.cost[(min(near)[1], slots)] if near else None

    # -- decision ----------------------------------------------------------------------------------
    def predict(self, tau: float, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
                masks: bool = False) -> float | None:
        """Predicted generated tokens/s of the batch if its policy rows decode at ``tau`` (``masks``: some
        other row reads masks anyway, a lossless one)."""
        if tau not in self.tpf:
            return None
        slots = block_size if block_size and (masks or tau < 1.0 or any(t < 1.0 for t in fixed_taus)) else 1
        cost = self.step_cost(policy_rows + len(fixed_taus), slots)
        if not cost:
            return None
        return (policy_rows * self.tpf[tau] + sum(self._tpf_near(t) for t in fixed_taus)) / cost

    def _tpf_near(self, tau: float) -> float:
        """A named tau's tokens/forward: that of the nearest measured candidate (1.0 while none is)."""
        known = [t for t in self.tpf if t in self.candidates or t == 1.0]
        return self.tpf[min(known, key=lambda t: abs(t - tau))] if tau < 1.0 and known else 1.0

    def choose(self, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
               masks: bool = False) -> float:
        """The tau for the next step's policy rows; ``fixed_taus``: the other tau rows' own taus."""
        if not policy_rows or not block_size or block_size < 2:
            return self.tau
        self.decisions += 1
        if self._exploring is not None:
            tau, left = self._exploring
            self._exploring = (tau, left - 1) if left > 1 else None
            return self._use(tau)
        best = self.best(fixed_taus, policy_rows, block_size, masks)
        if best is None:  # measure before judging: the lowest unmeasured tau first (the widest window)
            unknown = [t for t in self.candidates
                       if self.predict(t, fixed_taus, policy_rows, block_size, masks) is None]
            return self._explore(min(unknown))
        if self.decisions % self.explore_every == 0:
            return self._explore(min(self.candidates, key=lambda t: self.last_seen.get(t, -1)))
        return self._use(best)

    def best(self, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
             masks: bool = False) -> float | None:
        """The candidate with the highest predicted tokens/s (ties: the higher tau); None while some
        candidate is unmeasured."""
        scores = {t: self.predict(t, fixed_taus, policy_rows, block_size, masks) for t in self.candidates}
        if any(v is None for v in scores.values()):
            return None
        return max(scores, key=lambda t: (scores[t], t))

    def _explore(self, tau: float) -> float:
        self._exploring = (tau, self.explore_steps - 1) if self.explore_steps > 1 else None
        return self._use(tau)

    def _use(self, tau: float) -> float:
        self.last_seen[tau] = self.decisions
        self.tau = tau
        return tau

    def snapshot(self) -> dict:
        return {"policy": self.name, "tau": self.tau,
                "step_seconds": {f"{b}x{w}": s for (b, w), s in sorted(self.cost.items())},
                "tokens_per_forward": {str(t): v for t, v in sorted(self.tpf.items())}}


def make_policy(kind: Literal["fixed", "adaptive"], taus: TauRange):
    if kind == "fixed":
        return FixedTau(taus)
    if kind == "adaptive":
        return AdaptiveTau(taus)
    raise ConfigError(f"tau_policy: must be one of {', '.join(POLICIES)}, got {kind!r}")
