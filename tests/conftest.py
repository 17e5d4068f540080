"""Shared fixtures: tiny random models of two architectures, and the real SmolLM2 checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# The real S3 server fixtures (s3_server, store_uri), shared by the store, release and flow tests.
pytest_plugins = ["s3_server"]


def tiny_config(arch: str, attn: str = "sdpa", vocab: int = 96):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  attn_implementation=attn)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", attn: str = "sdpa", seed: int = 0, vocab: int = 96):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, attn, vocab), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct (real weights), converted to safetensors once into the mars cache."""
    from mars.core.models import MarsError, convert_smollm2

    try:
        return convert_smollm2()
    except MarsError as err:  # the package is part of the dev install; say so loudly if it is missing
        pytest.fail(str(err))
