"""Shared fixtures: tiny random models of two architectures, and the real SmolLM2 checkpoint."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

# `make test` runs the suite in 2 xdist workers (a file per worker at a time); each worker then gets its share of
# the cores, and so do the CLIs it starts, since oversubscribed threads make tiny matmuls several times slower.
_threads = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(_threads)
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


def pytest_report_header(config):
    # the suite writes SmolLM2 checkpoints (513 MB each) and S3 objects under the temp dir: a CI run that
    # failed with "No space left on device" and S3 "InternalError"s is told apart from a regression here
    where = config.option.basetemp or tempfile.gettempdir()
    free = shutil.disk_usage(where if os.path.isdir(where) else tempfile.gettempdir()).free
    return f"free disk under {where}: {free / 2**30:.1f} GiB (`pytest -m slow` in one process peaked at 2.1 GiB there)"


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


def periodic(n: int, length: int, seed: int, period: int = 3) -> list[list[int]]:
    """``n`` sequences that each repeat a random phrase of ``period`` token ids below 60."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 60, (period,), generator=g).tolist() * length)[:length] for _ in range(n)]


def train_to_draft(model, mask_token_id: int, block_size: int = 4, steps: int = 150):
    """MARS-train ``model`` in place (seconds) on repeated phrases, after a 7-token prompt: its mask slots
    then predict what greedy decoding will say, so lossless drafts verify (a random model's seldom do)."""
    from mars.core.batch import build_batch
    from mars.core.loss import compute_loss

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        examples = [{"input_ids": x, "prompt_len": 7} for x in periodic(16, 23, seed=step)]
        batch = build_batch(examples, objective="mars", block_size=block_size, mask_token_id=mask_token_id,
                            pad_token_id=0, block_offset="random", generator=g)
        optimizer.zero_grad()
        compute_loss(model, batch).loss.backward()
        optimizer.step()
    return model.eval()


# The longest files first (a whole default `dvc repro`: a third of the suite; the Prefect flow end to end; then the
# files with SmolLM2, multi-process or lm-eval tests), so that the two workers end together on short files instead
# of one waiting while the other starts a long one; the rest keep their order. By `make test`'s --durations.
LONGEST_FIRST = ("test_reference_results.py", "test_flow.py", "test_trainer.py", "test_lm_eval.py", "test_study.py",
                 "test_export.py", "test_serve.py", "test_tree.py", "test_distill.py", "test_decoding.py",
                 "test_release.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct (real weights), converted to safetensors once into the mars cache."""
    from mars.core.models import MarsError, convert_smollm2

    try:
        return convert_smollm2()
    except MarsError as err:  # the package is part of the dev install; say so loudly if it is missing
        pytest.fail(str(err))
