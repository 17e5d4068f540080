"""params.yaml loading: profiles, -S overrides and typed sections with errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from mars.config import load_params, resolve, section
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


def test_the_projects_params_file_loads_for_every_profile():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    import yaml

    profiles = yaml.safe_load((root / "params.yaml").read_text()).get("profiles", {})
    for name in profiles:
        assert load_params(root / "params.yaml", [f"profile={name}"])["profile"] == name
