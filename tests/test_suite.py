"""The built-in instruction suite: deterministic, disjoint splits, every family present and correct."""

from __future__ import annotations

import re

import pytest

from mars.training import suite
from mars.errors import ConfigError


def test_same_seed_gives_the_same_items_and_another_seed_other_items():
    assert suite.train(200, seed=3) == suite.train(200, seed=3)
    assert suite.heldout(80, seed=3) == suite.heldout(80, seed=3)
    assert suite.train(200, seed=3) != suite.train(200, seed=4)


def test_train_and_heldout_are_disjoint_by_content_whatever_the_seeds():
    held = suite.heldout(400, seed=0)
    for seed in (0, 1):
        train_prompts = {it.prompt for it in suite.train(3000, seed=seed)}
        assert not train_prompts & {it.prompt for it in held}
    assert all(suite.split_of(it.family, it.prompt) == "heldout" for it in held)


def test_at_least_six_families_each_filled_evenly_with_distinct_items():
    assert len(suite.family_names()) >= 6
    items = suite.heldout(83, seed=0)
    counts = {name: sum(it.family == name for it in items) for name in suite.family_names()}
    n_fam = len(counts)
    assert sorted(counts.values()) == [83 // n_fam] * (n_fam - 83 % n_fam) + [83 // n_fam + 1] * (83 % n_fam)
    assert len({it.id for it in items}) == len({it.prompt for it in items}) == len(items)
    chosen = suite.train(40, seed=0, families=["sorting", "copying"])
    assert [sum(it.family == f for it in chosen) for f in ("sorting", "copying")] == [20, 20]


def test_training_items_interleave_families():
    first = [it.family for it in suite.train(400, seed=0)[:40]]
    assert len(set(first)) >= 5


def test_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown nope"):
        suite.train(10, families=["nope"])


def _numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_responses_are_correct_answers(split):
    items = suite.generate(split, 800, seed=5)
    checked = set()
    for it in items:
        if it.family == "arithmetic":
            a, op, b, _, c = it.response.split()
            assert it.response.startswith(re.search(r"\d+ [-+x] \d+", it.prompt).group())
            assert int(c) == {"+": int(a) + int(b), "-": int(a) - int(b), "x": int(a) * int(b)}[op]
        elif it.family == "sorting":
            assert _numbers(it.response) == sorted(_numbers(it.prompt), reverse="descending" in it.prompt)
        elif it.family == "counting":
            word = it.prompt.split("the word ")[1].split()[0]
            listed = it.prompt.split(": ")[1].rstrip("?").split(", ")
            assert _numbers(it.response) == [listed.count(word)]
        elif it.family == "copying":
            assert it.response in it.prompt or it.response.split()[0] in it.prompt
        elif it.family == "word_problem":
            steps = re.findall(r"(\d+) ([-+x]) (\d+) = (\d+)", it.response)
            assert len(steps) == 2
            for a, op, b, c in steps:
                assert int(c) == {"+": int(a) + int(b), "-": int(a) - int(b), "x": int(a) * int(b)}[op]
            assert it.response.endswith(f"The answer is {steps[-1][3]}.")
        elif it.family == "choice":
            assert it.response in it.prompt
        checked.add(it.family)
    assert {"arithmetic", "sorting", "counting", "copying", "word_problem", "choice"} <= checked


def test_score_is_exact_match_after_strip_and_final_answer_for_word_problems():
    assert suite.score("sorting", " 1, 2, 3\n", "1, 2, 3") == 1.0
    assert suite.score("sorting", "1, 3, 2", "1, 2, 3") == 0.0
    ref = "Mia buys 2 x 3 = 6 pens. Then Mia has 1 + 6 = 7 pens. The answer is 7."
    assert suite.score("word_problem", "so 1 + 6 = 7. The answer is 7.", ref) == 1.0
    assert suite.score("word_problem", "The answer is 8.", ref) == 0.0
    assert suite.score("word_problem", "no number", ref) == 0.0
    assert suite.score("external_family", "yes", " yes ") == 1.0
