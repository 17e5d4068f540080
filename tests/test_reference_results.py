"""The committed reference results (dvc.lock, metrics/) are what a fresh `dvc repro` of the default profile gives.

The default profile trains with one thread per process and seeded data, init and shuffles, so on one
machine a re-run is bit-identical. Another CPU may round matmuls differently, so the check allows:
- the same gate decision (passed, and every check's outcome);
- every evaluated score within SCORE_TOL (12 of the 400 held-out items) and tokens/forward within TPF_TOL;
- the same set of metric keys (checkpoint x benchmark x tau).
Wall-clock figures (seconds, tokens/s) are not compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from project_copy import REPO, copy_project, init_repo

SCORE_TOL = 0.03
TPF_TOL = 0.05


def _reference(name: str) -> dict:
    path = REPO / "metrics" / name
    assert path.is_file(), f"{path} is not committed: run `dvc repro` and commit dvc.lock and metrics/"
    return json.loads(path.read_text())


def compare_eval(reference: dict, fresh: dict) -> list[str]:
    """Differences beyond the tolerances, one line each (empty: reproduced)."""
    problems = []
    if set(reference) != set(fresh):
        problems.append(f"metric keys differ: only committed {sorted(set(reference) - set(fresh))}, "
                        f"only fresh {sorted(set(fresh) - set(reference))}")
    for key in sorted(set(reference) & set(fresh)):
        ref, new = reference[key], fresh[key]
        if abs(ref["score"] - new["score"]) > SCORE_TOL:
            problems.append(f"{key}: score {new['score']:.4f} vs committed {ref['score']:.4f}")
        if abs(ref["tokens_per_forward"] - new["tokens_per_forward"]) > TPF_TOL:
            problems.append(f"{key}: tokens/forward {new['tokens_per_forward']:.3f} vs committed "
                            f"{ref['tokens_per_forward']:.3f}")
    return problems


def compare_gate(reference: dict, fresh: dict) -> list[str]:
    problems = []
    if reference["passed"] != fresh["passed"]:
        problems.append(f"gate passed={fresh['passed']} vs committed {reference['passed']}")
    ref_checks, new_checks = ({c["name"]: c["passed"] for c in d["checks"]} for d in (reference, fresh))
    if ref_checks != new_checks:
        problems.append(f"gate checks {new_checks} vs committed {ref_checks}")
    return problems


def test_tolerances_catch_a_changed_score_and_a_changed_decision():
    ref = {"mars/heldout/tau=1.0": {"score": 0.40, "tokens_per_forward": 1.0}}
    assert compare_eval(ref, {"mars/heldout/tau=1.0": {"score": 0.42, "tokens_per_forward": 1.04}}) == []
    assert compare_eval(ref, {"mars/heldout/tau=1.0": {"score": 0.44, "tokens_per_forward": 1.0}})
    assert compare_eval(ref, {"mars/heldout/tau=1.0": {"score": 0.40, "tokens_per_forward": 1.1}})
    assert compare_eval(ref, {"mars/heldout/tau=0.9": {"score": 0.40, "tokens_per_forward": 1.0}})
    gate = {"passed": True, "checks": [{"name": "heldout", "passed": True}, {"name": "average", "passed": True}]}
    assert compare_gate(gate, gate) == []
    assert compare_gate(gate, {"passed": True, "checks": [{"name": "heldout", "passed": True},
                                                          {"name": "average", "passed": False}]})


@pytest.mark.slow
def test_fresh_dvc_repro_reproduces_the_committed_metrics(tmp_path):
    reference_eval, reference_gate = _reference("eval.json"), _reference("gate.json")
    root = copy_project(tmp_path / "project")
    for generated in ("metrics", "dvc.lock"):  # what the run must produce by itself
        target = root / generated
        if target.is_dir():
            subprocess.run(["rm", "-rf", str(target)], check=True)
        elif target.exists():
            target.unlink()
    init_repo(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MARS_STORE", "AWS_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    repro = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env, capture_output=True,
                           text=True, timeout=1800)
    assert repro.returncode == 0, (repro.stdout + repro.stderr)[-6000:]
    fresh_eval = json.loads((root / "metrics/eval.json").read_text())
    fresh_gate = json.loads((root / "metrics/gate.json").read_text())
    problems = compare_eval(reference_eval, fresh_eval) + compare_gate(reference_gate, fresh_gate)
    assert not problems, "\n".join(problems)
