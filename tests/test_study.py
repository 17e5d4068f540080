"""The smollm2 study, shrunken: distill -> prepare -> sft (the base) -> mars -> evaluate -> gate on the real
SmolLM2-135M-Instruct weights, with the profile's own stages and a few prompts and steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mars.cli import main

ROOT = Path(__file__).resolve().parents[1]

# The smollm2 profile, shrunk: 3 pool prompts x 2 families, 16-token answers, 2 steps, 2 verifier items x 2 families
SHRINK = [
    "profile=smollm2", "profiles.smollm2.tasks.n_train=3",
    "profiles.smollm2.distill.max_new_tokens=16", "profiles.smollm2.distill.hit_limit=keep",
    "profiles.smollm2.distill.dtype=float32",  # fp32: greedy tokens do not depend on the batch, so tau=1 re-decodes them
    "profiles.smollm2.data.n_heldout=2",
    "profiles.smollm2.train.batch_size=2", "profiles.smollm2.train.mars.max_steps=2",
    "profiles.smollm2.evaluate.dtype=float32", "profiles.smollm2.evaluate.taus=[1.0,0.9]",
    "profiles.smollm2.evaluate.sweep_n=1",
    # the held-out split of the distilled data (off in the profile): the base must re-decode its own answers
    "profiles.smollm2.evaluate.benchmarks.heldout={enabled: true, n: 0, max_new_tokens: 16}",
    "profiles.smollm2.evaluate.benchmarks.reasoning_pool.max_new_tokens=16",
    "profiles.smollm2.evaluate.benchmarks.reasoning_pool.options.families=[gcd]",
    "profiles.smollm2.evaluate.benchmarks.reasoning_new.max_new_tokens=16",
    "profiles.smollm2.evaluate.benchmarks.reasoning_new.options.families=[lcm]",
    "profiles.smollm2.evaluate.benchmarks.gsm.n=2", "profiles.smollm2.evaluate.benchmarks.gsm.max_new_tokens=16",
    "profiles.smollm2.evaluate.benchmarks.gsm.sweep_n=1", "profiles.smollm2.evaluate.benchmarks.humaneval.sweep_n=1",
    "profiles.smollm2.evaluate.benchmarks.humaneval.n=2",
    "profiles.smollm2.evaluate.benchmarks.humaneval.max_new_tokens=16",
    "profiles.smollm2.tasks.n_heldout=2",
]


def mars(*argv: str) -> int:
    return main([*argv, "--params", str(ROOT / "params.yaml"), *[x for s in SHRINK for x in ("-S", s)]])


@pytest.mark.slow
def test_shrunken_smollm2_study_runs_end_to_end(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pool = ["tasks.families={gcd: {config: {min_numbers: 2, max_numbers: 2, min_value: 2, max_value: 30}},"
            " letter_counting: {}, lcm: {pool: false}}"]
    SHRINK.extend(pool)
    try:
        assert mars("base", "--out", "models/base") == 0
        assert mars("distill", "--base", "models/base", "--out", "data/distilled", "--work", "data/w", "--no-progress") == 0
        manifest = json.loads(Path("data/distilled/manifest.json").read_text())
        assert manifest["prompts"] == 6 and manifest["by_family"] == {"gcd": 3, "letter_counting": 3}
        assert mars("prepare", "--base", "models/base", "--out", "data/prepared") == 0
        for stage, init in (("sft", "models/base"), ("mars", "checkpoints/sft/final"),
                            ("ar_control", "checkpoints/sft/final")):
            assert mars("train", "--stage", stage, "--init", init, "--data", "data/prepared", "--out",
                        f"checkpoints/{stage}", "--metrics", f"metrics/train_{stage}.tsv", "--no-progress") == 0
        assert json.loads(Path("checkpoints/sft/final/mars_run.json").read_text())["steps"] == 0  # the base is the SFT
        assert mars("evaluate", "--checkpoint", "sft=checkpoints/sft/final",
                    "--checkpoint", "ar_control=checkpoints/ar_control/final", "--checkpoint",
                    "mars=checkpoints/mars/final", "--data", "data/prepared", "--out", "eval",
                    "--metrics", "metrics/eval.json") == 0
        gate = mars("gate", "--metrics", "metrics/eval.json", "--eval-dir", "eval", "--out", "metrics/gate.json")
    finally:
        del SHRINK[-len(pool):]
    metrics = json.loads(Path("metrics/eval.json").read_text())
    # the base at tau = 1 re-decodes its own distilled responses: the held-out rows carved from them match
    base = metrics["sft/heldout/tau=1.0"]
    assert base["score"] == 1.0 and base["agree_exact"] == 1.0
    assert "ar_control/heldout/tau=0.9" not in metrics  # AR checkpoints run at tau = 1 only (ar_taus)
    assert "ar_control/heldout/lossless" not in metrics and "mars/heldout/lossless" in metrics
    for key in ("mars/reasoning_pool/tau=1.0", "mars/reasoning_new/tau=1.0", "ar_control/reasoning_pool/tau=1.0"):
        entry = metrics[key]
        assert 0 <= entry["agree_exact"] <= 1 and entry["ref_logprob"] <= 0 and entry["n"] == 2
    assert metrics["mars/reasoning_pool/tau=1.0"]["derived_from"] == "lossless"  # fp32: one decode for both
    assert metrics["mars/gsm/tau=0.9"]["n"] == 1 and metrics["mars/gsm/tau=1.0"]["n"] == 2  # the sweep's subset
    decision = json.loads(Path("metrics/gate.json").read_text())
    assert gate == (0 if decision["passed"] else 1)
    compared = {(c["benchmark"], c["baseline_name"]) for c in decision["checks"] if c["kind"] == "benchmark"}
    assert {("reasoning_pool", "ar_control"), ("reasoning_pool", "sft"), ("humaneval", "ar_control")} <= compared
    assert not any(c["gated"] for c in decision["checks"] if c.get("baseline_name") == "sft")  # report_against
    assert all("se" in c and "mdd" in c for c in decision["checks"] if c["kind"] == "benchmark")
