"""The mask token: a spare row when there is one, exactly one new row otherwise, never silently."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from mars.core.batch import build_batch
from mars.core.loss import compute_loss
from mars.core.mask_token import MASK_TOKEN, MaskTokenError, add_mask_token, mask_token_id


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from mars.core.models import load_model

    return load_model(smollm2_dir)


def _word_tokenizer(words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|unused|>": 1, **{f"w{i}": i + 2 for i in range(words - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|unused|>"])


def test_spare_embedding_row_is_used_without_resize():
    model = tiny_model("qwen2", vocab=96)  # 96 rows, 90 tokens: like Qwen2.5's padded embedding
    tok = _word_tokenizer(90)
    info = add_mask_token(model, tok)
    assert (info.token_id, info.resized, info.added_to_tokenizer) == (90, False, True)
    assert model.get_input_embeddings().num_embeddings == 96
    assert mask_token_id(model) == 90


def test_full_embedding_gets_exactly_one_row_and_records_it():
    model = tiny_model("llama", vocab=64)
    params_before = sum(p.numel() for p in model.parameters())
    info = add_mask_token(model, _word_tokenizer(64))
    assert info.resized and info.embedding_rows_before == 64 and info.embedding_rows_after == 65
    hidden = model.config.hidden_size
    added = sum(p.numel() for p in model.parameters()) - params_before
    assert added in (hidden, 2 * hidden)  # one row (tied) or one row in each of embedding and head


def test_an_existing_unused_special_token_can_be_named():
    model = tiny_model("llama", vocab=64)
    info = add_mask_token(model, _word_tokenizer(64), token="<|unused|>")
    assert (info.token_id, info.added_to_tokenizer, info.resized) == (1, False, False)


def test_no_room_and_no_resize_is_a_clear_error():
    with pytest.raises(MaskTokenError, match="no room for mask token"):
        add_mask_token(tiny_model("llama", vocab=64), _word_tokenizer(64), allow_resize=False)


def test_checkpoint_without_mask_token_is_refused():
    with pytest.raises(MaskTokenError, match="not a MARS checkpoint"):
        mask_token_id(tiny_model("llama"))


@pytest.mark.slow
def test_smollm2_mask_token_round_trips_and_a_training_step_is_finite(smol, tmp_path):
    model, tok = smol
    info = add_mask_token(model, tok)
    assert info.resized and info.embedding_rows_before == 49152  # SmolLM2 has no spare rows
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.convert_tokens_to_ids(MASK_TOKEN) == info.token_id
    assert again.encode(f"a {MASK_TOKEN} b", add_special_tokens=False).count(info.token_id) == 1

    model.train()
    exs = []
    for q, a in [("What is 2+2?", "4"), ("Name a colour.", "Blue is a colour.")]:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        exs.append({"input_ids": p_ids + r_ids, "prompt_len": len(p_ids)})
    batch = build_batch(exs, objective="mars", block_size=4, mask_token_id=info.token_id, pad_token_id=tok.pad_token_id)
    out = compute_loss(model, batch, w_ar=1.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.n_mask > 0 and out.n_ar > 0
    grad = model.get_input_embeddings().weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad[info.token_id].abs().sum() > 0
