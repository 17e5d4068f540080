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
  accepted) and the ceiling (1.0), the one that maximises the predicted
  generated tokens per second of the whole batch: sum over rows of tokens/forward at the row's tau,
  divided by the step cost at the batch size and the window that tau needs. Rows that named their tau
  keep it; they count in the prediction as they are.
* tokens/forward per candidate is the mean over its last ``tpf_samples`` row-steps. A row moved into the
  lossless mode has no drafts for one step (it yields one token): the engine leaves that step out of the
  lossless mode's tokens/forward, and the policy moves rows into or out of the lossless mode only for a
  predicted gain above ``switch_margin``.
* with ``lossless`` one more candidate is the lossless mode (:mod:`mars.decoding.loop`): tau = 1.0's
  greedy output with the mask slots as verified drafts, so it costs no score at all. Its window is the
  widest (the last token, B-1 drafts, B-1 masks: 2B-1 slots), so it wins where a wide step is cheap (few
  rows) and gives way to a tau or to plain tau = 1 where it is not. Only greedy rows can take it: while a
  policy row samples, the candidates are the taus. It is where the policy starts settled: it costs no score,
  so a tau must predict more than ``switch_margin`` above it to take the rows out (on SmolLM2 in bf16 it
  was the fastest fixed setting at every load; at 16 rows plain tau = 1 predicted within a few percent of it
  and, settled from the release's tau, the policy spent part of a bursty trace there).

Unmeasured candidates are tried first (each for a few steps), and every ``explore_every``-th decision
re-measures the candidate measured longest ago, so the estimates follow the load. A step cost measured
only a few times at this batch size is read off a line through the window's measured batch sizes
(:meth:`AdaptiveTau.step_cost`): under a changing load most batch sizes are visited for a step or two.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal, Sequence

from mars.errors import ConfigError

POLICIES = ("fixed", "adaptive")
LOSSLESS = "lossless"  # the adaptive policy's candidate beside the taus (a row in the lossless mode)
Arm = float | str  # a tau, or LOSSLESS


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
               lossless_rows: int = 0, greedy: bool = True) -> float:
        return self.tau

    def observe(self, batch: int, slots: int, seconds: float | None, accepted: dict[Arm, tuple[int, int]]) -> None:
        pass

    def snapshot(self) -> dict:
        return {"policy": self.name, "tau": self.tau, "step_seconds": {}, "tokens_per_forward": {}}


class AdaptiveTau:
    """See the module docstring. Not thread-safe: the engine's stepping thread calls it."""

    name = "adaptive"

    def __init__(self, taus: TauRange, *, tpf_samples: int = 128, cost_samples: int = 15, cell_samples: int = 5,
                 explore_steps: int = 3,
                 explore_every: int = 150, switch_margin: float = 0.05, candidates: Sequence[float] | None = None,
                 lossless: bool = False):
        self.taus = taus
        self.candidates: list[Arm] = sorted(candidates) if candidates else taus.candidates()
        if lossless:
            self.candidates.append(LOSSLESS)
        # tokens/forward of an arm: over its last `tpf_samples` row-steps (a step of 16 rows counts 16)
        self.tpf_samples, self.cost_samples, self.cell_samples = tpf_samples, cost_samples, cell_samples
        self._accepted: dict[Arm, tuple[deque, list[int]]] = {}
        self.explore_steps, self.explore_every = explore_steps, explore_every
        # moving rows into or out of the lossless mode costs a step without drafts: only for a gain above this
        self.switch_margin = switch_margin
        self._settled: Arm = LOSSLESS if lossless else taus.default  # the last choice that was not an exploration
        self.cost: dict[tuple[int, int], float] = {}  # (batch, slots) -> seconds per step (median of recent)
        self._recent: dict[tuple[int, int], deque] = {}
        self._lines: dict[int, tuple[float, float] | None] = {}  # slots -> (a, c): see step_cost
        self.tpf: dict[Arm, float] = {1.0: 1.0}  # arm -> tokens per row and forward (tau = 1: exactly 1)
        self.last_seen: dict[Arm, int] = {}  # decision count when each candidate last ran
        self.decisions = 0
        self.arm: Arm = taus.default  # the last choice
        self._exploring: tuple[Arm, int] | None = None  # (arm, steps left)

    @property
    def tau(self) -> float:
        """The tau a policy row decodes at now (the lossless mode's output is tau = 1.0's)."""
        return 1.0 if self.arm == LOSSLESS else self.arm

    # -- measurements ------------------------------------------------------------------------------
    def observe(self, batch: int, slots: int, seconds: float | None, accepted: dict[Arm, tuple[int, int]]) -> None:
        """One iteration of ``batch`` rows reading ``slots`` slots each (2B-1: some row is lossless) took
        ``seconds`` (None: a step with a joining prompt, whose cost is not a decoding step's);
        ``accepted[arm] = (tokens, rows)`` for the rows at each tau and in the lossless mode."""
        if seconds is not None:
            recent = self._recent.setdefault((batch, slots), deque(maxlen=self.cost_samples))
            recent.append(seconds)
            self.cost[(batch, slots)] = statistics.median(recent)
            self._lines.pop(slots, None)
        for arm, (tokens, rows) in accepted.items():
            if rows and arm != 1.0 and arm in self.candidates:  # a request's own tau is not a candidate
                window, sums = self._accepted.setdefault(arm, (deque(), [0, 0]))  # sums: tokens, rows in it
                window.append((tokens, rows))
                sums[0], sums[1] = sums[0] + tokens, sums[1] + rows
                while sums[1] - window[0][1] >= self.tpf_samples:
                    old_tokens, old_rows = window.popleft()
                    sums[0], sums[1] = sums[0] - old_tokens, sums[1] - old_rows
                self.tpf[arm] = sums[0] / sums[1]

    def step_cost(self, batch: int, slots: int) -> float | None:
        """The cell's median once it holds ``cell_samples`` samples; else a line (seconds = a + c x batch,
        least squares over this window's cells, each weighted by its samples) through every batch size
        measured at this window, so that a batch size visited for a step or two (a load passing by) is read
        off the window's whole record rather than one noisy sample; with one batch size measured at this
        window, its cost scaled by another window's line; None while the window was never measured."""
        recent = self._recent.get((batch, slots))
        if recent is not None and len(recent) >= self.cell_samples:
            return self.cost[(batch, slots)]
        line = self._line(slots)
        if line is not None:
            return line[0] + line[1] * batch
        cells = [(abs(b - batch), b) for b, w in self.cost if w == slots]
        if not cells:
            return None
        near = min(cells)[1]
        for other in sorted({w for _, w in self.cost} - {slots}):
            shape = self._line(other)
            if shape is not None:
                return self.cost[(near, slots)] * (shape[0] + shape[1] * batch) / (shape[0] + shape[1] * near)
        return self.cost[(near, slots)]

    def _line(self, slots: int) -> tuple[float, float] | None:
        """(a, c) of seconds = a + c x batch at this window, through its well-measured cells where there
        are two, else through all; None below two batch sizes. The slope is kept >= 0 (a step never gets
        cheaper with more rows; a negative fit is noise)."""
        if slots in self._lines:
            return self._lines[slots]
        cells = [(b, self.cost[(b, w)], len(self._recent[(b, w)])) for b, w in self.cost if w == slots]
        trusted = [cell for cell in cells if cell[2] >= self.cell_samples]
        cells = trusted if len(trusted) >= 2 else cells  # thin cells only shape the line while too few are not
        line = None
        if len(cells) >= 2:
            total = sum(n for _, _, n in cells)
            mean_b = sum(b * n for b, _, n in cells) / total
            mean_s = sum(s * n for _, s, n in cells) / total
            spread = sum(n * (b - mean_b) ** 2 for b, _, n in cells)
            slope = max(0.0, sum(n * (b - mean_b) * (s - mean_s) for b, s, n in cells) / spread)
            line = (mean_s - slope * mean_b, slope)
        self._lines[slots] = line
        return line

    # -- decision ----------------------------------------------------------------------------------
    def predict(self, arm: Arm, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
                lossless_rows: int = 0) -> float | None:
        """Predicted generated tokens/s of the batch if its policy rows decode at ``arm`` (``lossless_rows``:
        rows that asked for the lossless mode themselves)."""
        if arm not in self.tpf:
            return None
        if arm == LOSSLESS or lossless_rows:
            slots = 2 * block_size - 1
        elif arm < 1.0 or any(t < 1.0 for t in fixed_taus):
            slots = block_size
        else:
            slots = 1
        cost = self.step_cost(policy_rows + len(fixed_taus) + lossless_rows, slots)
        if not cost:
            return None
        named = sum(self._tpf_near(t) for t in fixed_taus) + lossless_rows * self.tpf.get(LOSSLESS, 1.0)
        return (policy_rows * self.tpf[arm] + named) / cost

    def _tpf_near(self, tau: float) -> float:
        """A named tau's tokens/forward: that of the nearest measured candidate tau (1.0 while none is)."""
        known = [t for t in self.tpf if t != LOSSLESS and (t in self.candidates or t == 1.0)]
        return self.tpf[min(known, key=lambda t: abs(t - tau))] if tau < 1.0 and known else 1.0

    def _open(self, greedy: bool) -> list[Arm]:
        return self.candidates if greedy else [a for a in self.candidates if a != LOSSLESS]

    def choose(self, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
               lossless_rows: int = 0, greedy: bool = True) -> Arm:
        """The arm for the next step's policy rows (a tau, or LOSSLESS); ``fixed_taus``: the other tau rows'
        own taus; ``greedy``: every policy row is greedy (else the lossless mode is not a candidate)."""
        if not policy_rows or not block_size or block_size < 2:
            return self.arm
        self.decisions += 1
        open_ = self._open(greedy)
        if self._exploring is not None:
            arm, left = self._exploring
            self._exploring = (arm, left - 1) if left > 1 else None
            if arm in open_:
                return self._use(arm)
            self._exploring = None
        scores = {a: self.predict(a, fixed_taus, policy_rows, block_size, lossless_rows) for a in open_}
        best = _best(scores)
        if best is None:  # measure before judging: the widest unmeasured window first
            return self._explore(min((a for a, v in scores.items() if v is None), key=_width_order))
        if self.decisions % self.explore_every == 0:
            return self._explore(min(open_, key=lambda a: self.last_seen.get(a, -1)))
        settled = self._settled
        if (best == LOSSLESS) != (settled == LOSSLESS) and settled in scores:
            now = scores[settled]
            if now and scores[best] < now * (1 + self.switch_margin):
                best = settled
        self._settled = best
        return self._use(best)

    def best(self, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
             lossless_rows: int = 0, greedy: bool = True) -> Arm | None:
        """The candidate with the highest predicted tokens/s (ties: the narrower window); None while
        some candidate is unmeasured."""
        return _best({a: self.predict(a, fixed_taus, policy_rows, block_size, lossless_rows)
                      for a in self._open(greedy)})

    def _explore(self, arm: Arm) -> Arm:
        steps = self.explore_steps + (arm == LOSSLESS)  # its first step has no drafts yet (not counted)
        self._exploring = (arm, steps - 1) if steps > 1 else None
        return self._use(arm)

    def _use(self, arm: Arm) -> Arm:
        self.last_seen[arm] = self.decisions
        self.arm = arm
        return arm

    def snapshot(self) -> dict:
        return {"policy": self.name, "tau": self.tau, "arm": str(self.arm),
                "step_seconds": {f"{b}x{w}": s for (b, w), s in sorted(self.cost.items())},
                "tokens_per_forward": {str(a): v for a, v in sorted(self.tpf.items(), key=lambda kv: _width_order(kv[0]))}}


def _best(scores: dict[Arm, float | None]) -> Arm | None:
    if any(v is None for v in scores.values()):
        return None
    return max(scores, key=lambda a: (scores[a], _width_order(a)))


def _width_order(arm: Arm) -> float:
    """Lower first: the lossless mode (the widest window), then the taus from low to high."""
    return -1.0 if arm == LOSSLESS else arm


def make_policy(kind: Literal["fixed", "adaptive"], taus: TauRange, *, lossless: bool = False):
    """``lossless``: the adaptive policy may put greedy rows in the lossless mode (see the module docstring)."""
    if kind == "fixed":
        return FixedTau(taus)
    if kind == "adaptive":
        return AdaptiveTau(taus, lossless=lossless)
    raise ConfigError(f"tau_policy: must be one of {', '.join(POLICIES)}, got {kind!r}")
