"""The metric key ``<checkpoint>/<benchmark>/tau=<tau>``: one codec for eval.json, the gate and the plots."""

from __future__ import annotations

from pathlib import Path

import pytest

from mars.errors import MarsError
from mars.evaluation.metric_key import MetricKey, metric_key


def test_keys_are_written_as_eval_json_holds_them_and_parse_back():
    assert metric_key("mars", "heldout", 1) == "mars/heldout/tau=1.0"
    assert metric_key("ar_control", "gsm", 0.95) == "ar_control/gsm/tau=0.95"
    for key in ("mars/heldout/tau=1.0", "sft/hub_gsm8k/tau=0.7"):
        parsed = MetricKey.parse(key)
        assert parsed.format() == key
    ckpt, bench, tau = MetricKey.parse("mars/heldout/tau=0.9")
    assert (ckpt, bench, tau) == ("mars", "heldout", 0.9)


def test_the_key_names_its_per_item_outputs():
    assert MetricKey("mars", "heldout", 0.9).outputs_path("eval") == Path("eval/mars/heldout/tau=0.9.jsonl")


@pytest.mark.parametrize("key", ["mars/heldout", "mars/heldout/0.9", "mars/heldout/tau=x", "mars/heldout/tau=nan",
                                 "/heldout/tau=1.0", "a/b/c/tau=1.0"])
def test_malformed_keys_are_refused_with_the_expected_form(key):
    with pytest.raises(MarsError, match=r"expected '<checkpoint>/<benchmark>/tau=<tau>'"):
        MetricKey.parse(key)


def test_names_with_a_slash_cannot_make_a_key():
    with pytest.raises(MarsError, match="checkpoint name 'a/b'"):
        metric_key("a/b", "heldout", 1.0)


def test_the_lossless_mode_has_its_own_key_with_no_tau():
    key = MetricKey("mars", "heldout", None)
    assert key.format() == metric_key("mars", "heldout", None) == "mars/heldout/lossless"
    assert MetricKey.parse("mars/heldout/lossless") == key and key.mode == "lossless"
    assert MetricKey.parse("mars/heldout/tau=1.0").mode == "tau"
    assert key.outputs_path("eval") == Path("eval/mars/heldout/lossless.jsonl")
    with pytest.raises(MarsError, match="or '<checkpoint>/<benchmark>/lossless'"):
        MetricKey.parse("mars/heldout/lossy")
