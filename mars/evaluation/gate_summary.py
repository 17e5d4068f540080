"""A study's headline in markdown, from its gate decision and evaluation metrics: per benchmark, MARS at
tau = 1.0 against each compared checkpoint (paired difference +- SE, whether it is gated, what the gate
could detect), and MARS's score and tokens/forward at each tau and in lossless mode.

``flows.results`` writes it to ``results/<profile>/summary.md`` after a study; ``mars gate`` prints the
same checks line by line.
"""

from __future__ import annotations

from mars.evaluation.metric_key import MetricKey, sweep_order


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _verdict(check: dict) -> str:
    if not check.get("gated"):
        return "reported"
    return "pass" if check.get("passed") else "FAIL"


def render(gate: dict, metrics: dict) -> str:
    """The markdown summary of ``gate`` (metrics/gate.json) and ``metrics`` (metrics/eval.json)."""
    cand = gate.get("candidate", "mars")
    rule = gate.get("rule") or {}
    lines = [f"# {cand}: the gate and the speed", "",
             f"Gate **{'passed' if gate.get('passed') else 'FAILED'}**"
             + (" (overridden)" if gate.get("overridden") else "")
             + f": {rule.get('tests', '?')} test(s) at alpha {rule.get('alpha', '?')} (Holm), detectable drops at "
               f"power {rule.get('power', '?')}. Scores in %; differences are {cand} minus the other checkpoint on "
               "the same items, +- their paired SE.", ""]
    lines += ["| benchmark | vs | n | other | " + cand + " | difference | p (Holm) | detects | verdict |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in gate.get("checks", []):
        if c.get("kind") in ("benchmark", "average", "speed") and c.get("delta") is not None:
            where = c.get("benchmark") or ("average" if c["kind"] == "average" else f"average at tau={c.get('tau')}")
            se = "n/a" if c.get("se") is None else _pct(c["se"])
            p = "-" if c.get("p_holm") is None else f"{c['p_holm']:.3g}"
            lines.append(f"| {where} | {c.get('baseline_name')} | {c['n']} | {_pct(c.get('baseline'))} | "
                         f"{_pct(c.get('candidate'))} | {100 * c['delta']:+.1f} +- {se} | {p} | "
                         f"{_pct(c.get('mdd'))} | {_verdict(c)} |")
        elif c.get("kind") == "speed":
            lines.append(f"| tokens/forward at tau={c.get('tau')} | limit {c.get('limit')} | | | {c.get('value'):.2f} "
                         f"| | | | {_verdict(c)} |")
        elif c.get("kind") == "missing":
            lines.append(f"| {c.get('name')} | | | | | | | | FAIL: {c.get('message')} |")
    for failure in gate.get("failures") or []:
        lines.append(f"\n- {failure}")
    # MARS at every tau of the sweep and lossless, per benchmark
    rows: dict[str, list[tuple]] = {}
    for key, entry in metrics.items():
        parsed = MetricKey.parse(key)
        if parsed.checkpoint == cand:
            rows.setdefault(parsed.benchmark, []).append((parsed.tau, entry))
    if rows:
        lines += ["", f"{cand} at each tau (score %, tokens/forward, items; lossless: the tau = 1.0 output with "
                      "verified drafts):", "", "| benchmark | tau | score | tokens/forward | n |", "|---|---|---:|---:|---:|"]
        for bench in sorted(rows):
            for tau, entry in sorted(rows[bench], key=lambda r: sweep_order(r[0])):
                tpf = entry["tokens"] / entry["forwards"] if entry["forwards"] else 0.0
                lines.append(f"| {bench} | {'lossless' if tau is None else f'{tau:g}'} | {_pct(entry['score'])} | "
                             f"{tpf:.2f} | {entry.get('n', '')} |")
    return "\n".join(lines) + "\n"
