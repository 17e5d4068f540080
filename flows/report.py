"""The run report shown as a Prefect markdown artifact: what ran, the evaluation table, the gate decision."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _flatten(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        rows: list[tuple[str, Any]] = []
        for key, value in node.items():
            rows += _flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return rows
    return [(prefix, node)]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(rows: list[tuple[str, Any]], head: tuple[str, str] = ("metric", "value")) -> str:
    lines = [f"| {head[0]} | {head[1]} |", "| --- | --- |"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in rows]
    return "\n".join(lines)


def gate_passed(gate: Any) -> bool | None:
    return gate.get("passed") if isinstance(gate, dict) else None


def gate_summary(gate: Any) -> str:
    """One line: the verdict and why (mars gate lists ``failures``; an override names who and why)."""
    if not isinstance(gate, dict):
        return "no gate decision"
    why = gate.get("failures") or gate.get("reasons") or gate.get("reason")
    if gate.get("overridden"):
        override = gate.get("override") or {}
        why = f"overridden by {override.get('by')}: {override.get('reason')}"
    if isinstance(why, list):
        why = "; ".join(map(str, why))
    verdict = "passed" if gate.get("passed") else "failed"
    return f"{verdict}: {why}" if why else verdict


def _gate_tables(gate: dict) -> list[str]:
    checks = gate.get("checks")
    if isinstance(checks, list) and all(isinstance(c, dict) for c in checks):
        lines = ["| check | value | limit | passed |", "| --- | --- | --- | --- |"]
        lines += [f"| {_cell(c.get('name'))} | {_cell(c.get('value'))} | {_cell(c.get('limit'))} | "
                  f"{'yes' if c.get('passed') else 'NO'} |" for c in checks]
        rest = {k: v for k, v in gate.items() if k not in {"checks", "failures"}}
        return lines + ["", table(_flatten(rest), ("setting", "value"))]
    return [table(_flatten(gate), ("field", "value"))]


def _embedded(report_md: str) -> list[str]:
    """The evaluation report one heading level down, without its images (relative paths do not
    resolve in the Prefect UI; the PNGs stay in the project's eval/figures/)."""
    return [("#" + line) if line.startswith("#") else line
            for line in report_md.strip().splitlines() if not line.startswith("![")]


def render(header: dict[str, Any], eval_metrics: Any, eval_report: str | None, gate: Any) -> str:
    passed = gate_passed(gate)
    verdict = {True: "PASSED", False: "REJECTED", None: "not decided"}[passed]
    out = [f"# MARS pipeline: gate {verdict}", ""]
    out += [f"- project: `{header.get('project')}`", f"- revision: `{header.get('revision')}`",
            f"- overrides: `{' '.join(header.get('overrides') or []) or 'none'}`",
            f"- DVC remote: `{header.get('remote') or 'none'}`",
            f"- release: {header.get('released') or 'none (staging only)'}", ""]
    done = header.get("result") or {}
    if done:
        out += ["## Stages", "", "| stage | outcome | outputs |", "| --- | --- | --- |"]
        for name, res in done.items():
            outs = ", ".join(f"`{p}`@{(md5 or '')[:10]}" for p, md5 in res.get("outs", {}).items())
            out.append(f"| {name} | {res.get('outcome')} | {outs} |")
        out.append("")
    out += ["## Gate", "", f"**{gate_summary(gate)}**", ""]
    if isinstance(gate, dict):
        out += _gate_tables(gate) + [""]
    out += ["## Evaluation", ""]
    if eval_report:
        out += _embedded(eval_report) + [""]
    elif eval_metrics is not None:
        out += [table(_flatten(eval_metrics)), ""]
    else:
        out += ["no evaluation metrics yet", ""]
    return "\n".join(out)
