"""config.mars: what a checkpoint records about itself, written and read through one typed record."""

from __future__ import annotations

import json

import pytest
from transformers import PretrainedConfig

from mars.core.checkpoint_info import CheckpointInfo, CheckpointInfoError

TRAINED = CheckpointInfo(block_size=4, mask_token_id=7, objective="mars", w_ar=1.0, stage="mars",
                         block_offset="random", base="models/base")


def test_a_written_record_survives_save_pretrained_and_reads_back(tmp_path):
    config = PretrainedConfig()
    TRAINED.write_to(config)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["mars"] == TRAINED.to_dict()
    assert CheckpointInfo.read(tmp_path) == TRAINED
    assert CheckpointInfo.from_config(PretrainedConfig.from_pretrained(tmp_path)) == TRAINED
    assert CheckpointInfo.block_size_of(PretrainedConfig.from_pretrained(tmp_path)) == 4


def test_what_was_not_recorded_stays_out_of_the_section():
    partial = CheckpointInfo.from_section({"block_size": 8, "mask_token_id": 3}, "x")
    assert partial.stage is None and partial.to_dict() == {"block_size": 8, "mask_token_id": 3}


def test_a_plain_model_has_no_record():
    assert CheckpointInfo.from_config(PretrainedConfig()) is None
    assert CheckpointInfo.block_size_of(PretrainedConfig()) is None


@pytest.mark.parametrize("section,message", [
    ({"block_size": "four", "mask_token_id": 3}, r"config.mars.block_size: expected an integer, got 'four'"),
    ({"block_size": 0, "mask_token_id": 3}, r"config.mars.block_size: must be >= 1"),
    ({"block_size": 4}, r"config.mars.mask_token_id"),
    ({"block_size": 4, "mask_token_id": 3, "objective": "diffusion"}, r"config.mars.objective: expected 'ar' or 'mars'"),
    ({"block_size": 4, "mask_token_id": 3, "blocksize": 8}, r"config.mars: unknown key 'blocksize'"),
    ([4, 3], r"config.mars: expected a mapping"),
])
def test_a_malformed_record_names_the_checkpoint_and_the_key(tmp_path, section, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "mars": section}))
    with pytest.raises(CheckpointInfoError, match=rf"{tmp_path / 'config.json'}: {message}"):
        CheckpointInfo.read(tmp_path)


def test_a_folder_that_is_no_mars_checkpoint_says_so(tmp_path):
    with pytest.raises(CheckpointInfoError, match="no such file"):
        CheckpointInfo.read(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointInfoError, match="not a MARS checkpoint"):
        CheckpointInfo.read(tmp_path)
