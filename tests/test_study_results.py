"""flows/results.py: a study's collection into results/<profile>/ replaces what the study writes, nothing else."""

from __future__ import annotations

import json

from flows import results


def test_collect_replaces_only_the_study_paths(tmp_path):
    clone, out = tmp_path / "clone", tmp_path / "results" / "smollm2"
    for path, text in {"metrics/eval.json": "{}", "eval/report.md": "new report", "eval/figures/a.png": "png",
                       "dvc.lock": "lock", "params.yaml": "profile: smollm2"}.items():
        (clone / path).parent.mkdir(parents=True, exist_ok=True)
        (clone / path).write_text(text)
    # the previous study's copy, and files other commands wrote beside it
    kept = {"README.md": "the study page", "bench_serve_bf16.txt": "# load benchmark", "extra/notes.md": "notes"}
    stale = {"metrics/old.json": "{}", "report.md": "old report", "figures/old.png": "png",
             "data_stats.json": "{}", "params.resolved.json": "{}"}
    for path, text in {**kept, **stale}.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)

    record = results.collect(clone, out, profile="smollm2", command="infra/study.sh smollm2", status=0)

    for path, text in kept.items():
        assert (out / path).read_text() == text
    assert sorted(p.name for p in (out / "metrics").iterdir()) == ["eval.json"]
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["a.png"]
    assert (out / "report.md").read_text() == "new report"
    # what this run did not produce is not left over from the last one: command.json lists it as missing
    assert not (out / "data_stats.json").exists() and "data/prepared/stats.json" in record["missing"]
    assert json.loads((out / "command.json").read_text())["copied"] == record["copied"]
    assert {"metrics", "report.md", "figures", "dvc.lock", "params.yaml"} <= set(record["copied"])


def test_a_study_that_reached_its_gate_gets_its_headline(tmp_path):
    from test_gate import GateConfig, Outcomes, loses

    clone, out = tmp_path / "clone", tmp_path / "results" / "smollm2"
    cand, base = loses(300, lost=30, won=12, right=100)
    o = Outcomes().add("mars", "reasoning", cand).add("ar_control", "reasoning", base)
    o.add("mars", "reasoning", cand[:64], tau=0.9, tokens_per_forward=1.5).add("mars", "reasoning", cand, tau=None,
                                                                              tokens_per_forward=1.8)
    decision = o.decide(GateConfig(speed_tau=0.9, max_score_drop=0.05, tolerance=0.0))
    (clone / "metrics").mkdir(parents=True)
    (clone / "metrics" / "eval.json").write_text(json.dumps(o.metrics))
    (clone / "metrics" / "gate.json").write_text(json.dumps(decision))

    record = results.collect(clone, out, profile="smollm2", command="infra/study.sh smollm2", status=1)

    summary = (out / "summary.md").read_text()
    assert "summary.md" in record["copied"] and "Gate **FAILED**: 2 test(s)" in summary
    assert "| reasoning | ar_control | 300 | 43.3 | 37.3 | -6.0 +- " in summary  # 112 vs 130 items right
    assert "| reasoning | lossless | 37.3 | 1.80 | 300 |" in summary and "| reasoning | 0.9 |" in summary
    (clone / "metrics" / "gate.json").unlink()  # a run stopped before its gate: no headline, none left over
    results.collect(clone, out, profile="smollm2", command="infra/study.sh smollm2", status=1)
    assert not (out / "summary.md").exists()


def test_a_study_without_dvc_stops_before_it_touches_anything(tmp_path):
    # it once ran on, failed at `dvc exp run`, and its collection replaced the last results with nothing
    import shutil
    import subprocess
    from pathlib import Path

    repo = tmp_path / "project"
    (repo / "infra").mkdir(parents=True)
    shutil.copy2(Path(__file__).resolve().parents[1] / "infra" / "study.sh", repo / "infra" / "study.sh")
    (repo / "results" / "smollm2").mkdir(parents=True)
    (repo / "results" / "smollm2" / "report.md").write_text("the last study's report")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    run = subprocess.run(["bash", "infra/study.sh", "smollm2"], cwd=repo, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 127 and "dvc not found: run `make install`" in run.stderr
    assert (repo / "results" / "smollm2" / "report.md").read_text() == "the last study's report"
    assert not (repo / "build").exists()
