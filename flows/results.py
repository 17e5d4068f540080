"""A study's results, copied out of the project copy that ran it into ``results/<profile>/``.

``infra/study.sh PROFILE`` runs ``dvc exp run -S profile=PROFILE`` in its own clone (the checkout's
params.yaml and outputs stay the default profile's) and then calls this: the metrics (evaluation,
gate, training losses), eval/report.md and its figures, the distillation manifest, the prepared
data's stats, dvc.lock and the params every stage saw go to ``results/<profile>/``, next to
``command.json`` (the exact command, the commit, the exit status, when), and ``summary.md``, the headline
(:mod:`mars.evaluation.gate_summary`) where the run got as far as its gate. What is missing (a run that
stopped early) is listed there instead of copied, so the folder always says how far the run got.

Only the paths a study writes are replaced: the benchmark outputs and the README that live beside them in
``results/<profile>/`` come from other commands and are left alone.

    python -m flows.results CLONE OUT --profile P --command "..." --status N
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


def collect(clone: Path, out: Path, *, profile: str, command: str, status: int) -> dict:
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
              "collected_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copied": copied,
              "missing": missing}
    (out / "command.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("clone", type=Path, help="the project copy the study ran in")
    parser.add_argument("out", type=Path, help="results/<profile>/")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--command", required=True, help="the command that ran the study, as typed")
    parser.add_argument("--status", type=int, default=0, help="its exit status")
    args = parser.parse_args(argv)
    record = collect(args.clone, args.out, profile=args.profile, command=args.command, status=args.status)
    print(f"results of {args.profile} (exit {record['exit_status']}) -> {args.out}"
          + (f"; missing: {', '.join(record['missing'])}" if record["missing"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
