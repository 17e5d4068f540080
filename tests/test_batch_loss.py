"""Dual-stream batches and the MARS loss, as DESIGN.md specifies them."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from mars.core.batch import IGNORE, build_batch
from mars.errors import DataError, MarsError
from mars.core.loss import compute_loss, mars_loss
from mars.core.masking import CLEAN, NOISY

MASK, PAD = 95, 0


def _mars(exs, B=4, **kw):
    return build_batch(exs, objective="mars", block_size=B, mask_token_id=MASK, pad_token_id=PAD, **kw)


def test_noisy_copy_masks_every_response_token_and_keeps_the_prompt():
    b = _mars([{"input_ids": [5, 6, 7, 8, 9, 10], "prompt_len": 2}], B=2, drop_prompt=False)
    L = b.clean_len
    assert b.input_ids[0, :6].tolist() == [5, 6, 7, 8, 9, 10]
    assert b.input_ids[0, L : L + 6].tolist() == [5, 6, MASK, MASK, MASK, MASK]


def test_both_streams_share_position_ids_and_pad_to_a_multiple_of_b():
    b = _mars([{"input_ids": list(range(1, 8)), "prompt_len": 3}], B=4, drop_prompt=False)
    assert b.clean_len == 8 and b.input_ids.shape[1] == 16
    assert torch.equal(b.position_ids[0, :8], b.position_ids[0, 8:])
    assert (b.stream[0, :8] == CLEAN).all() and (b.stream[0, 8:] == NOISY).all()


def test_labels_are_next_response_token_in_both_streams():
    x = [11, 12, 13, 14, 15]
    b = _mars([{"input_ids": x, "prompt_len": 2}], B=1, drop_prompt=False)
    L = b.clean_len
    expected = [IGNORE, 13, 14, 15, IGNORE]  # output at t predicts x[t+1] where t+1 is a response token
    assert b.labels[0, :5].tolist() == expected
    assert b.labels[0, L : L + 5].tolist() == expected


def test_variable_lengths_pad_with_no_targets_and_invalid_keys():
    b = _mars([{"input_ids": list(range(1, 12)), "prompt_len": 4}, {"input_ids": [1, 2, 3], "prompt_len": 1}])
    assert b.input_ids.shape[0] == 2
    assert not b.layout.valid[1, 3 : b.clean_len].any()
    assert (b.labels[1, 3 : b.clean_len] == IGNORE).all()
    assert b.num_targets() == {"ar": 7 + 2, "mask": 7 + 2}


def test_ar_objective_builds_the_clean_stream_only():
    b = build_batch([{"input_ids": [1, 2, 3, 4], "prompt_len": 2}], objective="ar", block_size=4,
                    mask_token_id=None, pad_token_id=PAD)
    assert b.input_ids.shape == (1, 4) and (b.stream == CLEAN).all()
    assert b.num_targets() == {"ar": 2, "mask": 0}


def test_random_block_offset_is_seeded_and_varies_block_starts():
    exs = [{"input_ids": list(range(1, 30)), "prompt_len": 5}] * 8
    a = _mars(exs, block_offset="random", generator=torch.Generator().manual_seed(1))
    b = _mars(exs, block_offset="random", generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.layout.block, b.layout.block)
    first_blocks = {tuple(r.tolist()) for r in a.layout.block[:, :8]}
    assert len(first_blocks) > 1  # different offsets across rows


@pytest.mark.parametrize("bad,msg", [
    ({"input_ids": [1, 2, 3], "prompt_len": 3}, "no response tokens"),
    ({"input_ids": [1, 2, 3], "prompt_len": 0}, "no prompt tokens"),
])
def test_bad_examples_are_clear_errors(bad, msg):
    with pytest.raises(DataError, match=msg):
        _mars([bad])


def test_too_long_example_and_bad_block_size_are_errors():
    with pytest.raises(DataError, match="exceeds max_length 4"):
        _mars([{"input_ids": [1, 2, 3, 4, 5], "prompt_len": 1}], max_length=4)
    for B in (0, -3):
        with pytest.raises(MarsError, match="block_size must be >= 1"):
            _mars([{"input_ids": [1, 2, 3], "prompt_len": 1}], B=B)


def test_loss_reports_both_streams_and_w_ar_weights_the_ar_part():
    logits = torch.randn(6, 10)
    targets = torch.randint(0, 10, (6,))
    streams = torch.tensor([CLEAN, CLEAN, NOISY, NOISY, NOISY, CLEAN])
    full = mars_loss(logits, targets, streams, w_ar=1.0)
    ablation = mars_loss(logits, targets, streams, w_ar=0.0)
    ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    assert torch.allclose(full.l_ar, ce[[0, 1, 5]].mean())
    assert torch.allclose(full.l_mask, ce[[2, 3, 4]].mean())
    assert torch.allclose(full.loss, full.l_mask + full.l_ar)
    assert torch.allclose(ablation.loss, ablation.l_mask)  # w_ar = 0: the paper's ablation
    assert (full.n_mask, full.n_ar) == (3, 3)


def test_global_denominators_make_shards_sum_to_the_whole():
    logits, targets = torch.randn(8, 10), torch.randint(0, 10, (8,))
    streams = torch.tensor([CLEAN, NOISY] * 4)
    whole = mars_loss(logits, targets, streams)
    halves = [mars_loss(logits[s], targets[s], streams[s], denominators=(4, 4)) for s in (slice(0, 4), slice(4, 8))]
    assert torch.allclose(halves[0].loss + halves[1].loss, whole.loss)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compute_loss_backward_is_finite_and_ar_loss_matches_hf(attn):
    model = tiny_model("qwen2", attn)
    exs = [{"input_ids": list(range(3, 20)), "prompt_len": 5}, {"input_ids": list(range(7, 17)), "prompt_len": 6}]
    out = compute_loss(model, _mars(exs), w_ar=1.0)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # the clean stream's L_AR equals HF's own causal LM loss on the response tokens
    ex = exs[0]
    ids = torch.tensor([ex["input_ids"]])
    labels = ids.clone()
    labels[:, : ex["prompt_len"]] = IGNORE
    single = compute_loss(model, _mars([ex]), w_ar=1.0)
    with torch.no_grad():
        hf = model(input_ids=ids, labels=labels).loss
    assert torch.allclose(single.l_ar, hf, atol=1e-5)


def test_kl_ar_loss_is_the_divergence_from_the_teacher_and_zero_against_itself():
    logits, targets = torch.randn(6, 10), torch.randint(0, 10, (6,))
    streams = torch.tensor([CLEAN, CLEAN, NOISY, NOISY, NOISY, CLEAN])
    ce = mars_loss(logits, targets, streams, w_ar=2.0)
    teacher = torch.randn(3, 10)
    kl = mars_loss(logits, targets, streams, w_ar=2.0, teacher_logits=teacher)
    log_p, log_q = logits[[0, 1, 5]].log_softmax(-1), teacher.log_softmax(-1)
    assert torch.allclose(kl.l_ar, (log_q.exp() * (log_q - log_p)).sum(-1).mean())
    assert torch.allclose(kl.l_mask, ce.l_mask)  # the mask slots still learn the data's tokens
    assert torch.allclose(kl.loss, kl.l_mask + 2.0 * kl.l_ar)
    itself = mars_loss(logits, targets, streams, teacher_logits=logits[[0, 1, 5]])
    assert abs(float(itself.l_ar)) < 1e-6
    with pytest.raises(ValueError, match="teacher_logits"):
        mars_loss(logits, targets, streams, teacher_logits=teacher[:2])


def test_the_clean_view_gives_the_clean_streams_outputs_and_a_teacher_equal_to_the_model_gives_zero_l_ar():
    from mars.core.loss import target_logits

    model = tiny_model("llama", "sdpa").eval()
    exs = [{"input_ids": list(range(3, 20)), "prompt_len": 5}, {"input_ids": list(range(7, 17)), "prompt_len": 6}]
    batch = _mars(exs, block_offset="random", generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dual, _ = target_logits(model, batch)
        clean, targets = target_logits(model, batch.clean_view())
        streams = batch.stream[batch.labels != IGNORE]
        assert torch.allclose(dual[streams == CLEAN], clean, atol=1e-5)
        assert torch.equal(targets, batch.labels[batch.labels != IGNORE][streams == CLEAN])
        out = compute_loss(model, batch, teacher=model)
    assert abs(float(out.l_ar)) < 1e-5 and float(out.l_mask) > 0
