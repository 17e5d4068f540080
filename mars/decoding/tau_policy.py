"""Which :class:`~mars.decoding.setting.Setting` the serving rows that named none decode at.

``fixed`` serves the release's default tau. ``adaptive`` (the default) chooses by measured goodput: a
wider window yields more tokens per row and step but costs more per step, and how much more depends on
the batch and the hardware, so the choice is measured online, not configured.

* Measured: the cost of a step per (batch-size bucket, window slots), a moving average over steps that
  took no prompt and moved no row (prefill and a row's first step in a new setting say nothing about the
  setting); and the tokens a row yields per step in each setting, a request's prompt step included but not
  a row's first step after a move (it yields what the old setting left). tau = 1 yields exactly one. Lossless
  widths need no exploration of their own: a lossless step at width W that accepted n tokens would have
  accepted min(n, w) at width w <= W from the same state (the first masks see the same inputs under
  causal attention).
* Decided: every ``decide_every`` steps, the candidate with the most predicted tokens/s at the batch as it
  is (rows that named their setting count as they are), moving only for a lead above ``switch_margin``;
  every ``explore_every`` steps, a short run (``decide_every`` steps) of the candidate measured longest ago
  at this batch size, so estimates follow the load. Unmeasured candidates are tried first.
* Candidates: tau = 1, the lossless mode at B and at each of ``lossless_widths``, and at B with each of
  the draft ``trees``: all exactly greedy. A tree candidate is measured on its own (what a tree accepts
  says nothing about a chain's), so the node budget that pays is found per batch size.
  A lossy tau < 1 is one only where the operator names a floor; rows that sample (temperature > 0) choose
  between tau = 1 and that floor, since the lossless mode is greedy.

The decision and the estimates behind it are published as one immutable :class:`PolicySnapshot` that
``/metrics`` reads from another thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping, Sequence

from mars.decoding.setting import GREEDY, Setting
from mars.decoding.tree_shape import AUTO, TreeShape
from mars.errors import ConfigError

# The shapes ``tree: auto`` weighs beside the chain and greedy AR: masks after every node (15 entries a step at
# B = 4), then wider trees (22, 34, 63 entries) whose extra tokens/forward pay only where a wide step is cheap.
AUTO_TREES = tuple(TreeShape.parse(t) for t in ("chain", "top2/16+masks:4", "top4/8", "top4/16"))
COST_WEIGHT = 0.125  # moving average of step costs: about the last 8 clean steps of a cell
TOKEN_ROWS = 128  # moving average of tokens per row-step: about the last 128 row-steps of a setting


@dataclass(frozen=True)
class PolicyConfig:
    """The tau policy's knobs (``mars serve`` flags of the same names)."""

    kind: Literal["fixed", "adaptive"] = "adaptive"
    tau_floor: float | Literal["release"] | None = None  # the lowest lossy tau allowed; None: greedy only
    lossless_widths: tuple[int, ...] = (2,)  # lossless widths below the checkpoint's B the policy may use
    trees: tuple[TreeShape, ...] = ()  # draft trees (lossless at B) the policy may use; "auto" stands for AUTO_TREES
    decide_every: int = 4  # steps between decisions (and the length of an exploration)
    switch_margin: float = 0.05  # a candidate must predict this much more tokens/s than the setting in use
    explore_every: int = 128  # steps between explorations

    def __post_init__(self):
        if self.kind not in ("fixed", "adaptive"):
            raise ConfigError(f"tau_policy: must be fixed or adaptive, got {self.kind!r}")
        floor = self.tau_floor
        if floor is not None and floor != "release" and (isinstance(floor, bool) or not isinstance(floor, (int, float))
                                                         or not 0.0 < floor <= 1.0):
            raise ConfigError(f"tau_floor: must be in (0, 1] or 'release', got {floor!r}")
        trees = []
        for t in self.trees:  # auto stands for the ladder tree: auto weighs
            trees += AUTO_TREES if t == AUTO else [t if isinstance(t, TreeShape) else TreeShape.parse(t, "trees")]
        object.__setattr__(self, "trees", tuple(dict.fromkeys(trees)))  # a shape named twice is one candidate
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 2 for w in self.lossless_widths):
            raise ConfigError(f"lossless_widths: must be integers >= 2, got {list(self.lossless_widths)}")
        for key in ("decide_every", "explore_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.switch_margin < 0:
            raise ConfigError(f"switch_margin: must be >= 0, got {self.switch_margin}")


@dataclass(frozen=True)
class PolicySnapshot:
    setting: Setting  # the setting of the rows that named none
    tokens_per_step: Mapping[Setting, float] = field(default_factory=dict)  # per row and step
    step_cost: Mapping[tuple[int, int], float] = field(default_factory=dict)  # (batch bucket, slots) -> seconds


@dataclass(frozen=True)
class StepRecord:
    """What the engine saw in one step."""

    rows: int  # rows in the step
    slots: int  # the widest row's window slots (what the step cost)
    seconds: float
    clean: bool  # no prompt joined and no row moved to another setting: a decoding step of this setting mix
    yields: Sequence[tuple[Setting, int]] = ()  # (setting, tokens) per row, but for rows that just moved setting


def bucket(rows: int) -> int:
    """The batch-size bucket a step's cost is filed under: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


class FixedPolicy:
    """Every row that named no setting decodes at one setting (the release's default tau)."""

    def __init__(self, setting: Setting):
        self.snapshot = PolicySnapshot(setting)

    def choose(self, rows: int, named: Sequence[Setting] = (), greedy: bool = True) -> Setting:
        return self.snapshot.setting

    def observe(self, step: StepRecord) -> None:
        pass


class AdaptivePolicy:
    """The goodput-driven choice among greedy settings (and a named floor); see the module docstring."""

    def __init__(self, cfg: PolicyConfig, block_size: int, floor: float | None = None):
        self.cfg, self.block_size = cfg, block_size
        widths = sorted({w for w in cfg.lossless_widths if w < block_size}, reverse=True)
        lossless = [Setting(lossless=True)] + [Setting(lossless=True, width=w) for w in widths] \
            + [Setting(lossless=True, tree=t) for t in cfg.trees] if block_size > 1 else []
        lossy = [Setting(tau=floor)] if floor is not None and floor < 1.0 and block_size > 1 else []
        self.candidates = {True: [GREEDY, *lossless, *lossy], False: [GREEDY, *lossy]}  # by whether rows are greedy
        self.setting = lossless[0] if lossless else GREEDY  # the lossless mode costs no score: start there
        self.cost: dict[tuple[int, int], float] = {}
        self.tokens: dict[Setting, float] = {GREEDY: 1.0}
        self.samples: dict[object, int] = {}  # cost cell or setting -> samples averaged so far
        self.measured: dict[tuple[int, int], int] = {}  # cost cell -> the step it was last measured at
        self.tried: dict[tuple[int, Setting], int] = {}  # (bucket, setting) -> the step its exploration began
        self.steps, self.next_decision, self.next_exploration = 0, 0, cfg.explore_every
        self.exploring: Setting | None = None
        self.snapshot = PolicySnapshot(self.setting)

    def choose(self, rows: int, named: Sequence[Setting] = (), greedy: bool = True) -> Setting:
        """The setting for the step's rows that named none: ``rows`` in the step, ``named`` the settings of
        those that named theirs, ``greedy`` whether every policy row decodes greedily."""
        self.steps += 1
        candidates = self.candidates[greedy]
        current = self.exploring or self.setting
        if self.steps < self.next_decision and current in candidates:
            return current
        self.next_decision = self.steps + self.cfg.decide_every
        self.exploring = None
        size = bucket(rows)
        scores = {s: self.predict(s, rows, named) for s in candidates}
        untried = [s for s, v in scores.items() if v is None
                   and self.steps - self.tried.get((size, s), -self.cfg.explore_every) >= self.cfg.explore_every]
        if self.setting not in candidates:  # sampling rows: the lossless mode is out, tau = 1 is the start
            self.setting = GREEDY
        if untried:
            self._explore(untried[0], size)
        elif self.steps >= self.next_exploration:
            self.next_exploration = self.steps + self.cfg.explore_every
            others = [s for s in candidates if s != self.setting]
            if others:
                self._explore(min(others, key=lambda s: self.measured.get((size, self._slots(s, named)), -1)), size)
        else:
            best = max((s for s, v in scores.items() if v is not None), key=lambda s: scores[s], default=self.setting)
            now = scores.get(self.setting)
            if now is None or scores[best] > now * (1 + self.cfg.switch_margin):
                self.setting = best
        self._publish()
        return self.exploring or self.setting

    def observe(self, step: StepRecord) -> None:
        if step.clean:
            cell = (bucket(step.rows), step.slots)
            self._average(self.cost, cell, step.seconds, 1, 1 / COST_WEIGHT)
            self.measured[cell] = self.steps
        by_setting: dict[Setting, list[int]] = {}
        for setting, tokens in step.yields:
            if setting.lossless and setting.tree is None:  # what each narrower chain candidate would have accepted
                width = setting.at(self.block_size)
                for s in self.candidates[True]:
                    if s.lossless and s.tree is None and s.at(self.block_size) <= width:
                        by_setting.setdefault(s, []).append(min(tokens, s.at(self.block_size)))
            elif setting != GREEDY:
                by_setting.setdefault(setting, []).append(tokens)
        for setting, tokens in by_setting.items():
            self._average(self.tokens, setting, sum(tokens) / len(tokens), len(tokens), TOKEN_ROWS)
        self._publish()

    def _average(self, means: dict, key, value: float, count: int, horizon: float) -> None:
        """A moving average over about the last ``horizon`` samples; the plain mean until there are that many
        (a setting measured only in short explorations would otherwise keep its first samples' bias)."""
        seen = self.samples[key] = self.samples.get(key, 0) + count
        old = means.get(key, value)
        means[key] = old + (value - old) * count / min(seen, horizon)

    def predict(self, setting: Setting, rows: int, named: Sequence[Setting] = ()) -> float | None:
        """Predicted tokens/s of a step with ``rows`` rows, those that named none at ``setting``; None where
        the step's cost or the setting's tokens have not been measured."""
        cost = self.cost.get((bucket(rows), self._slots(setting, named)))
        tokens = self.tokens.get(setting)
        if cost is None or tokens is None:
            return None
        own = sum(self.tokens.get(s, 1.0) for s in named)
        return ((rows - len(named)) * tokens + own) / cost

    def _slots(self, setting: Setting, named: Sequence[Setting]) -> int:
        return max([setting.slots(self.block_size)] + [s.slots(self.block_size) for s in named])

    def _explore(self, setting: Setting, size: int) -> None:
        self.exploring = setting
        self.tried[(size, setting)] = self.steps

    def _publish(self) -> None:
        self.snapshot = PolicySnapshot(self.exploring or self.setting, MappingProxyType(dict(self.tokens)),
                                       MappingProxyType(dict(self.cost)))


class Steering:
    """A policy's hold on a :class:`~mars.decoding.batch.CachedBatch`, shared by the serving engine and
    ``generate(tree="auto")``: before a step the steered rows (those that named no setting) get the policy's
    setting; after it the policy learns what the step cost and what each row yielded, a row's first step in a
    new setting left out (it yields what its old setting left it: no drafts yet, or a cache of verified ones)."""

    def __init__(self, policy):
        self.policy = policy
        self._before: dict[int, Setting] = {}  # id(row) -> the setting of its last step
        self._moved = False

    def before_step(self, live: Sequence, steered: Sequence, narrow=None) -> Setting | None:
        """Give the ``steered`` rows among ``live`` the policy's choice (``narrow(row, setting)`` may cap it
        per row); returns the choice, None where no row is steered."""
        chosen = None
        if steered:
            ids = {id(r) for r in steered}
            chosen = self.policy.choose(len(live), [r.setting for r in live if id(r) not in ids],
                                        greedy=all(r.sampler is None for r in steered))
            for r in steered:
                r.setting = chosen if narrow is None else narrow(r, chosen)
        self._moved = any(self._before.get(id(r), r.setting) != r.setting for r in live)
        return chosen

    def after_step(self, updates: Sequence, *, rows: int, slots: int, seconds: float, joined: bool) -> None:
        """Tell the policy about the step: ``rows`` decoded, the widest row's ``slots``, what it cost and
        whether prompts ``joined`` (a prefill says nothing about the settings)."""
        before, self._before = self._before, {}
        yields = []
        for u in updates:
            if before.get(id(u.row), u.row.setting) == u.row.setting:  # a joining row's prompt step counts
                yields.append((u.row.setting, len(u.new_tokens)))
            if not u.done:
                self._before[id(u.row)] = u.row.setting
        self.policy.observe(StepRecord(rows, slots, seconds, clean=not joined and not self._moved, yields=yields))


def make_policy(cfg: PolicyConfig, *, block_size: int, default_tau: float, release_floor: float):
    """The policy ``mars serve`` runs: ``fixed`` at the default tau; ``adaptive`` over the greedy settings and
    the named floor (``release``: the floor the release's gate accepted)."""
    if cfg.kind == "fixed":
        return FixedPolicy(Setting(tau=default_tau))
    floor = release_floor if cfg.tau_floor == "release" else cfg.tau_floor
    return AdaptivePolicy(cfg, block_size, floor)
