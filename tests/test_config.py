"""params.yaml loading: profiles, -S overrides and typed sections with errors that name the key."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from mars.cli.params import SECTIONS, section_type, validate
from mars.cli.params import main as params_cli
from mars.config import build, load_params, load_yaml, resolve, section
from mars.errors import ConfigError


@dataclass
class Knobs:
    lr: float = 1e-3
    steps: int = 10
    mode: Literal["fixed", "random"] = "fixed"
    taus: list[float] = field(default_factory=lambda: [1.0])
    note: str | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise ConfigError(f"steps: must be >= 1, got {self.steps}")


RAW = {"profile": "tiny", "train": {"lr": 0.01, "steps": 5},
       "profiles": {"tiny": {}, "big": {"train": {"lr": 5e-6, "steps": 100}}}}


def test_profile_values_win_over_top_level_sections():
    assert section(resolve(RAW), "train", Knobs).lr == 0.01
    big = section(resolve(RAW, ["profile=big"]), "train", Knobs)
    assert (big.lr, big.steps) == (5e-6, 100)


def test_an_override_the_profile_would_replace_is_an_error_naming_the_profiles_key():
    """`-S train.steps=7` under a profile that sets train.steps would be silently undone by the profile."""
    with pytest.raises(ConfigError, match=r"override 'train.steps=7': the profile big sets train.steps, and its "
                                          r"value wins; override profiles.big.train.steps instead"):
        resolve(RAW, ["profile=big", "train.steps=7"])
    with pytest.raises(ConfigError, match="sets train.lr"):  # a section given whole: its shadowed leaf is named
        resolve(RAW, ["profile=big", "train={lr: 0.1, note: x}"])
    assert section(resolve(RAW, ["profile=big", "train.note=x"]), "train", Knobs).note == "x"  # not in the profile
    assert section(resolve(RAW, ["profile=big", "profiles.big.train.steps=7"]), "train", Knobs).steps == 7
    assert section(resolve(RAW, ["profile=big", "train.steps=100"]), "train", Knobs).steps == 100  # the same value
    assert section(resolve(RAW, ["train.steps=7"]), "train", Knobs).steps == 7  # tiny sets nothing
    # dvc exp run -S adds a key the file lacks with +key=value (Hydra's syntax): the same override here
    assert section(resolve(RAW, ["+profiles.tiny.train.note=x"]), "train", Knobs).note == "x"
    assert section(resolve(RAW, ["++train.steps=7"]), "train", Knobs).steps == 7


def test_overrides_parse_yaml_values_like_dvc_exp_run_s():
    cfg = section(resolve(RAW, ["train.steps=7", "train.mode=random", "train.taus=[1.0, 0.9]"]), "train", Knobs)
    assert (cfg.steps, cfg.mode, cfg.taus) == (7, "random", [1.0, 0.9])


def test_exponent_floats_that_yaml_1_1_reads_as_strings_are_numbers():
    assert section(resolve(RAW, ["train.lr=3e-3"]), "train", Knobs).lr == 0.003


@pytest.mark.parametrize("override,message", [
    ("train.lr=fast", "train.lr: expected a number"),
    ("train.steps=2.5", "train.steps: expected an integer"),
    ("train.mode=sometimes", "train.mode: expected 'fixed' or 'random', got 'sometimes'"),
    ("train.epochs=3", "train: unknown key"),
    ("train.steps=0", "train.steps: must be >= 1"),
    ("profile=huge", "profile: unknown profile 'huge'"),
])
def test_bad_params_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        section(resolve(RAW, [override]), "train", Knobs)


def test_missing_file_and_bad_yaml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "params.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)


PROJECT_PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
RAW_PARAMS = load_yaml(PROJECT_PARAMS.read_text())
PROFILES = list(RAW_PARAMS["profiles"])


def differences(a, b, key: str) -> list[str]:
    """Dotted keys where two configs (as nested dicts) disagree."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differences(a.get(k), b.get(k), f"{key}.{k}")]
    return [] if a == b else [f"{key}: params.yaml {a!r}, class default {b!r}"]


def test_every_top_level_key_of_params_yaml_has_a_typed_config():
    assert set(SECTIONS) == set(RAW_PARAMS) - {"profiles"}
    assert {"tiny", "smollm2", "qwen2_5_0_5b", "qwen2_5_7b"} <= set(PROFILES)


@pytest.mark.parametrize("name", [n for n in SECTIONS if dataclasses.is_dataclass(section_type(n))])
def test_class_defaults_are_the_top_level_values_of_params_yaml(name):
    """One source of defaults: code run without params.yaml (``mars generate`` elsewhere, the library
    called directly) behaves as the default profile does."""
    cls = section_type(name)
    from_file = dataclasses.asdict(build(cls, RAW_PARAMS[name], name))
    diffs = differences(from_file, dataclasses.asdict(cls()), name)
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_section_of_every_profile_builds(profile):
    typed = validate(load_params(PROJECT_PARAMS, [f"profile={profile}"]))
    assert set(typed) == set(SECTIONS) and typed["profile"] == profile


def test_types_are_strict_and_errors_name_the_whole_key_once():
    from mars.core.checkpoint_info import CheckpointInfo
    from mars.evaluation.gate import GateConfig
    from mars.training.trainer import TrainConfig

    cases = [
        (TrainConfig, {"mars": {"block_size": "four"}}, "train", "train.mars.block_size: expected an integer, got 'four'"),
        (TrainConfig, {"batch_size": True}, "train", "train.batch_size: expected an integer, got True"),
        (TrainConfig, {"batch_size": "16"}, "train", "train.batch_size: expected an integer, got '16'"),
        (TrainConfig, {"group_by_length": 1}, "train", "train.group_by_length: expected true or false, got 1"),
        (TrainConfig, {"betas": [0.9, "x"]}, "train", "train.betas[1]: expected a number, got 'x'"),
        (TrainConfig, {"mars": {"epochs": 1, "blocksize": 8}}, "train", "train.mars: unknown key 'blocksize' (known: epochs"),
        (GateConfig, {"override": {"enabled": True}}, "gate", "gate.override.reason: an override needs a reason"),
        (GateConfig, {"override": "yes"}, "gate", "gate.override: expected a mapping, got 'yes'"),
        (CheckpointInfo, {"block_size": 4}, "config.mars", "config.mars.mask_token_id: missing required key"),
    ]
    for cls, data, key, message in cases:
        with pytest.raises(ConfigError) as err:
            build(cls, data, key)
        assert str(err.value).startswith(message), (data, str(err.value))


def test_exponent_floats_in_the_file_are_numbers(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train: {lr: 3e-3, eps: -1E+2}\n")  # YAML 1.1 (PyYAML) would read strings
    assert load_params(path)["train"] == {"lr": 0.003, "eps": -100.0}


def test_mars_params_prints_the_typed_sections_and_rejects_unknown_keys(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text("seed: 3\ntrain: {lr: 1.0e-3}\n")
    assert params_cli(["--params", str(path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["seed"] == 3 and shown["train"]["lr"] == 0.001 and shown["train"]["mars"]["block_size"] == 4
    for override, message in [("train.lrr=1", "train: unknown key 'lrr'"), ("trian.lr=1", "trian: unknown section"),
                              ("flow.cronn=x", "flow: unknown key 'cronn'"), ("sweep.w_ar=[-1]", "sweep.w_ar")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            params_cli(["--params", str(path), "-S", override])
    with pytest.raises(ConfigError, match="nope: unknown section"):
        params_cli(["--params", str(path), "--section", "nope"])
