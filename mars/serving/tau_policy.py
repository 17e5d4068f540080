"""Which tau a row without its own tau decodes at: ``fixed`` (the release's default) or ``adaptive``.

Lower tau only pays while a wider window costs little: a tau < 1 step forwards B slots per row instead
of one, and on a CPU that costs 1.1x-1.8x more per step depending on the batch (FACTS.md), so "lower
tau as the queue grows" alone can lose throughput at peak. The adaptive policy is goodput-driven:

* it measures online the cost of a decoding step per (batch size, window) (:meth:`observe`, the
  median of the last ``cost_samples`` seconds per engine iteration: robust to a neighbour's burst on
  a shared CPU), where the window is the slots read per row:
  1 when every row decodes at tau = 1, B when some row reads masks (its window then holds the tokens
  accepted last step + B-1 masks); and the tokens each tau yields per row and forward;
* before each step it picks the candidate that maximises the predicted generated tokens per second of
  the load: per batch, the sum over rows of tokens/forward at the row's tau, divided by the step cost at
  the batch size and the window that tau needs, summed over the batches of the last ``load_steps``
  decisions (:meth:`AdaptiveTau._scores`: chosen for each batch as it came, the policy moved at every
  other step while rows came and went). The candidate taus are the floor (the lowest tau the
  release's gate accepted) and the ceiling (1.0): a tau between them reads the floor's window at its
  cost and accepts fewer tokens (:meth:`TauRange.candidates`). Rows that named their tau keep it; they
  count in the prediction as they are.
* a step that takes new requests forwards their prompts beside the batch's windows. Its cost beyond the
  decoding step it joined is measured per prompt token and batch size, and the prediction charges each
  generated token its share of it (the traffic's prompt tokens per generated token, measured too:
  :meth:`AdaptiveTau.prompt_cost`). At high load that is much of a step's cost: on SmolLM2 in bf16 on a
  2-core CPU at 16 streams about half the steps take a prompt (62 tokens after the prefix cache, ~25
  generated a request), and a 16-row step that took one cost ~40 ms more than a decoding step.
* tokens/forward is estimated on the latest requests and compared on the same ones. The policy rows' last
  ``tpf_samples`` row-steps, and at least ``tpf_steps`` steps (at whatever arm they ran), give the level; an
  arm's estimate is that level with each step's tokens scaled by a paired ratio between the arm it ran at
  and the arm asked about (:meth:`AdaptiveTau.tokens_per_forward`). A pair's ratio comes from explorations:
  each is bracketed by the settled arm's steps just before and just after on the same rows, and the ratio is
  tokens/forward over the explorations against the brackets' (pooled over the last ``pair_samples``
  row-steps of each side: it is a property of the model and the traffic, not of the load). Why paired:
  tokens/forward depends on the request (how predictable its text is) far more than on the tau, and a window
  of an arm's own steps holds the requests it happened to run on, so comparing two arms' windows compared
  requests, not arms (on the default profile's toy the windows read the lossless mode 1.81 against tau =
  0.9's 3.32 while, decoded side by side, lossless was the faster fixed setting). tau = 1 yields exactly one
  token a row. A lone row's tokens swing from step to step, so the settled arm moves to an arm it pairs only
  once their explorations hold ``pair_trust`` row-steps of each; and since a tau < 1 gives up score for speed,
  it takes the rows out of the lossless mode only where its predicted gain stands above ``switch_margin`` by
  ``confidence`` standard errors of the pairs' ratio (read off the spread of the explorations' own ratios), and
  keeps them only while the gain stands above the noise (:meth:`AdaptiveTau._convinced`).
* a row's first step at a new arm yields what its old arm left it: moved into the lossless mode, no drafts
  (one token); to another lossless width, the old width's drafts (narrowed, it verifies all B-1 of them;
  widened, its one); out of it to a tau, a cache holding every verified draft (on the default profile's toy
  at one row, tau = 0.9's first step after the lossless mode yielded 2.39 tokens against 2.07 at its later
  steps). The engine leaves that step out of the arm's tokens/forward: counted, the explorations of block
  size 2 from B read the wide arm's drafts and the steps back at B read one draft (on the toy at one stream
  the policy then ran block size 2 for 41% of its steps, 21% slower there than B), and tau = 0.9's
  brackets and explorations beside the lossless mode read it ahead (a ratio of 0.955 for lossless over tau =
  0.9, pooled over 1000 requests at one stream, where the two yield the same decoded alternately).
* the settled arm moves only for a predicted gain above ``switch_margin``: a move into the lossless mode
  or wider in it costs a step, and on a shared CPU the step costs wander (in ``bench_serve`` on the
  default profile's toy at 16 streams the cells at 15 rows, measured while a request leaves and the next
  arrives, read tau = 1 within 1% of tau = 0.9, and with no margin the policy spent 10-26% of its steps
  at tau = 1, which is 30% slower there). A move into the lossless mode from a tau needs only
  ``enter_margin``: its output is tau = 1.0's, so a tau < 1 has to earn its score loss by a clear gain,
  and where the two tie the policy decodes losslessly (on the toy, tau = 0.9 and lossless at B were
  within noise at every load, and settled at tau = 0.9 by one noisy estimate the policy stayed there).
  So does a move between lossless widths: the same greedy output, for at most one step with fewer drafts
  (on SmolLM2 in bf16 at 4 streams, settled at block size 2 on its first estimates, the policy stayed
  there for 94% of a level whose end it scored B 5.7% ahead, where B fixed was 2.3% faster).
* with ``lossless`` one more candidate is the lossless mode (:mod:`mars.decoding.loop`): tau = 1.0's
  greedy output with the mask slots as verified drafts, so it costs no score at all. Its window is the
  widest (the last token, B-1 drafts, B-1 masks: 2B-1 slots), so it wins where a wide step is cheap (few
  rows) and gives way to a tau or to plain tau = 1 where it is not. Only greedy rows can take it: while a
  policy row samples, the candidates are the taus. It is where the policy starts settled: it costs no score,
  so a tau must predict more than ``switch_margin`` above it to take the rows out (on SmolLM2 in bf16 it
  was the fastest fixed setting at every load; at 16 rows plain tau = 1 predicted within a few percent of it
  and, settled from the release's tau, the policy spent part of a bursty trace there).
* the lossless mode also comes narrower (``lossless_block_sizes``, default 2): at block size w < B a row
  forwards w - 1 drafts and w - 1 masks, a 2w-1 window, for the same greedy tokens. The width is a knob
  load turns: on SmolLM2 in bf16 on a 2-core CPU a 7-slot step costs 1.03-1.06x a 1-slot one at batch 1
  and 1.9-2.0x at batch 16, a 3-slot step 1.0x and 1.35x, and in ``bench_serve`` lossless at block size 2
  was 7% behind B at one stream and 6% ahead of it at 16 streams (1.56 tokens/forward against 1.82, for a
  cheaper step). Moving between lossless widths keeps a row's drafts (a narrower row verifies what it has).

Unmeasured candidates are tried first, and every ``explore_every`` decisions the policy re-measures the
candidate measured longest ago (of those predicted within ``explore_within`` of the best; one further
behind only every ``explore_far_every`` decisions), so the estimates follow the load. Both turns come as
much less often as a paired exploration lasts longer than ``explore_steps`` steps at the load's rows (at
one row 12 steps: every 600 decisions), so that ~2% of the steps explore at any load: every 150, on the
default profile's toy at one stream 12% of the steps explored (in-process, 288 requests). An exploration lasts
``explore_steps`` steps, or ``explore_rows`` row-steps where it pairs arms (12 steps of a lone row: see
:meth:`AdaptiveTau._explore`). An arm predicted ahead of the settled one by the margin, but on fewer
than ``pair_trust`` paired row-steps, is explored at once and again ``pair_gap`` exploration lengths after
each ends, until the pairs are trusted: waiting for the regular turn, a short load ends before the policy may move.
Where every step takes a prompt (short answers at many streams) no window is measured decoding alone; after
an exploration's worth of such steps a window is priced by its whole steps (:meth:`AdaptiveTau._whole_step_cost`).
A step cost measured only a few times at this batch size is read off a cost model fitted over every
measured cell (a fixed part, a part per row, a part per token forwarded and a part per row of a window wider than
one slot: :meth:`AdaptiveTau.step_cost`):
under a changing load most batch sizes are visited for a step or two. A window the policy is not settled in
is priced against the settled one side by side, as tokens/forward is: each exploration's decoding steps
against the settled arm's around it, a ratio pooled over explorations (:meth:`AdaptiveTau._cost_ratio`), and
the settled arm moves to another window only once it is priced so (:meth:`AdaptiveTau._costs_paired`).
"""

from __future__ import annotations

import math
import operator
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np

from mars.errors import ConfigError

POLICIES = ("fixed", "adaptive")
LOSSLESS = "lossless"  # the adaptive policy's candidate beside the taus (a row in the lossless mode)
Arm = float | str  # a tau, LOSSLESS (at the checkpoint's B) or a narrower lossless arm, "lossless:w"


def narrow_lossless(width: int) -> str:
    """The arm of the lossless mode at block size ``width`` < B: w - 1 drafts and w - 1 masks a step."""
    return f"{LOSSLESS}:{width}"


def is_lossless(arm: Arm) -> bool:
    return isinstance(arm, str) and (arm == LOSSLESS or arm.startswith(LOSSLESS + ":"))


def arm_block_size(arm: Arm, block_size: int) -> int:
    """The block size a row decodes at under ``arm`` in a batch of B = ``block_size``."""
    return int(arm.split(":")[1]) if isinstance(arm, str) and ":" in arm else block_size


def arm_of(tau: float, lossless: bool, row_block_size: int | None, block_size: int) -> Arm:
    """The arm a row decodes at: its tau, or the lossless arm of its block size."""
    if not lossless:
        return tau
    width = min(row_block_size or block_size, block_size)
    return LOSSLESS if width >= block_size else narrow_lossless(width)


@dataclass
class _Bracket:
    """One exploration of ``arm`` and the ``settled`` arm's steps around it, on the same rows."""

    arm: Arm
    settled: Arm
    after_left: int  # settled steps still to take after the exploration
    widths: bool  # both arms are lossless widths (see yields)
    during: list[int] = field(default_factory=lambda: [0, 0])  # tokens, rows at `arm`
    # tokens, rows at `settled`: the steps just before, then the steps just after
    base: list[int] = field(default_factory=lambda: [0, 0])
    # the same of the steps that took no prompts
    during_decoding: list[int] = field(default_factory=lambda: [0, 0])
    base_decoding: list[int] = field(default_factory=lambda: [0, 0])
    # the decoding steps' seconds, by (batch, slots), at `arm` and at `settled` (see AdaptiveTau._cost_ratio)
    during_cost: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    base_cost: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def add(self, during: bool, step: tuple[int, int] | None, cost: tuple[int, int, float] | None) -> None:
        """A step of ``arm`` (``during``) or of ``settled``: its ``(tokens, rows)`` (None: not counted) and, a step
        that took no prompts, ``(batch, slots, seconds)`` (else None)."""
        tokens, decoding, costs = ((self.during, self.during_decoding, self.during_cost) if during else
                                   (self.base, self.base_decoding, self.base_cost))
        if step:
            tokens[0], tokens[1] = tokens[0] + step[0], tokens[1] + step[1]
            if cost:
                decoding[0], decoding[1] = decoding[0] + step[0], decoding[1] + step[1]
        if cost:
            costs.setdefault(cost[:2], []).append(cost[2])

    def yields(self) -> tuple[list[int], list[int]]:
        """``(tokens, rows)`` at ``arm`` and at ``settled`` to pair: between two lossless widths those of the steps
        that took no prompts where both sides have some, since a joining row yields one token in the lossless
        mode whatever the width and how many such steps a bracket holds is chance; at the start of traffic not
        even that: on SmolLM2 over HTTP the first bracket of block size 2 against B set block size 2 on the
        answers' first tokens (1.67 a row and step) against B's steps just before, where the prompts joined
        (1.44); with the warm-up's other two and one at one stream, the pairs read B 1.025x block size 2's,
        where fixed it yields 1.11x. Where every step takes a prompt, all of them."""
        if self.widths and self.during_decoding[1] and self.base_decoding[1]:
            return self.during_decoding, self.base_decoding
        return self.during, self.base


@dataclass(frozen=True)
class TauRange:
    default: float  # the fixed policy's tau, and what a release vouches for
    floor: float  # the lowest tau the gate accepted
    ceiling: float = 1.0

    def __post_init__(self):
        if not 0.0 < self.floor <= self.default <= self.ceiling <= 1.0:
            raise ConfigError(f"tau range: need 0 < floor ({self.floor}) <= default ({self.default}) <= ceiling "
                              f"({self.ceiling}) <= 1")

    def candidates(self) -> list[float]:
        """The floor and the ceiling. A tau between them reads the same window as the floor (B slots a row)
        at the same step cost and accepts no more tokens (a mask is accepted while its confidence >= tau),
        so it never yields more tokens/s: only a measurement to spend exploration on (on the default
        profile's toy at one stream tau = 0.95 read 1.63 tokens/forward against 0.9's 1.95, and noise in the
        estimates had the policy decode there)."""
        return sorted({self.floor, self.ceiling})


class FixedTau:
    name = "fixed"

    def __init__(self, taus: TauRange):
        self.taus = taus
        self.tau = taus.default

    def choose(self, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
               lossless_rows: int = 0, greedy: bool = True) -> float:
        return self.tau

    def observe(self, batch: int, slots: int, seconds: float, accepted: dict[Arm, tuple[int, int]],
                prompt_tokens: int = 0) -> None:
        pass


class AdaptiveTau:
    """See the module docstring. The engine's stepping thread calls it; /metrics only reads it."""

    name = "adaptive"
    clock = staticmethod(time.perf_counter)  # what the policy's own work is timed with (see _Pace)

    def __init__(self, taus: TauRange, *, tpf_samples: int = 128, tpf_steps: int = 32, pair_samples: int = 1024,
                 pair_trust: int = 48, cost_samples: int = 15, cell_samples: int = 5, cost_pair_steps: int = 256,
                 explore_steps: int = 3, explore_rows: int = 12, explore_every: int = 150, explore_within: float = 0.2,
                 explore_far_every: int = 600,
                 rescore_every: int = 16, load_steps: int = 32, refit_every: int = 64, switch_margin: float = 0.05,
                 enter_margin: float = 0.01, pair_gap: int = 4, pair_rounds: int = 16, confidence: float = 3.0,
                 flow_steps: int = 512, candidates: Sequence[float] | None = None, lossless: bool = False,
                 lossless_block_sizes: Sequence[int] = (2,), budget: float = 0.002):
        self.taus = taus
        self.candidates: list[Arm] = sorted(candidates) if candidates else taus.candidates()
        if lossless:  # narrow arms only where the batch's B is wider (see _open)
            self.candidates += [LOSSLESS, *(narrow_lossless(w) for w in sorted(set(lossless_block_sizes)) if w >= 2)]
        # tokens/forward of an arm: over its last `tpf_samples` row-steps (a step of 16 rows counts 16), and at
        # least `tpf_steps` steps: at 16 rows 128 row-steps are 8 steps, and settled at tau = 1 (whose steps hold
        # nothing to learn) the level was the last two or three explorations; in-process on SmolLM2 at 16 streams
        # the lossless arms' estimates then moved by 10-15% between rescorings (1.53 -> 1.71, 1.65 -> 1.90 ->
        # 1.61 for block size 2), and each jump moved the policy
        self.tpf_samples, self.tpf_steps = tpf_samples, tpf_steps
        self.cost_samples, self.cell_samples = cost_samples, cell_samples
        # a window's step cost against the settled one's, side by side (see _cost_ratio): like a tokens/forward
        # ratio, a property of the model and the machine, so a long memory
        self.cost_pair_steps = cost_pair_steps
        # a paired ratio is a property of the model and the traffic, not of the load: a long memory
        self.pair_samples = pair_samples
        # the settled arm moves to another arm but tau = 1 (whose yield is known) only once their explorations
        # hold this many row-steps of each: on SmolLM2 at one stream, three 12-step brackets read the lossless
        # mode's ratio to tau = 0.9 as 1.05-1.6 (1.29 decoded side by side), and the policy spent 21% of its
        # steps at tau = 0.9, 20% slower there
        self.pair_trust = pair_trust
        # an arm predicted ahead of the settled one by the margin on fewer paired row-steps is paired at once,
        # then again `pair_gap` exploration lengths after each exploration ends, rather than at the regular
        # turn: at one row trust takes four 12-step explorations, and on the default profile's toy the regular
        # turn (every `explore_every` decisions, 150) had the policy in the lossless mode through whole
        # bench_serve levels while it predicted tau = 0.9 46% ahead
        self.pair_gap = pair_gap
        # out of the lossless mode into a tau < 1 (speed bought with score) only where the paired gain stands
        # above `switch_margin` by `confidence` standard errors of the pairs' ratio (see _convinced)
        self.confidence = confidence
        # ... pairing a tau ahead of the lossless mode but not by that much sooner than the regular turn only up to
        # `pair_rounds` explorations: where its gain is in the step costs, not in the pairs' ratio, more pairs do
        # not settle it, and each costs the rows a step without drafts back in the lossless mode (on the default
        # profile's toy in-process on a bursty trace, three rounds: 50 explorations of tau = 0.9 and 6.6% of the
        # steps there uncapped, 37 and 4.0% capped)
        self.pair_rounds = pair_rounds
        self._cost_tries: Counter = Counter()  # (arm, settled) -> explorations made to price the arm's window
        self._explored_at = -pair_gap * max(explore_steps, explore_rows)  # the decision the last exploration ended
        self._accepted: dict[Arm, SlidingSums] = {}  # arm -> (tokens, rows) of its own last row-steps
        self.explore_steps, self.explore_rows, self.explore_every = explore_steps, explore_rows, explore_every
        # a candidate predicted more than `explore_within` behind the best is re-measured only every
        # `explore_far_every` decisions: on SmolLM2 at 16 streams a 3-step exploration of the lossless mode at
        # B reads a window of 7 at twice the cost of the settled one of 3, in a load that lasted ~150 steps
        self.explore_within, self.explore_far_every = explore_within, explore_far_every
        # the arm is chosen for the load, the batches of the last `load_steps` decisions (see _scores), and
        # re-scored every `rescore_every` decisions, not every step: on the default profile's toy a step is
        # ~1 ms, and at 4 streams, where rows come and go every few steps, scoring at each change took 13% of
        # the engine's time; every 8 decisions (and a refit every 16 samples) the policy still took ~42 us of the
        # toy's ~1.1 ms step at one stream, and 16 (and 64) read 0.931 of the best fixed setting in-process there
        # against 0.915 (three alternating runs each): a load outlasts 16 steps (on SmolLM2, ~1 s)
        self.rescore_every = rescore_every
        # ... and less often where a rescoring, or a refit of the cost models, would take more than `budget` of the
        # engine's time (each measured, a moving average, against the mean step): on the default profile's toy (a
        # ~1.8 ms step, in-process on a bursty trace) the policy took 2% of the engine's time, a third of it in
        # rescorings (~150 us each) and a fifth in refits (~350 us); on SmolLM2 (a 20-80 ms step) the budget
        # leaves both at `rescore_every` and `refit_every`
        self.budget = budget
        self._mean_step: float | None = None  # seconds per engine iteration, a moving average
        self._rescoring = _Pace(rescore_every, self._allowed)  # a rescoring's seconds, refits apart
        self._load: deque[tuple[int, tuple[float, ...], int]] = deque(maxlen=load_steps)  # (policy rows, named
        # taus, named lossless rows) of each decision
        self._open_memo: dict[tuple[bool, int], list[Arm]] = {}  # (greedy, B) -> the candidates open
        self._choice: tuple[tuple[bool, int], int] | None = None  # ((greedy, B), the decision the settled arm was
        # scored at); None after an exploration starts: its measurements are scored at the next decision
        # the settled arm moves only for a predicted gain above this (see the module docstring), into the
        # lossless mode (from a tau or another width) above `enter_margin`
        self.switch_margin, self.enter_margin = switch_margin, enter_margin
        self._settled: Arm = LOSSLESS if lossless else taus.default  # the last choice that was not an exploration
        self.cost: dict[tuple[int, int], float] = {}  # (batch, slots) -> seconds per step (median of recent)
        self._recent: dict[tuple[int, int], deque] = {}
        self._whole: dict[tuple[int, int], deque] = {}  # the same, of steps that took prompts (see _whole_step_cost)
        # batch -> seconds per joining prompt token beyond the step it joined (median of recent), and the
        # traffic's prompt tokens per generated token over the last `flow_steps` steps (see prompt_cost)
        self.prompt_token_cost: dict[int, float] = {}
        self._prompt_recent: dict[int, deque] = {}
        self.flow_steps = flow_steps
        self._flow = SlidingPairs(steps=flow_steps)  # (prompt tokens, generated) a step
        # the step costs' and the prompt prices' models (see _cost_model, _price_model), each refitted after
        # `refit_every` new samples, not each one: medians move slowly, and a fit (least squares over every cell)
        # is most of a decision's time on a small model
        self._costs = _LazyFit(refit_every, self._fit_costs, self._allowed, lambda: self.clock())
        self._prices = _LazyFit(refit_every, self._fit_prices, self._allowed, lambda: self.clock())
        self.tpf: dict[Arm, float] = {1.0: 1.0}  # arm -> tokens per row and forward in its own window
        # paired ratios (see the module docstring): (arm a, arm b) -> (a tokens, a rows, b tokens, b rows) per
        # exploration of one beside the other
        self._pairs: dict[tuple[Arm, Arm], SlidingSums] = {}
        # paired step costs (see _cost_ratio): (batch, narrower slots, wider slots) -> (narrower seconds, steps,
        # wider seconds, steps), each exploration's median over its steps
        self._cost_pairs: dict[tuple[int, int, int], SlidingSums] = {}
        # the settled arm's last steps, (arm, (tokens, rows) or None, (batch, slots, seconds) of a decoding step
        # or None): an exploration's steps before
        self._settled_steps: deque[tuple[Arm, tuple[int, int] | None, tuple[int, int, float] | None]] = \
            deque(maxlen=max(explore_steps, explore_rows))
        self._bracket: _Bracket | None = None
        # the policy rows' last row-steps at any arm but tau = 1: (tokens, rows), by arm
        self._level = self._new_tpf_window()
        self._phase: str | None = None  # "explore" or "settled": what the step being taken is
        self._pending: list[tuple] = []  # steps observed, not filed yet (see observe)
        self.last_seen: dict[Arm, int] = {}  # decision count when each candidate last ran
        self.decisions = 0
        self._turn_at = 0  # the decision the last regular exploration began at
        self.arm: Arm = taus.default  # the last choice
        self._exploring: tuple[Arm, int] | None = None  # (arm, steps left)
        self._extended = 0  # steps the exploration under way was lengthened by (steps that took prompts)

    @property
    def tau(self) -> float:
        """The tau a policy row decodes at now (the lossless mode's output is tau = 1.0's)."""
        return 1.0 if is_lossless(self.arm) else self.arm

    # -- measurements ------------------------------------------------------------------------------
    def observe(self, batch: int, slots: int, seconds: float, accepted: dict[Arm, tuple[int, int]],
                prompt_tokens: int = 0) -> None:
        """One iteration of ``batch`` rows reading ``slots`` slots each (2B-1: some row is lossless) took
        ``seconds``; ``prompt_tokens``: the joining prompts' tokens it forwarded (0: a decoding step);
        ``accepted[arm] = (tokens, rows)`` for the rows at each tau and in the lossless mode.

        A step of an exploration is filed at once (its length and bracket depend on it); the others are
        filed together at the next decision that scores or explores, or after ``rescore_every`` of them
        (:meth:`flush`): nothing decides on them before. On the default profile's toy (a ~1.4 ms step) filed
        one at a time, between forwards, they took ~30 us a step, filed 16 at a time ~18 us (an ad-hoc
        timing in-process at one stream): the policy's code and data stay in the CPU's caches through a batch."""
        phase, self._phase = self._phase, None
        self._pending.append((batch, slots, seconds, accepted, prompt_tokens, phase, self.arm))
        if phase == "explore" or len(self._pending) >= self.rescore_every:
            self.flush()

    def flush(self) -> None:
        """File the steps observed since the last flush, in order (see :meth:`observe`). The engine's thread
        does so before every decision and reading that needs them; /metrics, on another thread, reads what
        is filed (up to ``rescore_every`` steps ago)."""
        if self._pending:
            pending, self._pending = self._pending, []
            for record in pending:
                self._file(*record)

    def _file(self, batch: int, slots: int, seconds: float, accepted: dict[Arm, tuple[int, int]],
              prompt_tokens: int, phase: str | None, arm: Arm) -> None:
        """One observed step (see :meth:`observe`): ``phase`` and ``arm``, what the policy rows took it as."""
        mean = self._mean_step
        self._mean_step = seconds if mean is None else mean + (seconds - mean) / 64
        if prompt_tokens:  # what the prompts cost beyond the decoding step they joined (see prompt_cost)
            if slots in self._cost_model()[1]:
                recent = _cell(self._prompt_recent, batch, self._new_samples)
                recent.append(max(seconds - self.step_cost(batch, slots), 0.0) / prompt_tokens)
                new = batch not in self.prompt_token_cost
                self.prompt_token_cost[batch] = _median(recent)
                self._prices.sample(new)
            else:  # a window not measured decoding alone yet: the whole step (see _whole_step_cost)
                _cell(self._whole, (batch, slots), self._new_samples).append(seconds)
            if phase == "explore" and self._extended < self.explore_steps and not self._well_measured(batch, slots):
                # a step that took prompts measured no decoding step: explore one more (over HTTP at 16 streams
                # most steps take one, and SmolLM2's 16-row 1-slot cell went unmeasured through 500 steps), unless
                # the cell holds enough already: then the extra steps buy one sample of fifteen at the price of the
                # explored arm (on SmolLM2 at 16 streams tau = 0.9, re-measured once a bench_serve round for 6
                # steps, 3 of them extensions, runs 60% dearer a step than the settled lossless block size 2)
                self._extended += 1
                explored, left = self._exploring or (arm, 0)
                self._exploring = (explored, left + 1)
        else:
            new = (batch, slots) not in self._recent  # a new cell: a window the model may not know yet
            recent = _cell(self._recent, (batch, slots), self._new_samples)
            recent.append(seconds)
            self.cost[(batch, slots)] = _median(recent)
            self._costs.sample(new)
        generated = 0
        for row_arm, (tokens, rows) in accepted.items():
            generated += tokens
            if rows and row_arm != 1.0 and row_arm in self.candidates:  # a request's own tau is not a candidate
                window = _cell(self._accepted, row_arm, self._new_tpf_window)
                window.add((tokens, rows))
                self.tpf[row_arm] = window.total[0] / window.total[1]
        self._flow.add((prompt_tokens, generated))
        self._pair(accepted.get(arm), None if prompt_tokens else (batch, slots, seconds), phase, arm)

    # what a cell, arm or pair starts with (see _cell)
    def _new_samples(self) -> deque:  # a cell's last `cost_samples` seconds
        return deque(maxlen=self.cost_samples)

    def _new_tpf_window(self) -> SlidingSums:  # the last `tpf_samples` rows' (tokens, rows), `tpf_steps` steps
        return SlidingPairs(steps=self.tpf_steps, at_least=self.tpf_samples)

    def _new_pair_pool(self) -> SlidingSums:
        # a pair's (a tokens, a rows, b tokens, b rows, n, sum of x, sum of x^2) per exploration, x the log of its
        # tokens/forward ratio (n = 1) where both sides have tokens (see _ratio_error)
        return SlidingSums(7, at_least={1: self.pair_samples, 3: self.pair_samples})

    def _new_cost_pool(self) -> SlidingSums:  # (narrow seconds, steps, wide seconds, steps) per exploration
        return SlidingSums(4, at_least={1: self.cost_pair_steps, 3: self.cost_pair_steps})

    def prompt_cost(self, batch: int) -> float:
        """Seconds of joining prompts per generated token while ``batch`` rows decode: the prompt tokens the
        traffic brings per generated token (the last ``flow_steps`` steps) times what one costs beyond the step
        it joins at that batch size (:meth:`_price_model`). Each request's prompt is forwarded once whatever
        the arm, beside more rows at a higher price: in-process on SmolLM2 in bf16 on a 2-core CPU ~0.32 ms a
        token at one row, ~0.6 ms at 4 and 16. Not by window: the backend packs a prompt beside the rows'
        windows, and decoded alternately every 6 steps a prompt token cost as much or less beside wider ones
        (SmolLM2 at 16 rows: 0.64, 0.59 and 0.61 ms beside 1-, 3- and 7-slot windows, 0.65, 0.54 and 0.50 in
        a second run; at 4 rows 0.63, 0.59 and 0.58; the default profile's toy at 4 rows: 24, 21 and 20 us
        beside 1-, 4- and 7-slot ones). Priced by window, a window the policy was not settled in was priced on
        its explorations' few join steps: on the toy at 4 rows the lossless mode's prompts read 39-68 us a token
        and tau = 0.9's 27-40, and the policy predicted tau = 0.9 8-20% ahead of lossless, which was as fast
        fixed; and a price model that may not fall as the window widens could only charge wide windows more."""
        self.flush()
        prompt, generated = self._flow.total
        if not prompt or not generated or not self.prompt_token_cost:
            return 0.0
        shape = self._price_model()
        if shape is None:  # too few batch sizes for a line: the nearest priced one
            return prompt / generated * self.prompt_token_cost[_nearest(self.prompt_token_cost, batch)]
        return prompt / generated * _shape_at(shape, batch, 1)

    def _price_model(self) -> tuple[float, float, float, float] | None:
        """``(a, c, 0, 0)`` >= 0: a joining prompt token costs a + c x batch seconds, fitted over the batch
        sizes' medians (weighted by their join steps, over those with ``cell_samples`` of them where they
        determine it). Not each batch size's own median: over HTTP a cell's median moved by 4x from one batch
        size to the next (SmolLM2 at 16 streams: 2.6 ms a token beside 16 rows, 1.3 and 0.59 beside 14 and 15)."""
        return self._prices.get()

    def _fit_prices(self) -> tuple[float, float, float, float] | None:
        return self._fit([(b, 1, price, len(self._prompt_recent[b])) for b, price in self.prompt_token_cost.items()],
                         _LINE)

    def _pair(self, step: tuple[int, int] | None, cost: tuple[int, int, float] | None, phase: str | None,
              arm: Arm) -> None:
        """File the step the policy rows took at ``arm`` (``(tokens, rows)``; None: none counted, a move's
        first step) in ``phase`` into the open bracket, or as one of the settled arm's last steps; ``cost``:
        ``(batch, slots, seconds)`` of a decoding step (None: it took prompts)."""
        if phase is None:  # no policy rows this step
            return
        step = step if step and step[1] else None
        if step and arm != 1.0:  # tau = 1 yields one token whatever the request: nothing to learn
            self._level.add(step, key=arm)
        bracket = self._bracket
        if phase == "explore":
            if bracket is not None and bracket.arm == arm:
                bracket.add(True, step, cost)
            return
        if step or cost:
            self._settled_steps.append((arm, step, cost))
        if bracket is None:
            return
        if arm != bracket.settled:  # the policy moved on: the bracket has what it has
            self._close_bracket()
            return
        bracket.add(False, step, cost)
        if step:
            bracket.after_left -= 1
            if bracket.after_left <= 0:
                self._close_bracket()

    def _close_bracket(self) -> None:
        bracket, self._bracket = self._bracket, None
        if bracket is None:
            return
        during, base = bracket.yields()
        if during[1] and base[1] and bracket.arm != 1.0:  # tau = 1's yield is known
            key = _pair_key(bracket.arm, bracket.settled)
            first, second = (during, base) if key[0] == bracket.arm else (base, during)
            spread = (0, 0.0, 0.0)
            if first[0] and second[0]:
                x = math.log((first[0] / first[1]) / (second[0] / second[1]))
                spread = (1, x, x * x)
            _cell(self._pairs, key, self._new_pair_pool).add((*first, *second, *spread))
        for (batch, slots), seconds in bracket.during_cost.items():
            for (base_batch, base_slots), base_seconds in bracket.base_cost.items():
                if base_batch == batch and base_slots != slots:  # each side's median, narrower window first
                    narrow, wide = (seconds, base_seconds) if slots < base_slots else (base_seconds, seconds)
                    _cell(self._cost_pairs, (batch, min(slots, base_slots), max(slots, base_slots)),
                          self._new_cost_pool).add((_median(narrow) * len(narrow), len(narrow),
                                                    _median(wide) * len(wide), len(wide)))

    def tokens_per_forward(self, arm: Arm) -> float | None:
        """The estimate decisions use: tau = 1 yields exactly 1; another arm, the policy rows' last
        ``tpf_samples`` row-steps (whatever arm they ran at) with each arm's tokens scaled by its paired
        ratio to ``arm``: what ``arm`` would have yielded on the latest requests. While ``arm`` has no ratio
        to the arms of those steps: its own window. Never below one: every step gives a row its slot-0 token
        whatever the arm, and a ratio read on easy requests scaled onto hard ones can say less (in-process on
        SmolLM2 at one stream tau = 0.9 read 0.91). /metrics reads it from another thread: on the steps filed
        so far (see :meth:`flush`)."""
        if arm == 1.0:
            return 1.0
        tokens = rows = 0.0
        for other, (other_tokens, other_rows) in list(self._level.by_key.items()):  # /metrics reads it too
            ratio = 1.0 if other == arm else self._ratio(arm, other)
            if ratio is not None and other_rows:
                tokens, rows = tokens + other_tokens * ratio, rows + other_rows
        own = tokens / rows if rows else self.tpf.get(arm)
        return None if own is None else max(own, 1.0)

    def _ratio(self, arm: Arm, base: Arm) -> float | None:
        """tokens/forward at ``arm`` over that at ``base``, on the same rows at the same time."""
        key = _pair_key(arm, base)
        if key not in self._pairs:
            return None
        a_tokens, a_rows, b_tokens, b_rows = self._pairs[key].total[:4]
        if not a_tokens or not b_tokens:  # rows that stopped at once (a stop token first): no ratio yet
            return None
        ratio = (a_tokens / a_rows) / (b_tokens / b_rows)
        return ratio if key[0] == arm else 1.0 / ratio

    def _ratio_error(self, arm: Arm, base: Arm) -> float | None:
        """The standard error of the log of :meth:`_ratio`, read off the spread of its explorations' own ratios
        (each a bracket's tokens/forward at one arm over the other's); None before four explorations."""
        pool = self._pairs.get(_pair_key(arm, base))
        if pool is None or pool.total[4] < 4:  # a spread of two or three is itself noise
            return None
        n, total, squares = pool.total[4:]
        return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1) / n)

    def _convinced(self, tau: float, lossless: Arm, scores: dict[Arm, float], margin: float) -> bool:
        """Whether ``tau`` < 1, predicted the fastest, shows it against the ``lossless`` arm: their explorations hold
        ``pair_trust`` row-steps of each (:meth:`_trusted`) and the predicted gain stands above ``margin`` by
        ``confidence`` standard errors of their paired ratio (:meth:`_ratio_error`); the policy moves to the tau
        above ``switch_margin`` and goes back to the lossless mode, without a margin, once the tau shows no gain.
        A tau gives up score for speed, so it has to show the speed (where it is not the settled arm too: a
        policy settled at tau = 1 moved on to tau = 0.9 without the test): a 12-step bracket at
        one row reads one arm's tokens/forward over the other's anywhere in 0.63-1.45 on the default profile's
        toy, and in-process at one stream ten explorations read the lossless mode 0.914x tau = 0.9's, where
        decoded fixed side by side the lossless mode yielded 2.08 tokens/forward to tau = 0.9's 2.06 and was
        4.5% faster; settled at tau = 0.9 by them the policy ran there for 96% of its steps."""
        if not self._trusted(tau, lossless):
            return False
        if self.confidence <= 0:
            return True
        error = self._ratio_error(tau, lossless)
        return error is not None and scores[tau] >= scores[lossless] * (1 + margin) * math.exp(self.confidence * error)

    def _explorations(self, arm: Arm, base: Arm) -> int:
        """How many explorations pairing ``arm`` with ``base`` their pool holds."""
        pool = self._pairs.get(_pair_key(arm, base))
        return 0 if pool is None else pool.total[4]

    def _trusted(self, arm: Arm, base: Arm) -> bool:
        """Whether the explorations pairing ``arm`` with ``base`` hold ``pair_trust`` row-steps of each."""
        pool = self._pairs.get(_pair_key(arm, base))
        return self.pair_trust <= 0 or (pool is not None and min(pool.total[1], pool.total[3]) >= self.pair_trust)

    def _cost_ratio(self, batch: int, slots: int, reference: int) -> float | None:
        """A decoding step's seconds at ``batch`` rows and ``slots``-wide windows over those at ``reference``-wide
        ones, measured side by side: each exploration's steps against the settled arm's just before and just
        after it, on the same rows (the median of each side, pooled over the last ``cost_pair_steps`` steps of
        each); None until both sides hold ``cell_samples``. Why paired: a window the policy is not settled in is
        measured only while explored, and its cell's median is of that time; set against the settled window's
        cell, fresh at every step, it compared the CPU then with the CPU now (on the default profile's toy at
        one row, over three rounds the 4-slot cell read 1.39-1.82 ms and the 7-slot one 1.34-1.56, in another
        run 1.60 and 1.88, where decoded alternately every 12 steps both cost 1.79 ms)."""
        if slots == reference:
            return 1.0
        pool = self._cost_pairs.get((batch, min(slots, reference), max(slots, reference)))
        if pool is None:
            return None
        narrow_seconds, narrow_steps, wide_seconds, wide_steps = pool.total
        if min(narrow_steps, wide_steps) < self.cell_samples:
            return None
        ratio = (wide_seconds / wide_steps) / (narrow_seconds / narrow_steps)
        return ratio if slots > reference else 1.0 / ratio

    def step_cost(self, batch: int, slots: int, modelled: bool = False) -> float | None:
        """The cell's median once it holds ``cell_samples`` samples (unless ``modelled``); else the cost model
        (:meth:`_cost_model`), so that a batch size visited for a step or two (a load passing by) is read
        off the whole record rather than one noisy sample; a window never measured decoding alone, its whole
        steps (:meth:`_whole_step_cost`), else None.
        ``modelled``: the model even for a well-measured cell (see :meth:`_scores`)."""
        self.flush()
        if not modelled and self._well_measured(batch, slots):
            return self.cost[(batch, slots)]
        shape, windows = self._cost_model()
        if slots not in windows:
            return self._whole_step_cost(batch, slots)
        if shape is None:  # too few cells for a shape: the window's nearest batch size as measured
            return self.cost[(_nearest([b for b, w in self.cost if w == slots], batch), slots)]
        return _shape_at(shape, batch, slots)

    def cost_cells(self) -> list[tuple[int, int, float, int, float | None]]:
        """Every decoding cell measured: ``(batch, slots, median seconds, samples, the cost model's seconds)``,
        sorted; what :meth:`step_cost` reads the cell's median against (benchmarks print it)."""
        self.flush()
        return sorted((batch, slots, seconds, len(self._recent[(batch, slots)]), self.step_cost(batch, slots, True))
                      for (batch, slots), seconds in list(self.cost.items()))

    def _whole_step_cost(self, batch: int, slots: int) -> float | None:
        """A window never measured decoding alone, priced by its whole steps (prompts included) once an
        exploration's worth of them (2 x ``explore_steps``) says no decoding step is coming: where every
        step takes a prompt (short answers at many streams) none ever does, and waiting for one, the policy
        explored the first such window for good (driven at 16 rows with a prompt joining each step: 797 of
        800 steps). Apart from the decoding cells, and no prompt charged on top (:meth:`predict`): a prompt
        priced against a whole step would read ~0 and, once the window is measured alone, undercharge it.
        None while fewer. Rough where only some steps take prompts (a whole step carries a join, the other
        windows only the traffic's average share): it stands only until the window's first decoding step."""
        cells = {b: recent for (b, w), recent in self._whole.items() if w == slots}
        if sum(len(recent) for recent in cells.values()) < 2 * self.explore_steps:
            return None
        return _median(cells[_nearest(cells, batch)])

    def _well_measured(self, batch: int, slots: int) -> bool:
        recent = self._recent.get((batch, slots))
        return recent is not None and len(recent) >= self.cell_samples

    def _cost_model(self) -> tuple[tuple[float, float, float, float] | None, set[int]]:
        """``(a, c, d, e), windows``: seconds = a + c x batch + d x batch x slots + e x batch x [slots > 1], and
        the windows measured so far. A step costs a fixed part, a part per row, a part per token forwarded (rows
        x slots) and, where the window is wider than one slot, a part per row more: a row that reads masks
        (a query of several tokens) pays for the masked attention and the gathers a one-token query skips.
        SmolLM2 in bf16 on a 2-core CPU, forwards of the serving backend at a ~150-token cache (ms; 1, 3, 4,
        7 slots): 29.9, 52.6, 57.0, 78.7 at 16 rows, 26.6, 42.5, 47.3, 63.5 at 12; a straight line fitted over
        these and the cells at 1-14 rows reads 32.1 and 48.3 ms at 16 rows for 1 and 3 slots, the lossless
        mode at block size 2 then 4% ahead of tau = 1, which is 12% faster (this shape: 29.7 and 50.8), and in
        ``bench_serve`` at 16 streams the policy ran that lossless width for 95% of its steps.
        The shape is fitted over every cell of every window at once (least squares, each cell weighted by its
        samples, over the well-measured cells where they determine it; c, d and e kept >= 0: a step never gets
        cheaper with more rows or tokens). Why one shape: the
        windows the policy is not settled in are measured only where it explored them, often at other loads,
        and a line per window drawn through a few nearby batch sizes extrapolates badly: in-process on
        SmolLM2 in bf16 the line through the 7-slot window's cells read 72 ms at 16 rows, where that forward
        alone takes 92 ms, and in ``bench_serve`` at 16 streams the policy with such lines stayed at tau = 1
        for 87% of its steps while lossless at block size 2, fixed, was 8% faster than tau = 1 fixed. The
        cost per token forwarded is the same in every window."""
        return self._costs.get()

    def _fit_costs(self) -> tuple[tuple[float, float, float, float] | None, set[int]]:
        cells = [(b, w, self.cost[(b, w)], len(self._recent[(b, w)])) for b, w in self.cost]
        return self._fit(cells, _STEP), {w for _, w, _, _ in cells}

    def _fit(self, cells: list[tuple[int, int, float, int]], terms: tuple[tuple[int, ...], ...]
             ) -> tuple[float, float, float, float] | None:
        """:func:`_shape` (of ``terms``) over the cells holding ``cell_samples`` samples where they determine it;
        the thin ones (a passing load's one sample) only where needed."""
        return _shape([cell for cell in cells if cell[3] >= self.cell_samples], terms) or _shape(cells, terms)

    # -- decision ----------------------------------------------------------------------------------
    def predict(self, arm: Arm, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
                lossless_rows: int = 0) -> float | None:
        """Predicted generated tokens/s of the batch if its policy rows decode at ``arm``: its tokens per
        step over the step's cost and the joining prompts' share per token (:meth:`prompt_cost`)
        (``lossless_rows``: rows that asked for the lossless mode themselves), as :meth:`_scores` reads it."""
        self.flush()
        return self._scores([arm], block_size, {(policy_rows, tuple(fixed_taus), lossless_rows): 1})[arm]

    def _predicted(self, tpf: float | None, slots: int, batch: int, policy_rows: int, named_tokens: float,
                   modelled: bool, cost: float | None, charge: float) -> tuple[float, float] | None:
        """(generated tokens, seconds) of one step of ``batch`` rows whose widest reads ``slots`` slots, its
        policy rows yielding ``tpf`` tokens each and the others ``named_tokens`` in all, and ``charge`` seconds of
        joining prompts a generated token; None while something in it is unmeasured. ``cost``: the step's seconds
        where they are known already (see :meth:`_scores`), else :meth:`step_cost`'s."""
        if tpf is None:
            return None
        cost = cost or self.step_cost(batch, slots, modelled)
        if not cost:
            return None
        generated = policy_rows * tpf + named_tokens
        return generated, cost + generated * charge

    def _named_tokens(self, fixed_taus: tuple[float, ...], lossless_rows: int) -> float:
        """Tokens a step yields the rows that named their tau or mode."""
        if not fixed_taus and not lossless_rows:
            return 0.0
        return sum(map(self._tpf_near, fixed_taus)) + lossless_rows * (self.tokens_per_forward(LOSSLESS) or 1.0)

    def _scores(self, arms: Sequence[Arm], block_size: int,
                load: dict[tuple[int, tuple[float, ...], int], int] | None = None) -> dict[Arm, float | None]:
        """Predicted tokens/s of each arm over the load: the batches of the last ``load_steps`` decisions
        (``load``: batch -> count, else those), each arm's generated tokens over its seconds summed over them.
        Why the load and not the batch at hand: at many streams rows leave and join every step, the batch
        size moves between ~12 and 16, and each batch size's estimates carry their own noise; chosen per
        batch, the policy on the default profile's toy (in-process, a bursty trace) moved between tau = 0.9
        and the lossless mode every one to three steps at 12-16 rows, ~50 moves in 1400 steps, and each move
        into the lossless mode costs every row a step without drafts.
        Within a batch every arm is read at the same kind of step cost: a window paired with the settled
        arm's at that batch size is its step cost times their paired ratio (:meth:`_cost_ratio`); the others,
        the cells' medians where every such window is well measured at its batch size, else the cost model for
        each. On a busy CPU a cell's median wandered by ~5% around the per-window line the policy used before;
        set against another window's line it flipped the choice as the batch size moved by a row or two (on
        the default profile's toy, 13 rows favoured tau = 0.9 and 15 the lossless mode)."""
        tpf = {a: self.tokens_per_forward(a) for a in arms}
        own = {a: _own_window(a, block_size) for a in arms}
        settled = _own_window(self._settled, block_size)
        tokens: dict[Arm, float | None] = dict.fromkeys(arms, 0.0)
        seconds = dict.fromkeys(arms, 0.0)
        for (policy_rows, fixed_taus, lossless_rows), count in (Counter(self._load) if load is None else load).items():
            batch = policy_rows + len(fixed_taus) + lossless_rows
            named = _named_window(fixed_taus, block_size, lossless_rows)
            slots = {a: max(own[a], named) for a in arms}
            reference = max(settled, named)
            ratios = {a: self._cost_ratio(batch, w, reference) for a, w in slots.items()}
            modelled = not all(self._well_measured(batch, w) for a, w in slots.items() if ratios[a] is None)
            base = self.step_cost(batch, reference, modelled) if any(r is not None for r in ratios.values()) else None
            named_tokens = self._named_tokens(fixed_taus, lossless_rows)
            # the joining prompts' share of a generated token, but in a window priced by whole steps, which hold
            # their prompts already (see _whole_step_cost)
            charge, priced = self.prompt_cost(batch), self._cost_model()[1]
            for a in arms:
                cost = base * ratios[a] if base and ratios[a] is not None else None
                step = tokens[a] is not None and self._predicted(tpf[a], slots[a], batch, policy_rows, named_tokens,
                                                                 modelled, cost, charge if slots[a] in priced else 0.0)
                if not step:
                    tokens[a] = None
                    continue
                tokens[a] += count * step[0]
                seconds[a] += count * step[1]
        return {a: None if tokens[a] is None else tokens[a] / seconds[a] for a in arms}

    def _tpf_near(self, tau: float) -> float:
        """A named tau's tokens/forward: that of the nearest measured candidate tau (1.0 while none is)."""
        known = [t for t in self.tpf if not is_lossless(t) and (t in self.candidates or t == 1.0)]
        return self.tokens_per_forward(min(known, key=lambda t: abs(t - tau))) if tau < 1.0 and known else 1.0

    def _open(self, greedy: bool, block_size: int) -> list[Arm]:
        """The candidates for this step: no lossless arm while a policy row samples, no narrow lossless arm
        as wide as the batch's B."""
        key = (greedy, block_size)
        if key not in self._open_memo:
            self._open_memo[key] = [a for a in self.candidates if not is_lossless(a) or
                                    (greedy and (a == LOSSLESS or arm_block_size(a, block_size) < block_size))]
        return self._open_memo[key]

    def choose(self, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
               lossless_rows: int = 0, greedy: bool = True) -> Arm:
        """The arm for the next step's policy rows (a tau, or LOSSLESS); ``fixed_taus``: the other tau rows'
        own taus; ``greedy``: every policy row is greedy (else the lossless mode is not a candidate)."""
        if not policy_rows or not block_size or block_size < 2:
            return self.arm
        decisions = self.decisions = self.decisions + 1
        self._load.append((policy_rows, tuple(fixed_taus), lossless_rows))
        # the regular turn, and the far arms' turn, come as much less often as a paired exploration lasts longer
        # than `explore_steps` at this many rows: ~2% of the steps explore at any load
        spacing = self._paired_length(policy_rows) / self.explore_steps
        due = decisions - self._turn_at >= self.explore_every * spacing
        choice = self._choice
        if self._exploring is None and not due and choice is not None and choice[0] == (greedy, block_size) \
                and decisions - choice[1] < self._rescoring.interval:
            return self._use(self._settled)  # scored a few steps ago: the estimates and the load move slowly
        open_ = self._open(greedy, block_size)
        if self._exploring is not None:
            arm, left = self._exploring
            self._exploring = (arm, left - 1) if left > 1 else None
            if arm in open_:
                if self._exploring is None:
                    self._explored_at = self.decisions
                return self._use(arm, explore=True)
            self._exploring, self._explored_at = None, self.decisions
        settled = self._settled
        turn = (greedy, block_size)
        self.flush()
        started, fitting = self.clock(), self._costs.spent + self._prices.spent
        scores = self._scores(open_, block_size)
        self._rescoring.took(self.clock() - started - (self._costs.spent + self._prices.spent - fitting))
        best = _best(scores)
        if best is None:  # measure before judging: the widest unmeasured window first
            self._choice = None
            return self._explore(min((a for a, v in scores.items() if v is None), key=_width_order), policy_rows)
        if due:  # the candidate measured longest ago, of those near the best or not measured for long
            self._choice, self._turn_at = None, self.decisions
            near = [a for a in open_ if scores[a] >= scores[best] * (1 - self.explore_within)
                    or self.decisions - self.last_seen.get(a, -1) >= self.explore_far_every * spacing]
            return self._explore(min(near, key=lambda a: self.last_seen.get(a, -1)), policy_rows)
        pair_due = self.decisions - self._explored_at >= self.pair_gap * self._explore_length(best, policy_rows)
        fallen_back = False
        if not is_lossless(best) and best < 1.0:
            # a tau < 1 gives up score for speed: it takes the rows out of the lossless mode only where it shows the
            # speed, beyond the margin, and keeps them only while it still shows some
            rival = max((a for a in open_ if is_lossless(a)), key=scores.get, default=None)
            margin = 0.0 if best == settled else self.switch_margin
            if rival is not None and not self._convinced(best, rival, scores, margin):
                ahead = scores[best] >= scores[rival] * (1 + self.switch_margin)
                if ahead and rival == settled and pair_due and self._explorations(best, rival) < self.pair_rounds:
                    # but on too little evidence: pair them sooner, up to `pair_rounds` explorations
                    self._choice = None
                    return self._explore(best, policy_rows)
                best, fallen_back = rival, True
        if best != settled and settled in scores and not (fallen_back and not is_lossless(settled)):
            now = scores[settled]
            # into the lossless mode, from a tau or another width: it costs no score, only a step with fewer drafts
            margin = self.enter_margin if is_lossless(best) else self.switch_margin
            if now and scores[best] < now * (1 + margin):
                best = settled
        if best != settled and settled in scores and 1.0 not in (best, settled) and not self._trusted(best, settled):
            # ahead, but on too few paired row-steps yet to say which yields more: pair them sooner (a settled
            # arm this batch cannot take, the lossless mode while a row samples, is not kept)
            if pair_due:
                self._choice = None
                return self._explore(best, policy_rows)
            best = settled
        if best != settled and settled in scores and not fallen_back and \
                not self._costs_paired(best, settled, block_size):
            # ahead on step costs read off cells of other times: price its window beside the settled one first
            if pair_due and self._cost_tries[(best, settled)] < self.pair_rounds:
                self._cost_tries[(best, settled)] += 1
                self._choice = None
                return self._explore(best, policy_rows)
            best = settled
        self._choice = (turn, self.decisions)
        self._settled = best
        return self._use(best)

    def _costs_paired(self, arm: Arm, settled: Arm, block_size: int) -> bool:
        """Whether moving the policy rows from ``settled`` to ``arm`` keeps the step's window, or its window is priced
        beside the settled one (:meth:`_cost_ratio`) at some batch of the load. Why: a window the policy is not
        settled in is otherwise priced by cells of other times, and over HTTP a step's seconds carry the event
        loop's work beside it (the tokens it streams out): on the default profile's toy at 16 streams the cells
        read 1.5-6.5 ms where a step takes ~2.4 ms in-process, the policy predicted tau = 1 65% ahead of the
        lossless mode, which fixed was 38% faster, and it ran tau = 1 for 17% of the level's steps. A window never
        measured decoding alone is priced by whole steps (:meth:`_whole_step_cost`), which no pair prices: as it is."""
        own, base = _own_window(arm, block_size), _own_window(settled, block_size)
        decoded = self._cost_model()[1]
        for policy_rows, fixed_taus, lossless_rows in set(self._load):
            named = _named_window(fixed_taus, block_size, lossless_rows)
            slots, reference = max(own, named), max(base, named)
            batch = policy_rows + len(fixed_taus) + lossless_rows
            if slots == reference or not {slots, reference} <= decoded or \
                    self._cost_ratio(batch, slots, reference) is not None:
                return True
        return False

    def _allowed(self) -> float | None:
        """Seconds of the policy's work a step may carry (``budget`` of the mean step); None before a step."""
        return None if self._mean_step is None else self.budget * self._mean_step

    def best(self, fixed_taus: Sequence[float], policy_rows: int, block_size: int | None,
             lossless_rows: int = 0, greedy: bool = True) -> Arm | None:
        """The candidate with the highest predicted tokens/s for this batch alone (ties: the narrower window);
        None while some candidate is unmeasured."""
        self.flush()
        return _best(self._scores(self._open(greedy, block_size), block_size,
                                  {(policy_rows, tuple(fixed_taus), lossless_rows): 1}))

    def _explore(self, arm: Arm, rows: int = 1) -> Arm:
        """Run ``arm`` for a few steps of ``rows`` policy rows: ``explore_steps``, or as many as make
        ``explore_rows`` row-steps where it is paired (a ratio from a handful of a lone row's tokens is
        noise: on the default profile's toy at one stream, 3-step explorations had it settle in the
        lossless mode's block size 2, 21% slower there than B, for a third of its steps)."""
        self.flush()
        length = self._explore_length(arm, rows)
        # a move: its first step yields what the old arm left the rows, and the engine does not count it
        steps = length + self._paired(arm)
        self._exploring = (arm, steps - 1) if steps > 1 else None
        if self._exploring is None:
            self._explored_at = self.decisions
        self._extended = 0
        self._close_bracket()
        if arm != self._settled:  # the settled arm's last `length` steps, then as many after
            bracket = self._bracket = _Bracket(arm, self._settled, length,
                                               is_lossless(arm) and is_lossless(self._settled))
            for settled, step, cost in list(self._settled_steps)[-length:]:
                if settled == self._settled:
                    bracket.add(False, step, cost)
        return self._use(arm, explore=True)

    def _paired(self, arm: Arm) -> bool:
        """Whether an exploration of ``arm`` pairs it with the settled arm (tau = 1's yield is known)."""
        return arm != self._settled and arm != 1.0

    def _explore_length(self, arm: Arm, rows: int) -> int:
        """Steps an exploration of ``arm`` at ``rows`` policy rows lasts (before a move's uncounted step)."""
        return self._paired_length(rows) if self._paired(arm) else self.explore_steps

    def _paired_length(self, rows: int) -> int:
        """Steps a paired exploration lasts at ``rows`` policy rows: ``explore_rows`` row-steps, at least
        ``explore_steps`` steps."""
        return max(self.explore_steps, -(-self.explore_rows // max(rows, 1)))

    def _use(self, arm: Arm, explore: bool = False) -> Arm:
        self.last_seen[arm] = self.decisions
        # re-measuring the settled arm is a settled step (it brackets the next exploration)
        self.arm, self._phase = arm, "explore" if explore and arm != self._settled else "settled"
        return arm


class SlidingSums:
    """Running sums of the latest records (tuples of counts), in total and by key (of keyed records): the
    oldest record leaves while the others still number ``steps`` and hold, at each ``index: count`` of
    ``at_least``, that many, so an add costs O(1) amortized however long the window. Sums are new tuples on
    every change: /metrics reads them from another thread. The window's rule is data, not a callback called
    per record: the engine's thread adds three records a step (replaying a recorded toy engine trace, the
    policy's time went from 12.7 to 12.1 us a step)."""

    def __init__(self, width: int, steps: int = 0, at_least: dict[int, int] | None = None):
        self.steps, self.at_least = steps, tuple((at_least or {}).items())
        self.records: deque[tuple[object, tuple]] = deque()
        self.total: tuple = (0,) * width
        self.by_key: dict[object, tuple] = {}

    def add(self, record: tuple, key: object = None) -> None:
        records, by_key = self.records, self.by_key
        records.append((key, record))
        total = self.total = tuple(map(operator.add, self.total, record))
        if key is not None:
            sums = by_key.get(key)
            by_key[key] = tuple(record) if sums is None else tuple(map(operator.add, sums, record))
        while len(records) > self.steps:  # the others would still number `steps`
            old_key, old = records[0]
            for index, count in self.at_least:
                if total[index] - old[index] < count:
                    return
            records.popleft()
            total = self.total = tuple(map(operator.sub, total, old))
            if old_key is not None:
                by_key[old_key] = tuple(map(operator.sub, by_key[old_key], old))


class SlidingPairs(SlidingSums):
    """:class:`SlidingSums` of two counts, the second at least ``at_least`` (0: no floor), with the add written
    out for two: the engine's thread adds three such records a step (replaying a recorded toy engine trace,
    the policy's time went from 12.4 to 11.2 us a step)."""

    def __init__(self, steps: int = 0, at_least: int = 0):
        super().__init__(2, steps, {1: at_least})
        self.floor = at_least

    def add(self, record: tuple[int, int], key: object = None) -> None:
        records, by_key = self.records, self.by_key
        records.append((key, record))
        first, second = record
        total_first, total_second = self.total
        total_first, total_second = total_first + first, total_second + second
        if key is not None:
            sums = by_key.get(key)
            by_key[key] = record if sums is None else (sums[0] + first, sums[1] + second)
        steps, floor = self.steps, self.floor
        while len(records) > steps:  # the others would still number `steps` and hold `floor`
            old_key, (old_first, old_second) = records[0]
            if total_second - old_second < floor:
                break
            records.popleft()
            total_first, total_second = total_first - old_first, total_second - old_second
            if old_key is not None:
                sums = by_key[old_key]
                by_key[old_key] = (sums[0] - old_first, sums[1] - old_second)
        self.total = (total_first, total_second)


class _Pace:
    """How often a piece of the policy's work comes: every ``every`` turns (decisions, samples) at least, and as
    much less often as keeps it (its seconds, a moving average) within ``allowed()`` seconds a turn."""

    def __init__(self, every: int, allowed: Callable[[], float | None]):
        self.every, self.allowed, self.interval = every, allowed, every
        self.seconds: float | None = None

    def took(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else self.seconds + (seconds - self.seconds) / 8
        allowed = self.allowed()
        if allowed:
            self.interval = max(self.every, math.ceil(self.seconds / allowed))


class _LazyFit:
    """A model fitted over measured cells when it is read, and kept until a sample opened a new cell or as many
    samples have come in since as its pace allows (``every``, or more where a fit would take more than
    ``allowed()`` seconds a sample: :class:`_Pace`)."""

    def __init__(self, every: int, fit: Callable[[], object], allowed: Callable[[], float | None],
                 clock: Callable[[], float]):
        self.fit, self.clock, self.pace = fit, clock, _Pace(every, allowed)
        self.value, self.fresh, self.since = None, False, 0
        self.spent = 0.0  # seconds fitting in all

    def sample(self, new_cell: bool) -> None:
        self.since += 1
        if new_cell or self.since >= self.pace.interval:
            self.fresh = False

    def get(self):
        if not self.fresh:
            started = self.clock()
            self.value, self.fresh, self.since = self.fit(), True, 0
            took = self.clock() - started
            self.spent += took
            self.pace.took(took)
        return self.value


def _own_window(arm: Arm, block_size: int) -> int:
    """The slots a row reads at ``arm`` (a step's cost class is its widest row's)."""
    return 2 * arm_block_size(arm, block_size) - 1 if is_lossless(arm) else block_size if arm < 1.0 else 1


def _named_window(fixed_taus: Sequence[float], block_size: int, lossless_rows: int) -> int:
    """The slots the widest of the rows that named their tau or mode reads (1 where there are none)."""
    return 2 * block_size - 1 if lossless_rows else block_size if any(t < 1.0 for t in fixed_taus) else 1


def _cell(cells: dict, key, make: Callable[[], object]):
    """``cells[key]``, made by ``make()`` the first time (setdefault would build one on every call, on the
    engine's stepping thread)."""
    value = cells.get(key)
    if value is None:
        value = cells[key] = make()
    return value


def _nearest(values, target: int) -> int:
    """The value closest to ``target`` (``target`` itself when present; ties: the smaller)."""
    return min(values, key=lambda v: (abs(v - target), v))


def _median(values: Sequence[float]) -> float:
    ordered, mid = sorted(values), len(values) // 2  # statistics.median is ~3x slower, on a ~1 ms step
    return ordered[mid] if len(values) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# the sets of terms a shape tries, in turn (see _shape): a step's cost, and a prompt token's price (a line in batch)
_STEP = ((0, 1, 2, 3), (0, 2, 3), (0, 1, 2), (0, 2), (0, 1))
_LINE = ((0, 1), (0,))


def _shape(cells: list[tuple[int, int, float, int]], terms: tuple[tuple[int, ...], ...] = _STEP
           ) -> tuple[float, float, float, float] | None:
    """(a, c, d, e) >= 0 of seconds = a + c x batch + d x batch x slots + e x batch x [slots > 1], of the first
    set of ``terms`` that fits none below 0 (and that the cells determine: e needs two windows wider than one
    slot); the terms left out are 0. Weighted least squares, each cell counting as often as it was sampled. The
    arrays are built once for every set of terms tried: on the default profile's toy, building them took most
    of a fit's time, and a fit comes every few dozen steps."""
    root = np.sqrt(np.array([n for _, _, _, n in cells], dtype=float))
    x = np.array([(1.0, b, b * w, b * (w > 1)) for b, w, _, _ in cells], dtype=float).reshape(-1, 4) * root[:, None]
    y = np.array([s for _, _, s, _ in cells], dtype=float) * root
    for features in terms:
        fit = _least_squares(x, y, features)
        if fit is not None and min(fit) >= 0.0:
            return fit
    return None


def _shape_at(shape: tuple[float, float, float, float], batch: int, slots: int) -> float:
    """A shape's (see :func:`_shape`) seconds at ``batch`` rows of ``slots``-slot windows."""
    a, c, d, e = shape
    return a + c * batch + d * batch * slots + (e * batch if slots > 1 else 0.0)


def _least_squares(x: np.ndarray, y: np.ndarray, features: tuple[int, ...]) -> tuple[float, float, float, float] | None:
    """Least squares of ``y`` on the chosen ``features`` (columns) of ``x``; the terms left out are 0. None
    when the rows do not determine the fit."""
    solution, _, rank, _ = np.linalg.lstsq(x[:, list(features)], y, rcond=None)
    if rank < len(features):
        return None
    fit = [0.0, 0.0, 0.0, 0.0]
    for feature, value in zip(features, solution):
        fit[feature] = float(value)
    return tuple(fit)


def _best(scores: dict[Arm, float | None]) -> Arm | None:
    if any(v is None for v in scores.values()):
        return None
    return max(scores, key=lambda a: (scores[a], _width_order(a)))


def _pair_key(a: Arm, b: Arm) -> tuple[Arm, Arm]:
    """The pool of paired explorations of two arms: one per pair, whichever was explored, so the ratio
    either way is one number."""
    return tuple(sorted((a, b), key=_width_order))


def _width_order(arm: Arm) -> float:
    """Lower first: the lossless arms from the widest window (at the checkpoint's B) to the narrowest, then
    the taus from low to high."""
    if is_lossless(arm):
        return -1.0 if arm == LOSSLESS else -1.0 + 1.0 / arm_block_size(arm, 0)
    return arm


def make_policy(kind: Literal["fixed", "adaptive"], taus: TauRange, *, lossless: bool = False):
    """``lossless``: the adaptive policy may put greedy rows in the lossless mode (see the module docstring)."""
    if kind == "fixed":
        return FixedTau(taus)
    if kind == "adaptive":
        return AdaptiveTau(taus, lossless=lossless)
    raise ConfigError(f"tau_policy: must be one of {', '.join(POLICIES)}, got {kind!r}")
