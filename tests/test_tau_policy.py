"""The tau policy (mars.decoding.tau_policy) as a specification, driven by a fake step clock: made-up step costs
per (rows, window) and made-up accepted counts, no model."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from mars.decoding.setting import GREEDY, Setting
from mars.decoding.tree_shape import TreeShape
from mars.errors import ConfigError
from mars.decoding.tau_policy import AdaptivePolicy, FixedPolicy, PolicyConfig, StepRecord, bucket, make_policy

B = 4
LOSSLESS, NARROW, FLOOR = Setting(lossless=True), Setting(lossless=True, width=2), Setting(tau=0.9)
# a lossless row at B accepts these counts in turn (a wrong draft after 0, 1, 2 or all 3 drafts)
ACCEPTED = (4, 1, 3, 2, 4, 4, 1, 2)


def drive(policy, steps: int, rows: int, cost, tokens=None, sampling: bool = False) -> Counter:
    """Run ``steps`` steps of ``rows`` rows that name no setting; ``cost(rows, slots)`` is a step's seconds and
    ``tokens(setting)`` a row's yield (default: lossless rows accept ACCEPTED in turn, capped by the width; a
    tau < 1 yields 2). Returns the steps run at each setting."""
    counts = itertools.cycle(ACCEPTED)
    tokens = tokens or (lambda s: min(next(counts), s.at(B)) if s.lossless else (2 if s.tau < 1 else 1))
    ran, before = Counter(), None
    for _ in range(steps):
        setting = policy.choose(rows, greedy=not sampling)
        ran[setting] += 1
        moved = before is not None and setting != before
        yields = [] if moved else [(setting, tokens(setting)) for _ in range(rows)]
        policy.observe(StepRecord(rows, setting.slots(B), cost(rows, setting.slots(B)), clean=not moved,
                                  yields=yields))
        before = setting
    return ran


def cheap_windows(rows: int, slots: int) -> float:  # a wide window costs little: one row, an idle accelerator
    return 0.010 * (1 + 0.01 * slots)


def dear_windows(rows: int, slots: int) -> float:  # a busy device: past a fixed cost, it grows with rows x slots
    return 0.05 + 0.001 * rows * slots


def test_with_cheap_windows_it_settles_in_the_lossless_mode_at_the_full_width():
    policy = AdaptivePolicy(PolicyConfig(), B)
    ran = drive(policy, 600, rows=1, cost=cheap_windows)
    assert ran.most_common(1)[0][0] == LOSSLESS and ran[LOSSLESS] > 0.8 * 600
    assert policy.snapshot.setting == LOSSLESS


def test_it_picks_the_faster_lossless_width_when_the_step_costs_say_so():
    # at 16 rows a 7-slot step costs 1.65x a 3-slot one: B's extra drafts do not pay for it, width 2's do
    policy = AdaptivePolicy(PolicyConfig(), B)
    ran = drive(policy, 800, rows=16, cost=dear_windows)
    assert ran.most_common(1)[0][0] == NARROW and ran[NARROW] > 0.7 * 800
    # and where even a 3-slot step costs more than its drafts return, plain greedy AR
    flat = AdaptivePolicy(PolicyConfig(), B)
    ran = drive(flat, 800, rows=16, cost=lambda rows, slots: 0.01 + 0.002 * rows * slots)
    assert ran.most_common(1)[0][0] == GREEDY


def test_narrower_lossless_widths_are_credited_from_the_full_widths_accepted_counts():
    """A lossless step at width W that accepted n would have accepted min(n, w) at width w <= W: the narrow
    width's tokens are known before it ever runs."""
    policy = AdaptivePolicy(PolicyConfig(), B)
    policy.observe(StepRecord(2, LOSSLESS.slots(B), 0.01, clean=True, yields=[(LOSSLESS, 4), (LOSSLESS, 1)]))
    assert policy.tokens[LOSSLESS] == pytest.approx(2.5) and policy.tokens[NARROW] == pytest.approx(1.5)
    policy.observe(StepRecord(1, NARROW.slots(B), 0.01, clean=True, yields=[(NARROW, 2)]))
    assert policy.tokens[LOSSLESS] == pytest.approx(2.5)  # a narrow row says nothing about a wider width


def test_draft_trees_are_candidates_measured_on_their_own_and_win_where_they_pay():
    top2 = Setting(lossless=True, tree=TreeShape.parse("top2/16"))
    policy = AdaptivePolicy(PolicyConfig(trees=("top2/16",)), B)
    assert policy.candidates[True] == [GREEDY, LOSSLESS, NARROW, top2] and top2 not in policy.candidates[False]
    policy.observe(StepRecord(1, LOSSLESS.slots(B), 0.01, clean=True, yields=[(LOSSLESS, 4)]))
    assert top2 not in policy.tokens  # a chain's yield says nothing about a tree's
    policy.observe(StepRecord(1, top2.slots(B), 0.01, clean=True, yields=[(top2, 3)]))
    assert policy.tokens[top2] == 3 and policy.tokens[LOSSLESS] == 4 and policy.tokens[NARROW] == 2

    def tokens(s):  # the tree yields 3.2 a step, the chain its ACCEPTED counts (2.6 on average)
        return 3.2 if s == top2 else min(next(counts), s.at(B)) if s.lossless else 1

    def idle(rows, slots):  # one row, an idle accelerator: 68 slots cost 7% more than one
        return 0.010 * (1 + 0.001 * slots)

    for rows, cost, wins in ((1, idle, top2), (16, dear_windows, NARROW)):
        counts = itertools.cycle(ACCEPTED)
        ran = drive(AdaptivePolicy(PolicyConfig(trees=("top2/16",)), B), 800, rows=rows, cost=cost, tokens=tokens)
        # one row on an idle device: the tree's extra tokens pay for its window; 16 rows: its 68 slots do not
        assert ran.most_common(1)[0][0] == wins, rows
    with pytest.raises(ConfigError, match="trees: expected a tree shape"):
        PolicyConfig(trees=("top-2",))


def test_a_setting_measured_in_short_explorations_is_averaged_over_all_it_yielded():
    """Until a setting has yielded as many row-steps as the moving average spans, its estimate is their plain
    mean: a setting seen only in a few short explorations is not stuck near its first step's yield."""
    policy = AdaptivePolicy(PolicyConfig(), B)
    for n in (1, 4, 4, 3):
        policy.observe(StepRecord(1, LOSSLESS.slots(B), 0.01, clean=True, yields=[(LOSSLESS, n)]))
    assert policy.tokens[LOSSLESS] == pytest.approx(3.0)
    for _ in range(10 * 128):  # past the span, a moving average: it follows a change
        policy.observe(StepRecord(1, LOSSLESS.slots(B), 0.01, clean=True, yields=[(LOSSLESS, 2)]))
    assert policy.tokens[LOSSLESS] == pytest.approx(2.0, abs=1e-3)


def test_it_never_picks_a_tau_below_one_without_a_floor():
    for rows, cost in ((1, cheap_windows), (16, dear_windows)):
        ran = drive(AdaptivePolicy(PolicyConfig(), B), 400, rows=rows, cost=cost, tokens=lambda s: 3)
        assert all(s.tau == 1.0 for s in ran)
    # rows that sample cannot take the lossless mode: without a floor they decode at tau = 1 only
    ran = drive(AdaptivePolicy(PolicyConfig(), B), 200, rows=4, cost=cheap_windows, sampling=True)
    assert set(ran) == {GREEDY}
    # a fixed-tau release default is the fixed policy's business, and the adaptive policy needs it named
    assert make_policy(PolicyConfig(), block_size=B, default_tau=0.9, release_floor=0.8).candidates[True] == \
        [GREEDY, LOSSLESS, NARROW]


def test_a_named_floor_is_a_candidate_and_wins_where_it_yields_more_tokens_per_second():
    policy = make_policy(PolicyConfig(tau_floor=0.9), block_size=B, default_tau=0.9, release_floor=0.5)
    assert FLOOR in policy.candidates[True] and FLOOR in policy.candidates[False]
    ran = drive(policy, 600, rows=1, cost=cheap_windows, tokens=lambda s: 3.5 if s == FLOOR else
                (1.5 if s.lossless else 1))
    assert ran.most_common(1)[0][0] == FLOOR
    released = make_policy(PolicyConfig(tau_floor="release"), block_size=B, default_tau=0.9, release_floor=0.7)
    assert Setting(tau=0.7) in released.candidates[True]


@pytest.mark.parametrize("lead, settles_at", [(1.02, LOSSLESS), (1.12, NARROW)])
def test_only_a_lead_beyond_the_switch_margin_moves_the_policy(lead, settles_at):
    # lossless at width 2 yields `lead` times B's tokens/s; measured well, a lead inside the 5% margin leaves the
    # policy where it started
    def cost(rows, slots):
        return {1: 0.0100, 3: 0.0100, 7: 0.0100 * (21 / 8) / (14 / 8) * lead}[slots]

    policy = AdaptivePolicy(PolicyConfig(switch_margin=0.05), B)
    for setting in (GREEDY, LOSSLESS, NARROW):  # each measured over whole cycles of ACCEPTED first
        for n in ACCEPTED * 16:
            policy.observe(StepRecord(1, setting.slots(B), cost(1, setting.slots(B)), clean=True,
                                      yields=[(setting, min(n, setting.at(B)) if setting.lossless else 1)]))
    ran = drive(policy, 600, rows=1, cost=cost)
    assert ran.most_common(1)[0][0] == settles_at and ran[settles_at] > 0.9 * 600


def test_it_explores_now_and_then_and_follows_a_change_in_the_costs():
    policy = AdaptivePolicy(PolicyConfig(decide_every=4, explore_every=40), B)
    first = drive(policy, 400, rows=16, cost=cheap_windows)
    assert first.most_common(1)[0][0] == LOSSLESS
    assert 0 < first[GREEDY] + first[NARROW] < 0.35 * 400  # short explorations of the others
    then = drive(policy, 800, rows=16, cost=dear_windows)  # the device saturates: wide windows get dear
    assert then.most_common(1)[0][0] == NARROW


def test_step_costs_are_filed_by_batch_size_bucket_and_only_from_clean_steps():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]
    policy = AdaptivePolicy(PolicyConfig(), B)
    policy.observe(StepRecord(3, 7, 0.5, clean=False))  # a prompt joined: prefill, not a decoding step
    assert policy.cost == {}
    policy.observe(StepRecord(3, 7, 0.02, clean=True))
    policy.observe(StepRecord(4, 7, 0.04, clean=True))
    assert set(policy.cost) == {(4, 7)} and 0.02 < policy.cost[(4, 7)] < 0.04


def test_the_snapshot_is_an_immutable_value_replaced_at_each_decision():
    policy = AdaptivePolicy(PolicyConfig(decide_every=2), B)
    drive(policy, 50, rows=2, cost=cheap_windows)
    snap = policy.snapshot
    with pytest.raises(TypeError):
        snap.step_cost[(2, 1)] = 1.0  # read-only views: /metrics reads them from another thread
    drive(policy, 10, rows=2, cost=cheap_windows)
    assert policy.snapshot is not snap and snap.tokens_per_step[LOSSLESS] > 1


def test_the_fixed_policy_serves_the_default_tau():
    policy = make_policy(PolicyConfig(kind="fixed"), block_size=B, default_tau=0.9, release_floor=0.5)
    assert isinstance(policy, FixedPolicy) and policy.choose(16) == FLOOR == policy.snapshot.setting


def test_a_checkpoint_without_masks_has_greedy_as_its_only_candidate():
    policy = AdaptivePolicy(PolicyConfig(tau_floor=0.5), 1)
    assert policy.candidates == {True: [GREEDY], False: [GREEDY]}
    assert set(drive(policy, 30, rows=2, cost=cheap_windows)) == {GREEDY}


@pytest.mark.parametrize("kw, key", [
    ({"kind": "greedy"}, "tau_policy"), ({"tau_floor": 0.0}, "tau_floor"), ({"tau_floor": "gate"}, "tau_floor"),
    ({"lossless_widths": (1,)}, "lossless_widths"), ({"decide_every": 0}, "decide_every"),
    ({"explore_every": 0}, "explore_every"), ({"switch_margin": -0.1}, "switch_margin")])
def test_a_bad_knob_is_refused_naming_it(kw, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        PolicyConfig(**kw)
