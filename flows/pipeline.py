"""The MARS pipeline as a Prefect flow: one task per DVC stage.

DVC decides what is stale and caches outputs; this flow adds what DVC lacks: a schedule, retries
where a retry can help (pull/push, promote), the stages' output streamed into the Prefect log as
it is printed, and a markdown artifact with the evaluation table and the gate decision.

Each stage task runs ``dvc repro --single-item STAGE`` in the project, in dvc.yaml order, so a
stage DVC finds up to date is skipped in about a second and a re-run after a failure resumes at the
failed stage. Tasks pass revisions (output md5s from dvc.lock, the git commit, the release URI),
never weights.

Overrides (``profile``, ``overrides=["train.lr=1e-4"]``) are applied to params.yaml for the run
with ``dvc exp run -S`` semantics and params.yaml is restored afterwards (see
:func:`flows.project.overridden_params`), so a run never leaves the user's knobs changed.

Releases: the pipeline's promote stage publishes to ``staging`` (what every ``dvc repro`` and
``dvc exp run`` does too). Only this flow's release step moves the production stage
(``flow.release_stage``, ``prod``), with ``mars promote --stage prod --by prefect:<flow run>``: the
gated checkpoint and export of this run, recorded with who and when. A run with overrides is an
experiment: it stops at staging unless ``promote=True`` is passed explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE as NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Failed

from flows import project, report
from mars.config import ConfigError, resolve, section


@dataclass
class FlowConfig:
    """The ``flow:`` section of params.yaml (read after overrides and the profile are applied)."""

    cron: str = "0 3 * * 1"
    timezone: str = "UTC"
    promote: bool = True
    release_stage: str | None = "prod"  # moved after the plan by `mars promote --stage ...`; null: no release step
    target: str = "promote"
    gate_stage: str = "gate"
    gate_metrics: str = "metrics/gate.json"
    eval_metrics: str = "metrics/eval.json"
    eval_report: str = "eval/report.md"
    pull: bool = True
    push: bool = True
    retry_stages: list[str] = field(default_factory=lambda: ["promote"])
    retries: int = 2
    retry_delay_s: float = 30.0
    progress_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if len(self.cron.split()) != 5:
            raise ConfigError(f"cron: expected 5 fields (min hour day month weekday), got {self.cron!r}")
        if self.retries < 0:
            raise ConfigError(f"retries: must be >= 0, got {self.retries}")
        if self.retry_delay_s < 0 or self.progress_interval_s < 0:
            raise ConfigError("retry_delay_s, progress_interval_s: must be >= 0")


def load_flow_config(root: Path) -> FlowConfig:
    return section(resolve(project.load_raw_params(root), source=str(root / project.PARAMS_FILE)), "flow", FlowConfig)


@task(cache_policy=NO_CACHE)
def run_stage(root: str, stage: str, progress_interval_s: float) -> dict[str, Any]:
    """``dvc repro --single-item STAGE``; returns what DVC did and the stage's output revisions."""
    logger = get_run_logger()
    result = project.stream(project.dvc_command("repro", "--single-item", stage), Path(root),
                            project.command_env(progress_interval_s), logger.info)
    if result.returncode != 0:
        raise project.StageFailed(stage, result.returncode, result.tail)
    return {"stage": stage, "outcome": project.stage_outcome(stage, result.tail),
            "outs": project.lock_record(Path(root), stage)}


@task(cache_policy=NO_CACHE)
def release(root: str, stage: str, by: str, progress_interval_s: float) -> str:
    """``mars promote --stage STAGE --by BY``: the explicit, recorded move of the production stage."""
    logger = get_run_logger()
    result = project.stream(project.mars_command("promote", "--stage", stage, "--by", by), Path(root),
                            project.command_env(progress_interval_s), logger.info)
    if result.returncode != 0:
        raise project.StageFailed(f"release to {stage}", result.returncode, result.tail)
    return result.tail[-1] if result.tail else ""


@task(cache_policy=NO_CACHE)
def transfer(root: str, direction: str, remote: str) -> str:
    """``dvc pull`` / ``dvc push`` against the default remote (network: worth retrying)."""
    logger = get_run_logger()
    extra = ["--allow-missing"] if direction == "pull" else []
    result = project.stream(project.dvc_command(direction, *extra), Path(root), project.command_env(10.0), logger.info)
    if result.returncode != 0:
        raise project.StageFailed(f"dvc {direction}", result.returncode, result.tail)
    return remote


def _publish_report(root: Path, cfg: FlowConfig, header: dict[str, Any]) -> dict | None:
    """The markdown artifact: run header, evaluation table, gate decision. Returns the gate record."""
    gate = report.read_json(root / cfg.gate_metrics)
    markdown = report.render(header, report.read_json(root / cfg.eval_metrics),
                             report.read_text(root / cfg.eval_report), gate)
    create_markdown_artifact(markdown=markdown, key="mars-pipeline-report",
                             description="MARS evaluation and promotion gate")
    return gate


@flow(name="mars-pipeline")
def mars_pipeline(profile: str | None = None, overrides: list[str] | None = None, promote: bool | None = None,
                  project_dir: str = "."):
    """Reproduce the DVC pipeline stage by stage; promote the release when the gate passes.

    profile: a profile of params.yaml (``profiles.NAME``); None keeps the file's own.
    overrides: ``section.key=value`` changes, as ``dvc exp run -S`` takes them, for this run only.
    promote: run the promote stage, then the release to ``flow.release_stage`` (None: ``flow.promote``
        from params.yaml, and no release when there are overrides: an experiment stops at staging).
    project_dir: the DVC project (the worker's working directory by default).
    """
    logger = get_run_logger()
    root = project.find_root(project_dir)
    changes = ([f"profile={profile}"] if profile else []) + list(overrides or [])
    with project.overridden_params(root, changes):
        cfg = load_flow_config(root)
        releasing = bool(cfg.release_stage) and (promote if promote is not None else cfg.promote and not changes)
        promote = cfg.promote if promote is None else promote
        plan = project.stage_plan(root, cfg.target, include_target=promote)
        remote = project.default_remote(root)
        header = {"project": str(root), "revision": project.git_revision(root), "overrides": changes,
                  "remote": remote, "stages": plan}
        logger.info("plan: %s", " -> ".join(plan))
        retrying = dict(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_s)
        if remote and cfg.pull:
            transfer.with_options(name="dvc-pull", **retrying)(str(root), "pull", remote)
        stages: dict[str, dict] = {}
        for stage in plan:
            options = retrying if stage in cfg.retry_stages else {}
            state = run_stage.with_options(task_run_name=f"stage-{stage}", **options)(
                str(root), stage, cfg.progress_interval_s, return_state=True)
            if state.is_failed() and stage == cfg.gate_stage:
                gate = _publish_report(root, cfg, header | {"result": stages})
                if gate is not None:  # the gate decided; a crash without a decision stays a stage failure
                    return Failed(name="GateRejected",
                                  message=f"gate rejected the release: {report.gate_summary(gate)}; "
                                          f"not promoted ({cfg.gate_metrics})")
            stages[stage] = state.result()  # raises the stage's error: nothing downstream runs
        released = None
        if releasing and cfg.target in stages:
            by = f"prefect:{flow_run.get_name() or flow_run.get_id()}"
            released = release.with_options(task_run_name=f"release-{cfg.release_stage}", **retrying)(
                str(root), cfg.release_stage, by, cfg.progress_interval_s)
        if remote and cfg.push:
            transfer.with_options(name="dvc-push", **retrying)(str(root), "push", remote)
        gate = _publish_report(root, cfg, header | {"result": stages, "released": released})
    return {**header, "stages": stages, "gate": gate, "promoted": promote and cfg.target in stages,
            "released": released}

