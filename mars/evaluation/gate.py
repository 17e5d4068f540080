"""The promotion gate: MARS at tau = 1.0 must not be worse than the AR baseline (``mars gate``).

Checks, on ``metrics/eval.json`` (written by ``mars evaluate``):

1. per benchmark: ``candidate@tau`` >= ``baseline@tau`` - ``tolerance`` (tau = ``gate.tau``, 1.0);
2. on average over those benchmarks: the same with ``average_tolerance``;
   (1 and 2 for each baseline when ``baseline`` is a list, e.g. ``[ar_control, sft]``: the AR control
   and the model MARS started from;)
3. optionally, at ``speed_tau`` (a tau < 1 where MARS is meant to be used): the candidate's average
   tokens/forward is at least ``min_tokens_per_forward``, and its average score is at most
   ``max_score_drop`` below the baseline's at ``tau``. An AR model never trained with masks decodes
   exactly like the baseline at tau = 1.0 but is confidently wrong below it; check 3 is what stops it.

With the per-item outputs (``--eval-dir``, written by ``mars evaluate``) every difference also gets its
paired standard error over the items both checkpoints answered (``paired_se``, ``n_paired``): the
score differences of the same items, not two independent samples.

The decision and every number it used go to ``metrics/gate.json``; the verb exits 1 when the gate does
not pass, so ``dvc repro`` and the flow stop. An explicit override (``gate.override`` in params, or
``--override REASON --override-by WHO``) passes it anyway and is recorded as such: reason and who.

The decision names what it judged (``artifacts``): the sha256 of the candidate checkpoint as
``mars evaluate`` recorded it in every entry (``checkpoint_sha256``, :func:`mars.core.digest.sha256_tree`),
and, where the gate runs after the export, the sha256 of the export made from it. ``mars promote``
publishes only those exact bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from mars.core.atomic import read_json, write_json
from mars.core.digest import is_sha256, sha256_file, sha256_tree
from mars.decoding.setting import Setting
from mars.errors import ConfigError, MarsError
from mars.evaluation.metric_key import MetricKey, metric_key


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
    tolerance: float = 0.05  # score points (scores are 0..1) the candidate may trail per benchmark
    average_tolerance: float | None = None  # None: same as tolerance
    benchmarks: list[str] = field(default_factory=list)  # empty: every benchmark both have at tau
    speed_tau: float | None = 0.9  # None: no check below tau = 1.0
    min_tokens_per_forward: float | None = None
    max_score_drop: float | None = 0.2
    override: Override = field(default_factory=Override)

    def __post_init__(self):
        if not self.baselines() or self.candidate in self.baselines():
            raise ConfigError(f"baseline: must name checkpoints other than the candidate ({self.candidate!r})")
        if self.tolerance < 0 or (self.average_tolerance is not None and self.average_tolerance < 0):
            raise ConfigError("tolerance: must be >= 0")
        if (self.min_tokens_per_forward is not None or self.max_score_drop is not None) and self.speed_tau is None:
            raise ConfigError("speed_tau: min_tokens_per_forward / max_score_drop need the tau they apply at")
        if self.speed_tau is not None:
            Setting.check_tau(self.speed_tau, "speed_tau")


    def baselines(self) -> list[str]:
        return [self.baseline] if isinstance(self.baseline, str) else list(self.baseline)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def paired(candidate: dict[str, float], baseline: dict[str, float]) -> dict:
    """Mean score difference over the items both have, and its paired standard error."""
    common = sorted(set(candidate) & set(baseline))
    diffs = [candidate[i] - baseline[i] for i in common]
    n = len(diffs)
    if n < 2:
        return {"n_paired": n, "paired_delta": _mean(diffs), "paired_se": float("nan")}
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return {"n_paired": n, "paired_delta": mean, "paired_se": (var / n) ** 0.5}


def decide(metrics: dict, cfg: GateConfig, item_scores=None) -> dict:
    """The gate decision (JSON-ready) for eval metrics ``metrics``; pure: no files.

    ``item_scores(checkpoint, benchmark, tau) -> {item id: score} | None``, where given, adds the paired
    difference and its standard error to every comparison.
    """
    checks: list[dict] = []
    failures: list[str] = []

    def check(name: str, kind: str, value: float, limit: float, ok: bool, message: str, **extra) -> None:
        checks.append({"name": name, "kind": kind, "value": value, "limit": limit, "passed": ok, **extra})
        if not ok:
            failures.append(message)

    def entry(ckpt: str, bench: str, tau: float) -> dict | None:
        return metrics.get(metric_key(ckpt, bench, tau))

    def benchmarks_at(ckpt: str, tau: float) -> set[str]:
        keys = [MetricKey.parse(k) for k in metrics]
        return {k.benchmark for k in keys if k.checkpoint == ckpt and k.tau == float(tau)}

    def pairing(bench: str, base: str) -> dict:
        if item_scores is None:
            return {}
        c, b = item_scores(cand, bench, cfg.tau), item_scores(base, bench, cfg.tau)
        return paired(c, b) if c is not None and b is not None else {}

    cand = cfg.candidate
    avg_tol = cfg.tolerance if cfg.average_tolerance is None else cfg.average_tolerance
    first: list[tuple[str, float, float]] = []  # the comparisons with the first baseline (the speed check's)
    for base in cfg.baselines():
        # one baseline keeps the plain check names; with several, each name says which baseline
        suffix = "" if len(cfg.baselines()) == 1 else f" vs {base}"
        names = cfg.benchmarks or sorted(benchmarks_at(cand, cfg.tau) | benchmarks_at(base, cfg.tau))
        compared: list[tuple[str, float, float]] = []
        ses: list[float] = []
        for bench in names:
            c, b = entry(cand, bench, cfg.tau), entry(base, bench, cfg.tau)
            if c is None or b is None:
                missing = [metric_key(x, bench, cfg.tau) for x, e in ((cand, c), (base, b)) if e is None]
                check(bench + suffix, "missing", float("nan"), float("nan"), False,
                      f"{bench}: no metrics for {', '.join(missing)}", baseline_name=base)
                continue
            limit = b["score"] - cfg.tolerance
            ok = c["score"] >= limit - 1e-12
            pair = pairing(bench, base)
            ses.append(pair.get("paired_se", float("nan")))
            check(bench + suffix, "benchmark", c["score"], limit, ok,
                  f"{bench}: {cand} {c['score']:.4f} < {base} {b['score']:.4f} - tolerance {cfg.tolerance}",
                  candidate=c["score"], baseline=b["score"], delta=c["score"] - b["score"], n=c.get("n"),
                  baseline_name=base, **pair)
            compared.append((bench, c["score"], b["score"]))
        if not names:
            check("benchmarks" + suffix, "missing", float("nan"), float("nan"), False,
                  f"no benchmark has metrics for {cand} or {base} at tau={float(cfg.tau)}", baseline_name=base)
        if compared:
            c_avg, b_avg = _mean([c for _, c, _ in compared]), _mean([b for _, _, b in compared])
            # benchmarks hold different items: the SE of the mean difference adds their variances
            se = {"paired_se": sum(x * x for x in ses) ** 0.5 / len(ses)} if item_scores is not None else {}
            check("average" + suffix, "average", c_avg, b_avg - avg_tol, c_avg >= b_avg - avg_tol - 1e-12,
                  f"average: {cand} {c_avg:.4f} < {base} {b_avg:.4f} - tolerance {avg_tol}",
                  candidate=c_avg, baseline=b_avg, delta=c_avg - b_avg, benchmarks=[n for n, _, _ in compared],
                  baseline_name=base, **se)
        if base == cfg.baselines()[0]:
            first = compared
    compared, base = first, cfg.baselines()[0]

    if cfg.speed_tau is not None and compared:
        fast = {bench: entry(cand, bench, cfg.speed_tau) for bench, _, _ in compared}
        absent = [metric_key(cand, b, cfg.speed_tau) for b, e in fast.items() if e is None]
        if absent:
            check("speed", "missing", float("nan"), float("nan"), False, f"speed: no metrics for {', '.join(absent)}")
        else:
            tokens = sum(e["tokens"] for e in fast.values())
            forwards = sum(e["forwards"] for e in fast.values())
            tpf = tokens / forwards if forwards else 0.0
            if cfg.min_tokens_per_forward is not None:
                check("tokens_per_forward", "speed", tpf, cfg.min_tokens_per_forward, tpf >= cfg.min_tokens_per_forward,
                      f"speed: {cand} at tau={cfg.speed_tau} makes {tpf:.3f} tokens/forward "
                      f"< {cfg.min_tokens_per_forward}", tau=cfg.speed_tau)
            if cfg.max_score_drop is not None:
                fast_avg = _mean([e["score"] for e in fast.values()])
                b_avg = _mean([b for _, _, b in compared])
                limit = b_avg - cfg.max_score_drop
                check("score_at_speed_tau", "speed", fast_avg, limit, fast_avg >= limit - 1e-12,
                      f"speed: {cand} at tau={cfg.speed_tau} averages {fast_avg:.4f} < {base} {b_avg:.4f} "
                      f"- max_score_drop {cfg.max_score_drop}", tau=cfg.speed_tau, candidate=fast_avg, baseline=b_avg)

    checks_passed = not failures
    overridden = cfg.override.enabled and not checks_passed
    return {
        "passed": checks_passed or cfg.override.enabled,
        "checks_passed": checks_passed,
        "overridden": overridden,
        "override": asdict(cfg.override),
        "candidate": cand,
        "baseline": cfg.baseline,
        "tau": cfg.tau,
        "tolerance": cfg.tolerance,
        "average_tolerance": avg_tol,
        "speed_tau": cfg.speed_tau,
        "min_tokens_per_forward": cfg.min_tokens_per_forward,
        "max_score_drop": cfg.max_score_drop,
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


def item_scores_from(eval_dir: str | Path):
    """``item_scores`` for :func:`decide` from ``mars evaluate``'s per-item outputs under ``eval_dir``."""
    from mars.evaluation.evaluate import read_jsonl

    def scores(checkpoint: str, benchmark: str, tau: float) -> dict[str, float] | None:
        path = MetricKey(checkpoint, benchmark, float(tau)).outputs_path(eval_dir)
        return {r["id"]: float(r["score"]) for r in read_jsonl(path)} if path.is_file() else None

    return scores


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
    """Decide on ``metrics_path`` (+ paired standard errors from ``eval_dir``'s per-item outputs, where given);
    the decision records the sha256 of the evaluated candidate and of ``export``, the export made from it."""
    metrics = read_metrics(metrics_path)  # raises first when the file is missing or malformed
    decision = decide(metrics, cfg, item_scores_from(eval_dir) if eval_dir is not None else None)
    decision["metrics"] = str(metrics_path)
    decision["metrics_sha256"] = sha256_file(metrics_path)
    decision["artifacts"] = judged_artifacts(metrics, metrics_path, cfg, export)
    write_json(out, decision)
    return decision
