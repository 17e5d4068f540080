"""One recipe run against issue #44's goals, from its study's outputs (no decoding): the numbers of
docs/recipe.md's table and a line per goal.

    python benchmarks/recipe_row.py build/study-pool [--tau 0.9]

reads STUDY/metrics/eval.json and gate.json and STUDY/eval (the per-item outputs). Per benchmark: MARS's
tokens/forward at tau and lossless; its score at tau against its own tau = 1 output on the same items
(paired, +- SE); MARS at tau = 1 against ar_control and against the base (the gate's checks); the drift of
MARS at tau = 1 from the base (exact agreement with the base's output, mean log-prob of it under the base);
on the chat benchmark, the outputs at tau with a doubled word their tau = 1 output lacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mars.evaluation.benchmarks.chat import added
from mars.evaluation.evaluate import read_jsonl
from mars.evaluation.metric_key import MetricKey
from mars.evaluation.paired import Paired

# issue #44's acceptance
GOALS = {"tau_tpf": 1.6, "tau_drop": 0.01, "lossless_tpf": 2.0, "chat_tau_tpf": 1.4, "chat_lossless_tpf": 1.7,
         "chat_doubled": 2 / 50}
GATED = ("reasoning_pool", "reasoning_new")


def _items(folder: Path, key: MetricKey) -> dict[str, dict]:
    path = key.outputs_path(folder)
    if not path.is_file():
        raise SystemExit(f"recipe_row: {path}: no such file (was {key.format()} evaluated there?)")
    return {row["id"]: row for row in read_jsonl(path)}


def _pm(paired: Paired | dict) -> str:
    delta, se = (paired.delta, paired.se) if isinstance(paired, Paired) else (paired["delta"], paired["se"])
    return f"{100 * delta:+.1f} +- {100 * se:.1f}"


def summarize(study: Path, tau: float = 0.9, candidate: str = "mars") -> dict:
    """Per benchmark the numbers above; whether MARS at tau = 1 passed the gate's checks against its baseline
    (every gated check, Holm-corrected as the gate did; its speed checks and any override aside)."""
    metrics = json.loads((study / "metrics" / "eval.json").read_text())
    gate = json.loads((study / "metrics" / "gate.json").read_text())
    base = (gate["config"].get("report_against") or ["sft"])[0]  # the base: the SFT checkpoint of an instruct model
    checks = {(c["benchmark"], c["baseline_name"]): c for c in gate["checks"] if c["kind"] == "benchmark"}
    gated = [c for c in gate["checks"] if c.get("gated") and c.get("baseline_name") == gate["baseline"]]
    benchmarks = sorted({MetricKey.parse(key).benchmark for key in metrics if key.startswith(f"{candidate}/")})
    rows = {}
    for bench in benchmarks:
        keys = {name: MetricKey(candidate, bench, t) for name, t in (("tau", float(tau)), ("lossless", None),
                                                                      ("greedy", 1.0))}
        at_tau, lossless, greedy = (metrics.get(keys[name].format()) for name in ("tau", "lossless", "greedy"))
        if at_tau is None or greedy is None:
            continue
        ones, lossy = _items(study / "eval", keys["greedy"]), _items(study / "eval", keys["tau"])
        scores = lambda items: {i: r["score"] for i, r in items.items()}  # noqa: E731
        row = {"tau_tpf": at_tau["tokens_per_forward"], "lossless_tpf": lossless and lossless["tokens_per_forward"],
               "tau_vs_1": Paired.of(scores(lossy), scores(ones)),
               "vs_ar_control": checks.get((bench, gate["baseline"])), "vs_base": checks.get((bench, base)),
               "agree_exact": greedy.get("agree_exact"), "ref_logprob": greedy.get("ref_logprob")}
        if bench == "chat":
            doubled = [i for i, r in lossy.items() if i in ones and added(ones[i]["text"], r["text"])]
            row["doubled"] = (len(doubled), sum(i in ones for i in lossy))
        rows[bench] = row
    return {"not_worse": bool(gated) and all(c["passed"] for c in gated), "gate": gate["passed"],
            "overridden": gate.get("overridden", False), "benchmarks": rows}


def goal_lines(summary: dict, tau: float) -> list[str]:
    """A line per goal of issue #44, met or not, with the number."""
    rows, lines = summary["benchmarks"], []

    def line(ok: bool, text: str) -> None:
        lines.append(f"[{'met' if ok else 'NOT met'}] {text}")

    for bench in GATED:
        if bench in rows:
            r = rows[bench]
            line(r["tau_tpf"] >= GOALS["tau_tpf"],
                 f"{bench}: tau {tau:g} {r['tau_tpf']:.2f} tokens/forward (>= {GOALS['tau_tpf']:.1f})")
            line(r["tau_vs_1"].delta >= -GOALS["tau_drop"], f"{bench}: tau {tau:g} - tau 1 score {_pm(r['tau_vs_1'])} "
                 f"points, n {r['tau_vs_1'].n} (>= -{100 * GOALS['tau_drop']:g})")
            line((r["lossless_tpf"] or 0) >= GOALS["lossless_tpf"],
                 f"{bench}: lossless {r['lossless_tpf'] or 0:.2f} tokens/forward (>= {GOALS['lossless_tpf']:.1f})")
    line(summary["not_worse"], "MARS at tau = 1 not worse than ar_control by the gate's rule (its gated checks)")
    lines.append(f"(the gate as a whole: {'passed' if summary['gate'] else 'failed'}"
                 f"{', overridden' if summary['overridden'] else ''})")
    if "chat" in rows:
        r = rows["chat"]
        line(r["tau_tpf"] >= GOALS["chat_tau_tpf"],
             f"chat: tau {tau:g} {r['tau_tpf']:.2f} tokens/forward (>= {GOALS['chat_tau_tpf']:.1f})")
        line((r["lossless_tpf"] or 0) >= GOALS["chat_lossless_tpf"],
             f"chat: lossless {r['lossless_tpf'] or 0:.2f} tokens/forward (>= {GOALS['chat_lossless_tpf']:.1f})")
        hits, n = r["doubled"]
        line(n >= 50 and hits <= GOALS["chat_doubled"] * n, f"chat: {hits} of {n} outputs at tau {tau:g} with a "
             f"doubled word tau 1 lacks (<= {GOALS['chat_doubled'] * 50:g} of 50, n >= 50)")
    return lines


def table(summary: dict, tau: float) -> list[str]:
    out = [f"| benchmark | tau {tau:g} tok/fwd | lossless | tau {tau:g} - tau 1 | MARS@1 - ar_control | MARS@1 - base "
           "| agree with base | base log-prob |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for bench, r in summary["benchmarks"].items():
        cells = [f"{r['tau_tpf']:.2f}", f"{r['lossless_tpf']:.2f}" if r["lossless_tpf"] else "-", _pm(r["tau_vs_1"]),
                 _pm(r["vs_ar_control"]) if r["vs_ar_control"] else "-", _pm(r["vs_base"]) if r["vs_base"] else "-",
                 f"{r['agree_exact']:.2f}" if r["agree_exact"] is not None else "-",
                 f"{r['ref_logprob']:.3f}" if r["ref_logprob"] is not None else "-"]
        out.append(f"| {bench} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="a study's folder (build/study-NAME): metrics/ and eval/")
    parser.add_argument("--tau", type=float, default=0.9)
    args = parser.parse_args(argv)
    for name in ("metrics/eval.json", "metrics/gate.json"):
        if not (args.study / name).is_file():
            raise SystemExit(f"recipe_row: {args.study / name}: no such file (has the study reached its gate?)")
    summary = summarize(args.study, args.tau)
    print("\n".join(table(summary, args.tau)))
    print()
    print("\n".join(goal_lines(summary, args.tau)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
