"""``mars base``: the base model of each profile, with the mask token registered and recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mars.cli import main
from mars.config import load_params, section
from mars.errors import ConfigError
from mars.core.mask_token import MASK_TOKEN, mask_token_id
from mars.core.models import load_model
from mars.training.base import ModelConfig, TinyConfig, build_base, build_tiny, describe, save_base

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.intermediate_size=64",
         "model.tiny.tokenizer_corpus=400", "model.tiny.vocab_size=400"]


def small_tiny(**kw) -> TinyConfig:
    cfg = dict(vocab_size=400, tokenizer_corpus=400, hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    return TinyConfig(**{**cfg, **kw})


def test_tiny_base_puts_the_mask_token_on_a_spare_row_without_resizing(tmp_path):
    out = tmp_path / "base"
    args = ["base", "--params", str(ROOT / "params.yaml"), "--out", str(out)]
    assert main(args + [x for s in SMALL for x in ("-S", s)]) == 0
    info = json.loads((out / "base.json").read_text())
    assert info["source"] == "tiny" and info["architecture"] == "LlamaForCausalLM"
    mask = info["mask_token"]
    assert mask["resized"] is False and mask["added_to_tokenizer"] is True
    assert mask["embedding_rows_before"] == mask["embedding_rows_after"] == info["embedding_rows"]
    assert info["embedding_rows"] % 64 == 0 and mask["token_id"] < info["embedding_rows"]
    assert mask["token_id"] == info["vocab_size"] - 1  # the first spare row

    model, tokenizer = load_model(out)
    assert mask_token_id(model, tokenizer) == mask["token_id"]
    assert tokenizer.encode(MASK_TOKEN, add_special_tokens=False) == [mask["token_id"]]
    assert model.get_input_embeddings().num_embeddings == info["embedding_rows"]
    assert model.config.tie_word_embeddings
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert tokenizer.eos_token == "<|end|>" and tokenizer.pad_token == "<|pad|>"
    assert not list(tmp_path.glob(".base-*")), "no temp dir may be left behind"


def test_tiny_chat_template_and_tokenizer():
    _, tok = build_tiny(small_tiny(), seed=0)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>\nWhat is 12 + 30?<|end|>\n<|assistant|>\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>") and tok.eos_token_id in ids
    digits = [t for t in tok.convert_ids_to_tokens(tok.encode("12345", add_special_tokens=False))]
    assert digits == list("12345"), "digits are split one by one"
    text = "Sort these numbers: 3, 1.\n{\"a\": 1} | x |"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tiny_base_is_deterministic_in_the_seed():
    m1, t1 = build_tiny(small_tiny(), seed=0)
    m2, t2 = build_tiny(small_tiny(), seed=0)
    m3, _ = build_tiny(small_tiny(), seed=1)
    assert t1.backend_tokenizer.to_str() == t2.backend_tokenizer.to_str()
    w1, w2, w3 = (m.get_input_embeddings().weight for m in (m1, m2, m3))
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)


def test_the_same_seed_writes_the_same_bytes(tmp_path):
    # dvc.lock's hash of models/base is then the same on every machine (tests/test_reference_results.py)
    args = ["base", "--params", str(ROOT / "params.yaml"), *[x for s in SMALL for x in ("-S", s)]]
    for run in ("a", "b"):
        assert main([*args, "--out", str(tmp_path / run)]) == 0
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "base.json" in files and "model.safetensors" in files
    assert [f for f in files if (tmp_path / "a" / f).read_bytes() != (tmp_path / "b" / f).read_bytes()] == []


def test_model_section_is_validated():
    with pytest.raises(ConfigError, match="model.tiny.hidden_size"):
        section(load_params(ROOT / "params.yaml", ["model.tiny.hidden_size=30"]), "model", ModelConfig)
    with pytest.raises(ConfigError, match="model.tiny: unknown key.*nope"):
        section(load_params(ROOT / "params.yaml", ["model.tiny.nope=1"]), "model", ModelConfig)


def test_hub_profile_fails_offline_with_a_clear_message(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "base"
    proc = subprocess.run(
        [sys.executable, "-m", "mars.cli", "base", "--params", str(ROOT / "params.yaml"),
         "-S", "profile=qwen2_5_0_5b", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mars base: error:") and "Qwen/Qwen2.5-0.5B-Instruct" in last and "hub" in last
    assert not out.exists()


@pytest.mark.slow
def test_smollm2_base_records_the_resize_and_round_trips_the_mask_token(smollm2_dir, tmp_path):
    model, tokenizer, info = build_base(ModelConfig(source="smollm2"), seed=0)
    assert info.resized and info.embedding_rows_after == info.embedding_rows_before + 1
    save_base(model, tokenizer, describe(model, tokenizer, info, "smollm2"), tmp_path / "base")
    recorded = json.loads((tmp_path / "base" / "base.json").read_text())
    assert recorded["mask_token"]["resized"] is True
    assert recorded["embedding_rows"] == info.embedding_rows_after
    reloaded, tok = load_model(tmp_path / "base")
    assert mask_token_id(reloaded, tok) == info.token_id == tok.convert_tokens_to_ids(MASK_TOKEN)
    assert reloaded.get_input_embeddings().num_embeddings == info.embedding_rows_after
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
