"""Streaming detokenization: deltas joined are the whole text, stop strings cut, linear decoding cost."""

from __future__ import annotations

import random

import pytest

from mars.core.models import load_tokenizer
from mars.serving.text_stream import TextStream

TEXT = ("Sure! Here's the plan: 1) 数据 → 模型, 2) émigré café 🎉🚀 naïve -- ok.\n"
        "def f(x):\n    return x ** 2  # the end\n") * 3


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def stream(tokenizer, ids, stop=(), seed=0):
    rng, out, i = random.Random(seed), TextStream(tokenizer, stop), 0
    deltas = []
    while i < len(ids):
        k = rng.randint(1, 5)  # MARS accepts 1..B tokens a step
        deltas.append(out.push(ids[i: i + k]))
        i += k
    deltas.append(out.finish())
    return "".join(deltas), out


@pytest.mark.parametrize("seed", range(4))
def test_deltas_joined_are_the_whole_text_even_inside_multibyte_characters(tokenizer, seed):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    ids = ids[: len(ids) - seed * 7] + [tokenizer.eos_token_id]  # ends anywhere, then a special token
    text, out = stream(tokenizer, ids, seed=seed)
    assert text == out.text() == tokenizer.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in text[:-1]


@pytest.mark.parametrize("stop", [["café"], ["🚀", "zzz"], ["\n    return"], ["x ** 2  # the"]])
def test_a_stop_string_cuts_the_stream_where_it_cuts_the_whole_text(tokenizer, stop):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    text, _ = stream(tokenizer, ids, stop)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == whole[: min(whole.find(s) for s in stop if s in whole)]


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times(tokenizer):
    ids = tokenizer(TEXT * 8, add_special_tokens=False)["input_ids"]
    decoded = []
    original = tokenizer.decode
    tokenizer.decode = lambda toks, **kw: (decoded.append(len(toks)), original(toks, **kw))[1]
    try:
        text, out = stream(tokenizer, ids)
    finally:
        tokenizer.decode = original
    assert text == original(ids, skip_special_tokens=True)
    streaming = sum(decoded) - len(ids)  # finish() decodes the whole text once
    assert len(ids) > 1000 and streaming < 12 * len(ids)  # the whole text at every push: ~len(ids)^2 / 6
