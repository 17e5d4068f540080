"""The doubled words a lower tau adds to an output (issue #44's count): the chat benchmark's check, and
benchmarks/doubled_words.py counting them in an evaluation's outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mars.errors import DataError
from mars.evaluation.benchmarks import BenchmarkConfig, Context, create
from mars.evaluation.benchmarks.chat import added, doubled

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import doubled_words  # noqa: E402


def test_a_doubled_word_is_a_word_that_follows_itself():
    assert doubled("The capital of of France is Paris.") == {"of"}
    assert doubled("The the cat\nsat sat") == {"the", "sat"}  # case and line breaks aside
    assert doubled("It is is, I think; no, no.") == {"is"}  # "no, no": punctuation between them
    assert doubled("had had") == {"had"} and doubled("a b c") == set()


def test_only_doubled_words_the_greedy_output_lacks_count():
    assert added("Paris is the capital of France.", "Paris is the capital of of France.") == {"of"}
    assert added("He had had enough.", "He had had enough.") == set()  # greedy says it too: not tau's doing


def test_the_chat_benchmark_scores_an_output_without_a_doubled_word_one():
    bench = create("chat", BenchmarkConfig(kind="chat", n=50), Context())
    items = bench.items()
    assert len(items) == 50 and len({it.id for it in items}) == 50 and all(it.prompt.strip() for it in items)
    scored = bench.score(items[:2], ["The capital of France is Paris.", "The capital of of France is Paris."])
    assert scored == [{"score": 1.0, "doubled": []}, {"score": 0.0, "doubled": ["of"]}]


def test_a_missing_or_bad_prompt_file_is_named(tmp_path):
    missing = create("chat", BenchmarkConfig(kind="chat", options={"path": str(tmp_path / "none.jsonl")}), Context())
    with pytest.raises(DataError, match=r"evaluate.benchmarks.chat.options.path: .*none.jsonl: no such file"):
        missing.items()
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"text": "no prompt"}\n')
    bad = create("chat", BenchmarkConfig(kind="chat", options={"path": str(tmp_path / "bad.jsonl")}), Context())
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a JSON object with a 'prompt'"):
        bad.items()


def test_the_script_counts_them_in_an_evaluations_outputs(tmp_path, capsys):
    out = tmp_path / "eval" / "mars" / "chat"
    out.mkdir(parents=True)
    greedy = {"a": "He had had enough.", "b": "Paris is nice.", "c": "Fine."}
    lossy = {"a": "He had had enough.", "b": "Paris is is nice.", "c": "Fine fine."}
    for point, texts in (("tau=1.0", greedy), ("tau=0.9", lossy)):
        (out / f"{point}.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in texts.items()))
    assert doubled_words.main(["--eval", str(tmp_path / "eval"), "--tau", "0.9"]) == 0
    printed = capsys.readouterr().out
    assert "with a doubled word the tau = 1 output lacks: 2 of 3" in printed and "  b: is" in printed
