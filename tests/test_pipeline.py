"""dvc.yaml, params.yaml and prefect.yaml as a specification: what each stage runs, reads and writes.

These read the files and ask the real `dvc` about them; the end-to-end run is in test_flow.py.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows import project
from flows.pipeline import FlowConfig, load_flow_config
from mars.cli import VERBS
from mars.config import ConfigError, build, resolve

REPO = Path(__file__).resolve().parents[1]
ORDER = ["base", "distill", "prepare", "sft", "mars", "ar_control", "evaluate", "export", "gate", "promote"]
TRAINING = {"sft": "sft", "mars": "mars", "ar_control": "ar_control"}


@pytest.fixture(scope="module")
def dvc_yaml() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())


@pytest.fixture(scope="module")
def params() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def lookup(params: dict, dotted: str):
    node = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def stage_params(stage: dict, profile: str) -> list[str]:
    return [p.replace("${profile}", profile) for p in stage.get("params", [])]


def dep_paths(stage: dict) -> set[str]:
    return set(stage.get("deps", []))


def test_stages_are_the_pipeline_in_order(dvc_yaml):
    assert list(dvc_yaml["stages"]) == ORDER
    listed = subprocess.run([sys.executable, "-m", "dvc", "stage", "list", "--name-only"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.split()
    assert listed == ORDER  # dvc itself accepts the file, templated params included


def test_flow_plan_follows_dvc_graph_and_leaves_the_sweep_out():
    plan = project.stage_plan(REPO, "promote")
    assert plan == ORDER
    assert project.stage_plan(REPO, "promote", include_target=False) == ORDER[:-1]
    everything = subprocess.run([sys.executable, "-m", "dvc", "stage", "list", "--all", "--name-only"], cwd=REPO,
                                check=True, capture_output=True, text=True).stdout.split()
    sweep = [s for s in everything if s.startswith("sweep/dvc.yaml:")]
    # B in {4, 8, 16} x w_ar in {1, 0}: a training and an evaluation each, none of them in the default plan
    assert len(sweep) == 12 and not set(sweep) & set(plan)


def library_modules_of(cli_module: str) -> set[str]:
    """The files of the library modules a verb's CLI module imports (mars.cli, config and errors are plumbing)."""
    tree = ast.parse((REPO / (cli_module.replace(".", "/") + ".py")).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
              for a in n.names}  # `from mars.training import base`
    files = {name.replace(".", "/") + ".py" for name in names if name.startswith("mars.")}
    plumbing = {"mars/config.py", "mars/errors.py"}
    return {f for f in files if (REPO / f).is_file() and not f.startswith("mars/cli/") and f not in plumbing}


def test_every_stage_is_one_mars_verb_depending_on_the_code_it_runs(dvc_yaml):
    for name, stage in dvc_yaml["stages"].items():
        words = stage["cmd"].split()
        assert words[0] == "mars" and words[1] in VERBS, f"{name}: {stage['cmd']!r} is not a `mars VERB` call"
        modules = library_modules_of(VERBS[words[1]][0])
        assert modules, f"{name}: mars {words[1]} runs no library module"
        assert modules <= dep_paths(stage), f"{name}: its code {sorted(modules - dep_paths(stage))} is not a dependency"


def test_each_stage_reads_data_produced_upstream(dvc_yaml):
    outs = {}
    for name, stage in dvc_yaml["stages"].items():
        for out in stage.get("outs", []) + stage.get("metrics", []) + stage.get("plots", []):
            outs[next(iter(out)) if isinstance(out, dict) else out] = name
    for name, stage in dvc_yaml["stages"].items():
        for dep in dep_paths(stage):
            # a dependency is code, a stage's output, or data committed with the code (the prompt sets)
            committed = subprocess.run(["git", "ls-files", "--", dep], cwd=REPO,
                                       capture_output=True, text=True).stdout.strip()
            if not dep.startswith("mars/") and not committed:
                assert dep in outs, f"{name}: depends on {dep}, which no stage writes and git does not hold"
        for path in re.findall(r"--(?:init|data|base|checkpoint|export|gate|metrics) (?:\w+=)?(\S+)", stage["cmd"]):
            if path in outs and outs[path] != name:
                assert path in dep_paths(stage), f"{name}: reads {path} without depending on it"


@pytest.mark.parametrize("profile", ["tiny", "smollm2", "qwen2_5_0_5b", "qwen2_5_7b"])
def test_listed_params_exist_for_every_profile(dvc_yaml, params, profile):
    for name, stage in dvc_yaml["stages"].items():
        for key in stage_params(stage, profile):
            lookup(params, key)  # KeyError names the key (a profile names every tracked section, {} at least)


def test_a_stage_tracks_the_profiles_copy_of_each_section_it_reads_and_no_more(dvc_yaml, params):
    """So a variant overriding one section of the profile reruns the stages that read it, and a profile
    cannot set a section no stage would see change."""
    tracked = set()
    for name, stage in dvc_yaml["stages"].items():
        listed = stage.get("params", [])
        sections = {k.split(".")[0] for k in listed if not k.startswith("profiles") and k not in ("profile", "seed")}
        own = {k.split(".")[2] for k in listed if k.startswith("profiles.${profile}.")}
        assert "profile" in listed and "profiles.${profile}" not in listed, name  # the whole profile: every stage
        assert own == sections, f"{name}: reads {sorted(sections)}, tracks the profile's {sorted(own)}"
        tracked |= own
    for profile, sections in params["profiles"].items():
        assert set(sections) == tracked, f"profiles.{profile}: {sorted(set(sections) ^ tracked)}"


def test_training_stages_track_every_shared_train_key(dvc_yaml, params):
    shared = {f"train.{k}" for k in params["train"] if k not in TRAINING.values()}
    for name in TRAINING:
        listed = set(dvc_yaml["stages"][name]["params"])
        assert shared <= listed, f"{name}: does not track {sorted(shared - listed)}"
        assert f"train.{name}" in listed
        assert "seed" in listed and "profile" in listed and "profiles.${profile}.train" in listed
    assert "train.mars" not in dvc_yaml["stages"]["sft"]["params"]  # a B change reuses the SFT checkpoint


def test_checkpoints_persist_steps_and_cache_final_models(dvc_yaml):
    for name in TRAINING:
        outs = dvc_yaml["stages"][name]["outs"]
        assert f"checkpoints/{name}/final" in outs
        (steps,) = [o for o in outs if isinstance(o, dict)]
        assert steps == {f"checkpoints/{name}/steps": {"persist": True, "cache": False}}


def test_metrics_and_plots_are_declared(dvc_yaml):
    stages = dvc_yaml["stages"]
    assert stages["evaluate"]["metrics"] == [{"metrics/eval.json": {"cache": False}}]
    assert stages["gate"]["metrics"] == [{"metrics/gate.json": {"cache": False}}]
    for name in TRAINING:
        (plot,) = stages[name]["plots"]
        # persist: `dvc repro` must not delete the rows a resumed run continues from
        assert plot[f"metrics/train_{name}.tsv"]["cache"] is False and plot[f"metrics/train_{name}.tsv"]["persist"]
        assert stages[name]["metrics"] == [{f"metrics/train_{name}.json": {"cache": False}}]
    shows = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=REPO,
                           capture_output=True, text=True)
    assert shows.returncode == 0, shows.stderr  # definitions parse even before any run


def test_params_header_stays_true_and_flow_keys_are_commented(params):
    text = (REPO / "params.yaml").read_text()
    assert text.startswith("# Every knob of the pipeline")
    assert params["profile"] == "tiny" and isinstance(params["seed"], int)
    for sec in ("flow", "sweep"):
        block = text.split(f"\n{sec}:", 1)[1].split("\n\n", 1)[0]
        for line in block.strip().splitlines():
            assert "#" in line, f"{sec}: uncommented line {line!r}"
    cfg = load_flow_config(REPO)
    assert cfg == build(FlowConfig, params["flow"], "flow")


def test_flow_config_rejects_bad_values_naming_the_key():
    with pytest.raises(ConfigError, match=r"flow\.cron: expected 5 fields"):
        build(FlowConfig, {"cron": "weekly"}, "flow")
    with pytest.raises(ConfigError, match=r"flow\.retries"):
        build(FlowConfig, {"retries": -1}, "flow")
    with pytest.raises(ConfigError, match=r"flow: unknown key 'cronn' \(known: cron, timezone"):
        build(FlowConfig, {"cronn": "* * * * *"}, "flow")


def test_profiles_switch_with_one_override(params):
    for name in ("smollm2", "qwen2_5_0_5b", "qwen2_5_7b"):
        resolved = resolve(params, [f"profile={name}"])
        assert resolved["model"]["source"] != params["model"]["source"], name


def test_prefect_yaml_deploys_the_flow_on_the_flow_cron():
    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    weekly = deployments["weekly"]
    assert weekly["entrypoint"] == "flows/pipeline.py:mars_pipeline"
    assert weekly["work_pool"]["name"] == "mars-process"
    cfg = load_flow_config(REPO)
    assert [(s["cron"], s["timezone"]) for s in weekly["schedules"]] == [(cfg.cron, cfg.timezone)]
    gpu = yaml.safe_load((REPO / "infra/prefect/k8s-gpu.prefect.yaml").read_text())
    template = json.loads((REPO / "infra/prefect/k8s-gpu-job-template.json").read_text())
    variables = template["variables"]["properties"]
    for dep in gpu["deployments"]:
        assert set(dep["work_pool"]["job_variables"]) <= set(variables), dep["name"]
        assert dep["parameters"]["profile"] in yaml.safe_load((REPO / "params.yaml").read_text())["profiles"]
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"


def test_overrides_apply_for_the_run_and_the_file_comes_back(tmp_path):
    (tmp_path / ".dvc").mkdir()
    original = "# knobs\ntrain:\n  lr: 0.001  # peak\n  sft: {epochs: 5}\n"
    (tmp_path / "params.yaml").write_text(original)
    with project.overridden_params(tmp_path, ["train.lr=0.5", "train.sft.epochs=1"]):
        inside = yaml.safe_load((tmp_path / "params.yaml").read_text())
        assert inside["train"] == {"lr": 0.5, "sft": {"epochs": 1}}
        assert (tmp_path / project.PARAMS_BACKUP).read_text() == original
    assert (tmp_path / "params.yaml").read_text() == original
    assert not (tmp_path / project.PARAMS_BACKUP).exists()

    with pytest.raises(RuntimeError), project.overridden_params(tmp_path, ["train.lr=0.5"]):
        raise RuntimeError("a stage failed")
    assert (tmp_path / "params.yaml").read_text() == original

    with pytest.raises(project.FlowError, match="train.lrr"):
        with project.overridden_params(tmp_path, ["train.lrr=1"]):
            pass
    assert (tmp_path / "params.yaml").read_text() == original and not (tmp_path / project.PARAMS_BACKUP).exists()


def test_an_interrupted_run_blocks_the_next_until_params_are_restored(tmp_path):
    (tmp_path / ".dvc").mkdir()
    (tmp_path / "params.yaml").write_text("a: 1\n")
    backup = tmp_path / project.PARAMS_BACKUP
    backup.parent.mkdir(parents=True)
    backup.write_text("a: 0\n")  # what a killed run leaves behind
    with pytest.raises(project.FlowError, match="interrupted"):
        with project.overridden_params(tmp_path, ["a=2"]):
            pass
    assert (tmp_path / "params.yaml").read_text() == "a: 1\n" and backup.read_text() == "a: 0\n"


def test_stage_failure_message_keeps_the_stages_own_error_lines():
    lines = ["Running stage 'sft':", "> mars train --stage sft", *[f"step {i}" for i in range(50)],
             "mars train: error: train.lr: must be > 0, got -1.0",
             "ERROR: failed to reproduce 'sft': failed to run: mars train ..., exited with 1"]
    err = project.StageFailed("sft", 255, lines)
    assert "stage 'sft' failed" in str(err)
    assert "mars train: error: train.lr: must be > 0, got -1.0" in str(err)
    assert "step 10" not in str(err)
    assert project.stage_outcome("sft", ["Stage 'sft' didn't change, skipping"]) == "unchanged"
    assert project.stage_outcome("sft", ["Stage 'sft' is cached - skipping run, checking out outputs"]) == "restored"
    assert project.stage_outcome("sft", ["Running stage 'sft':"]) == "ran"
