"""The promotion gate: MARS at tau = 1.0 must not be detectably worse than the AR baseline (``mars gate``).

The rule, on ``metrics/eval.json`` and the per-item outputs beside it (``--eval-dir``, both written by
``mars evaluate``); the statistics are :mod:`mars.evaluation.paired`:

1. A benchmark is *gated* where every baseline scores at least ``min_baseline_score`` at ``tau`` (below
   that a drop cannot show); the others are reported, never gated.
2. Per gated benchmark and baseline: the candidate's and the baseline's scores on the same items give
   paired differences; the check fails where the candidate is worse than the baseline minus
   ``tolerance`` with one-sided confidence. The same on the equally weighted average of the gated
   benchmarks (``average_tolerance``), where there are two or more.
3. At ``speed_tau`` (a tau < 1 where MARS is meant to be used), the same test of the candidate's
   average there against the first baseline's at ``tau``, with ``max_score_drop`` as its tolerance; and
   its tokens/forward at least ``min_tokens_per_forward`` (a measurement, no test). An AR model never
   trained with masks decodes like the baseline at tau = 1.0 but is confidently wrong below it: this is
   what stops it.
4. The tests of 2 and 3 are one family: Holm's correction keeps the chance that an unchanged model fails
   the gate at most ``alpha``. Every check reports n, the paired difference, its SE, the p-values and its
   minimum detectable drop (the true drop that fails it with probability ``power``).
5. ``report_against``: more checkpoints (the base) compared the same way, in the report only.

Agreement with a reference's answers and its log-probabilities (:mod:`mars.evaluation.agreement`) measure
drift, not quality: they stay in the evaluation report. A metrics entry whose score is not the mean of
its per-item outputs fails the gate: the decision rests on the outputs.

The decision and every number it used go to ``metrics/gate.json``; the verb exits 1 when the gate does
not pass, so ``dvc repro`` and the flow stop. An explicit override (``gate.override`` in params, or
``--override REASON --override-by WHO``) passes it anyway and is recorded as such: reason and who.

The decision names what it judged (``artifacts``): the sha256 of the candidate checkpoint as
``mars evaluate`` recorded it in every entry (``checkpoint_sha256``, :func:`mars.core.digest.sha256_tree`),
and, where the gate runs after the export, the sha256 of the export made from it; and the evidence it
read (``evidence``: the metrics file and every per-item output, by sha256), from which ``mars promote``
derives the decision again (:func:`rederive`). Where the operator sets a key in ``MARS_GATE_KEY``, the
decision is signed (``signature``: HMAC-SHA256 over its canonical JSON, :func:`sign`) and ``mars promote``
refuses one without a valid signature (:func:`verify_signature`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from mars.core.atomic import read_json, write_json
from mars.core.digest import is_sha256, sha256_file, sha256_tree
from mars.decoding.setting import Setting
from mars.errors import ConfigError, MarsError
from mars.evaluation.metric_key import MetricKey, metric_key
from mars.evaluation.paired import Paired, holm, min_detectable_drop, p_worse

ItemScores = Callable[[str, str, float], "dict[str, float] | None"]
KEY_ENV = "MARS_GATE_KEY"  # the operator's signing key: `mars gate` signs with it, `mars promote` verifies
SIGNATURE_ALG = "hmac-sha256"


@dataclass
class Override:
    enabled: bool = False
    reason: str = ""
    by: str = ""

    def __post_init__(self):
        if self.enabled and not self.reason.strip():
            raise ConfigError("reason: an override needs a reason")
        if self.enabled and not self.by.strip():
            raise ConfigError("by: an override must say who made it")


@dataclass
class GateConfig:
    """The ``gate:`` section of params.yaml."""

    candidate: str = "mars"
    baseline: str | list[str] = "ar_control"  # or "sft", or a list: each is checked (the first for the speed check)
    tau: float = 1.0
    alpha: float = 0.05  # the chance that an unchanged model fails the gate (Holm over its checks)
    power: float = 0.8  # of the minimum detectable drop each check reports
    tolerance: float = 0.05  # score (0..1) the candidate may trail per benchmark before a drop counts
    average_tolerance: float | None = None  # None: same as tolerance
    min_baseline_score: float = 0.15  # a benchmark where a baseline scores less is reported, not gated
    benchmarks: list[str] = field(default_factory=list)  # empty: every benchmark both have at tau
    report_against: list[str] = field(default_factory=list)  # compared like baselines, in the report only
    speed_tau: float | None = 0.9  # None: no check below tau = 1.0
    min_tokens_per_forward: float | None = None
    max_score_drop: float | None = 0.2
    override: Override = field(default_factory=Override)

    def __post_init__(self):
        if not self.baselines() or self.candidate in self.baselines():
            raise ConfigError(f"baseline: must name checkpoints other than the candidate ({self.candidate!r})")
        if self.candidate in self.report_against:
            raise ConfigError(f"report_against: must not name the candidate ({self.candidate!r})")
        for key in ("alpha", "power"):
            if not 0.0 < getattr(self, key) < 1.0:
                raise ConfigError(f"{key}: must be in (0, 1), got {getattr(self, key)}")
        for key in ("tolerance", "average_tolerance", "max_score_drop"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise ConfigError(f"{key}: must be >= 0")
        if not 0.0 <= self.min_baseline_score <= 1.0:
            raise ConfigError(f"min_baseline_score: must be in [0, 1], got {self.min_baseline_score}")
        if (self.min_tokens_per_forward is not None or self.max_score_drop is not None) and self.speed_tau is None:
            raise ConfigError("speed_tau: min_tokens_per_forward / max_score_drop need the tau they apply at")
        if self.speed_tau is not None:
            Setting.check_tau(self.speed_tau, "speed_tau")

    def baselines(self) -> list[str]:
        return [self.baseline] if isinstance(self.baseline, str) else list(self.baseline)

    @classmethod
    def from_decision(cls, decision: dict) -> GateConfig:
        """The config a decision recorded (``decision["config"]``), to derive it again."""
        if not isinstance(decision.get("config"), dict):
            raise MarsError("the decision records no gate config (`config`)")
        recorded = dict(decision["config"])
        try:
            recorded["override"] = Override(**(recorded.get("override") or {}))
            return cls(**recorded)
        except (TypeError, ConfigError) as err:
            raise MarsError(f"the decision's config is not a gate config: {err}") from None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _finite(x: float) -> float | None:
    """JSON has no NaN: an undefined number is null."""
    return None if x is None or math.isnan(x) else x


def decide(metrics: dict, cfg: GateConfig, item_scores: ItemScores | None = None) -> dict:
    """The gate decision (JSON-ready) for eval metrics ``metrics`` and the per-item scores behind them; pure:
    no files. ``item_scores(checkpoint, benchmark, tau) -> {item id: score} | None`` (None: no outputs; every
    compared entry needs them, so without it every comparison fails as missing)."""
    cand, tau = cfg.candidate, float(cfg.tau)
    checks: list[dict] = []
    tests: list[tuple[dict, Paired, float]] = []  # the family Holm corrects: (check, differences, tolerance)

    def entry(ckpt: str, bench: str, at: float) -> dict | None:
        return metrics.get(metric_key(ckpt, bench, at))

    def benchmarks_at(ckpt: str) -> set[str]:
        keys = [MetricKey.parse(k) for k in metrics]
        return {k.benchmark for k in keys if k.checkpoint == ckpt and k.tau == tau}

    def missing(name: str, message: str, **extra) -> None:
        checks.append({"name": name, "kind": "missing", "gated": True, "passed": False, "message": message, **extra})

    def scores(ckpt: str, bench: str, at: float) -> dict[str, float] | None:
        """The per-item scores of one entry, after checking that the entry's score is their mean."""
        found = item_scores(ckpt, bench, at) if item_scores is not None else None
        key = metric_key(ckpt, bench, at)
        if found is None:
            missing(key, f"{key}: no per-item outputs (run `mars gate --eval-dir` on `mars evaluate`'s outputs)")
            return None
        if not found or abs(_mean(list(found.values())) - entry(ckpt, bench, at)["score"]) > 1e-9:
            missing(key, f"{key}: the metrics score is not the mean of its {len(found)} per-item outputs")
            return None
        return found

    baselines = cfg.baselines()
    names = cfg.benchmarks or sorted(benchmarks_at(cand) | set().union(*(benchmarks_at(b) for b in baselines)))
    if not names:
        missing("benchmarks", f"no benchmark has metrics for {cand} or {', '.join(baselines)} at tau={tau}")
    # 1. which benchmarks the gate judges; the others are compared all the same, in the report
    gated: list[str] = []
    ungated: dict[str, str] = {}  # benchmark -> why it is not gated
    for bench in names:
        absent = [metric_key(x, bench, tau) for x in (cand, *baselines) if entry(x, bench, tau) is None]
        if absent:
            missing(bench, f"{bench}: no metrics for {', '.join(absent)}")
            continue
        low = {b: entry(b, bench, tau)["score"] for b in baselines
               if entry(b, bench, tau)["score"] < cfg.min_baseline_score}
        if entry(cand, bench, tau).get("quality") is False and not cfg.benchmarks:
            ungated[bench] = ("not gated: its score is a surface check, not answer quality "
                              "(name it in benchmarks to gate it)")
        elif low:
            ungated[bench] = ("not gated: " + ", ".join(f"{b} scores {s:.3f}" for b, s in low.items())
                              + f" < min_baseline_score {cfg.min_baseline_score}")
        else:
            gated.append(bench)
    if names and not gated and not any(c["kind"] == "missing" for c in checks):
        missing("benchmarks", f"no benchmark where every baseline scores >= {cfg.min_baseline_score}: "
                              "the gate cannot judge (enable one a drop can show on)")

    # 2. and 5. per benchmark and on average, against each baseline (and the reported checkpoints)
    cand_items = {bench: scores(cand, bench, tau) if bench in gated else item_scores and item_scores(cand, bench, tau)
                  for bench in gated + list(ungated)}
    first: dict[str, dict[str, float]] = {}
    average_tolerance = cfg.tolerance if cfg.average_tolerance is None else cfg.average_tolerance
    for other in baselines + [r for r in cfg.report_against if r not in baselines]:
        suffix = "" if len(baselines) == 1 and other in baselines else f" vs {other}"
        parts = []
        for bench in gated + list(ungated):
            gating = other in baselines and bench in gated
            if gating:
                theirs = scores(other, bench, tau)
            else:  # a diagnostic: compared where it was evaluated, never a missing check
                theirs = item_scores(other, bench, tau) if item_scores and entry(other, bench, tau) else None
            if cand_items[bench] is None or theirs is None:
                continue
            if other == baselines[0] and gating:
                first[bench] = theirs
            pair = Paired.of(cand_items[bench], theirs)
            check = {"name": bench + suffix, "kind": "benchmark", "gated": gating, "baseline_name": other,
                     "benchmark": bench, "tau": tau, "candidate": entry(cand, bench, tau)["score"],
                     "baseline": entry(other, bench, tau)["score"]}
            if bench in ungated:
                check["note"] = ungated[bench]
            else:
                parts.append(pair)
            checks.append(check)
            tests.append((check, pair, cfg.tolerance))
        if len(parts) >= 2 and len(parts) == len(gated):
            check = {"name": "average" + suffix, "kind": "average", "gated": other in baselines,
                     "baseline_name": other, "benchmarks": gated, "tau": tau,
                     "candidate": _mean([entry(cand, b, tau)["score"] for b in gated]),
                     "baseline": _mean([entry(other, b, tau)["score"] for b in gated])}
            checks.append(check)
            tests.append((check, Paired.average(parts), average_tolerance))

    # 3. at the speed tau
    if cfg.speed_tau is not None and gated:
        speed = float(cfg.speed_tau)
        fast = {b: entry(cand, b, speed) for b in gated}
        absent = [metric_key(cand, b, speed) for b, e in fast.items() if e is None]
        if absent:
            missing("speed", f"speed: no metrics for {', '.join(absent)}")
        else:
            if cfg.min_tokens_per_forward is not None:
                forwards = sum(e["forwards"] for e in fast.values())
                tpf = sum(e["tokens"] for e in fast.values()) / forwards if forwards else 0.0
                ok = tpf >= cfg.min_tokens_per_forward
                checks.append({"name": "tokens_per_forward", "kind": "speed", "gated": True, "tau": speed,
                               "value": tpf, "limit": cfg.min_tokens_per_forward, "passed": ok,
                               "message": None if ok else f"speed: {cand} at tau={speed} makes {tpf:.3f} "
                                                          f"tokens/forward < {cfg.min_tokens_per_forward}"})
            if cfg.max_score_drop is not None:
                parts = []
                for bench in gated:
                    mine = scores(cand, bench, speed)
                    if mine is not None and bench in first:
                        parts.append(Paired.of(mine, first[bench]))
                if len(parts) == len(gated):
                    check = {"name": "score_at_speed_tau", "kind": "speed", "gated": True,
                             "baseline_name": baselines[0], "benchmarks": gated, "tau": speed,
                             "candidate": _mean([fast[b]["score"] for b in gated]),
                             "baseline": _mean([entry(baselines[0], b, tau)["score"] for b in gated])}
                    checks.append(check)
                    tests.append((check, parts[0] if len(parts) == 1 else Paired.average(parts),
                                  cfg.max_score_drop))

    # 4. the tests, Holm-corrected over the gated ones
    family = [(c, p, tol) for c, p, tol in tests if c["gated"]]
    level = cfg.alpha / max(1, len(family))
    adjusted = dict(zip((id(c) for c, _, _ in family), holm([p_worse(p, tol) for _, p, tol in family])))
    for check, pair, tol in tests:
        p = p_worse(pair, tol) if pair.usable else math.nan
        check.update(n=pair.n, delta=_finite(pair.delta), se=_finite(pair.se), tolerance=tol, p=_finite(p),
                     mdd=_finite(min_detectable_drop(pair.se, level, cfg.power, tol)))
        if not check["gated"]:
            check["passed"] = None
            continue
        check["p_holm"] = _finite(adjusted[id(check)]) if pair.usable else None
        check["passed"] = pair.usable and adjusted[id(check)] >= cfg.alpha
        if not pair.usable:
            check["message"] = f"{check['name']}: {pair.n} paired item(s): too few to judge"
        elif not check["passed"]:
            at = f" at tau={check['tau']}" if check["kind"] == "speed" else ""
            check["message"] = (f"{check['name']}: {cand}{at} is worse than {check['baseline_name']} by "
                                f"{-pair.delta:.4f} +- {pair.se:.4f} (n {pair.n}, tolerance {tol}): one-sided p "
                                f"{check['p']:.2g}, Holm-adjusted {check['p_holm']:.2g} < alpha {cfg.alpha}")

    failures = [c["message"] for c in checks if c["gated"] and c["passed"] is False]
    checks_passed = not failures
    return {
        "passed": checks_passed or cfg.override.enabled,
        "checks_passed": checks_passed,
        "overridden": cfg.override.enabled and not checks_passed,
        "override": asdict(cfg.override),
        "candidate": cand,
        "baseline": cfg.baseline,
        "tau": tau,
        "speed_tau": cfg.speed_tau,
        "rule": {
            "test": "one-sided paired z-test per check (candidate - baseline on the same items, > -tolerance), "
                    "Holm-corrected over the gated checks; a check fails where its adjusted p < alpha",
            "alpha": cfg.alpha, "power": cfg.power, "tests": len(family),
            "mdd_level": level,  # Bonferroni's alpha / tests: the level every check is sure to be tested at
            "gated_benchmarks": gated,
        },
        "config": asdict(cfg),
        "checks": checks,
        "failures": failures,
    }


def read_metrics(path: str | Path) -> dict:
    path = Path(path)
    data = read_json(path, "no evaluation metrics: run `mars evaluate` first")
    if not isinstance(data, dict):
        raise MarsError(f"{path}: expected an object of '<checkpoint>/<benchmark>/tau=<tau>' entries")
    for key, value in data.items():
        try:
            MetricKey.parse(key)
        except MarsError as err:
            raise MarsError(f"{path}: {err}") from None
        if not isinstance(value, dict) or not {"score", "tokens", "forwards"} <= set(value):
            raise MarsError(f"{path}: entry {key!r} lacks score/tokens/forwards")
    return data


class Evidence:
    """``item_scores`` for :func:`decide` from ``mars evaluate``'s per-item outputs under ``eval_dir``,
    remembering the sha256 of every file it read (``read``, by path relative to ``eval_dir``); given
    ``expected`` (a decision's record), a file whose bytes differ is refused."""

    def __init__(self, eval_dir: str | Path, expected: dict[str, str] | None = None):
        self.eval_dir, self.expected, self.read = Path(eval_dir), expected, {}

    def __call__(self, checkpoint: str, benchmark: str, tau: float) -> dict[str, float] | None:
        from mars.evaluation.evaluate import read_jsonl

        path = MetricKey(checkpoint, benchmark, float(tau)).outputs_path(self.eval_dir)
        relative = path.relative_to(self.eval_dir).as_posix()
        if not path.is_file():
            return None
        digest = sha256_file(path)
        if self.expected is not None and self.expected.get(relative) != digest:
            raise MarsError(f"{path}: not the per-item outputs the gate decided on (sha256 {digest[:12]}..., "
                            f"recorded {str(self.expected.get(relative))[:12]}...)")
        self.read[relative] = digest
        try:
            return {str(r["id"]): float(r["score"]) for r in read_jsonl(path)}
        except (KeyError, TypeError, ValueError) as err:
            raise MarsError(f"{path}: a row without a numeric score and an id ({err})") from None


def evaluated_sha256(metrics: dict, checkpoint: str, where: str | Path) -> str:
    """The sha256 of the checkpoint ``mars evaluate`` evaluated as ``checkpoint`` (one value in all its entries)."""
    found = {e.get("checkpoint_sha256") for k, e in metrics.items() if MetricKey.parse(k).checkpoint == checkpoint}
    if len(found) != 1 or not is_sha256(next(iter(found))):
        state = "no entries" if not found else "no checkpoint_sha256" if found == {None} else "several checkpoint_sha256"
        raise MarsError(f"{where}: {state} for {checkpoint!r}: cannot tell which checkpoint was evaluated "
                        "(run `mars evaluate` again: it records the sha256 of each checkpoint it evaluates)")
    return next(iter(found))


def judged_artifacts(metrics: dict, metrics_path: str | Path, cfg: GateConfig,
                     export: str | Path | None = None) -> dict:
    """What the decision is about: the candidate's sha256 and, given ``export``, the export's, after
    checking that the export was made from that very checkpoint."""
    checkpoint = evaluated_sha256(metrics, cfg.candidate, metrics_path)
    artifacts = {"checkpoint": {"name": cfg.candidate, "sha256": checkpoint}}
    if export is not None:
        export = Path(export)
        manifest = read_json(export / "manifest.json", "not an export: run `mars export`")
        made_from = (manifest.get("checkpoint") or {}).get("sha256") if isinstance(manifest, dict) else None
        if made_from != checkpoint:
            raise MarsError(f"{export}: exported from checkpoint sha256 {str(made_from)[:12]}..., not the "
                            f"{cfg.candidate} evaluated in {metrics_path} ({checkpoint[:12]}...): export the "
                            "evaluated checkpoint")
        artifacts["export"] = {"path": str(export), "sha256": sha256_tree(export)}
    return artifacts


def run_gate(metrics_path: str | Path, out: str | Path, cfg: GateConfig, eval_dir: str | Path | None = None,
             export: str | Path | None = None) -> dict:
    """Decide on ``metrics_path`` and ``eval_dir``'s per-item outputs; the decision records the evidence it
    read and the sha256 of the evaluated candidate and of ``export``, the export made from it."""
    metrics = read_metrics(metrics_path)  # raises first when the file is missing or malformed
    evidence = Evidence(eval_dir) if eval_dir is not None else None
    decision = decide(metrics, cfg, evidence)
    decision["metrics"] = str(metrics_path)
    decision["metrics_sha256"] = sha256_file(metrics_path)
    decision["evidence"] = {"eval_dir": None if eval_dir is None else str(eval_dir),
                            "outputs": dict(sorted(evidence.read.items())) if evidence is not None else {}}
    decision["artifacts"] = judged_artifacts(metrics, metrics_path, cfg, export)
    key = signing_key()
    if key is not None:
        decision["signature"] = sign(decision, key)
    write_json(out, decision)
    return decision


def signing_key() -> str | None:
    """The operator's signing key (``MARS_GATE_KEY``), or None where none is set."""
    return os.environ.get(KEY_ENV) or None


def _canonical(decision: dict) -> bytes:
    """The bytes a signature covers: the decision without its signature, as canonical JSON."""
    unsigned = {k: v for k, v in decision.items() if k != "signature"}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def sign(decision: dict, key: str) -> dict:
    """``decision``'s signature: HMAC-SHA256 with ``key`` over its canonical JSON (without the signature)."""
    return {"alg": SIGNATURE_ALG,
            "value": hmac.new(key.encode(), _canonical(decision), hashlib.sha256).hexdigest()}


def verify_signature(decision: dict, key: str, where: str | Path) -> None:
    """Raise unless ``decision`` carries a valid signature made with ``key`` (by `mars gate` with it set)."""
    signature = decision.get("signature")
    if not isinstance(signature, dict) or signature.get("alg") != SIGNATURE_ALG \
            or not isinstance(signature.get("value"), str):
        raise MarsError(f"{where}: the decision is not signed ({KEY_ENV} is set: only a decision `mars gate` "
                        f"signed with that key is accepted)")
    if not hmac.compare_digest(signature["value"], sign(decision, key)["value"]):
        raise MarsError(f"{where}: the decision's signature does not verify with {KEY_ENV} (edited after "
                        "`mars gate`, or signed with another key)")


def rederive(decision: dict, where: str | Path, root: str | Path = ".") -> dict:
    """The decision derived again from the evidence ``decision`` names (its metrics and per-item outputs,
    each by sha256, paths relative to ``root``) with the config it recorded; raises where the evidence
    is gone or changed, or where the recorded verdict or checks do not follow from it."""
    root = Path(root)
    metrics_path, recorded = decision.get("metrics"), decision.get("evidence")
    if not isinstance(metrics_path, str) or not isinstance(recorded, dict) or not isinstance(
            recorded.get("outputs"), dict) or not isinstance(recorded.get("eval_dir"), str):
        raise MarsError(f"{where}: names no evidence (metrics and per-item outputs): not a decision `mars gate "
                        "--eval-dir` wrote")
    gone = [root / metrics_path] + [root / recorded["eval_dir"] / rel for rel in recorded["outputs"]]
    gone = [path for path in gone if not path.is_file()]
    if gone:
        raise MarsError(f"{gone[0]}: no such file, yet the gate decided on it ({len(gone)} file(s) of the "
                        f"evidence {where} names are gone)")
    if sha256_file(root / metrics_path) != decision.get("metrics_sha256"):
        raise MarsError(f"{root / metrics_path}: not the metrics the gate decided on (sha256 differs)")
    cfg = GateConfig.from_decision(decision)
    evidence = Evidence(root / recorded["eval_dir"], expected=recorded["outputs"])
    again = decide(read_metrics(root / metrics_path), cfg, evidence)
    if set(evidence.read) != set(recorded["outputs"]):
        raise MarsError(f"{where}: its evidence lists other per-item outputs than its checks read")
    # the verdict and checks first, then the rest the rule derives (override, speed_tau, rule, ...) but its input
    verdict = ("passed", "checks_passed", "overridden", "checks", "failures")
    for key in verdict + tuple(k for k in again if k not in verdict and k != "config"):
        if again[key] != decision.get(key):
            raise MarsError(f"{where}: {key!r} does not follow from its own evidence and rule (derived again: "
                            f"{str(again[key])[:120]}); refusing it")
    return again
