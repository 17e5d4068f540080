"""benchmarks/doubled_words.py: the doubled words a lower tau adds to an output (issue #44's count)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from doubled_words import added, doubled  # noqa: E402


def test_a_doubled_word_is_a_word_that_follows_itself():
    assert doubled("The capital of of France is Paris.") == {"of"}
    assert doubled("The the cat\nsat sat") == {"the", "sat"}  # case and line breaks aside
    assert doubled("It is is, I think; no, no.") == {"is"}  # "no, no": punctuation between them
    assert doubled("had had") == {"had"} and doubled("a b c") == set()


def test_only_doubled_words_the_greedy_output_lacks_count():
    assert added("Paris is the capital of France.", "Paris is the capital of of France.") == {"of"}
    assert added("He had had enough.", "He had had enough.") == set()  # greedy says it too: not tau's doing
