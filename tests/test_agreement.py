"""Agreement with a reference model's greedy output, and the reference's log-probability of each output."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from mars.errors import MarsError
from mars.evaluation.agreement import annotate, compare, matched_prefix, token_logprobs


def test_matched_prefix_and_exact_agreement_against_the_reference_item():
    assert matched_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and matched_prefix([], [1]) == 0
    reference = [{"id": "a", "token_ids": [1, 2, 3, 9]}, {"id": "b", "token_ids": [5, 6]}]
    rows = [{"id": "b", "token_ids": [5, 6]}, {"id": "a", "token_ids": [1, 2, 7]}]
    assert compare(rows, reference) == [{"agree_exact": 1.0, "agree_prefix": 2, "agree_prefix_frac": 1.0},
                                        {"agree_exact": 0.0, "agree_prefix": 2, "agree_prefix_frac": 0.5}]
    with pytest.raises(MarsError, match="no output for item 'c'"):
        compare([{"id": "c", "token_ids": []}], reference)


def test_the_reference_log_probability_is_teacher_forced_on_each_prompt_whatever_the_batch():
    model = tiny_model()
    rows = [{"prompt_token_ids": [3, 4, 5, 6, 7], "token_ids": [8, 9]},
            {"prompt_token_ids": [10], "token_ids": [11, 12, 13, 14]},
            {"prompt_token_ids": [15, 16], "token_ids": []}]
    batched = token_logprobs(model, rows, batch_size=3)
    for row, (total, n) in zip(rows, batched):
        ids = torch.tensor([row["prompt_token_ids"] + row["token_ids"]])
        with torch.no_grad():
            logp = model(ids).logits[0].float().log_softmax(-1)
        p = len(row["prompt_token_ids"])
        expected = sum(float(logp[p - 1 + k, t]) for k, t in enumerate(row["token_ids"]))
        assert n == len(row["token_ids"]) and total == pytest.approx(expected, abs=1e-4)
    means = annotate([dict(r, id=str(i)) for i, r in enumerate(rows)],
                     [dict(r, id=str(i)) for i, r in enumerate(rows)], model, batch_size=2)
    assert means["agree_exact"] == 1.0
    assert means["ref_logprob"] == pytest.approx(sum(t for t, _ in batched) / 6, abs=1e-5)  # per token, not per item


def test_an_output_already_scored_is_not_forwarded_again():
    model = tiny_model()
    calls = []
    model.register_forward_hook(lambda module, args, kwargs, out: calls.append(1), with_kwargs=True)
    rows = [{"prompt_token_ids": [3, 4], "token_ids": [5, 6, 7]}, {"prompt_token_ids": [8], "token_ids": [9]}]
    memo: dict = {}
    first = token_logprobs(model, rows, batch_size=1, memo=memo)
    assert len(calls) == 2
    # the same outputs in another entry (a lossless output and its tau = 1 twin), one twice: no forward at all
    again = token_logprobs(model, [rows[1], rows[0], dict(rows[0])], batch_size=1, memo=memo)
    assert len(calls) == 2 and again == [first[1], first[0], first[0]]
