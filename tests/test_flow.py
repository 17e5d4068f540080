"""The Prefect flow against a real local Prefect server and the real `dvc`.

Fast tests drive a small DVC project whose stages are `mars --version` and short Python scripts (gate and
promote included), so every path of the flow (order, streamed logs, failure, gate rejection, retry,
resume, params restore, artifact) runs in seconds. The slow test runs the real tiny pipeline once,
with the artifact store and the DVC remote on SeaweedFS, and checks promotion, the no-op re-run,
the deployment from prefect.yaml, gate rejection and resume after a failed stage on that one run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from project_copy import copy_project, init_repo

REPO = Path(__file__).resolve().parents[1]
MARS = [sys.executable, "-m", "mars.cli"]  # this interpreter's mars, whether or not its bin is on PATH


# ------------------------------------------------------------------ Prefect server + flow helpers
@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A temporary Prefect server (SQLite under a temp PREFECT_HOME) for this module's flow runs."""
    home = tmp_path_factory.mktemp("prefect-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(home))
        mp.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        mp.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        mp.delenv("PREFECT_API_URL", raising=False)
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            yield


def run_flow(**kwargs):
    from flows.pipeline import mars_pipeline

    return mars_pipeline(**kwargs, return_state=True)


def run_id(state):
    return state.state_details.flow_run_id


def flow_logs(state) -> list[str]:
    """Every log message of the flow run and its tasks, in order, as the server stored them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id(state)])),
                                    limit=200, offset=len(messages), sort=LogSort.TIMESTAMP_ASC)
            messages += [log.message for log in page]
            if len(page) < 200:
                return messages


def task_states(state) -> dict[str, list[str]]:
    """Task run name -> state names of its runs (a retried task shows its retries in one run)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id(state)])))
        out: dict[str, list[str]] = {}
        for run in runs:
            out.setdefault(run.name, []).append(run.state.name)
            out[run.name + "#attempts"] = [str(run.run_count)]
        return out


def artifact(state) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id(state)])))
    (md,) = [a for a in found if a.key == "mars-pipeline-report"]
    return md.data


# --------------------------------------------------------------------------- the small project
TOY_PARAMS = """\
profile: tiny
seed: 0
toy:
  score: 0.7       # what the evaluation "measures"
  threshold: 0.5   # the gate's bar
flow:
  retry_delay_s: 0
  progress_interval_s: 0
profiles:
  tiny: {}
"""

# What `mars evaluate` writes (metrics/eval.json and the per-item outputs under eval/), through
# tests/gate_evidence.py (copied into the project): the candidate scores toy.score on every item, the baseline 1.0.
TOY_EVAL = """\
import sys
from mars.config import load_params
from gate_evidence import write_evaluation
toy = load_params("params.yaml")["toy"]
if not isinstance(toy["score"], (int, float)):
    sys.exit(f"toy_eval: error: toy.score must be a number, got {toy['score']!r}")
print(f"evaluated: score={toy['score']}", flush=True)
write_evaluation("metrics/eval.json", "eval", "checkpoints/mars/final", [float(toy["score"])] * 10, [1.0] * 10,
                 benchmark="toy")
"""

# The real gate on that evaluation, as `mars gate --export` runs it: the decision names what it judged and
# the evidence it read, so that the flow's release step (a real `mars promote --stage prod`) derives it again
# and accepts it. The toy's bar: the candidate may trail the baseline's 1.0 by 1 - threshold, so it passes
# where score >= threshold and fails otherwise (every item moves by the same amount: no noise).
TOY_GATE = """\
import sys
from mars.config import load_params
from mars.evaluation.gate import run_gate
from gate_evidence import config
toy = load_params("params.yaml")["toy"]
decision = run_gate("metrics/eval.json", "metrics/gate.json", config(tolerance=1.0 - toy["threshold"]),
                    eval_dir="eval", export="exports/mars")
print("gate passed" if decision["passed"] else "gate FAILED", flush=True)
sys.exit(0 if decision["passed"] else 1)
"""

# Fails on its first attempt in a project (a flaky network upload), succeeds after: retries must absorb it.
TOY_PROMOTE = """\
import shutil, sys
from pathlib import Path
attempts = Path("promote_attempts")
n = int(attempts.read_text()) + 1 if attempts.exists() else 1
attempts.write_text(str(n))
if n == 1:
    sys.exit("promote: error: store unreachable (attempt 1)")
Path("store").mkdir(exist_ok=True)
shutil.copy("metrics/gate.json", "store/release.json")
print(f"promoted on attempt {n}", flush=True)
"""

TOY_DVC = """\
stages:
  base:
    cmd: mars --version > base.json && echo 'base - wrote base.json'
    params: [profile, "profiles.${profile}", seed]
    outs: [base.json]
  evaluate:
    cmd: python toy_eval.py
    deps: [base.json, toy_eval.py, gate_evidence.py, checkpoints/mars/final]
    params: [profile, "profiles.${profile}", toy.score]
    metrics: [metrics/eval.json: {cache: false}]
    outs: [eval]
  gate:
    cmd: python toy_gate.py
    deps: [metrics/eval.json, eval, toy_gate.py, gate_evidence.py, exports/mars]
    params: [toy.threshold]
    metrics: [metrics/gate.json: {cache: false}]
  promote:
    cmd: python toy_promote.py
    deps: [metrics/gate.json, base.json, toy_promote.py]
    outs: [store/release.json]
"""


@pytest.fixture
def toy(tmp_path) -> Path:
    from test_release import make_inputs

    root = tmp_path / "toy"
    root.mkdir()
    for name, text in {"params.yaml": TOY_PARAMS, "dvc.yaml": TOY_DVC, "toy_eval.py": TOY_EVAL,
                       "toy_gate.py": TOY_GATE, "toy_promote.py": TOY_PROMOTE,
                       "gate_evidence.py": (Path(__file__).parent / "gate_evidence.py").read_text()}.items():
        (root / name).write_text(text)
    stand_in = make_inputs(tmp_path / "stand_in", "toy")  # what `mars promote` ships: a fake checkpoint + export
    for kind, dest in (("checkpoint", "checkpoints/mars/final"), ("export", "exports/mars")):
        (root / dest).parent.mkdir(parents=True)
        stand_in[kind].rename(root / dest)
    init_repo(root)
    return root


def prod_pointer(toy: Path) -> dict | None:
    path = toy / "store" / "stages" / "mars" / "prod.json"
    return json.loads(path.read_text()) if path.exists() else None


# ------------------------------------------------------------------------------- fast tests
def test_flow_runs_every_stage_in_order_streams_logs_and_publishes_report(prefect_server, toy):
    params_before = (toy / "params.yaml").read_bytes()
    state = run_flow(project_dir=str(toy), overrides=["toy.score=0.9"])
    assert state.is_completed(), state.message
    result = state.result()
    assert list(result["stages"]) == ["base", "evaluate", "gate", "promote"]
    assert {s["outcome"] for s in result["stages"].values()} == {"ran"}
    assert result["promoted"] and result["gate"]["passed"]
    assert result["overrides"] == ["toy.score=0.9"]
    # a run with overrides is an experiment: it publishes (the promote stage) but does not release to prod
    assert result["released"] is None and prod_pointer(toy) is None and "release-prod" not in task_states(state)
    # revisions, not data: the md5 dvc.lock recorded for each output
    lock = yaml.safe_load((toy / "dvc.lock").read_text())["stages"]
    assert result["stages"]["base"]["outs"] == {"base.json": lock["base"]["outs"][0]["md5"]}
    # the stages saw the override, the user's params.yaml is back byte for byte
    assert json.loads((toy / "metrics/eval.json").read_text())["mars/toy/tau=1.0"]["score"] == 0.9
    assert (toy / "params.yaml").read_bytes() == params_before
    assert not (toy / ".dvc/tmp/flow/params.yaml.orig").exists()

    logs = flow_logs(state)
    for line in ("base - wrote base.json", "evaluated: score=0.9", "gate passed", "promoted on attempt 2"):
        assert line in logs, f"stage output {line!r} not streamed into the flow's logs"
    assert "promote: error: store unreachable (attempt 1)" in logs  # the failed first attempt is visible too
    tasks = task_states(state)
    assert tasks["stage-promote"] == ["Completed"] and tasks["stage-promote#attempts"] == ["2"], tasks
    assert tasks["stage-base#attempts"] == ["1"]

    report = artifact(state)
    assert "gate PASSED" in report and "| mars/toy/tau=1.0.score | 0.9 |" in report

    again = run_flow(project_dir=str(toy), overrides=["toy.score=0.9"])
    assert again.is_completed()
    assert {s["outcome"] for s in again.result()["stages"].values()} == {"unchanged"}


def test_only_the_flows_release_step_moves_prod_and_it_records_the_run(prefect_server, toy):
    state = run_flow(project_dir=str(toy))
    assert state.is_completed(), state.message
    result = state.result()
    pointer = prod_pointer(toy)
    assert pointer is not None and pointer["version"] == "v1" and pointer["action"] == "promote"
    assert pointer["moved_by"].startswith("prefect:")  # the flow run that released it
    assert "promoted mars v1 -> prod" in result["released"]
    assert task_states(state)["release-prod"] == ["Completed"]
    assert "release: promoted mars v1 -> prod" in artifact(state)
    # the same gated artifacts released again by the flow only when asked: promote=False releases nothing
    held = run_flow(project_dir=str(toy), promote=False)
    assert held.is_completed() and held.result()["released"] is None and prod_pointer(toy)["version"] == "v1"
    # a rejected gate releases nothing: prod stays on the last release
    rejected = run_flow(project_dir=str(toy), overrides=["toy.score=0.1"])
    assert rejected.name == "GateRejected" and prod_pointer(toy)["version"] == "v1"


def test_failed_stage_stops_the_flow_with_its_error_and_a_rerun_resumes_there(prefect_server, toy):
    first = run_flow(project_dir=str(toy), promote=False)
    assert first.is_completed(), first.message
    assert list(first.result()["stages"]) == ["base", "evaluate", "gate"]  # promote=False stops at the gate

    failed = run_flow(project_dir=str(toy), overrides=["toy.score=high"])
    assert failed.is_failed()
    assert "stage 'evaluate' failed" in failed.message
    assert "toy_eval: error: toy.score must be a number, got 'high'" in failed.message
    assert "toy_eval: error: toy.score must be a number, got 'high'" in flow_logs(failed)
    tasks = task_states(failed)
    assert tasks["stage-evaluate"] == ["Failed"] and tasks["stage-base"] == ["Completed"]
    assert "stage-gate" not in tasks and "stage-promote" not in tasks  # nothing downstream ran
    assert b"score: 0.7" in (toy / "params.yaml").read_bytes()  # restored after the failure as well

    fixed = run_flow(project_dir=str(toy))
    assert fixed.is_completed(), fixed.message
    outcomes = {k: v["outcome"] for k, v in fixed.result()["stages"].items()}
    assert outcomes["base"] == "unchanged"  # resumed at the failed stage
    assert outcomes["evaluate"] in {"ran", "restored"}


def test_rejected_gate_ends_the_run_before_promote_with_a_clear_state(prefect_server, toy):
    state = run_flow(project_dir=str(toy), overrides=["toy.score=0.1"])
    assert state.is_failed() and state.name == "GateRejected"
    rejected = "toy: mars is worse than ar_control by 0.9000 +- 0.0000 (n 10, tolerance 0.5)"
    assert "gate rejected the release" in state.message and rejected in state.message
    tasks = task_states(state)
    assert tasks["stage-gate"] == ["Failed"] and "stage-promote" not in tasks
    assert not (toy / "store" / "release.json").exists()
    report = artifact(state)
    assert "gate REJECTED" in report and rejected in report


def test_invalid_override_fails_before_any_stage(prefect_server, toy):
    state = run_flow(project_dir=str(toy), overrides=["toy.scroe=1"])
    assert state.is_failed()
    assert "toy.scroe" in state.message
    assert task_states(state) == {}
    assert (toy / "params.yaml").read_text() == TOY_PARAMS


# ---------------------------------------------------------------- the real pipeline, end to end
# Small enough for a couple of minutes on 2 loaded cores, big enough that every stage does real work.
FAST = [
    "data.n_train=256", "data.n_heldout=32", "model.tiny.tokenizer_corpus=1000",
    "train.sft.epochs=null", "train.sft.max_steps=12", "train.mars.epochs=null", "train.mars.max_steps=12",
    "train.save_every=5", "evaluate.taus=[1.0,0.9]", "evaluate.benchmarks.heldout.n=8",
    "evaluate.benchmarks.heldout.max_new_tokens=16", "export.latency_iters=2",
    "gate.min_baseline_score=0.0",  # 12 steps score ~0: judged anyway (the real gate would say it cannot judge)
]


def run_script(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout the whole group (server, worker) is stopped."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"{cmd[0]} did not finish in {timeout} s:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.fixture(scope="module")
def pipeline_run(prefect_server, tmp_path_factory):
    """The tiny pipeline reproduced once through the flow, store and DVC remote on SeaweedFS."""
    from dvc.utils.hydra import apply_overrides
    from s3_server import launch

    server = launch(tmp_path_factory.mktemp("seaweedfs"))
    root = copy_project(tmp_path_factory.mktemp("project"))
    bucket = server.make_bucket()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        for name, value in server.env().items():
            mp.setenv(name, value)
        mp.setenv("MARS_STORE_URI", f"s3://{bucket}/store")
        mp.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        apply_overrides(str(root / "params.yaml"), FAST)  # the project's own settings: a plain `dvc repro` agrees
        init_repo(root)
        subprocess.run(MARS + ["store", "configure-dvc", "--repo", str(root)], cwd=root, check=True)
        started = time.perf_counter()
        state = run_flow(project_dir=str(root))
        seconds = time.perf_counter() - started
        try:
            yield {"root": root, "state": state, "seconds": seconds, "bucket": bucket, "server": server}
        finally:
            server.stop()


@pytest.mark.slow
@pytest.mark.s3
def test_tiny_pipeline_end_to_end_through_the_flow(pipeline_run, tmp_path):
    root, state = pipeline_run["root"], pipeline_run["state"]
    assert state.is_completed(), f"{state.name}: {state.message}\n" + "\n".join(flow_logs(state)[-60:])
    result = state.result()
    assert list(result["stages"]) == ["base", "distill", "prepare", "sft", "mars", "ar_control", "evaluate",
                                      "export", "gate", "promote"]
    assert result["gate"]["passed"] and result["promoted"]
    assert "-> prod" in result["released"]  # the flow's release step, not the promote stage (staging)
    assert result["remote"] == "store"
    print(f"tiny pipeline through the flow: {pipeline_run['seconds']:.0f} s")

    # the release is in the S3 store: a downstream service pulls it by name and stage
    dest = tmp_path / "release"
    subprocess.run(MARS + ["pull", "mars", "--stage", "prod", "--to", str(dest)], cwd=root, check=True)
    assert (dest / "release.json").is_file() or any(dest.iterdir())
    # cached outputs went to the DVC remote on the same server
    keys = pipeline_run["server"].client().list_objects_v2(Bucket=pipeline_run["bucket"], Prefix="store/dvc/")
    assert keys.get("KeyCount", 0) > 0
    report = artifact(state)
    assert "gate PASSED" in report and "## Evaluation" in report

    # nothing changed: a plain `dvc repro` runs no stage, quickly
    started = time.perf_counter()
    repro = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    assert repro.returncode == 0, repro.stdout + repro.stderr
    assert "Running stage" not in repro.stdout and "Data and pipelines are up to date" in repro.stdout
    assert seconds < 15, f"no-op dvc repro took {seconds:.1f} s"
    print(f"no-op dvc repro: {seconds:.1f} s")

    # a B change retrains mars and ar_control (and what follows) but not sft: the stages list their keys
    from flows.project import overridden_params

    with overridden_params(root, ["train.mars.block_size=8"]):
        status = json.loads(subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root,
                                           check=True, capture_output=True, text=True).stdout)
    assert {"mars", "ar_control"} <= set(status) and not {"base", "prepare", "sft"} & set(status)

    # the deployment from prefect.yaml runs when triggered, with a process worker
    smoke = run_script([str(REPO / "infra/prefect/deploy_smoke.sh"), str(root)], timeout=900)
    assert smoke.returncode == 0, smoke.stdout[-6000:]
    assert "Flow run finished successfully in 'Completed'" in smoke.stdout

    # a bad param fails its stage with the stage's own message; a re-run resumes at that stage
    failed = run_flow(project_dir=str(root), overrides=["export.opset=7"])
    assert failed.is_failed() and "stage 'export' failed" in failed.message
    assert "opset: the dynamo exporter needs opset >= 18, got 7" in failed.message
    assert any("opset >= 18, got 7" in line for line in flow_logs(failed))
    assert {"stage-gate", "stage-promote"}.isdisjoint(task_states(failed))
    resumed = run_flow(project_dir=str(root))
    assert resumed.is_completed(), resumed.message
    outcomes = {k: v["outcome"] for k, v in resumed.result()["stages"].items()}
    # DVC removed export's output before the command failed; the resumed flow's `dvc pull` brings it back
    # from the remote, so nothing before the release has to run (a rejected gate: the toy project's tests)
    assert all(outcomes[s] == "unchanged" for s in ("base", "prepare", "sft", "mars", "ar_control", "evaluate",
                                                    "export", "gate"))
    assert resumed.result()["gate"]["passed"]
