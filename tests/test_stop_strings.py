"""Stop strings (lm-eval's ``until``): a sequence ends at the token whose text completes one, on every
decoding path and at every tau, and is otherwise the output it would have been."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from mars.decoding.generate import generate
from mars.decoding.stop_strings import StopStrings

VOCAB, MASK, B = 96, 95, 4


def word_tokenizer():
    """Token i is the word ``t<i>``; decoding joins words with spaces, so text spans token boundaries."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def confident_model():
    """Random tiny Llama with sharpened logits, so tau < 1 accepts a varying number of mask slots."""
    model = tiny_model("llama", vocab=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(60)
    model.config.mars = {"block_size": B, "mask_token_id": MASK}
    model.generation_config.eos_token_id = None
    return model


PROMPTS = [[3, 17, 40, 8], [60], [22, 5, 9, 31, 77, 12], [50, 51]]


def first_completion(tokenizer, ids: list[int], stop: str) -> int | None:
    """The reference cut: the shortest prefix of ``ids`` whose text contains ``stop``."""
    return next((j for j in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:j])), None)


@pytest.mark.parametrize("tau", [1.0, 0.5])
@pytest.mark.parametrize("path", [dict(use_cache=False), dict(batch_size=2), dict(b_cache=B)])
def test_a_row_ends_at_the_token_completing_a_stop_string(tau, path):
    model, tok = confident_model(), word_tokenizer()
    kwargs = dict(tau=tau, max_new_tokens=24, **{"batch_size": 4, **path})
    free = generate(model, tok, PROMPTS, **kwargs)
    ids = free[0].token_ids
    # a stop string across a token boundary and inside both tokens: "<end of token 3> t<start of token 4>"
    left, right = tok.decode(ids[3:4]), tok.decode(ids[4:5])
    stop = f"{left[-1]} {right[:2]}"
    stopped = generate(model, tok, PROMPTS, stop_strings=["never appears", stop], **kwargs)
    for before, after in zip(free, stopped):
        cut = first_completion(tok, before.token_ids, stop)
        if cut is None:
            assert after.token_ids == before.token_ids and after.finish_reason == before.finish_reason
        else:
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "stop"
            assert after.forwards <= before.forwards
    assert stopped[0].token_ids == ids[:5], "the first row completes the stop string at its fifth token"


def test_the_first_new_token_that_completes_a_stop_string_is_found_and_empty_strings_stop_nothing():
    tok = word_tokenizer()
    stops = StopStrings(tok, ["t7 t8 t9"])
    assert stops.cut([1, 7, 8], new=1) is None
    assert stops.cut([1, 7, 8, 9, 2], new=2) == 4  # completed by the first of the two new tokens
    assert not StopStrings(tok, ["", ""])
