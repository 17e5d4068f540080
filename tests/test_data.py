"""``mars prepare`` and ``load_split``: sources, malformed rows counted with reasons, shards and meta."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mars.training import suite
from mars.cli import main
from mars.config import build
from mars.training.data import DataConfig, check_tokenizer, load_meta, load_split, prepare
from mars.errors import ConfigError, DataError
from mars.core.models import load_tokenizer
from mars.training.base import ModelConfig, TinyConfig, build_base, describe, save_base

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small tiny-profile base (tokenizer trained on the suite, mask token registered)."""
    cfg = ModelConfig(tiny=TinyConfig(vocab_size=400, tokenizer_corpus=400, hidden_size=32, num_hidden_layers=2,
                                      intermediate_size=64))
    model, tok, info = build_base(cfg, seed=0)
    out = tmp_path_factory.mktemp("models") / "base"
    save_base(model, tok, describe(model, tok, info, "tiny"), out)
    return out


@pytest.fixture(scope="module")
def tokenizer(base):
    return load_tokenizer(base)


def write_jsonl(path: Path, lines: list) -> Path:
    with path.open("wb") as fh:
        for line in lines:
            fh.write(line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode())
            fh.write(b"\n")
    return path


def stats_of(out: Path, split: str = "train") -> dict:
    return json.loads((out / "stats.json").read_text())["splits"][split]


def test_builtin_prepare_writes_shards_meta_and_stats(base, tokenizer, tmp_path):
    out = tmp_path / "prepared"
    meta = prepare(DataConfig(n_train=160, n_heldout=40), base, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "heldout-00000-of-00001.parquet", "meta.json", "stats.json", "train-00000-of-00001.parquet"]
    assert load_meta(out) == meta and meta["counts"] == {"train": 160, "heldout": 40}
    assert meta["mask_token_id"] == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert meta["eos_token_id"] == tokenizer.eos_token_id and meta["pad_token_id"] == tokenizer.pad_token_id
    assert len(meta["tokenizer_sha256"]) == 64
    check_tokenizer(meta, tokenizer)

    schema = pq.read_schema(out / "train-00000-of-00001.parquet")
    assert schema.field("input_ids").type == pa.list_(pa.int32()) and schema.field("prompt_len").type == pa.int32()
    assert "prompt" not in schema.names
    train, held = load_split(out, "train"), load_split(out, "heldout")
    assert {r["family"] for r in train} == set(suite.family_names())
    items = {it.id: it for it in suite.heldout(40, seed=0)}
    for row in held:
        item = items[row["id"]]
        assert (row["prompt"], row["response"], row["family"]) == (item.prompt, item.response, item.family)
        prompt_ids, response_ids = row["input_ids"][: row["prompt_len"]], row["input_ids"][row["prompt_len"]:]
        assert tokenizer.decode(prompt_ids) == f"<|user|>\n{item.prompt}<|end|>\n<|assistant|>\n"
        assert response_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(response_ids[:-1]) == item.response
    assert not {r["id"] for r in train} & set(items)
    s = stats_of(out)
    assert s["kept"] == 160 and s["skipped"] == {} and s["tokens"]["total"]["max"] <= 128


def test_malformed_rows_are_counted_with_their_reasons(base, tmp_path):
    src = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "Say hi.", "response": "hi"},
        '{"prompt": "broken", "response": ',
        {"prompt": "Say nothing.", "response": "   "},
        {"prompt": "Count.", "response": 5},
        b'{"prompt": "caf\xe9", "response": "x"}',
        {"prompt": "No answer."},
        "[1, 2]",
        "",
        {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "red"}]},
        {"prompt": "Long? " * 80, "response": "yes"},
    ])
    out = tmp_path / "prepared"
    prepare(DataConfig(source=str(src), n_heldout=0), base, out)
    s = stats_of(out)
    assert s["skipped"] == {"bad_json": 1, "empty_response": 1, "wrong_type": 1, "non_utf8": 1,
                            "missing_response": 1, "not_an_object": 1, "too_long": 1}
    assert s["rows_read"] == 9 and s["kept"] == 2 and s["blank_lines"] == 1  # a blank line is not a row
    wheres = {p["reason"]: p["where"] for p in s["problems"]}
    assert wheres["bad_json"] == f"{src}:2" and wheres["non_utf8"] == f"{src}:5"
    assert [r["input_ids"][-1] for r in load_split(out, "train")] == [load_meta(out)["eos_token_id"]] * 2


def test_a_file_with_no_usable_row_is_an_error_naming_it_and_keeps_earlier_output(base, tmp_path, capsys):
    out = tmp_path / "prepared"
    prepare(DataConfig(n_train=16, n_heldout=8), base, out)
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{nope", {"prompt": "x", "response": ""}, b"\xff\xfe"])
    with pytest.raises(DataError, match=r"bad\.jsonl: no usable rows .*bad_json: 1"):
        prepare(DataConfig(source=str(bad)), base, out)
    code = main(["prepare", "--params", str(ROOT / "params.yaml"), "-S", f"data.source={bad}",
                 "--base", str(base), "--out", str(out)])
    assert code == 1 and "bad.jsonl: no usable rows" in capsys.readouterr().err
    assert load_meta(out)["counts"] == {"train": 16, "heldout": 8}, "the previous output is untouched"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_rows_past_what_the_json_parser_takes_are_counted_skips_not_a_traceback(base, tmp_path):
    """A row nested 100,000 deep (RecursionError in json) and an id of 5,000 digits (past Python's int
    digit limit: ValueError) are bad rows like any other: skipped, counted, named by file and line."""
    src = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "Say hi.", "response": "hi"},
        '{"prompt": "deep", "response": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"id": ' + "7" * 5000 + ', "prompt": "Say yes.", "response": "yes"}',
        {"prompt": "Say no.", "response": "no"},
    ])
    out = tmp_path / "prepared"
    prepare(DataConfig(source=str(src), n_heldout=0), base, out)
    s = stats_of(out)
    assert s["skipped"] == {"bad_json": 2} and s["kept"] == 2
    detail = {p["where"]: p["detail"] for p in s["problems"]}
    assert "nested too deeply" in detail[f"{src}:2"] and "4300 digits" in detail[f"{src}:3"]


def test_a_json_file_nested_too_deeply_is_one_line_naming_it(base, tmp_path, capsys):
    src = tmp_path / "rows.json"
    src.write_text("[" * 100_000 + "]" * 100_000)
    code = main(["prepare", "--params", str(ROOT / "params.yaml"), "-S", f"data.source={src}",
                 "--base", str(base), "--out", str(tmp_path / "prepared")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and f"{src}: not a JSON file (nested too deeply" in err


def test_parquet_and_messages_sources_with_a_heldout_file(base, tokenizer, tmp_path):
    rows = [{"question": f"Repeat {w}.", "answer": w, "task": "echo"} for w in ["cat", "dog", "fish", "bird"]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    held = write_jsonl(tmp_path / "held.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Repeat cow."},
                      {"role": "assistant", "content": "cow"}], "id": "h1"},
        {"messages": [{"role": "user", "content": "Repeat cat."}]},
    ])
    cfg = DataConfig(source=str(tmp_path / "train.parquet"), heldout=str(held), prompt_column="question",
                     response_column="answer", family_column="task")
    out = tmp_path / "prepared"
    prepare(cfg, base, out)
    train = load_split(out, "train")
    assert [r["family"] for r in train] == ["echo"] * 4
    assert train[0]["id"].endswith("-0")
    assert tokenizer.decode(train[0]["input_ids"][: train[0]["prompt_len"]]).startswith("<|user|>\nRepeat cat.")
    (h,) = load_split(out, "heldout")
    assert (h["id"], h["prompt"], h["response"], h["family"]) == ("h1", "Repeat cow.", "cow", "data")
    assert tokenizer.decode(h["input_ids"][: h["prompt_len"]]) == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nRepeat cow.<|end|>\n<|assistant|>\n")
    assert stats_of(out, "heldout")["skipped"] == {"missing_response": 1}


def test_carved_heldout_is_disjoint_and_a_local_dataset_dir_is_read(base, tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    lines = [{"prompt": f"Add {i} and 1.", "response": str(i + 1)} for i in range(30)]
    write_jsonl(ds / "train.jsonl", lines + lines[:5])  # duplicated prompts must not straddle the splits
    out = tmp_path / "prepared"
    prepare(DataConfig(source=str(ds), n_heldout=10, n_train=None), base, out)
    train, held = load_split(out, "train"), load_split(out, "heldout")
    prompts = {split: {tuple(r["input_ids"][: r["prompt_len"]]) for r in rows} for split, rows in
               (("train", train), ("heldout", held))}
    assert len(held) == 10 and not prompts["train"] & prompts["heldout"]
    dup = stats_of(out)["skipped"].get("heldout_overlap", 0)
    assert len(train) + len(held) + dup == 35


def test_overlong_examples_are_skipped_or_truncated_and_counted(base, tmp_path):
    src = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Go.", "response": "word " * 60},
                                                {"prompt": "Go on.", "response": "ok"}])
    for mode, kept, truncated, skipped in (("skip", 1, 0, {"too_long": 1}), ("truncate", 2, 1, {})):
        out = tmp_path / mode
        prepare(DataConfig(source=str(src), n_heldout=0, max_length=32, overlong=mode), base, out)
        s = stats_of(out)
        assert (s["kept"], s["truncated"], s["skipped"]) == (kept, truncated, skipped)
        assert max(len(r["input_ids"]) for r in load_split(out, "train")) <= 32


def test_a_response_cut_off_at_the_token_limit_is_trained_without_eos(base, tokenizer, tmp_path):
    """mars distill marks a response that hit max_new_tokens with finish_reason "length": the base did not
    stop there, so training must not teach it to (an EOS there makes a fine-tuned model answer short)."""
    src = write_jsonl(tmp_path / "rows.jsonl", [
        {"id": "a", "prompt": "Go.", "response": "one two", "finish_reason": "stop"},
        {"id": "b", "prompt": "Go.", "response": "one two", "finish_reason": "length"},
        {"id": "c", "prompt": "Go.", "response": "one two"},
        {"id": "d", "prompt": "Go.", "response": "one two", "finish_reason": 3}])
    out = tmp_path / "out"
    prepare(DataConfig(source=str(src), n_heldout=0, max_length=64), base, out)
    rows = {r["id"]: r["input_ids"] for r in load_split(out, "train")}
    eos = tokenizer.eos_token_id
    assert rows["a"][-1] == eos and rows["c"][-1] == eos
    assert rows["b"] == rows["a"][:-1]
    s = stats_of(out)
    assert (s["kept"], s["unterminated"], s["skipped"]) == (3, 1, {"wrong_type": 1})


def test_load_split_checks_the_shards_against_meta(base, tmp_path):
    out = tmp_path / "prepared"
    prepare(DataConfig(n_train=16, n_heldout=8), base, out)
    with pytest.raises(DataError, match="no split 'test'"):
        load_split(out, "test")
    meta = json.loads((out / "meta.json").read_text())
    meta["counts"]["train"] = 17
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="16 rows, meta.json says 17"):
        load_split(out, "train")
    meta["format_version"] = 99
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="format version 99"):
        load_split(out, "train")
    with pytest.raises(DataError, match=r"meta.json: no such file \(run `mars prepare"):
        load_split(tmp_path / "missing", "train")


def test_data_section_is_validated():
    with pytest.raises(ConfigError, match="families: unknown nope"):
        DataConfig(families=["nope"])
    with pytest.raises(ConfigError, match="families: only applies"):
        DataConfig(source="x.jsonl", families=["sorting"])
    with pytest.raises(ConfigError, match="data.overlong"):
        build(DataConfig, {"overlong": "cut"}, "data")


# ---- bad input (issue 16): each of these crashed or passed silently -------------------------------------
def test_a_lone_surrogate_is_a_counted_skip_and_blank_lines_are_counted(base, tmp_path, capsys):
    src = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "Say hi.", "response": "hi"},
        '{"prompt": "\\ud800", "response": "x"}',  # valid JSON, not text: crashed the tokenizer
        "",
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\\udfff"}]}',
        "   ",
        {"prompt": "Say ho.", "response": "ho"},
    ])
    out = tmp_path / "prepared"
    assert main(["prepare", "--params", str(ROOT / "params.yaml"), "-S", f"data.source={src}", "-S",
                 "data.n_heldout=0", "--base", str(base), "--out", str(out)]) == 0
    s = stats_of(out)
    assert s["skipped"] == {"non_utf8": 2} and s["kept"] == 2
    assert s["rows_read"] == 4 and s["blank_lines"] == 2
    assert [p["where"] for p in s["problems"]] == [f"{src}:2", f"{src}:4"]
    assert "surrogate" in s["problems"][0]["detail"]
    assert "(+ 2 blank lines)" in capsys.readouterr().out


def test_a_tiny_file_is_not_carved_into_almost_nothing_to_train_on(base, tmp_path):
    src = write_jsonl(tmp_path / "tiny.jsonl", [{"prompt": f"Add {i} and 1.", "response": str(i + 1)}
                                                for i in range(40)])
    with pytest.raises(DataError, match=r"tiny\.jsonl: 40 usable rows; holding out 39 .* leave 1 to train on: "
                                        r"lower data\.n_heldout \(at most 20\)"):
        prepare(DataConfig(source=str(src), n_heldout=400), base, tmp_path / "prepared")
    meta = prepare(DataConfig(source=str(src), n_heldout=20), base, tmp_path / "prepared")
    assert meta["counts"] == {"train": 20, "heldout": 20}
