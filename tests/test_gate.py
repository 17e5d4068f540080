"""mars gate: MARS at tau = 1.0 against the AR baseline by a stated rule: paired per-item differences, a
one-sided test per check, Holm over the checks, the minimum detectable drop of each; plus an override."""

from __future__ import annotations

import hashlib
import hmac
import json
import random
from pathlib import Path

import pytest

from mars.cli import gate as gate_cli
from mars.core.atomic import write_jsonl
from mars.core.digest import sha256_tree
from mars.errors import ConfigError, MarsError
from mars.evaluation import evaluate, gate
from mars.evaluation.gate import GateConfig, Override, decide
from mars.evaluation.metric_key import MetricKey
from mars.evaluation.paired import Paired, holm, min_detectable_drop, p_worse
from test_evaluate import make_checkpoint, toy_config


def digest_of(checkpoint: str) -> str:
    """A stand-in for the sha256 `mars evaluate` records of the checkpoint it evaluated as ``checkpoint``."""
    return hashlib.sha256(checkpoint.encode()).hexdigest()


class Outcomes:
    """eval.json entries and the per-item scores behind them: ``add("mars", "a", [1, 0, ...], tau=1.0)``."""

    def __init__(self):
        self.metrics: dict[str, dict] = {}
        self.items: dict[tuple[str, str, float], dict[str, float]] = {}

    def add(self, ckpt: str, bench: str, scores: list[float], tau: float | None = 1.0,
            tokens_per_forward: float = 1.0) -> Outcomes:
        key = MetricKey(ckpt, bench, tau)
        n = len(scores)
        self.metrics[key.format()] = {"score": sum(scores) / n, "tokens": round(100 * tokens_per_forward * n),
                                      "forwards": 100 * n, "n": n, "tau": tau, "checkpoint_sha256": digest_of(ckpt)}
        self.items[(ckpt, bench, tau)] = {f"{bench}-{i}": float(s) for i, s in enumerate(scores)}
        return self

    def scores(self, ckpt: str, bench: str, tau: float) -> dict[str, float] | None:
        return self.items.get((ckpt, bench, float(tau)))

    def decide(self, cfg: GateConfig) -> dict:
        return decide(self.metrics, cfg, self.scores)

    def write(self, root: Path) -> tuple[Path, Path]:
        """eval.json and the per-item outputs, as `mars evaluate` writes them."""
        for (ckpt, bench, tau), scores in self.items.items():
            write_jsonl(MetricKey(ckpt, bench, tau).outputs_path(root / "eval"),
                        [{"id": i, "score": s} for i, s in scores.items()])
        (root / "eval.json").write_text(json.dumps(self.metrics))
        return root / "eval.json", root / "eval"


def at_tau1(**over) -> GateConfig:
    """A gate with the tau = 1.0 checks only, no tolerance (params.yaml's also checks speed at tau 0.9)."""
    return GateConfig(**{"speed_tau": None, "max_score_drop": None, "tolerance": 0.0, **over})


def loses(n: int, lost: int, won: int = 0, right: int = 0) -> tuple[list[int], list[int]]:
    """(candidate, baseline) on ``n`` items: the candidate loses ``lost`` items the baseline got, wins
    ``won`` the baseline missed; both get ``right`` more; both miss the rest."""
    cand = [0] * lost + [1] * won + [1] * right
    base = [1] * lost + [0] * won + [1] * right
    return cand + [0] * (n - len(cand)), base + [0] * (n - len(base))


# ---- the statistics ---------------------------------------------------------------------------------------


def test_paired_differences_and_their_standard_error():
    p = Paired.of({"1": 1.0, "2": 0.0, "3": 1.0, "4": 0.0, "only-here": 1.0}, {"1": 1.0, "2": 0.0, "3": 0.0, "4": 1.0})
    # differences 0, 0, +1, -1 on the four shared items: mean 0, sd sqrt(2/3), SE sqrt(2/3)/2
    assert (p.n, p.delta) == (4, 0.0) and p.se == pytest.approx((2 / 3) ** 0.5 / 2)
    avg = Paired.average([Paired(100, -0.02, 0.03), Paired(50, 0.04, 0.04)])
    assert (avg.n, avg.delta, avg.se) == (150, pytest.approx(0.01), pytest.approx(0.025))  # sqrt(.03² + .04²) / 2
    assert not Paired.of({"1": 1.0}, {"1": 0.0}).usable


def test_holm_adjusts_step_down_and_keeps_the_order():
    assert holm([0.03, 0.5]) == pytest.approx([0.06, 0.5])
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])  # 3 x .01, max(2 x .03, .03), max(.04, .06)
    assert holm([]) == []


def test_a_drop_within_the_tolerance_is_not_a_drop():
    assert p_worse(Paired(400, -0.01, 0.01), tolerance=0.0) == pytest.approx(0.1587, abs=1e-4)
    assert p_worse(Paired(400, -0.01, 0.01), tolerance=0.02) == pytest.approx(0.8413, abs=1e-4)
    assert p_worse(Paired(400, -0.01, 0.0)) == 0.0 and p_worse(Paired(400, 0.0, 0.0)) == 1.0


def simulated_power(n: int, drop: float, discordant: float, level: float, runs: int, seed: int) -> float:
    """How often a one-sided paired test at ``level`` fails a candidate that truly loses ``drop``."""
    rng = random.Random(seed)
    failed = 0
    for _ in range(runs):
        # each item: the candidate loses it (prob (d + drop) / 2), wins it ((d - drop) / 2), or ties
        diffs = {}
        for i in range(n):
            u = rng.random()
            diffs[str(i)] = -1.0 if u < (discordant + drop) / 2 else 1.0 if u < discordant else 0.0
        if p_worse(Paired.of(diffs, dict.fromkeys(diffs, 0.0))) < level:
            failed += 1
    return failed / runs


def test_the_minimum_detectable_drop_matches_a_simulation_within_ten_percent():
    n, discordant, level = 300, 0.10, 0.05 / 4  # a gate of four tests: its per-check Bonferroni level
    se = (discordant / n) ** 0.5  # the SE of the mean difference near zero drop
    mdd = min_detectable_drop(se, level, power=0.8)
    assert 0.045 < mdd < 0.06
    # the test reaches 80% power between 0.9 and 1.1 times the stated drop
    assert simulated_power(n, 0.9 * mdd, discordant, level, runs=600, seed=1) < 0.8
    assert simulated_power(n, 1.1 * mdd, discordant, level, runs=600, seed=2) > 0.8


# ---- the rule on synthetic paired outcomes ---------------------------------------------------------------


def test_a_clear_drop_fails_and_says_by_how_much():
    cand, base = loses(300, lost=30, won=3, right=100)
    d = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).decide(at_tau1())
    assert not d["passed"] and not d["checks_passed"]
    (check,) = d["checks"]
    assert check["n"] == 300 and check["delta"] == pytest.approx(-0.09) and check["p_holm"] < 1e-6
    assert "a: mars is worse than ar_control by 0.0900 +- 0.0" in d["failures"][0]


def test_noise_around_zero_passes():
    cand, base = loses(300, lost=16, won=14, right=100)  # two items behind: well inside the noise
    d = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).decide(at_tau1())
    assert d["passed"]
    assert d["checks"][0]["delta"] == pytest.approx(-2 / 300) and d["checks"][0]["mdd"] > 0.04


def test_an_unchanged_model_fails_the_whole_gate_at_most_alpha_of_the_time():
    rng = random.Random(0)
    cfg = GateConfig(speed_tau=0.9, max_score_drop=0.0, tolerance=0.0)
    runs, failed = 300, 0
    for _ in range(runs):
        o = Outcomes()
        for bench in ("a", "b", "c"):
            base = [int(rng.random() < 0.5) for _ in range(120)]
            flip = lambda s: [1 - x if rng.random() < 0.1 else x for x in s]  # noqa: E731 - same model, other noise
            o.add("ar_control", bench, base).add("mars", bench, flip(base)).add("mars", bench, flip(base), tau=0.9)
        failed += not o.decide(cfg)["passed"]
    assert o.decide(cfg)["rule"]["tests"] == 5  # 3 benchmarks + their average + the speed check
    assert failed / runs <= 0.07  # alpha 0.05, and 300 runs' binomial noise


def test_graded_scores_are_compared_the_same_way():
    base = [0.5, 0.75, 1.0, 0.25] * 50
    d = Outcomes().add("mars", "ifbench", [s - 0.25 if i % 2 else s for i, s in enumerate(base)]) \
        .add("ar_control", "ifbench", base).decide(at_tau1())
    assert not d["passed"] and d["checks"][0]["delta"] == pytest.approx(-0.125)


def test_holm_corrects_over_every_check_of_the_gate():
    cand, base = loses(400, lost=30, won=16, right=150)  # one-sided p ~0.02 alone
    alone = Outcomes().add("mars", "a", cand).add("ar_control", "a", base)
    assert not alone.decide(at_tau1())["passed"]
    together = alone.add("mars", "b", base).add("ar_control", "b", base)  # b: identical, p = 1
    d = together.decide(at_tau1())
    assert d["rule"]["tests"] == 3 and d["passed"]  # a's p x 3 > 0.05; the average is a weaker drop
    by_name = {c["name"]: c for c in d["checks"]}
    assert by_name["a"]["p"] < 0.05 < by_name["a"]["p_holm"]
    assert by_name["average"]["benchmarks"] == ["a", "b"] and by_name["average"]["delta"] == pytest.approx(-0.0175)


def test_the_tolerance_is_part_of_the_rule():
    cand, base = loses(400, lost=30, won=10, right=150)  # 5 points behind, SE ~1.5
    o = Outcomes().add("mars", "a", cand).add("ar_control", "a", base)
    assert not o.decide(at_tau1())["passed"]
    d = o.decide(at_tau1(tolerance=0.06))
    assert d["passed"] and d["checks"][0]["tolerance"] == 0.06
    assert d["checks"][0]["mdd"] == pytest.approx(0.06 + (1.645 + 0.8416) * d["checks"][0]["se"], abs=1e-3)


def test_a_benchmark_the_baseline_cannot_score_on_is_reported_not_gated():
    cand, base = loses(200, lost=20, right=4)  # the baseline scores 12%: a drop there cannot show
    good_c, good_b = loses(200, lost=5, won=5, right=80)
    d = Outcomes().add("mars", "hard", cand).add("ar_control", "hard", base) \
        .add("mars", "easy", good_c).add("ar_control", "easy", good_b).decide(at_tau1())
    assert d["passed"] and d["rule"]["gated_benchmarks"] == ["easy"]
    hard = next(c for c in d["checks"] if c["name"] == "hard")  # compared all the same, in the report
    assert not hard["gated"] and hard["passed"] is None and hard["delta"] == pytest.approx(-0.1)
    assert hard["note"] == "not gated: ar_control scores 0.120 < min_baseline_score 0.15"
    assert d["rule"]["tests"] == 1 and "p_holm" not in hard
    only_hard = Outcomes().add("mars", "hard", cand).add("ar_control", "hard", base).decide(at_tau1())
    assert not only_hard["passed"] and "the gate cannot judge" in only_hard["failures"][0]


def test_each_baseline_is_gated_and_report_against_is_only_reported():
    cand, base = loses(300, lost=10, won=10, right=100)
    _, behind = loses(300, lost=40, right=100)  # sft got 40 more items right than mars
    o = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).add("sft", "a", behind) \
        .add("mars", "b", cand).add("ar_control", "b", base).add("sft", "b", behind)
    reported = o.decide(at_tau1(report_against=["sft"]))
    assert reported["passed"] and reported["rule"]["tests"] == 3
    sft = [c for c in reported["checks"] if c.get("baseline_name") == "sft"]
    assert [c["name"] for c in sft] == ["a vs sft", "b vs sft", "average vs sft"]
    assert all(c["passed"] is None and not c["gated"] and c["delta"] < 0 for c in sft)
    gated = o.decide(at_tau1(baseline=["ar_control", "sft"]))
    assert not gated["passed"] and gated["rule"]["tests"] == 6
    assert {c["name"] for c in gated["checks"] if c["passed"] is False} == {"a vs sft", "b vs sft", "average vs sft"}
    with pytest.raises(ConfigError, match="baseline: must name checkpoints other than the candidate"):
        GateConfig(baseline=["ar_control", "mars"])


def test_the_speed_check_uses_the_same_rule():
    cand, base = loses(300, lost=10, won=10, right=100)
    o = Outcomes().add("mars", "a", cand).add("ar_control", "a", base)
    slower, _ = loses(300, lost=40, right=80)  # 80 right against the baseline's 110: 10 points below
    o.add("mars", "a", slower, tau=0.9, tokens_per_forward=1.5)
    assert o.decide(GateConfig(speed_tau=0.9, max_score_drop=0.2, min_tokens_per_forward=1.4))["passed"]
    wrong = o.decide(GateConfig(speed_tau=0.9, max_score_drop=0.02))
    assert not wrong["passed"] and wrong["checks"][-1]["name"] == "score_at_speed_tau"
    assert wrong["checks"][-1]["delta"] == pytest.approx(-0.1) and wrong["checks"][-1]["tolerance"] == 0.02
    slow = o.decide(GateConfig(speed_tau=0.9, max_score_drop=None, min_tokens_per_forward=1.6))
    assert not slow["passed"] and slow["checks"][-1]["value"] == pytest.approx(1.5)
    with pytest.raises(ConfigError, match="speed_tau"):
        GateConfig(speed_tau=None, min_tokens_per_forward=1.5)


def test_a_check_on_one_paired_item_cannot_judge_and_says_so():
    cand, base = loses(100, lost=5, won=5, right=40)
    o = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).add("mars", "a", [1], tau=0.9)
    d = o.decide(GateConfig(speed_tau=0.9, max_score_drop=0.05))
    speed = d["checks"][-1]
    assert not d["passed"] and speed["n"] == 1 and speed["se"] is None
    assert "score_at_speed_tau: 1 paired item(s): too few to judge" in d["failures"]
    assert "+- n/a (n 1" in gate_cli.check_line(speed)


def test_missing_or_inconsistent_evidence_fails_instead_of_passing_silently():
    cand, base = loses(100, lost=5, won=5, right=40)
    o = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).add("ar_control", "b", base)
    d = o.decide(at_tau1())
    assert not d["passed"] and "b: no metrics for mars/b/tau=1.0" in d["failures"]
    assert not decide({}, at_tau1())["passed"]
    o = Outcomes().add("mars", "a", cand).add("ar_control", "a", base)
    assert "no per-item outputs" in decide(o.metrics, at_tau1())["failures"][0]
    o.metrics["mars/a/tau=1.0"]["score"] += 0.1  # a metrics file edited to pass
    assert "mars/a/tau=1.0: the metrics score is not the mean of its 100 per-item outputs" in \
        o.decide(at_tau1())["failures"]


def test_an_override_passes_a_failed_gate_and_is_recorded():
    cand, base = loses(100, lost=50, right=10)
    d = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).decide(
        at_tau1(override=Override(True, "hotfix for the demo", "alice")))
    assert d["passed"] and not d["checks_passed"] and d["overridden"]
    assert d["override"] == {"enabled": True, "reason": "hotfix for the demo", "by": "alice"}
    with pytest.raises(ConfigError, match="reason"):
        Override(True, "  ", "alice")
    with pytest.raises(ConfigError, match="by"):
        Override(True, "hotfix for the demo", "")


@pytest.mark.parametrize("key,value", [("alpha", 0.0), ("alpha", 1.0), ("power", 1.5), ("tolerance", -0.1),
                                       ("min_baseline_score", 2.0)])
def test_the_rule_parameters_are_validated_by_name(key, value):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        GateConfig(**{key: value})


# ---- the command and the decision file ----------------------------------------------------------------


def test_cli_writes_the_decision_and_exits_nonzero_on_failure(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("gate: {speed_tau: null, max_score_drop: null}\n")
    cand, base = loses(200, lost=40, right=60)
    eval_json, eval_dir = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).write(tmp_path)
    out = tmp_path / "gate.json"
    args = ["--params", str(params), "--metrics", str(eval_json), "--eval-dir", str(eval_dir), "--out", str(out)]
    assert gate_cli.main(args) == 1
    decision = json.loads(out.read_text())
    assert decision["passed"] is False and decision["metrics_sha256"]
    assert decision["rule"]["alpha"] == 0.05 and decision["config"]["tolerance"] == 0.05
    assert sorted(decision["evidence"]["outputs"]) == ["ar_control/a/tau=1.0.jsonl", "mars/a/tau=1.0.jsonl"]
    printed = capsys.readouterr()
    assert "FAIL a: 0.3000 vs 0.5000, paired delta -0.2000 +- 0.0284 (n 200" in printed.out
    assert "gate FAILED" in printed.err
    assert gate_cli.main(args + ["--override", "known regression, tracked", "--override-by", "bob"]) == 0
    decision = json.loads(out.read_text())
    assert decision["passed"] and decision["overridden"] and decision["override"]["by"] == "bob"
    with pytest.raises(MarsError, match="no evaluation metrics"):
        gate_cli.main(["--params", str(params), "--metrics", str(tmp_path / "none.json"), "--out", str(out)])


def test_an_override_from_any_entry_point_needs_a_reason_and_who(tmp_path):
    params = tmp_path / "params.yaml"
    cand, base = loses(100, lost=50, right=10)
    eval_json, eval_dir = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).write(tmp_path)
    out = tmp_path / "gate.json"
    args = ["--metrics", str(eval_json), "--eval-dir", str(eval_dir), "--out", str(out), "--params", str(params)]
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


def fake_export(path, made_from: str):
    path.mkdir()
    (path / "model.onnx").write_bytes(b"onnx")
    (path / "manifest.json").write_text(json.dumps({"checkpoint": {"sha256": made_from}}))
    return path


def test_the_decision_names_the_evaluated_checkpoint_and_its_export(tmp_path):
    cand, base = loses(100, lost=5, won=5, right=40)
    eval_json, eval_dir = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).write(tmp_path)
    out = tmp_path / "gate.json"
    export = fake_export(tmp_path / "export", made_from=digest_of("mars"))
    decision = gate.run_gate(eval_json, out, at_tau1(), eval_dir=eval_dir, export=export)
    assert decision["artifacts"] == {"checkpoint": {"name": "mars", "sha256": digest_of("mars")},
                                     "export": {"path": str(export), "sha256": sha256_tree(export)}}
    other = fake_export(tmp_path / "other", made_from=digest_of("something else"))
    with pytest.raises(MarsError, match="exported from checkpoint sha256 .* not the mars evaluated"):
        gate.run_gate(eval_json, out, at_tau1(), eval_dir=eval_dir, export=other)
    unbound = {k: {f: v for f, v in e.items() if f != "checkpoint_sha256"} for k, e in
               json.loads(eval_json.read_text()).items()}
    eval_json.write_text(json.dumps(unbound))
    with pytest.raises(MarsError, match="no checkpoint_sha256 for 'mars'"):
        gate.run_gate(eval_json, out, at_tau1(), eval_dir=eval_dir, export=export)


def test_a_decision_is_derived_again_from_the_evidence_it_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cand, base = loses(200, lost=40, right=60)
    Outcomes().add("mars", "a", cand).add("ar_control", "a", base).write(Path("."))
    decision = gate.run_gate("eval.json", "gate.json", at_tau1(), eval_dir="eval")
    decision = json.loads(Path("gate.json").read_text())
    assert gate.rederive(decision, "gate.json")["passed"] is False
    flipped = {**decision, "passed": True, "checks_passed": True, "failures": []}
    with pytest.raises(MarsError, match="'passed' does not follow from its own evidence"):
        gate.rederive(flipped, "gate.json")
    loosened = {**decision, "config": {**decision["config"], "tolerance": 0.5}}
    with pytest.raises(MarsError, match="does not follow from its own evidence"):
        gate.rederive(loosened, "gate.json")  # a looser rule gives other checks than the ones recorded
    with pytest.raises(MarsError, match="names no evidence"):
        gate.rederive({"passed": True, "artifacts": {}}, "gate.json")
    with pytest.raises(MarsError, match="'speed_tau' does not follow"):  # whatever the rule derives, not only the verdict
        gate.rederive({**decision, "speed_tau": 0.5}, "gate.json")
    Path("eval.json").rename("moved.json")
    with pytest.raises(MarsError, match=r"^eval\.json: no such file, yet the gate decided on it"):
        gate.rederive(decision, "gate.json")
    Path("moved.json").rename("eval.json")
    outputs = Path("eval/mars/a/tau=1.0.jsonl")
    outputs.write_text(outputs.read_text().replace('"score": 0.0', '"score": 1.0', 10))
    with pytest.raises(MarsError, match="not the per-item outputs the gate decided on"):
        gate.rederive(decision, "gate.json")


def test_the_decision_is_signed_where_the_operator_sets_a_key(tmp_path, monkeypatch):
    cand, base = loses(100, lost=5, won=5, right=40)
    eval_json, eval_dir = Outcomes().add("mars", "a", cand).add("ar_control", "a", base).write(tmp_path)
    monkeypatch.delenv(gate.KEY_ENV, raising=False)
    assert "signature" not in gate.run_gate(eval_json, tmp_path / "plain.json", at_tau1(), eval_dir=eval_dir)
    monkeypatch.setenv(gate.KEY_ENV, "k")
    gate.run_gate(eval_json, tmp_path / "gate.json", at_tau1(), eval_dir=eval_dir)
    decision = json.loads((tmp_path / "gate.json").read_text())  # as promote reads it back
    unsigned = {k: v for k, v in decision.items() if k != "signature"}
    canonical = json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()
    assert decision["signature"] == {"alg": "hmac-sha256", "value": hmac.new(b"k", canonical, "sha256").hexdigest()}
    gate.verify_signature(decision, "k", "gate.json")
    with pytest.raises(MarsError, match="gate.json: the decision's signature does not verify with MARS_GATE_KEY"):
        gate.verify_signature(decision, "other", "gate.json")
    with pytest.raises(MarsError, match="gate.json: the decision's signature does not verify"):
        gate.verify_signature({**decision, "passed": not decision["passed"]}, "k", "gate.json")
    with pytest.raises(MarsError, match=r"gate.json: the decision is not signed \(MARS_GATE_KEY is set"):
        gate.verify_signature(unsigned, "k", "gate.json")


# ---- on real evaluations of tiny checkpoints --------------------------------------------------------


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """ar_control: AR-trained on the toy task; ar_as_mars: the same AR weights posing as MARS;
    broken: an untrained model posing as MARS."""
    root = tmp_path_factory.mktemp("gate")
    ar = make_checkpoint(root / "ar")
    broken = make_checkpoint(root / "broken", trained=False, stage="mars")
    metrics = evaluate.run({"ar_control": str(ar), "ar_as_mars": str(ar), "broken": str(broken)},
                           toy_config(taus=[1.0, 0.9]), data_dir=None, out_dir=root / "eval",
                           metrics_path=root / "eval.json", train_metrics_dir=None, log=lambda *_: None)
    return metrics, gate.Evidence(root / "eval")


def test_a_plain_ar_checkpoint_passes_at_tau_1_but_fails_the_speed_gate(evaluated):
    metrics, evidence = evaluated
    # At tau = 1.0 it is the baseline itself, so only the check below tau = 1.0 can stop it.
    assert decide(metrics, at_tau1(candidate="ar_as_mars"), evidence)["passed"]
    d = decide(metrics, GateConfig(candidate="ar_as_mars", speed_tau=0.9, min_tokens_per_forward=1.2,
                                   max_score_drop=0.1), evidence)
    assert not d["passed"]
    failed = {c["name"] for c in d["checks"] if c["passed"] is False}
    assert failed & {"score_at_speed_tau", "tokens_per_forward"}


def test_a_broken_mars_checkpoint_fails_at_tau_1(evaluated):
    metrics, evidence = evaluated
    d = decide(metrics, at_tau1(candidate="broken"), evidence)
    assert not d["passed"]
    assert {c["name"] for c in d["checks"] if c["passed"] is False} == {"toy"}


def test_a_surface_check_is_reported_not_gated_unless_named():
    cand, base = loses(300, lost=30, right=200)  # a clear drop on the chat benchmark's no-doubled-word score
    o = Outcomes().add("mars", "chat", cand).add("ar_control", "chat", base)
    o.add("mars", "reasoning", [1, 0] * 150).add("ar_control", "reasoning", [1, 0] * 150)
    for key in ("mars/chat/tau=1.0", "ar_control/chat/tau=1.0"):
        o.metrics[key]["quality"] = False  # mars evaluate marks a benchmark without a verifier so
    decision = o.decide(at_tau1())
    chat = next(c for c in decision["checks"] if c["name"] == "chat")
    assert decision["passed"] and not chat["gated"] and "surface check" in chat["note"]
    named = o.decide(at_tau1(benchmarks=["chat", "reasoning"]))
    assert not named["passed"] and next(c for c in named["checks"] if c["name"] == "chat")["passed"] is False
