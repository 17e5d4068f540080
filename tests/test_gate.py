"""mars gate: MARS at tau = 1.0 vs the AR baseline, per benchmark and on average, plus an explicit override."""

from __future__ import annotations

import hashlib
import json

import pytest

from mars.evaluation import evaluate

from mars.cli import gate as gate_cli
from mars.evaluation import gate
from mars.errors import ConfigError, MarsError
from mars.core.digest import sha256_tree
from mars.evaluation.gate import GateConfig, Override, decide
from test_evaluate import make_checkpoint, toy_config


def entry(score: float, tau: float = 1.0, tokens: int = 100, forwards: int = 100) -> dict:
    return {"score": score, "tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / forwards,
            "seconds": 1.0, "n": 50, "tau": tau}


def digest_of(checkpoint: str) -> str:
    """A stand-in for the sha256 `mars evaluate` records of the checkpoint it evaluated as ``checkpoint``."""
    return hashlib.sha256(checkpoint.encode()).hexdigest()


def metrics(**scores) -> dict:
    """``name_bench=score`` -> eval.json entries at tau 1.0."""
    out = {}
    for key, score in scores.items():
        ckpt, bench = key.rsplit("_", 1)
        out[f"{ckpt}/{bench}/tau=1.0"] = {**entry(score), "checkpoint_sha256": digest_of(ckpt)}
    return out


def at_tau1(**over) -> GateConfig:
    """A gate with the tau = 1.0 checks only (params.yaml's also checks speed at tau 0.9)."""
    return GateConfig(**{"speed_tau": None, "max_score_drop": None, **over})


def test_passes_when_mars_matches_the_baseline_within_tolerance():
    d = decide(metrics(mars_a=0.50, ar_control_a=0.51, mars_b=0.80, ar_control_b=0.79), at_tau1(tolerance=0.02))
    assert d["passed"] and d["checks_passed"] and not d["overridden"]
    names = [c["name"] for c in d["checks"]]
    assert names == ["a", "b", "average"]
    assert d["checks"][0]["candidate"] == 0.50 and d["checks"][0]["baseline"] == 0.51


def test_one_benchmark_worse_than_the_tolerance_fails():
    d = decide(metrics(mars_a=0.40, ar_control_a=0.51, mars_b=0.95, ar_control_b=0.79), at_tau1(tolerance=0.02))
    assert not d["passed"]
    assert [c["name"] for c in d["checks"] if not c["passed"]] == ["a"]  # the average alone would pass
    assert "a: mars 0.4000 < ar_control 0.5100" in d["failures"][0]


def test_the_average_has_its_own_tolerance():
    m = metrics(mars_a=0.49, ar_control_a=0.51, mars_b=0.77, ar_control_b=0.79)
    assert decide(m, at_tau1(tolerance=0.02))["passed"]
    d = decide(m, at_tau1(tolerance=0.02, average_tolerance=0.01))
    assert not d["passed"] and [c["name"] for c in d["checks"] if not c["passed"]] == ["average"]


def test_the_baseline_is_a_param():
    m = metrics(mars_a=0.50, ar_control_a=0.60, sft_a=0.50)
    assert not decide(m, at_tau1())["passed"]
    assert decide(m, at_tau1(baseline="sft"))["passed"]


def test_missing_metrics_fail_instead_of_passing_silently():
    d = decide(metrics(mars_a=0.5, ar_control_a=0.5, ar_control_b=0.5), at_tau1())
    assert not d["passed"] and "mars/b/tau=1.0" in d["failures"][0]
    assert not decide({}, at_tau1())["passed"]


def test_speed_checks_at_a_named_tau():
    m = metrics(mars_a=0.5, ar_control_a=0.5)
    m["mars/a/tau=0.9"] = entry(0.45, tau=0.9, tokens=150, forwards=100)
    cfg = dict(speed_tau=0.9)
    assert decide(m, at_tau1(min_tokens_per_forward=1.4, max_score_drop=0.1, **cfg))["passed"]
    slow = decide(m, at_tau1(min_tokens_per_forward=1.6, **cfg))
    assert not slow["passed"] and slow["checks"][-1]["name"] == "tokens_per_forward"
    assert slow["checks"][-1]["value"] == pytest.approx(1.5)
    wrong = decide(m, at_tau1(max_score_drop=0.02, **cfg))
    assert not wrong["passed"] and wrong["checks"][-1]["name"] == "score_at_speed_tau"
    with pytest.raises(ConfigError, match="speed_tau"):
        GateConfig(speed_tau=None, min_tokens_per_forward=1.5)


def test_an_override_passes_a_failed_gate_and_is_recorded():
    m = metrics(mars_a=0.1, ar_control_a=0.5)
    d = decide(m, at_tau1(override=Override(True, "hotfix for the demo", "alice")))
    assert d["passed"] and not d["checks_passed"] and d["overridden"]
    assert d["override"] == {"enabled": True, "reason": "hotfix for the demo", "by": "alice"}
    with pytest.raises(ConfigError, match="reason"):
        Override(True, "  ", "alice")
    with pytest.raises(ConfigError, match="by"):
        Override(True, "hotfix for the demo", "")


def test_cli_writes_the_decision_and_exits_nonzero_on_failure(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("gate:\n  tolerance: 0.02\n")
    eval_json = tmp_path / "eval.json"
    eval_json.write_text(json.dumps(metrics(mars_a=0.3, ar_control_a=0.5)))
    out = tmp_path / "gate.json"
    assert gate_cli.main(["--params", str(params), "--metrics", str(eval_json), "--out", str(out)]) == 1
    decision = json.loads(out.read_text())
    assert decision["passed"] is False and decision["metrics_sha256"] and decision["checks"][0]["value"] == 0.3
    assert "gate FAILED" in capsys.readouterr().err
    assert gate_cli.main(["--params", str(params), "--metrics", str(eval_json), "--out", str(out),
                     "--override", "known regression, tracked", "--override-by", "bob"]) == 0
    decision = json.loads(out.read_text())
    assert decision["passed"] and decision["overridden"] and decision["override"]["by"] == "bob"
    with pytest.raises(MarsError, match="no evaluation metrics"):
        gate_cli.main(["--params", str(params), "--metrics", str(tmp_path / "none.json"), "--out", str(out)])


# ---- on real evaluations of tiny checkpoints --------------------------------------------------------


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """ar_control: AR-trained on the toy task; ar_as_mars: the same AR weights posing as MARS;
    broken: an untrained model posing as MARS."""
    root = tmp_path_factory.mktemp("gate")
    ar = make_checkpoint(root / "ar")
    broken = make_checkpoint(root / "broken", trained=False, stage="mars")
    return evaluate.run({"ar_control": str(ar), "ar_as_mars": str(ar), "broken": str(broken)},
                        toy_config(taus=[1.0, 0.9]), data_dir=None, out_dir=root / "eval",
                        metrics_path=root / "eval.json", train_metrics_dir=None, log=lambda *_: None)


def test_a_plain_ar_checkpoint_passes_at_tau_1_but_fails_the_speed_gate(evaluated):
    # At tau = 1.0 it is the baseline itself, so only the check below tau = 1.0 can stop it.
    assert decide(evaluated, at_tau1(candidate="ar_as_mars"))["passed"]
    d = decide(evaluated, GateConfig(candidate="ar_as_mars", speed_tau=0.9, min_tokens_per_forward=1.2,
                                     max_score_drop=0.1))
    assert not d["passed"]
    failed = {c["name"] for c in d["checks"] if not c["passed"]}
    assert failed & {"score_at_speed_tau", "tokens_per_forward"}


def test_a_broken_mars_checkpoint_fails_at_tau_1(evaluated):
    d = decide(evaluated, at_tau1(candidate="broken"))
    assert not d["passed"]
    assert {c["name"] for c in d["checks"] if not c["passed"]} == {"toy", "average"}


# ---- the decision binds what it judged, and an override says who (issue 16) ------------------------------
def fake_export(path, made_from: str):
    path.mkdir()
    (path / "model.onnx").write_bytes(b"onnx")
    (path / "manifest.json").write_text(json.dumps({"checkpoint": {"sha256": made_from}}))
    return path


def test_the_decision_names_the_evaluated_checkpoint_and_its_export(tmp_path):
    eval_json, out = tmp_path / "eval.json", tmp_path / "gate.json"
    eval_json.write_text(json.dumps(metrics(mars_a=0.5, ar_control_a=0.5)))
    export = fake_export(tmp_path / "export", made_from=digest_of("mars"))
    decision = gate.run_gate(eval_json, out, at_tau1(), export=export)
    assert decision["artifacts"] == {"checkpoint": {"name": "mars", "sha256": digest_of("mars")},
                                     "export": {"path": str(export), "sha256": sha256_tree(export)}}
    other = fake_export(tmp_path / "other", made_from=digest_of("something else"))
    with pytest.raises(MarsError, match="exported from checkpoint sha256 .* not the mars evaluated"):
        gate.run_gate(eval_json, out, at_tau1(), export=other)
    unbound = {k: {f: v for f, v in e.items() if f != "checkpoint_sha256"} for k, e in
               metrics(mars_a=0.5, ar_control_a=0.5).items()}
    eval_json.write_text(json.dumps(unbound))
    with pytest.raises(MarsError, match="no checkpoint_sha256 for 'mars'"):
        gate.run_gate(eval_json, out, at_tau1(), export=export)


def test_an_override_from_any_entry_point_needs_a_reason_and_who(tmp_path):
    params = tmp_path / "params.yaml"
    eval_json, out = tmp_path / "eval.json", tmp_path / "gate.json"
    eval_json.write_text(json.dumps(metrics(mars_a=0.1, ar_control_a=0.5)))
    args = ["--metrics", str(eval_json), "--out", str(out), "--params", str(params)]
    params.write_text("gate: {speed_tau: null, max_score_drop: null}\n")
    with pytest.raises(ConfigError, match="--override-by WHO"):
        gate_cli.main(args + ["--override", "ship it"])  # was recorded as `by: <login user>`
    with pytest.raises(ConfigError, match="--override-by WHO"):
        gate_cli.main(args + ["--override", " ", "--override-by", "bob"])
    params.write_text("gate: {override: {enabled: true, reason: ship it}}\n")
    with pytest.raises(ConfigError, match=r"^gate\.override\.by: an override must say who made it$"):
        gate_cli.main(args)
    params.write_text("gate: {override: {enabled: true, by: bob}}\n")
    with pytest.raises(ConfigError, match=r"^gate\.override\.reason: an override needs a reason$"):
        gate_cli.main(args)
    assert not out.exists()


def test_each_baseline_of_a_list_is_checked_with_the_paired_standard_error():
    m = metrics(mars_a=0.50, ar_control_a=0.50, sft_a=0.75)
    items = {"mars": {"1": 1.0, "2": 0.0, "3": 1.0, "4": 0.0}, "ar_control": {"1": 1.0, "2": 0.0, "3": 0.0, "4": 1.0},
             "sft": {"1": 1.0, "2": 1.0, "3": 1.0, "4": 0.0}}
    d = decide(m, at_tau1(baseline=["ar_control", "sft"], tolerance=0.02),
               item_scores=lambda ckpt, bench, tau: items[ckpt])
    by_name = {c["name"]: c for c in d["checks"]}
    assert list(by_name) == ["a vs ar_control", "average vs ar_control", "a vs sft", "average vs sft"]
    assert by_name["a vs ar_control"]["passed"] and not by_name["a vs sft"]["passed"]
    # differences per item vs ar_control: 0, 0, +1, -1 -> mean 0, sd sqrt(2/3), SE sqrt(2/3)/2
    assert by_name["a vs ar_control"]["paired_delta"] == 0.0 and by_name["a vs ar_control"]["n_paired"] == 4
    assert by_name["a vs ar_control"]["paired_se"] == pytest.approx((2 / 3) ** 0.5 / 2)
    # vs sft: 0, -1, 0, 0 -> mean -0.25, SE 0.25
    assert by_name["a vs sft"]["paired_delta"] == -0.25 and by_name["a vs sft"]["paired_se"] == pytest.approx(0.25)
    assert by_name["average vs sft"]["paired_se"] == pytest.approx(0.25)  # one benchmark: its own SE
    assert "a: mars 0.5000 < sft 0.7500 - tolerance 0.02" in d["failures"]
    with pytest.raises(ConfigError, match="baseline: must name checkpoints other than the candidate"):
        GateConfig(baseline=["ar_control", "mars"])
