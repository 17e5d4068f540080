"""The structured attention mask: its rule, and equivalence with plain causal forwards.

If the mask were wrong in any quadrant, the dual-stream logits would differ from the plain
forwards they stand for.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from mars.core.batch import IGNORE, build_batch
from mars.core.masking import CLEAN, NOISY, dual_stream_mask, noisy_start, to_additive

MASK_ID = 95
PAD_ID = 0


def reference_mask(L: int, B: int, offset: int = 0) -> torch.Tensor:
    """DESIGN.md's four rules, spelled out element by element."""
    m = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    blk = lambda t: (t + offset) // B  # noqa: E731
    for q in range(2 * L):
        for k in range(2 * L):
            qs, qt = (CLEAN, q) if q < L else (NOISY, q - L)
            ks, kt = (CLEAN, k) if k < L else (NOISY, k - L)
            if qs == CLEAN and ks == CLEAN:
                m[q, k] = kt <= qt
            elif qs == NOISY and ks == CLEAN:
                m[q, k] = blk(kt) < blk(qt)
            elif qs == NOISY and ks == NOISY:
                m[q, k] = blk(kt) == blk(qt) and kt <= qt
    return m


@pytest.mark.parametrize("L,B", [(1, 1), (7, 1), (8, 2), (9, 4), (16, 8), (5, 8)])
def test_mask_matches_design_rules(L, B):
    assert torch.equal(dual_stream_mask(L, B, prompt_len=0), reference_mask(L, B))


def test_mask_with_block_offset_shifts_block_boundaries():
    assert torch.equal(dual_stream_mask(12, 4, block_offset=3), reference_mask(12, 4, offset=3))
    assert not torch.equal(dual_stream_mask(12, 4, block_offset=3), dual_stream_mask(12, 4))


def test_no_row_is_empty_and_clean_never_sees_noisy():
    m = dual_stream_mask(13, 4, prompt_len=5)
    assert m.any(dim=1).all()
    assert not m[:13, 13:].any()


def test_b1_noisy_token_sees_clean_prefix_and_itself_only():
    # B = 1: a mask at t sees clean x[<t] and itself, i.e. it is a 2-ahead predictor.
    m = dual_stream_mask(6, 1)
    for t in range(6):
        row = m[6 + t]
        assert row[:t].all() and not row[t:6].any()
        assert row[6 + t] and row[6:].sum() == 1


def test_drop_prompt_keeps_the_loss_bearing_rows():
    L, B, p = 14, 4, 6
    full = dual_stream_mask(L, B, prompt_len=p)
    s = noisy_start(p, B)
    compact = dual_stream_mask(L, B, prompt_len=p, drop_prompt=True)
    assert compact.shape == (2 * L - s, 2 * L - s)
    keep = list(range(L)) + [L + t for t in range(s, L)]
    assert torch.equal(compact, full[keep][:, keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_additive_form_blocks_with_the_dtypes_own_finfo_min(dtype):
    m = dual_stream_mask(5, 2)
    add = to_additive(m[None], dtype)
    assert add.shape == (1, 1, 10, 10) and add.dtype == dtype  # [batch, heads, q, k], as eager adds it
    assert torch.equal(add[0, 0] == 0, m)
    assert (add[0, 0][~m] == torch.finfo(dtype).min).all()  # finite: float32's min would be -inf in float16


def _plain_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).logits[0]


def _dual_logits(model, batch, attn: str) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                     attention_mask=batch.attention_mask(attn)).logits


def _check_equivalence(model, attn, B, prompt_lens, lengths, block_offset="fixed", drop_prompt=True, reference=None):
    """Dual-stream logits of ``model`` vs plain causal forwards of ``reference`` (default: the same model)."""
    reference = reference or model
    gen = torch.Generator().manual_seed(B)
    exs = [{"input_ids": torch.randint(1, MASK_ID, (n,), generator=gen).tolist(), "prompt_len": p}
           for n, p in zip(lengths, prompt_lens)]
    batch = build_batch(exs, objective="mars", block_size=B, mask_token_id=MASK_ID, pad_token_id=PAD_ID,
                        block_offset=block_offset, drop_prompt=drop_prompt, generator=gen)
    logits = _dual_logits(model, batch, attn)
    assert torch.isfinite(logits).all()
    worst = 0.0
    for i, ex in enumerate(exs):
        x = torch.tensor(ex["input_ids"])
        n, p = len(x), ex["prompt_len"]
        # clean stream == plain causal forward of x
        worst = max(worst, (logits[i, :n] - _plain_logits(reference, x)).abs().max().item())
        # every noisy block == plain forward of [x before the block ; the block's noisy tokens]
        noisy = x.clone()
        noisy[p:] = MASK_ID
        row_pos = batch.position_ids[i]
        row_blk = batch.layout.block[i]
        valid = batch.layout.valid[i]
        for j in range(batch.clean_len, batch.input_ids.shape[1]):
            if not valid[j]:
                continue
            t = int(row_pos[j])
            start = int((row_pos[(row_blk == row_blk[j]) & valid] ).min())
            if batch.labels[i, j] == IGNORE:
                continue
            ref = _plain_logits(reference, torch.cat([x[:start], noisy[start : t + 1]]))[-1]
            worst = max(worst, (logits[i, j] - ref).abs().max().item())
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("B", [1, 2, 4, 8])
def test_dual_stream_forward_equals_plain_forwards(arch, attn, B):
    model = tiny_model(arch, attn)
    # prompt lengths that are and are not multiples of B; variable lengths in one batch
    _check_equivalence(model, attn, B, prompt_lens=[B, 3, 5], lengths=[B + 9, 17, 12])


@pytest.mark.parametrize("B", [2, 4])
def test_equivalence_holds_without_dropping_the_noisy_prompt(B):
    _check_equivalence(tiny_model("llama"), "sdpa", B, prompt_lens=[3, 6], lengths=[13, 15], drop_prompt=False)


@pytest.mark.parametrize("B", [4, 8])
def test_equivalence_holds_with_random_block_offsets(B):
    _check_equivalence(tiny_model("qwen2"), "sdpa", B, prompt_lens=[3, 6, 2], lengths=[19, 15, 11],
                       block_offset="random")


def test_flex_attention_block_mask_gives_the_same_logits():
    pytest.importorskip("torch.nn.attention.flex_attention")
    # Same weights (same seed); plain references run on sdpa, since inductor's CPU flex kernel fails
    # to compile for some odd sequence lengths.
    flex_model, sdpa_model = tiny_model("llama", "flex_attention"), tiny_model("llama", "sdpa")
    try:
        _check_equivalence(flex_model, "flex_attention", 4, prompt_lens=[3, 5], lengths=[13, 12],
                           reference=sdpa_model)
    except (RuntimeError, NotImplementedError, ImportError) as err:  # platform without flex support
        pytest.skip(f"flex attention does not run here: {type(err).__name__}: {str(err)[:200]}")
