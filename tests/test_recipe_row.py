"""benchmarks/recipe_row.py: a recipe run's numbers against issue #44's goals, read from its study's outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import recipe_row  # noqa: E402


def _write_items(study: Path, bench: str, point: str, items: dict[str, tuple[float, str]]) -> None:
    path = study / "eval" / "mars" / bench / f"{point}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "score": s, "text": t}) + "\n" for i, (s, t) in items.items()))


def _study(tmp_path: Path, not_worse: bool = True) -> Path:
    study = tmp_path / "study"
    (study / "metrics").mkdir(parents=True)
    # reasoning_pool: 4 items at tau = 1, the sweep's 2 of them at 0.9, one of which it gets wrong
    _write_items(study, "reasoning_pool", "tau=1.0", {f"p{k}": (1.0, "x") for k in range(4)})
    _write_items(study, "reasoning_pool", "tau=0.9", {"p0": (1.0, "x"), "p1": (0.0, "y")})
    # chat: 50 prompts; two of them double a word at 0.9, a third has the doubled word at tau = 1 too
    greedy = {f"c{k}": (1.0, "Paris is nice.") for k in range(50)} | {"c2": (1.0, "He had had enough.")}
    lossy = dict(greedy) | {"c0": (0.0, "Paris is is nice."), "c1": (0.0, "Paris Paris is nice.")}
    _write_items(study, "chat", "tau=1.0", greedy)
    _write_items(study, "chat", "tau=0.9", lossy)
    entry = lambda tpf, **extra: {"score": 0.5, "tokens_per_forward": tpf, **extra}  # noqa: E731
    metrics = {"mars/reasoning_pool/tau=1.0": entry(1.0, agree_exact=0.25, ref_logprob=-0.4),
               "mars/reasoning_pool/tau=0.9": entry(1.7), "mars/reasoning_pool/lossless": entry(2.2),
               "mars/chat/tau=1.0": entry(1.0), "mars/chat/tau=0.9": entry(1.3), "mars/chat/lossless": entry(1.8),
               "ar_control/reasoning_pool/tau=1.0": entry(1.0)}
    check = lambda baseline, delta, **extra: {"kind": "benchmark", "benchmark": "reasoning_pool",  # noqa: E731
                                              "baseline_name": baseline, "delta": delta, "se": 0.012, **extra}
    # the gate failed on its speed check alone: the comparison with ar_control is what the goal reads
    gate = {"passed": False, "baseline": "ar_control", "config": {"report_against": ["sft"]},
            "checks": [check("ar_control", -0.01, gated=True, passed=not_worse), check("sft", -0.05, gated=False),
                       {"kind": "speed", "name": "tokens/forward at tau=0.9", "gated": True, "passed": False}]}
    (study / "metrics" / "eval.json").write_text(json.dumps(metrics))
    (study / "metrics" / "gate.json").write_text(json.dumps(gate))
    return study


def test_each_benchmark_gets_its_speeds_its_paired_drop_at_tau_and_the_gates_comparisons(tmp_path):
    summary = recipe_row.summarize(_study(tmp_path), tau=0.9)
    assert summary["not_worse"] and not summary["gate"]  # a slow run may still be no worse than ar_control
    rows = summary["benchmarks"]
    pool = rows["reasoning_pool"]
    assert (pool["tau_tpf"], pool["lossless_tpf"]) == (1.7, 2.2)
    assert pool["tau_vs_1"].n == 2 and pool["tau_vs_1"].delta == -0.5  # the sweep's items only, paired by id
    assert pool["vs_ar_control"]["delta"] == -0.01 and pool["vs_base"]["delta"] == -0.05
    assert (pool["agree_exact"], pool["ref_logprob"]) == (0.25, -0.4)
    assert rows["chat"]["doubled"] == (2, 50)  # c2's doubled word is greedy's own


def test_every_goal_gets_a_line_that_says_whether_it_is_met(tmp_path, capsys):
    assert recipe_row.main([str(_study(tmp_path, not_worse=False))]) == 0
    printed = capsys.readouterr().out
    assert "| reasoning_pool | 1.70 | 2.20 | -50.0 +- 50.0 | -1.0 +- 1.2 | -5.0 +- 1.2 | 0.25 | -0.400 |" in printed
    assert "[met] reasoning_pool: tau 0.9 1.70 tokens/forward (>= 1.6)" in printed
    assert "[NOT met] reasoning_pool: tau 0.9 - tau 1 score -50.0 +- 50.0 points, n 2 (>= -1)" in printed
    assert "[met] reasoning_pool: lossless 2.20 tokens/forward (>= 2.0)" in printed
    assert "[NOT met] MARS at tau = 1 not worse than ar_control by the gate's rule (its gated checks)" in printed
    assert "(the gate as a whole: failed)" in printed
    assert "[NOT met] chat: tau 0.9 1.30 tokens/forward (>= 1.4)" in printed
    assert "[met] chat: lossless 1.80 tokens/forward (>= 1.7)" in printed
    assert "[met] chat: 2 of 50 outputs at tau 0.9 with a doubled word tau 1 lacks" in printed


def test_a_study_that_has_not_reached_its_gate_is_named(tmp_path):
    study = _study(tmp_path)
    (study / "metrics" / "gate.json").unlink()  # evaluated, not gated yet
    with pytest.raises(SystemExit, match="metrics/gate.json: no such file"):
        recipe_row.main([str(study)])
