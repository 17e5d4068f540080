"""A study's results, copied out of the project copy that ran it into ``results/<profile>/``.

``infra/study.sh PROFILE`` runs ``dvc exp run -S profile=PROFILE`` in its own clone (the checkout's
params.yaml and outputs stay the default profile's) and then calls this: the metrics (evaluation,
gate, training losses), eval/report.md and its figures, the distillation manifest, the prepared
data's stats, dvc.lock and the params every stage saw go to ``results/<profile>/``, next to
``command.json`` (the exact command, the commit, the exit status, when, and the wall clock of every
invocation that ran it: a resumed study is the sum of its runs), and ``summary.md``, the headline
(:mod:`mars.evaluation.gate_summary`) where the run got as far as its gate. What is missing (a run that
stopped early) is listed there instead of copied, so the folder always says how far the run got.

Only the paths a study writes are replaced: the benchmark outputs and the README that live beside them in
``results/<profile>/`` come from other commands and are left alone.

    python -m flows.results CLONE OUT --profile P --command "..." --status N [--started UNIX_TIME]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mars.evaluation import gate_summary

# (path in the clone, path under results/<profile>/)
COPIED = [
    ("metrics", "metrics"),
    ("eval/report.md", "report.md"),
    ("eval/figures", "figures"),
    ("eval/plots", "plots"),
    ("data/distilled/manifest.json", "distill_manifest.json"),
    ("data/prepared/stats.json", "data_stats.json"),
    ("dvc.lock", "dvc.lock"),
    ("params.yaml", "params.yaml"),
]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


RUNS = "build/study_runs.jsonl"  # in the clone (ignored by git): one line per invocation of the study


def record_run(clone: Path, started: float, status: int, ended: float | None = None) -> list[dict]:
    """Append this invocation (start, end, exit status, commit) to the clone's run log; return every run so far.
    An invocation killed before it got here (a machine that went away) has no line: the total undercounts it."""
    ended = max(started, time.time() if ended is None else ended)  # a clock stepped back: 0 s, not a lost record
    log = clone / RUNS
    log.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    with log.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"started": _utc(started), "ended": _utc(ended), "seconds": round(ended - started, 1),
                             "exit_status": status, "commit": commit}) + "\n")
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def collect(clone: Path, out: Path, *, profile: str, command: str, status: int, started: float | None = None) -> dict:
    """Copy what the run in ``clone`` produced into ``out``, replacing the previous study's copy of each path
    (a path this run did not produce is removed too, so no stale file sits beside the new command.json); return
    command.json."""
    out.mkdir(parents=True, exist_ok=True)
    for _, dest in COPIED:
        _remove(out / dest)
    _remove(out / "params.resolved.json")
    copied, missing = [], []
    for src, dest in COPIED:
        path = clone / src
        if path.is_dir():
            shutil.copytree(path, out / dest)
        elif path.is_file():
            shutil.copy2(path, out / dest)
        else:
            missing.append(src)
            continue
        copied.append(dest)
    _remove(out / "summary.md")
    gate, metrics = clone / "metrics" / "gate.json", clone / "metrics" / "eval.json"
    if gate.is_file() and metrics.is_file():  # the headline: the gate's checks and the speed at each tau
        (out / "summary.md").write_text(gate_summary.render(json.loads(gate.read_text()), json.loads(metrics.read_text())))
        copied.append("summary.md")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    resolved = subprocess.run([sys.executable, "-m", "mars.cli", "params"], cwd=clone, capture_output=True, text=True)
    if resolved.returncode == 0:
        (out / "params.resolved.json").write_text(resolved.stdout)
        copied.append("params.resolved.json")
    record = {"command": command, "profile": profile, "commit": commit, "exit_status": status,
              "collected_at": _utc(time.time()), "copied": copied, "missing": missing}
    if started is not None:  # the study's wall clock: every invocation of this clone, resumed ones summed
        runs = record_run(clone, started, status)
        record.update(runs=runs, hours=round(sum(r["seconds"] for r in runs) / 3600, 2))
    (out / "command.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("clone", type=Path, help="the project copy the study ran in")
    parser.add_argument("out", type=Path, help="results/<profile>/")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--command", required=True, help="the command that ran the study, as typed")
    parser.add_argument("--status", type=int, default=0, help="its exit status")
    parser.add_argument("--started", type=float, help="when this invocation started (Unix time): its wall clock "
                        "is logged in the clone, and command.json sums every invocation's")
    args = parser.parse_args(argv)
    record = collect(args.clone, args.out, profile=args.profile, command=args.command, status=args.status,
                     started=args.started)
    print(f"results of {args.profile} (exit {record['exit_status']}) -> {args.out}"
          + (f"; missing: {', '.join(record['missing'])}" if record["missing"] else "")
          + (f"; {record['hours']} h over {len(record['runs'])} run(s)" if "runs" in record else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
