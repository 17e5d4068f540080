"""mars.decoding: the accept rule, exact greedy AR at tau = 1, and the cached paths against the no-cache one."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import periodic, tiny_model, train_to_draft

from mars.cli.generate import main as generate_cli
from mars.decoding.accept import accept, greedy_tokens
from mars.decoding.batch import CachedBatch, DecodeRow
from mars.decoding.generate import GenerationResult, generate
from mars.decoding.setting import Setting
from mars.errors import MarsError
from mars.decoding.torch_backend import RowCache, TorchBackend, AttentionGroups

VOCAB, MASK, EOS, B = 96, 95, 63, 4
EOS_OF = {"llama": EOS, "qwen2": 85}  # a token each random model emits for some prompts and not others
TAUS = [0.95, 0.9, 0.7, 0.5, 0.3]


def mars_model(arch="llama", attn="sdpa", seed=0):
    """A random tiny model made confident enough that every tau accepts a varying number of slots
    (a plain random init puts ~1/V on every token), labelled as a MARS checkpoint with B = 4."""
    model = tiny_model(arch, attn, seed=seed, vocab=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(60)
    model.config.mars = {"block_size": B, "mask_token_id": MASK}
    model.generation_config.eos_token_id = EOS_OF[arch]
    return model


def random_prompts(lengths=(5, 1, 12, 3, 9, 17), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = [t for t in range(VOCAB) if t != MASK]
    return [[ids[i] for i in torch.randint(0, len(ids), (n,), generator=g).tolist()] for n in lengths]


def hf_greedy(model, prompts, max_new_tokens):
    """HF generate, greedy with KV cache, one batch (left padded); generated ids cut after EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos = model.generation_config.eos_token_id
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)[:, width:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


def tokens(results):
    return [r.token_ids for r in results]


# ------------------------------------------------------------------------------------------- accept rule


def _slot_logits(probs):
    """Logits whose softmax puts ``p`` on token 10 + slot (rest spread evenly), one row per list."""
    rows = []
    for row in probs:
        slots = []
        for j, p in enumerate(row):
            q = torch.full((VOCAB,), (1 - p) / (VOCAB - 1))
            q[10 + j] = p
            slots.append(q.log())
        rows.append(torch.stack(slots))
    return torch.stack(rows)


def _accept(probs, tau, room=None, stop=(), greedy=None):
    logits = _slot_logits(probs)
    b = logits.shape[0]
    return accept(logits, torch.full((b,), tau), torch.tensor(greedy or [tau >= 1.0] * b),
                  torch.tensor(list(stop), dtype=torch.long), torch.tensor(room or [99] * b))


def test_accept_takes_confident_slots_left_to_right_and_always_slot_zero():
    toks, n, stopped = _accept([[0.95, 0.92, 0.5, 0.99], [0.2, 0.99, 0.4, 0.99], [0.91, 0.91, 0.91, 0.91]], 0.9)
    # the first slot below tau ends the step even if later ones are confident; slot 0 counts regardless
    assert n.tolist() == [2, 2, 4]
    assert toks[0].tolist() == [10, 11, 12, 13] and not stopped.any()


def test_accept_stops_after_a_stop_token_and_within_the_budget():
    _, n, stopped = _accept([[0.99] * 4, [0.99] * 4], 0.5, stop=[11])  # slot 1 predicts token 11
    assert n.tolist() == [2, 2] and stopped.tolist() == [True, True]
    _, n, _ = _accept([[0.99] * 4, [0.99] * 4], 0.5, room=[3, 1])
    assert n.tolist() == [3, 1]


def test_tau_one_accepts_slot_zero_only_even_when_a_mask_rounds_to_probability_one():
    logits = torch.zeros(1, 3, VOCAB)
    logits[0, :, 5] = 200.0  # float32 softmax gives exactly 1.0
    assert torch.softmax(logits, -1).amax().item() == 1.0
    _, n, _ = accept(logits, torch.tensor([1.0]), torch.tensor([True]), torch.tensor([], dtype=torch.long),
                     torch.tensor([9]))
    assert n.tolist() == [1]


# ------------------------------------------------------------------------------------------- tau = 1.0


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager")])
def test_tau_one_is_hf_greedy_token_for_token(arch, attn):
    model = mars_model(arch, attn)
    prompts = random_prompts()
    alone = [hf_greedy(model, [p], 16)[0] for p in prompts]
    eos = EOS_OF[arch]
    assert any(eos in r for r in alone) and any(eos not in r for r in alone)  # both endings are covered
    assert hf_greedy(model, prompts, 16) == alone
    for kwargs in (dict(batch_size=1), dict(batch_size=4), dict(batch_size=6, b_cache=B),
                   dict(batch_size=4, use_cache=False), dict(batch_size=6, backend=TorchBackend(model, lean=False))):
        results = generate(model, None, prompts, tau=1.0, max_new_tokens=16, **kwargs)
        assert tokens(results) == alone, kwargs
        assert all(r.forwards == len(r.token_ids) for r in results)  # one token per forward


def test_tau_one_needs_no_mask_token_and_no_block_size():
    model = tiny_model("llama", vocab=VOCAB)  # a plain causal LM: no config.mars at all
    prompts = random_prompts((4, 9))
    results = generate(model, None, prompts, tau=1.0, max_new_tokens=10, batch_size=2)
    assert tokens(results) == [hf_greedy(model, [p], 10)[0] for p in prompts]


# ------------------------------------------------------------------------------------------- tau < 1


@pytest.mark.parametrize("arch,taus", [("llama", [0.9, 0.7, 0.5, 0.3]), ("qwen2", [0.6])])
def test_cached_block_cached_and_no_cache_paths_agree_at_every_tau(arch, taus):
    model = mars_model(arch)
    prompts = random_prompts()
    speedups = []
    for tau in taus:
        reference = generate(model, None, prompts, tau=tau, max_new_tokens=16, batch_size=1, use_cache=False)
        speedups.append(reference.tokens_per_forward)
        for kwargs in (dict(batch_size=6, use_cache=False), dict(batch_size=1), dict(batch_size=6),
                       dict(batch_size=4, b_cache=B), dict(batch_size=6, b_cache=7),
                       dict(batch_size=6, backend=TorchBackend(model, lean=False))):  # the generic model forward
            results = generate(model, None, prompts, tau=tau, max_new_tokens=16, **kwargs)
            assert tokens(results) == tokens(reference), (tau, kwargs)
            assert [r.forwards for r in results] == [r.forwards for r in reference], (tau, kwargs)
    # the comparison means something: several tokens per forward, more as tau falls
    assert speedups == sorted(speedups) and speedups[-1] > 1.5


def test_per_sequence_tau_in_a_batch_gives_each_sequence_its_alone_output():
    model = mars_model()
    prompts = random_prompts()
    taus = [1.0, 0.5, 0.9, 0.3, 0.7, 1.0]
    alone = [generate(model, None, [p], tau=t, max_new_tokens=20)[0] for p, t in zip(prompts, taus)]
    for kwargs in (dict(batch_size=6), dict(batch_size=4), dict(batch_size=6, b_cache=8),
                   dict(batch_size=3, use_cache=False)):
        mixed = generate(model, None, prompts, tau=taus, max_new_tokens=20, **kwargs)
        assert tokens(mixed) == tokens(alone), kwargs
        assert [r.tau for r in mixed] == taus
    # tau changes per call on the same loaded model: 1.0 is still HF greedy after a tau < 1 call
    assert tokens(generate(model, None, prompts[:2], tau=1.0, max_new_tokens=20)) == \
        [hf_greedy(model, [p], 20)[0] for p in prompts[:2]]


def test_row_cache_keeps_rows_contiguous_and_grows_without_losing_entries():
    cache = RowCache(layers=1, rows=2, kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu", capacity=4)
    cache.window(3)
    cache.write(0, torch.arange(1.0, 7.0).view(6, 1, 1), torch.zeros(6, 1, 1))  # rows 0 and 1: entries 0..2
    cache.commit(torch.tensor([3, 1]))  # row 1 keeps one entry: its other two are rejected
    allowed = cache.window(2, where=(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])))  # row 1 computes one entry
    assert cache.capacity >= 5  # 3 committed + a window of 2
    keys, _ = cache.write(0, torch.tensor([7.0, 8.0, 9.0]).view(3, 1, 1), torch.zeros(3, 1, 1))
    assert keys[:, 0, :, 0].tolist() == [[1, 2, 3, 7, 8], [4, 9, 6, 0, 0]]  # row 1 overwrote its rejected entry
    # window entry k of row i sees entries <= length[i] + k
    assert allowed.int().tolist() == [[[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]]
    cache.commit(torch.tensor([2, 1]))
    cache.retain(torch.tensor([1]))
    assert cache.length.tolist() == [2] and cache.keys[0][0, 0, :2, 0].tolist() == [4, 9]


@pytest.mark.parametrize("arch,attn,split", [("llama", "sdpa", False), ("qwen2", "sdpa", False),
                                             ("llama", "eager", False), ("llama", "sdpa", True),
                                             ("llama", "eager", True)])
def test_lean_forward_gives_the_models_own_logits_on_ragged_windows(arch, attn, split, monkeypatch):
    """Rows 0-2 decode (a token + 3 masks each, read at different offsets); row 3 just took a finished
    row's place, so its window is a whole new prompt: the lean forward computes only what each row
    reads (ragged), the model's own forward computes every entry of the padded window. ``split``: the
    new prompt's row attends in a call of its own (here it saves too few queries to by default)."""
    if split:
        monkeypatch.setattr(AttentionGroups, "MIN_SAVED", 0)
    model = mars_model(arch, attn)
    lean, generic = TorchBackend(model), TorchBackend(model, lean=False)
    assert lean.lean and not generic.lean
    prompts = random_prompts((9, 4, 6, 2))
    new_prompt = random_prompts((12,), seed=5)[0]
    steps = [  # (window per row, read per row, real tokens committed per row)
        ([[7, MASK, MASK, MASK]] * 3 + [new_prompt + [MASK] * 3], [[0, 1, 2, 3]] * 3 + [[11, 12, 13, 14]],
         [1, 1, 1, 12]),
        ([[8, MASK, MASK, MASK], [8, 9, 10, 11, MASK, MASK, MASK], [8, 9, MASK, MASK, MASK], [13, MASK, MASK, MASK]],
         [[0, 1, 2, 3], [3, 4, 5, 6], [1, 2, 3, 4], [0, 1, 2, 3]], [1, 4, 2, 1]),
    ]
    logits = {}
    for name, backend in (("lean", lean), ("generic", generic)):
        backend.start(prompts)
        backend.reset(torch.tensor([3]))
        lengths = torch.tensor([9, 4, 6, 0])
        for windows, read, committed in steps:
            width = max(map(len, windows))
            ids = torch.tensor([w + [MASK] * (width - len(w)) for w in windows])
            out = backend.forward(ids, lengths[:, None] + torch.arange(width), torch.tensor(read))
            logits.setdefault(name, []).append(out)
            backend.commit(torch.tensor(committed))
            lengths = lengths + torch.tensor(committed)
    for got, ref in zip(logits["lean"], logits["generic"]):
        assert got.shape == ref.shape == (4, 4, VOCAB)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_few_far_wider_rows_attend_in_a_call_of_their_own():
    needed = torch.tensor([3, 62, 3, 3, 1, 3, 3, 3])  # a new prompt beside decoding rows
    where = (torch.arange(62)[None, :] < needed[:, None]).nonzero(as_tuple=True)
    allowed = torch.ones(8, 62, 70, dtype=torch.bool)
    groups = AttentionGroups(needed, where, allowed, lambda a: a)
    assert [(None if rows is None else rows.tolist(), width) for rows, width, *_ in groups.groups] == \
        [(None, 3), ([1], 62)]  # 8 x 3 + 62 queries instead of 8 x 62
    # attention is per row: packed queries come back packed, each from its own group
    q = torch.randn(int(needed.sum()), 2, 4)
    keys = torch.randn(8, 2, 70, 4)

    def attend(q_, k_, v_, mask):  # [rows, heads, W, d] -> [rows, W, heads, d]: a query's own value
        return q_.transpose(1, 2) * 1.0

    assert torch.equal(groups.attend(attend, q, keys, keys), q.reshape(q.shape[0], -1))
    close = torch.tensor([3, 7, 3, 3, 1, 3, 3, 3])  # widths close together: one call
    where = (torch.arange(7)[None, :] < close[:, None]).nonzero(as_tuple=True)
    assert len(AttentionGroups(close, where, allowed[:, :7], lambda a: a).groups) == 1


def test_lean_forward_is_for_llama_and_qwen2_only():
    model = mars_model()
    model.config.model_type = "mistral"
    assert not TorchBackend.supports_lean(model) and not TorchBackend(model).lean
    with pytest.raises(MarsError, match="lean forward supports llama, qwen2"):
        TorchBackend(model, lean=True)


class RecordingBackend(TorchBackend):
    """The real torch backend, recording the rows and width of each forward and what each commit kept."""

    def __init__(self, model):
        super().__init__(model)
        self.rows, self.widths, self.commits, self.refilled, self.extended, self.prefixes = [], [], [], 0, 0, []

    def forward(self, window_ids, positions, read=None):
        self.rows.append(window_ids.shape[0])
        self.widths.append(window_ids.shape[1])
        return super().forward(window_ids, positions, read)

    def commit(self, n_accept):
        self.commits.append(n_accept.tolist())
        super().commit(n_accept)

    def reset(self, rows):
        self.refilled += len(rows)
        super().reset(rows)

    def extend(self, count):
        self.extended += count
        super().extend(count)

    def cache_prefix(self, ids):
        self.prefixes.append(list(ids))
        super().cache_prefix(ids)


@pytest.mark.parametrize("b_cache", [None, 8])
def test_finished_sequences_leave_the_batch(b_cache):
    model = mars_model()
    prompts = random_prompts()
    backend = RecordingBackend(model)
    results = generate(model, None, prompts, tau=0.7, max_new_tokens=20, batch_size=6, b_cache=b_cache,
                       backend=backend)
    assert tokens(results) == tokens(generate(model, None, prompts, tau=0.7, max_new_tokens=20, use_cache=False))
    assert backend.rows[0] == 6 and backend.rows == sorted(backend.rows, reverse=True) and backend.rows[-1] < 6
    assert results.model_calls == len(backend.rows)


def test_a_finished_row_takes_the_next_waiting_prompt():
    model = mars_model()
    prompts = random_prompts()
    backend = RecordingBackend(model)
    results = generate(model, None, prompts, tau=0.7, max_new_tokens=20, batch_size=3, backend=backend)
    static = generate(model, None, prompts, tau=0.7, max_new_tokens=20, batch_size=3, use_cache=False)
    assert tokens(results) == tokens(static) and [r.forwards for r in results] == [r.forwards for r in static]
    assert backend.refilled == 3  # every prompt beyond the first three took a finished row's place
    busy = next(k for k, rows in enumerate(backend.rows) if rows < 3)
    assert set(backend.rows[:busy]) == {3}  # the batch stays full while prompts wait...
    assert backend.rows[busy:] == sorted(backend.rows[busy:], reverse=True)  # ...then shrinks as rows finish
    assert results.model_calls <= static.model_calls  # two static batches wait for their slowest rows


def test_results_report_tokens_forwards_and_finish():
    model = mars_model()
    results = generate(model, None, random_prompts(), tau=0.5, max_new_tokens=20, batch_size=3)
    for r in results:
        assert isinstance(r, GenerationResult) and 1 <= len(r.token_ids) <= 20
        assert (r.finish_reason == "stop") == (r.token_ids[-1] == EOS) and EOS not in r.token_ids[:-1]
        assert r.finish_reason == "stop" or len(r.token_ids) == 20
        assert r.tokens_per_forward == pytest.approx(len(r.token_ids) / r.forwards) and r.block_size == B
    assert results.tokens_per_forward == pytest.approx(results.tokens / results.forwards)
    assert results.tokens_per_forward > 1.0


def test_generation_stops_at_the_model_context():
    model = mars_model()
    model.generation_config.eos_token_id = None
    context = model.config.max_position_embeddings
    prompt = random_prompts((context - 5,))[0]
    (result,) = generate(model, None, [prompt], tau=0.5, max_new_tokens=50)
    assert len(result.token_ids) == 5 and result.finish_reason == "length"


# ------------------------------------------------------------------------------------------- lossless mode

BLOCKS = (2, 4, 8)


def test_lossless_accept_keeps_drafts_while_they_are_the_greedy_tokens():
    # read j's greedy token is 10 + j; a lossless row's draft j is checked against read j's token
    logits = _slot_logits([[0.2] * 4] * 4 + [[0.95, 0.95, 0.5, 0.99]])
    drafts = torch.tensor([[10, 11, 12], [10, 7, 12], [-1, -1, -1], [10, 11, -1], [-1, -1, -1]])
    lossless = torch.tensor([True, True, True, True, False])
    toks, n, stopped = accept(logits, torch.full((5,), 0.9), torch.zeros(5, dtype=torch.bool),
                              torch.tensor([], dtype=torch.long), torch.full((5,), 99), lossless, drafts)
    # all three drafts right: they and the token read after the last one (4); the second draft wrong:
    # the first draft and the greedy token in place of the wrong one (2); no drafts: the one AR token;
    # confidence plays no part in lossless rows, and a tau row beside them keeps the tau rule (2)
    assert n.tolist() == [4, 2, 1, 3, 2] and not stopped.any()
    assert toks[1, :2].tolist() == [10, 11]
    _, n, stopped = accept(logits[:1], torch.tensor([0.9]), torch.tensor([False]), torch.tensor([11]),
                           torch.tensor([99]), lossless[:1], drafts[:1])
    assert n.tolist() == [2] and stopped.tolist() == [True]  # a verified stop token ends the row
    _, n, _ = accept(logits[:1], torch.tensor([0.9]), torch.tensor([False]), torch.tensor([], dtype=torch.long),
                     torch.tensor([3]), lossless[:1], drafts[:1])
    assert n.tolist() == [3]  # within the budget


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lossless_is_hf_greedy_token_for_token_at_every_block_size(arch):
    model = mars_model(arch)
    prompts = random_prompts()
    alone = [hf_greedy(model, [p], 16)[0] for p in prompts]
    for block_size in BLOCKS:
        reference = generate(model, None, prompts, mode="lossless", block_size=block_size, max_new_tokens=16,
                             batch_size=1, use_cache=False)
        assert tokens(reference) == alone, block_size
        for kwargs in (dict(batch_size=6, use_cache=False), dict(batch_size=1), dict(batch_size=6),
                       dict(batch_size=4), dict(batch_size=6, b_cache=block_size),
                       dict(batch_size=6, b_cache=block_size + 3),
                       dict(batch_size=6, backend=TorchBackend(model, lean=False))):
            results = generate(model, None, prompts, mode="lossless", block_size=block_size, max_new_tokens=16,
                               **kwargs)
            assert tokens(results) == alone, (block_size, kwargs)
            assert [r.forwards for r in results] == [r.forwards for r in reference], (block_size, kwargs)
            assert all(r.mode == "lossless" for r in results)


DRAFT_EOS = 30


@pytest.fixture(scope="module")
def drafting_model():
    """A tiny Llama MARS-trained (B = 4) on repeated phrases: lossless drafts verify, unlike a random model's."""
    model = train_to_draft(tiny_model("llama", vocab=VOCAB), MASK, block_size=B)
    model.config.mars = {"block_size": B, "mask_token_id": MASK}
    model.generation_config.eos_token_id = DRAFT_EOS  # a token it has learnt to repeat
    return model


def test_lossless_drafts_verify_several_tokens_per_forward_and_stay_exact(drafting_model):
    model = drafting_model
    repeating = [x[:n] for x, n in zip(periodic(5, 12, seed=1000), (7, 6, 11, 8, 9))]
    stopping = [([12, DRAFT_EOS, 40] * 3)[:8]]  # greedy stops three tokens in: on a verified draft
    other = random_prompts((6, 3, 10), seed=3)  # no phrase to repeat: drafts verify now and then
    prompts = repeating + stopping + other
    new = 20
    alone = [hf_greedy(model, [p], new)[0] for p in prompts]
    assert [len(a) for a in alone[:5]] == [new] * 5 and alone[5] == [40, 12, DRAFT_EOS]
    for block_size in BLOCKS:
        reference = generate(model, None, prompts, mode="lossless", block_size=block_size, max_new_tokens=new,
                             batch_size=1, use_cache=False)
        assert tokens(reference) == alone, block_size
        # every draft right: one AR token from the prompt's forward, then B per forward
        assert [r.forwards for r in reference[:5]] == [1 + -(-(new - 1) // block_size)] * 5, block_size
        assert any(len(r.token_ids) > r.forwards > 1 + -(-(len(r.token_ids) - 1) // block_size)
                   for r in reference[6:]), block_size  # some drafts right, some wrong
        for kwargs in (dict(batch_size=9), dict(batch_size=4), dict(batch_size=9, b_cache=block_size),
                       dict(batch_size=9, b_cache=2 * block_size + 1), dict(batch_size=3, use_cache=False),
                       dict(batch_size=9, backend=TorchBackend(model, lean=False))):
            results = generate(model, None, prompts, mode="lossless", block_size=block_size,
                               max_new_tokens=new, **kwargs)
            assert tokens(results) == alone, (block_size, kwargs)
            assert [r.forwards for r in results] == [r.forwards for r in reference], (block_size, kwargs)


def test_lossless_windows_hold_the_last_token_the_drafts_and_masks_and_only_verified_tokens_are_cached(
        drafting_model):
    prompt = periodic(1, 7, seed=3000)[0]
    backend = RecordingBackend(drafting_model)
    (result,) = generate(drafting_model, None, [prompt], mode="lossless", max_new_tokens=11, backend=backend)
    # the prompt + 3 masks -> 1 token and 3 drafts; then the last token + 3 drafts + 3 masks -> 4 tokens
    # (its 3 drafts and the token after them) and 3 drafts; the last step verifies only the draft the
    # budget can use (11 = 1 + 4 + 4 + 2)
    assert backend.widths == [7 + 3, 1 + 3 + 3, 1 + 3 + 3, 1 + 1 + 3] and result.forwards == 4
    assert backend.commits == [[7], [1 + 3], [1 + 3], [1 + 1]]  # the token fed last and the verified drafts
    assert result.token_ids == hf_greedy(drafting_model, [prompt], 11)[0]
    for prompt in random_prompts((6, 3, 10), seed=3):  # drafts right and wrong: every step caches all but
        backend = RecordingBackend(drafting_model)  # the newest token, never a draft it has not verified
        (result,) = generate(drafting_model, None, [prompt], mode="lossless", max_new_tokens=20, backend=backend)
        assert sum(c for (c,) in backend.commits) == len(prompt) + len(result.token_ids) - 1


def test_lossless_rows_refill_and_mix_with_tau_rows_as_if_alone(drafting_model):
    model = drafting_model
    prompts = [x[:n] for x, n in zip(periodic(4, 12, seed=2000), (7, 4, 10, 5))] + random_prompts((6, 9), seed=4)
    modes = ["lossless", "tau", "lossless", "tau", "lossless", "tau"]
    taus = [0.9, 0.5, 0.3, 1.0, 0.7, 0.9]
    alone = [generate(model, None, [p], mode=m, tau=t, max_new_tokens=20)[0] for p, m, t in zip(prompts, modes, taus)]
    assert [a.token_ids for a, m in zip(alone, modes) if m == "lossless"] == \
        [hf_greedy(model, [p], 20)[0] for p, m in zip(prompts, modes) if m == "lossless"]
    backend = RecordingBackend(model)
    for kwargs in (dict(batch_size=6), dict(batch_size=2, backend=backend), dict(batch_size=6, b_cache=8),
                   dict(batch_size=4, use_cache=False)):
        mixed = generate(model, None, prompts, mode=modes, tau=taus, max_new_tokens=20, **kwargs)
        assert tokens(mixed) == tokens(alone), kwargs
        assert [r.forwards for r in mixed] == [r.forwards for r in alone], kwargs
        assert [r.mode for r in mixed] == modes and [r.tau for r in mixed] == taus
    assert backend.refilled == 4  # two rows, six prompts: continuous batching refilled four times
    lossless = [a for a, m in zip(alone, modes) if m == "lossless"]
    assert sum(len(a.token_ids) for a in lossless) > 2 * sum(a.forwards for a in lossless)


def test_a_row_with_its_own_block_size_forwards_only_its_masks_and_decodes_as_at_that_block_size(drafting_model):
    """In a batch of B = 4, a row of block size w forwards w - 1 masks (a lossless row: w - 1 drafts and
    w - 1 masks) and a tau = 1 row none: the window is as wide as its widest row needs, and each row gets
    the tokens and forwards it gets alone at its own block size."""
    model = drafting_model
    prompt = periodic(1, 7, seed=3000)[0]
    backend = RecordingBackend(model)
    batch = CachedBatch(backend, block_size=B, stop_ids=torch.tensor([DRAFT_EOS]), mask_id=MASK)
    batch.add([DecodeRow(prompt, 11, Setting(lossless=True, width=2))])
    while len(batch):
        (update,) = [u for u in batch.step() if u.done] or [None]
    alone = generate(model, None, [prompt], mode="lossless", block_size=2, max_new_tokens=11)[0]
    assert update.token_ids == alone.token_ids == hf_greedy(model, [prompt], 11)[0]
    assert update.forwards == alone.forwards
    assert backend.widths[1:] == [1 + 1 + 1] * (len(backend.widths) - 1)  # the last token, a draft, a mask

    prompts = [x[:n] for x, n in zip(periodic(3, 12, seed=2100), (7, 5, 9))] + random_prompts((6, 4, 8), seed=5)
    settings = [("lossless", 1.0, 2), ("lossless", 1.0, None), ("tau", 0.5, 2), ("tau", 1.0, None),
                ("lossless", 1.0, 3), ("tau", 0.5, 3)]
    rows = [DecodeRow(p, 16, Setting(t, m == "lossless", w), key=i)
            for i, (p, (m, t, w)) in enumerate(zip(prompts, settings))]
    backend = RecordingBackend(model)
    batch = CachedBatch(backend, block_size=B, stop_ids=torch.tensor([DRAFT_EOS]), mask_id=MASK)
    batch.add(rows)
    done = {}
    while len(batch):
        done.update({u.row.key: u for u in batch.step() if u.done})
    for i, (p, (m, t, w)) in enumerate(zip(prompts, settings)):
        (alone,) = generate(model, None, [p], mode=m, tau=t, block_size=w or B, max_new_tokens=16)
        assert (done[i].token_ids, done[i].forwards) == (alone.token_ids, alone.forwards), settings[i]
    assert max(backend.widths[1:]) <= 2 * B - 1


def test_rows_starting_with_the_shared_prompt_head_get_its_cache_and_decode_as_alone(drafting_model):
    """With a ``prefix``, a joining row whose prompt starts with it (and goes on) gets the head's cache entries
    copied in and forwards only the rest of its prompt; each row decodes as alone, whether it joined an empty
    batch, took a finished row's place or joined a running batch."""
    model = drafting_model
    head = periodic(1, 6, seed=4000)[0]
    tails = [x[:n] for x, n in zip(periodic(5, 9, seed=4100), (3, 1, 5, 2, 4))]
    prompts = [head + t for t in tails] + [head[:4] + [50, 51], list(head)]  # the last two do not start past it
    settings = [("lossless", 1.0), ("tau", 0.5), ("tau", 1.0), ("lossless", 1.0), ("tau", 0.7), ("lossless", 1.0),
                ("tau", 1.0)]
    rooms = [5, 12, 4, 12, 6, 9, 7]
    rows = [DecodeRow(p, room, Setting(t, m == "lossless"), key=i)
            for i, (p, (m, t), room) in enumerate(zip(prompts, settings, rooms))]
    backend = RecordingBackend(model)
    batch = CachedBatch(backend, block_size=B, stop_ids=torch.tensor([DRAFT_EOS]), mask_id=MASK, prefix=head)
    # the head is computed when a row first needs it, by the caller that adds and steps rows (the server's
    # engine thread): a forward in another thread slowed that thread's steps ~45%
    assert backend.prefixes == []
    batch.add(rows[:3])
    assert backend.prefixes == [head]
    # the first window holds the tails only: 3 + 3 masks, 1 + 3 masks, 5 (tau = 1: no mask)
    done = {u.row.key: u for u in batch.step() if u.done}
    assert backend.widths == [6]
    pending = rows[3:]
    while len(batch) or pending:
        if pending:  # into a finished row's place where one is free, else at the end of the running batch
            batch.add([pending.pop(0)])
        done.update({u.row.key: u for u in batch.step() if u.done})
    assert backend.refilled and backend.extended
    assert batch.prefix_hits == 5 and backend.prefixes == [head]  # computed once
    for i, (p, (m, t), room) in enumerate(zip(prompts, settings, rooms)):
        (alone,) = generate(model, None, [p], mode=m, tau=t, max_new_tokens=room)
        assert (done[i].token_ids, done[i].forwards) == (alone.token_ids, alone.forwards), i


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("prompts,kwargs,message", [
    (["   "], dict(tau=0.9), "empty prompt"),
    ([[]], dict(tau=0.9), "empty list"),
    ([[3] * 256], dict(tau=0.9), "context"),
    ([[3]], dict(tau=0.0), "tau"),
    ([[3]], dict(tau=1.5), "tau"),
    ([[3]], dict(tau=float("nan")), "tau"),
    ([[3], [4]], dict(tau=[0.9]), "tau"),
    ([[3]], dict(tau=0.9, block_size=0), "block_size"),
    ([[3]], dict(tau=0.9, b_cache=2), "b_cache"),
    ([[3]], dict(mode="fast"), "mode: must be one of tau, lossless, got 'fast'"),
    ([[3], [4]], dict(mode=["lossless"]), "mode: got 1 values for 2 prompts"),
    ([[3], [4]], dict(mode=["lossless", "greedy"]), r"mode\[1\]"),
])
def test_bad_input_is_a_clear_error(prompts, kwargs, message):
    with pytest.raises(MarsError, match=message):
        generate(mars_model(), None, prompts, max_new_tokens=4, **kwargs)


def test_a_checkpoint_without_mask_token_cannot_decode_below_tau_one():
    model = tiny_model("llama", vocab=VOCAB)
    with pytest.raises(MarsError, match="mask token"):
        generate(model, None, [[3, 4]], tau=0.9, block_size=4, max_new_tokens=4)
    with pytest.raises(MarsError, match="block_size"):
        generate(model, None, [[3, 4]], tau=0.9, max_new_tokens=4)
    with pytest.raises(MarsError, match="mask token"):  # lossless drafts come from the mask slots too
        generate(model, None, [[3, 4]], mode="lossless", block_size=4, max_new_tokens=4)


# ------------------------------------------------------------------------------------------- SmolLM2, CLI

CHAT = ["What is the capital of France?", "List three prime numbers."]


@pytest.mark.slow
def test_smollm2_tau_one_is_hf_greedy_on_chat_prompts(smollm2_dir):
    from mars.core.models import load_model

    model, tokenizer = load_model(smollm2_dir)
    encoded = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in CHAT]
    eos = model.generation_config.eos_token_id
    alone = []
    for ids in encoded:  # HF greedy with KV cache, one prompt at a time; cut after EOS
        row = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
        alone.append(row[: row.index(eos) + 1] if eos in row else row)
    for batch_size in (1, 2):
        results = generate(model, tokenizer, CHAT, tau=1.0, max_new_tokens=10, batch_size=batch_size)
        assert [r.prompt_token_ids for r in results] == [list(ids) for ids in encoded]
        assert tokens(results) == alone
        assert [r.text for r in results] == [tokenizer.decode(a, skip_special_tokens=True) for a in alone]


@pytest.mark.slow
def test_smollm2_lossless_is_hf_greedy_at_every_block_size(smollm2_dir):
    """Real weights (fp32) with a fresh mask token: its drafts are seldom right, the output always is."""
    from mars.core.mask_token import add_mask_token
    from mars.core.models import load_model

    model, tokenizer = load_model(smollm2_dir)
    model.config.mars = {"block_size": 4, "mask_token_id": add_mask_token(model, tokenizer).token_id}
    counting = tokenizer("1, 2, 3, 4, 5, 6, 7, 8,", add_special_tokens=False)["input_ids"]
    prompts = CHAT + [counting]  # ragged: two chat turns and a bare continuation
    encoded = [r.prompt_token_ids for r in generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=1)]
    eos = model.generation_config.eos_token_id
    alone = []
    for ids in encoded:
        row = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        alone.append(row[: row.index(eos) + 1] if eos in row else row)
    for block_size in BLOCKS:
        reference = generate(model, tokenizer, prompts, mode="lossless", block_size=block_size, max_new_tokens=8,
                             batch_size=3, use_cache=False)
        assert tokens(reference) == alone, block_size
        for kwargs in (dict(batch_size=1), dict(batch_size=3), dict(batch_size=3, b_cache=block_size)):
            results = generate(model, tokenizer, prompts, mode="lossless", block_size=block_size,
                               max_new_tokens=8, **kwargs)
            assert tokens(results) == alone, (block_size, kwargs)
            assert [r.forwards for r in results] == [r.forwards for r in reference], (block_size, kwargs)


def test_cli_generate_json(smollm2_dir, tmp_path, capsys):
    """``mars generate --json`` on a small random checkpoint with SmolLM2's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mars.core.mask_token import add_mask_token
    from mars.core.models import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256))
    info = add_mask_token(model, tokenizer)
    model.config.mars = {"block_size": 4, "mask_token_id": info.token_id}
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    argv = ["--model", str(tmp_path / "ckpt"), "--tau", "0.8", "--max-new-tokens", "6", "--json",
            "--params", str(tmp_path / "none.yaml"), CHAT[0], CHAT[1]]
    with pytest.raises(MarsError, match="none.yaml"):
        generate_cli(argv)
    (tmp_path / "none.yaml").write_text("decode: {batch_size: 2}\n")
    assert generate_cli(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == CHAT
    for line in lines:
        assert {"prompt_token_ids", "token_ids", "text", "forwards", "tokens_per_forward"} <= set(line)
        assert line["block_size"] == 4 and line["tau"] == 0.8 and len(line["token_ids"]) == 6
        assert line["text"] == tokenizer.decode(line["token_ids"], skip_special_tokens=True)
    # --mode lossless (or decode.mode): the greedy tokens, as tau = 1.0 gives them
    for args in (["--mode", "lossless"], ["--tau", "1.0"]):
        assert generate_cli(argv[:2] + args + argv[4:]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    lossless, greedy = lines[:2], lines[2:]
    assert [line["mode"] for line in lossless] == ["lossless"] * 2 and [line["mode"] for line in greedy] == ["tau"] * 2
    assert [line["token_ids"] for line in lossless] == [line["token_ids"] for line in greedy]
    (tmp_path / "none.yaml").write_text("decode: {tau: 2.0}\n")
    with pytest.raises(MarsError, match="decode.tau"):
        generate_cli(argv)
    (tmp_path / "none.yaml").write_text("decode: {mode: fast}\n")
    with pytest.raises(MarsError, match="decode.mode"):
        generate_cli(argv)


def test_a_prompts_file_line_bench_decode_cannot_read_is_one_line_naming_it(tmp_path):
    from mars.decoding.speed import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hi"}\n\n' + "[" * 100_000 + "\n")
    with pytest.raises(MarsError, match=rf"{path}:3: not valid JSON \(nested too deeply\)"):
        load_prompts(None, 4, prompts_file=str(path))
    path.write_text('{"text": "hi"}\n')
    with pytest.raises(MarsError, match=rf"{path}:1: no 'prompt' text"):
        load_prompts(None, 4, prompts_file=str(path))


def test_bench_reports_medians_speedups_and_ceiling_against_hf():
    from mars.decoding.speed import format_table, run

    model = mars_model()
    report = run(model, None, random_prompts((5, 9, 3)), batch_sizes=[1, 2], taus=[1.0, 0.5], block_size=B,
                 max_new_tokens=6, b_cache=None, repeats=1)
    rows = {(r["batch_size"], r["method"], r["tau"]): r for r in report["rows"]}
    # HF prompt lookup only at batch 1 (HF's candidate generator takes one row)
    assert set(rows) == {(bs, m, t) for bs in (1, 2) for m, t in (("hf_generate", None), ("mars", 1.0),
                                                                   ("mars", 0.5), ("mars_lossless", None))} | \
        {(1, "hf_prompt_lookup", None)}
    lookup = rows[1, "hf_prompt_lookup", None]
    assert lookup["same_as_hf"] == 3  # greedy output: drafts are verified
    assert lookup["tokens_per_forward"] >= 1.0 and lookup["speedup_vs_ar"] is None and lookup["ceiling_speedup"] is None
    for bs in (1, 2):
        assert rows[bs, "hf_generate", None]["speedup_vs_hf"] == 1.0
        assert rows[bs, "hf_generate", None]["tokens_per_forward"] == 1.0  # one forward per token, prefill not counted
        assert rows[bs, "hf_generate", None]["speedup_vs_ar"] is None and rows[bs, "mars", 1.0]["speedup_vs_ar"] == 1.0
        assert rows[bs, "mars", 0.5]["speedup_vs_ar"] == pytest.approx(
            rows[bs, "mars", 0.5]["speedup_vs_hf"] / rows[bs, "mars", 1.0]["speedup_vs_hf"])
        assert rows[bs, "mars", 1.0]["same_as_hf"] == 3  # same greedy output, prompt for prompt
        assert rows[bs, "mars", 1.0]["ceiling_speedup"] == 1.0
        assert rows[bs, "mars", 0.5]["tokens_per_forward"] > 1.0 and rows[bs, "mars", 0.5]["ceiling_speedup"] > 0
        lossless = rows[bs, "mars_lossless", None]
        assert lossless["same_as_hf"] == 3  # greedy output too
        assert lossless["tokens_per_forward"] >= 1.0 and lossless["ceiling_speedup"] > 0
        assert lossless["speedup_vs_ar"] == pytest.approx(lossless["speedup_vs_hf"] / rows[bs, "mars", 1.0]["speedup_vs_hf"])
    table = format_table(report)
    assert "mars tau=0.5" in table and "mars lossless" in table and "hf lookup" in table


def test_a_model_never_trained_with_masks_is_refused_below_tau_1():
    """An AR checkpoint (config.mars.objective: ar) or a base model (a mask token, no config.mars) is
    confidently wrong below tau = 1: refused there unless the caller asks for it; tau = 1 and lossless stay."""
    prompts = random_prompts((5, 9))
    ar = mars_model()
    ar.config.mars = {**ar.config.mars, "objective": "ar", "stage": "ar_control"}
    base = mars_model()
    del base.config.mars
    base.config.mask_token_id = MASK
    for model, what in ((ar, "config.mars.objective is ar"), (base, "no config.mars")):
        with pytest.raises(MarsError, match=f"never trained with masks.*{what}.*allow_untrained"):
            generate(model, None, prompts, tau=[1.0, 0.9], block_size=B, max_new_tokens=4)
        assert len(generate(model, None, prompts, tau=1.0, max_new_tokens=4)) == 2
        assert len(generate(model, None, prompts, mode="lossless", block_size=B, max_new_tokens=4)) == 2
        assert len(generate(model, None, prompts, tau=0.9, block_size=B, max_new_tokens=4, allow_untrained=True)) == 2
    trained = mars_model()
    trained.config.mars = {**trained.config.mars, "objective": "mars"}
    assert len(generate(trained, None, prompts, tau=0.9, max_new_tokens=4)) == 2


def test_a_block_larger_than_the_models_context_is_refused():
    with pytest.raises(MarsError, match=r"block_size: 100000 is more than the model's context \(256 positions\)"):
        generate(mars_model(), None, random_prompts((3,)), tau=0.9, block_size=100_000, max_new_tokens=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_heads_stacked_as_queries_give_transformers_attention_bit_for_bit(dtype):
    """A window of several queries on a GQA model (4 query heads, 2 key/value heads): the lean forward
    stacks the query heads of a key/value head as queries instead of repeating the cache span per head,
    and gets exactly what transformers' sdpa attention gets, at one query too (where transformers stacks them)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = mars_model("llama", "sdpa").to(dtype)
    backend = TorchBackend(model)
    assert backend.stack_gqa and backend.kv_groups == 2
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    for rows, width, span in ((3, 4, 11), (2, 1, 9), (1, 12, 12)):
        q = torch.randn(rows, 4, width, backend.head_dim, generator=gen).to(dtype)
        cache = torch.randn(2, rows, 2, span + 5, backend.head_dim, generator=gen).to(dtype)
        keys, values = cache[0, :, :, :span], cache[1, :, :, :span]  # a view of a longer cache, as decoding has
        lengths = torch.randint(0, span - width + 1, (rows,), generator=gen)
        allowed = torch.arange(span)[None, None, :] <= (lengths[:, None] + torch.arange(width))[:, :, None]
        got = backend._attention(attn, q, keys, values, backend._mask(allowed))
        ref, _ = sdpa_attention_forward(attn, q, keys, values, allowed[:, None], dropout=0.0, scaling=attn.scaling)
        assert got.shape == (rows, width, 4, backend.head_dim)
        assert torch.equal(got, ref)


def test_the_greedy_token_is_the_first_of_tied_maxima_as_hf_greedy_takes_it():
    logits = torch.tensor([[[0.5, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]],
                           [[-1.0, -4.0, -1.0, -1.0], [0.0, 1.0, 0.0, 1.0]]])
    for dtype in (torch.float32, torch.bfloat16):
        assert greedy_tokens(logits.to(dtype)).tolist() == [[1, 0], [0, 1]]
    wide = torch.randn(3, 5, 49153).bfloat16()  # a real vocabulary's width, bf16 as served: many exact ties
    wide[:, :, 7] = wide.amax(-1)
    assert torch.equal(greedy_tokens(wide), wide.float().argmax(-1))
