"""reasoning-gym tasks: disjoint train / held-out splits, and the ``reasoning`` benchmark's verifiers."""

from __future__ import annotations

import pytest

from mars.errors import ConfigError
from mars.evaluation.benchmarks import BenchmarkConfig, Context, create
from mars.evaluation.benchmarks.reasoning import readings, verify
from mars.training import tasks
from mars.training.tasks import TaskFamily, TasksConfig

DEFAULT = TasksConfig()
PARTIAL_CREDIT = {"calendar_arithmetic", "time_intervals", "prime_factorization"}


def test_train_and_heldout_splits_are_disjoint_by_content():
    cfg = TasksConfig(n_train=40, n_heldout=40, families={"gcd": TaskFamily(config={"min_numbers": 2, "max_numbers": 2,
                                                                                    "min_value": 2, "max_value": 9})})
    held = {e["question"] for e in tasks.heldout(cfg, "gcd")}
    train, dropped = tasks.train(cfg, "gcd")
    questions = [e["question"] for e in train]
    assert not held & set(questions) and len(set(questions)) == len(questions)
    assert dropped > 0  # gcd of numbers below 10 has few distinct questions: the overlaps were seen and dropped


def test_the_heldout_split_asks_each_question_once():
    small = {"basic_arithmetic": TaskFamily(config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                                    "operators": ["+"], "allow_parentheses": False,
                                                    "allow_negation": False})}
    entries = tasks.heldout(TasksConfig(n_heldout=80, families=small), "basic_arithmetic")
    questions = [e["question"] for e in entries]
    assert len(set(questions)) == len(questions) > 40  # 100 sums of two digits: a 160-item draw repeats many


def test_seed_ranges_that_overlap_are_refused():
    # reasoning-gym seeds item i with seed + i: seeds 1 and 2 would share all items but one
    with pytest.raises(ConfigError, match=r"heldout_seed: items 2\.\.65 overlap the train draw 1\.\.112"):
        TasksConfig(train_seed=1, heldout_seed=2)
    with pytest.raises(ConfigError, match="gsm_symbolic comes from a benchmark's test set"):
        TasksConfig(families={"gsm_symbolic": TaskFamily()})
    with pytest.raises(ConfigError, match=r"tasks.families: unknown reasoning-gym family 'nope'"):
        tasks.heldout(TasksConfig(families={"nope": TaskFamily()}), "nope")


@pytest.mark.parametrize("family", list(DEFAULT.families))
def test_each_verifier_scores_a_right_and_a_wrong_answer(family):
    entries = tasks.heldout(DEFAULT, family)
    entry = entries[0]
    wrong = next(e["answer"] for e in entries[1:] if e["answer"] != entry["answer"])  # another item's answer
    assert verify(family, entry["answer"], entry)[0] == 1.0
    # some families give partial credit for a near miss (an hour off, a factor list in the wrong form)
    assert verify(family, wrong, entry)[0] < 1.0 if family in PARTIAL_CREDIT else verify(family, wrong, entry)[0] == 0.0
    assert verify(family, "I do not know.", entry)[0] == 0.0


def test_an_answer_in_prose_is_read_out():
    entry = next(e for e in tasks.heldout(DEFAULT, "gcd") if e["answer"] != "1")
    assert verify("gcd", f"The GCD of these numbers is {entry['answer']}.", entry) == (1.0, entry["answer"])
    assert verify("gcd", f"Let us see.\nThe answer is {entry['answer']}.", entry)[0] == 1.0
    assert readings("Steps.\nThe answer is 42.") == ["Steps.\nThe answer is 42.", "The answer is 42", "42"]


def test_the_benchmark_takes_heldout_items_of_the_named_families_and_marks_the_pool():
    cfg = BenchmarkConfig(kind="reasoning", n=0, options={"families": ["gcd", "lcm"]})
    bench = create("reasoning", cfg, Context(tasks=TasksConfig(n_heldout=3)))
    items = bench.items()
    assert [it.family for it in items] == ["gcd"] * 3 + ["lcm"] * 3
    assert items[0].prompt == tasks.heldout(TasksConfig(n_heldout=3), "gcd")[0]["question"]
    scored = bench.score(items, [it.reference for it in items[:3]] + ["no idea"] * 3)
    assert [s["score"] for s in scored] == [1.0] * 3 + [0.0] * 3
    assert [s["in_pool"] for s in scored] == [True] * 3 + [False] * 3  # lcm is evaluation only
    with pytest.raises(ConfigError, match=r"options.families: nope not in tasks.families"):
        create("reasoning", BenchmarkConfig(kind="reasoning", options={"families": ["nope"]}),
               Context(tasks=DEFAULT)).items()


def test_the_default_families_draw_the_same_items_in_every_process():
    """The distill stage resumes by a digest of its pool, evaluation regenerates the held-out split: a
    family whose items depend on the process (str hash order) would break both."""
    import os
    import subprocess
    import sys

    script = ("import hashlib; from mars.training.tasks import TasksConfig, heldout, train; cfg = TasksConfig(); "
              "print({n: hashlib.sha256(repr([heldout(cfg, n), train(cfg, n)]).encode()).hexdigest() "
              "for n in cfg.families})")
    outs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1
