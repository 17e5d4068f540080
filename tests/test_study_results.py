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


def test_a_resumed_study_sums_the_wall_clock_of_its_invocations(tmp_path):
    clone, out = tmp_path / "clone", tmp_path / "results" / "smollm2"
    clone.mkdir()
    now = __import__("time").time()
    first = results.collect(clone, out, profile="smollm2", command="infra/study.sh smollm2", status=1,
                            started=now - 3600)  # cut off after an hour
    second = results.collect(clone, out, profile="smollm2", command="infra/study.sh smollm2", status=0,
                             started=now - 1800)  # resumed: half an hour more
    assert first["hours"] == 1.0 and len(first["runs"]) == 1
    assert [r["exit_status"] for r in second["runs"]] == [1, 0] and 1.49 <= second["hours"] <= 1.51
    assert json.loads((out / "command.json").read_text())["hours"] == second["hours"]
    assert "runs" not in results.collect(clone, out, profile="smollm2", command="c", status=0)  # no start: no time


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


def _fake_tools(bin_dir, params_status: int = 0):
    """Stand-ins for dvc and mars that record their arguments: what the script asks of them is under test."""
    bin_dir.mkdir()
    for tool, status in (("dvc", 0), ("mars", params_status)):
        script = bin_dir / tool
        where = '[ "$*" = "cache dir" ] && echo "$PWD/.dvc/cache"\n' if tool == "dvc" else ""
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> "$CALLS"\n{where}exit {status}\n')
        script.chmod(0o755)


def _project(tmp_path):
    import shutil
    import subprocess
    from pathlib import Path

    repo = tmp_path / "project"
    (repo / "infra").mkdir(parents=True)
    shutil.copy2(Path(__file__).resolve().parents[1] / "infra" / "study.sh", repo / "infra" / "study.sh")
    (repo / "params.yaml").write_text("profile: default\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], cwd=repo, check=True)
    return repo


def _study(repo, tmp_path, *args):
    import subprocess

    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "CALLS": str(tmp_path / "calls")}
    return subprocess.run(["bash", "infra/study.sh", *args], cwd=repo, capture_output=True, text=True, env=env)


def test_a_variant_starts_from_the_profiles_study_and_reuses_its_outputs(tmp_path):
    repo = _project(tmp_path)
    _fake_tools(tmp_path / "bin")
    seed = repo / "build" / "study-smollm2"
    for path in ("models/base/model.safetensors", "data/distilled/train.jsonl", "data/distill_work/shard-0.jsonl",
                 "data/prepared/train.jsonl", "checkpoints/mars/final/model.safetensors",
                 "checkpoints/mars/steps/step-00000010/model.safetensors", "eval_work/sft/gsm/tau=1.0.json"):
        (seed / path).parent.mkdir(parents=True, exist_ok=True)
        (seed / path).write_text(path)
    (seed / "dvc.lock").write_text("schema: '2.0'\n")
    run = _study(repo, tmp_path, "smollm2", "e1", "-S", "profiles.smollm2.train.mars.epochs=1")
    work = repo / "build" / "study-e1"
    assert "starting from" in run.stdout and (work / "dvc.lock").read_text() == "schema: '2.0'\n"
    for path in ("models/base/model.safetensors", "data/distilled/train.jsonl", "data/distill_work/shard-0.jsonl",
                 "data/prepared/train.jsonl", "checkpoints/mars/final/model.safetensors", "eval_work/sft/gsm/tau=1.0.json"):
        assert (work / path).read_text() == path  # the pool, what was built on it, the finished decodings
    assert not (work / "checkpoints" / "mars" / "steps").exists()  # a changed run starts over, not from its steps
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["mars params -S profile=smollm2 -S profiles.smollm2.train.mars.epochs=1",
                     "dvc cache dir", f"dvc cache dir --local {seed}/.dvc/cache",  # the profile study's cache
                     "dvc exp run -S profile=smollm2 -S profiles.smollm2.train.mars.epochs=1"]


def test_a_variant_may_start_from_another_variants_study(tmp_path):
    repo = _project(tmp_path)
    _fake_tools(tmp_path / "bin")
    pool = repo / "build" / "study-pool"
    (pool / "data" / "distilled").mkdir(parents=True)
    (pool / "data" / "distilled" / "train.jsonl").write_text("the bigger pool")
    (pool / "dvc.lock").write_text("schema: '2.0'\n")
    run = _study(repo, tmp_path, "smollm2", "pool-b8", "--from", "pool", "-S", "profiles.smollm2.train.mars.block_size=8")
    assert run.returncode == 0 and f"starting from {pool}'s dvc.lock" in run.stdout
    assert (repo / "build" / "study-pool-b8" / "data" / "distilled" / "train.jsonl").read_text() == "the bigger pool"
    assert (tmp_path / "calls").read_text().splitlines()[-1] == \
        "dvc exp run -S profile=smollm2 -S profiles.smollm2.train.mars.block_size=8"
    missing = _study(repo, tmp_path, "smollm2", "other", "--from", "nothing", "-S", "seed=1")
    assert missing.returncode == 2 and "--from nothing: " in missing.stderr and "has no dvc.lock" in missing.stderr
    assert not (repo / "build" / "study-other").exists()
    for args, says in ((("smollm2", "--from", "pool"), "NAME comes before the options"),
                       (("smollm2", "smollm2", "--from", "pool"), "the profile's own study starts from nothing")):
        refused = _study(repo, tmp_path, *args)
        assert refused.returncode == 2 and says in refused.stderr, args


def test_an_override_the_profile_would_replace_stops_the_study_before_it_clones(tmp_path):
    repo = _project(tmp_path)
    _fake_tools(tmp_path / "bin", params_status=2)  # mars params refuses the override (tests/test_config.py)
    run = _study(repo, tmp_path, "smollm2", "e1", "-S", "train.mars.epochs=1")
    assert run.returncode == 2 and not (repo / "build").exists()
    assert (tmp_path / "calls").read_text().splitlines() == ["mars params -S profile=smollm2 -S train.mars.epochs=1"]


def test_a_resumed_study_applies_its_overrides_to_the_committed_params_again(tmp_path):
    """dvc exp run leaves the overrides in the clone's params.yaml, where a second `+KEY=VALUE` is refused."""
    repo = _project(tmp_path)
    _fake_tools(tmp_path / "bin")
    dvc = tmp_path / "bin" / "dvc"  # a run that writes its override into params.yaml, as dvc exp run does
    dvc.write_text('#!/bin/sh\necho "dvc $* with $(cat params.yaml | tr \'\\n\' \' \')" >> "$CALLS"\n'
                   'echo "added: 1" >> params.yaml\n')
    for _ in range(2):
        assert _study(repo, tmp_path, "smollm2", "pool", "-S", "+added=1").returncode == 0
    runs = [call for call in (tmp_path / "calls").read_text().splitlines() if call.startswith("dvc exp run")]
    assert runs == ["dvc exp run -S profile=smollm2 -S +added=1 with profile: default "] * 2
