"""mars.decoding.tree (issue #43): draft trees from the mask slots, their attention mask, their verification,
and the no-cache tree reference, which decodes exactly as HF greedy for any tree."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_decoding import EOS_OF, MASK, VOCAB, mars_model, random_prompts

from mars.decoding.accept import greedy_tokens
from mars.decoding.batch import CachedBatch, DecodeRow
from mars.decoding.generate import DecodeConfig, decode_cached, generate
from mars.decoding.reference import decode_no_cache
from mars.decoding.setting import Setting
from mars.decoding.tau_policy import AUTO_TREES, PolicyConfig, Steering
from mars.decoding.tree_shape import AUTO, tree_shape
from mars.decoding.tree import CHAIN, ROOT, ROOT_ONLY, Tree, TreeShape, Verdict, build_tree, tree_window, verify
from mars.decoding.torch_backend import TorchBackend, attention_mask
from mars.decoding.tree_reference import decode_tree_no_cache, window_mask
from mars.errors import ConfigError, MarsError

ROOMS = [16, 5, 16, 9, 1, 16]


def hf_greedy(model, prompt, max_new_tokens):
    """HF generate, greedy with KV cache, one prompt; cut after EOS."""
    eos = model.generation_config.eos_token_id
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def tree_decode(model, prompts, block_size, shape, room):
    return decode_tree_no_cache(model, prompts, block_size=block_size, shape=shape, room=room,
                                stop_ids=[model.generation_config.eos_token_id], mask_id=MASK)


def bits(rows):
    return torch.tensor([[c == "1" for c in row.replace(" ", "")] for row in rows])


# ------------------------------------------------------------------------------------------- the tree window

# depth 0: nodes 0 (token 10) and 1 (11); node 2 (12) and 3 (13) under node 0; node 4 (14) under node 2
HAND = Tree(tokens=(10, 11, 12, 13, 14), parents=(ROOT, ROOT, 0, 0, 2), logp=(0.0,) * 5, groups=(ROOT, 1, 4))


def test_tree_mask_equals_a_hand_built_reference():
    assert HAND.depths == (0, 0, 1, 1, 2) and HAND.path(4) == [0, 2, 4] and HAND.path(ROOT) == []
    assert torch.equal(HAND.ancestors(), bits(["10000",
                                               "01000",
                                               "10100",
                                               "10010",
                                               "10101"]))
    window = tree_window(HAND, 2, MASK)  # B = 3: two masks after the root, after node 1 and after node 4
    assert window.ids.tolist() == [10, 11, 12, 13, 14] + [MASK] * 6
    # a group's mask j after a node of depth d sits at depth d + 1 + j (the root's depth is -1)
    assert window.depth.tolist() == [0, 0, 1, 1, 2] + [0, 1] + [1, 2] + [3, 4]
    assert window.group_start == (5, 7, 9)
    assert torch.equal(window.allowed, bits(["10000 00 00 00",
                                             "01000 00 00 00",
                                             "10100 00 00 00",
                                             "10010 00 00 00",
                                             "10101 00 00 00",
                                             "00000 10 00 00",  # the root's group: the prefix only
                                             "00000 11 00 00",
                                             "01000 00 10 00",  # node 1's group: node 1's path
                                             "01000 00 11 00",
                                             "10101 00 00 10",  # node 4's group: nodes 0, 2, 4
                                             "10101 00 00 11"]))
    # after a prefix of n tokens: causal over the prefix, which every window entry sees
    full = window_mask(window, 3)
    assert torch.equal(full[:3, :3], torch.ones(3, 3, dtype=torch.bool).tril()) and not full[:3, 3:].any()
    assert full[3:, :3].all() and torch.equal(full[3:, 3:], window.allowed)


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_every_window_entry_reads_what_its_own_path_reads_causally(arch, attn):
    """The mask and positions are right: a node's logits are those of prefix + its path in a plain causal
    forward; a mask group's are those of prefix + its node's path + the masks."""
    model = mars_model(arch, attn)
    prefix = random_prompts((6,))[0]
    window = tree_window(HAND, 2, MASK)
    n = len(prefix)
    ids = torch.tensor([prefix + window.ids.tolist()])
    positions = torch.cat([torch.arange(n), n + window.depth])[None]
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions,
                       attention_mask=attention_mask(model, window_mask(window, n)[None])).logits[0, n:]

        def causal(tokens, last):
            return model(input_ids=torch.tensor([prefix + tokens])).logits[0, -last:]

        for j in range(len(HAND)):
            path = [HAND.tokens[i] for i in HAND.path(j)]
            torch.testing.assert_close(logits[j], causal(path, 1)[0], rtol=0, atol=1e-4)
        for node, start in zip(HAND.groups, window.group_start):
            path = [HAND.tokens[i] for i in HAND.path(node)]
            torch.testing.assert_close(logits[start: start + 2], causal(path + [MASK, MASK], 2), rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------- building a tree


def _all_paths(logp, shape):
    """Every path of the full top-k product with its log-probability (brute force)."""
    ranked = logp.sort(-1, descending=True)
    paths = [((), 0.0)]
    out = []
    for d in range(logp.shape[0]):
        paths = [(p + (int(ranked.indices[d, r]),), lp + float(ranked.values[d, r]))
                 for p, lp in paths for r in range(shape.k(d))]
        out += paths
    return out


@pytest.mark.parametrize("top_k", [(2,), (3,), (3, 2, 1), (1, 4)])
@pytest.mark.parametrize("budget", [1, 4, 7, 15, None])
def test_a_tree_keeps_the_most_probable_paths_within_its_budget(top_k, budget):
    logp = torch.randn(3, 12, generator=torch.Generator().manual_seed(sum(top_k) + (budget or 0))).log_softmax(-1)
    shape = TreeShape(top_k, budget)
    tree = build_tree(logp, shape)
    paths = sorted(_all_paths(logp, shape), key=lambda p: -p[1])
    expected = paths[: budget if budget is not None else len(paths)]
    assert {tuple(tree.tokens[i] for i in tree.path(j)) for j in range(len(tree))} == {p for p, _ in expected}
    assert all(p < j for j, p in enumerate(tree.parents))  # parents first: the window can be laid out in order
    for j in range(len(tree)):
        assert math.isclose(tree.logp[j], sum(float(logp[d, tree.tokens[i]]) for d, i in enumerate(tree.path(j))),
                            abs_tol=1e-5)


def test_the_chain_is_the_mask_slots_greedy_tokens_with_masks_after_the_last():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    tree = build_tree(logits.log_softmax(-1), CHAIN)
    assert list(tree.tokens) == greedy_tokens(logits).tolist()  # today's drafts
    assert tree.parents == (ROOT, 0, 1) and tree.groups == (2,)
    assert build_tree(logits[:1].log_softmax(-1), CHAIN).groups == (0,)
    assert build_tree(logits[:0].log_softmax(-1), TreeShape((3,))) == ROOT_ONLY  # no room for drafts
    assert build_tree(logits.log_softmax(-1), TreeShape((3,), max_nodes=0)) == ROOT_ONLY


# p(token 0) = 0.6, p(1) = 0.3 at depth 0; p(0) = 0.7, p(1) = 0.2 at depth 1 (two more tokens share the rest)
TWO_DEEP = torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.7, 0.2, 0.05, 0.05]]).log()


def test_mask_groups_go_after_every_node_the_top_path_or_the_likeliest_ends():
    tree = build_tree(TWO_DEEP, TreeShape((2,)))
    # most probable first: [0] .6, [0 0] .42, [1] .3, [1 0] .21, [0 1] .12, [1 1] .06
    assert tree.tokens == (0, 0, 1, 0, 1, 1) and tree.parents == (ROOT, 0, ROOT, 2, 0, 2)
    assert tree.groups == (ROOT, 0, 1, 2, 3, 4, 5)
    assert build_tree(TWO_DEEP, TreeShape((2,), masks="top")).groups == (1,)  # the end of [0 0]
    # the path ends at X with p(X) * (1 - p(X's children)): [0 0] .42, [1 0] .21, [0 1] .12, the root .1,
    # [0] .06, [1] .03
    assert build_tree(TWO_DEEP, TreeShape((2,), masks=3)).groups == (1, 3, 4)
    assert build_tree(TWO_DEEP, TreeShape((2,), masks=4)).groups == (ROOT, 1, 3, 4)
    budget = build_tree(TWO_DEEP, TreeShape((2,), max_nodes=3))
    assert budget.tokens == (0, 0, 1) and budget.parents == (ROOT, 0, ROOT) and budget.groups == (ROOT, 0, 1, 2)


@pytest.mark.parametrize("bad", [dict(top_k=()), dict(top_k=(0,)), dict(top_k=(2, True)), dict(max_nodes=-1),
                                 dict(masks="all"), dict(masks=0)])
def test_a_tree_shape_is_checked(bad):
    with pytest.raises(ConfigError):
        TreeShape(**bad)


def test_shape_labels_name_the_columns_of_the_ceiling_table():
    assert [s.label for s in (CHAIN, TreeShape(), TreeShape((3,), 16), TreeShape((3, 2), masks=4))] == \
        ["chain+masks:top", "chain", "top3/16", "(3,2)+masks:4"]


# ------------------------------------------------------------------------------------------- verification


def _greedy(root, **at):
    """Greedy tokens read at the root and at nodes n0..n5 of TWO_DEEP's tree (-1 where never read)."""
    return [root] + [at.get(f"n{j}", -1) for j in range(6)]


def test_verify_accepts_the_longest_path_the_greedy_tokens_take_and_the_token_after_it():
    tree = build_tree(TWO_DEEP, TreeShape((2,)))  # nodes: [0] [0 0] [1] [1 0] [0 1] [1 1]
    assert verify(tree, _greedy(1, n2=0, n3=7), (), 99) == Verdict((1, 0, 7), 3, False)  # [1 0] holds, 7 read after it
    assert verify(tree, _greedy(5), (), 99) == Verdict((5,), ROOT, False)  # no draft holds: the root's token only
    assert verify(tree, _greedy(0, n0=3), (), 99) == Verdict((0, 3), 0, False)  # [0] holds, [0 3] is no node
    # nothing after a stop token, whether it is a draft ([1 0]) or the token read after the path
    assert verify(tree, _greedy(1, n2=0, n3=7), {0}, 99) == Verdict((1, 0), 2, True)
    assert verify(tree, _greedy(1, n2=0, n3=7), {7}, 99) == Verdict((1, 0, 7), 3, True)
    # the room cuts the path: the last token is read at node [1]
    assert verify(tree, _greedy(1, n2=0, n3=7), (), 2) == Verdict((1, 0), 2, False)
    assert verify(ROOT_ONLY, [4], (), 1) == Verdict((4,), ROOT, False)


# ------------------------------------------------------------------------------------------- decoding

SHAPES = [CHAIN, TreeShape((1,)), TreeShape((2,), 6), TreeShape((3, 2), 10, masks=3),
          TreeShape((VOCAB, 1), masks=2)]  # the last holds every token at depth 0: a draft holds every step


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_lossless_is_hf_greedy_token_for_token(arch):
    model = mars_model(arch)
    prompts = random_prompts()
    greedy = [hf_greedy(model, p, max(ROOMS)) for p in prompts]
    eos = EOS_OF[arch]
    assert any(eos in g for g in greedy) and any(eos not in g for g in greedy)  # both endings are covered
    expected = [g[:r] for g, r in zip(greedy, ROOMS)]
    for block_size in (2, 4, 8):
        for shape in SHAPES:
            rows = tree_decode(model, prompts, block_size, shape, ROOMS)  # a ragged batch
            assert rows.token_ids == expected, (block_size, shape)
            assert rows.stopped == [eos in t for t in expected]
            if shape == CHAIN:  # the chain tree is today's lossless reference, forward for forward
                chain = decode_no_cache(model, prompts, slots=block_size, settings=[Setting(lossless=True)] * 6,
                                        room=ROOMS, stop_ids=torch.tensor([eos]), mask_id=MASK)
                assert (chain.token_ids, chain.forwards) == (rows.token_ids, rows.forwards), block_size
            if shape.top_k[0] == VOCAB:  # drafts hold: the comparison covers verified paths and their groups
                assert sum(map(len, expected)) > 1.3 * sum(rows.forwards), block_size
            if block_size == 4 and arch == "llama" and shape.top_k[0] > 1:  # batch 1: each row as in the batch
                alone = [tree_decode(model, [p], block_size, shape, [r]) for p, r in zip(prompts, ROOMS)]
                assert [(a.token_ids[0], a.forwards[0]) for a in alone] == list(zip(rows.token_ids, rows.forwards))


def test_tree_lossless_is_hf_greedy_with_eager_attention():
    model = mars_model("llama", "eager")  # eager adds the mask: it needs the additive form
    prompts = random_prompts()
    expected = [hf_greedy(model, p, r) for p, r in zip(prompts, ROOMS)]
    for shape in (TreeShape((2,), 6), TreeShape((VOCAB, 1), masks=2)):
        assert tree_decode(model, prompts, 4, shape, ROOMS).token_ids == expected, shape


A, B_, C = 10, 11, 12  # greedy cycles A -> B -> C -> A; every mask slot ranks A, B, C first, in that order


def cycle_model():
    """A hand-built Llama whose layer adds nothing (o_proj and down_proj are zero): the logits are a
    function of the current token alone. A, B, C and the mask token get orthogonal embeddings; greedy
    cycles A -> B -> C -> A, and a mask's top three are A, B, C, so its top-1 is right a third of the time
    and its top-3 always."""
    model = tiny_model("llama", vocab=VOCAB)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        for dim, token in enumerate((A, B_, C, MASK)):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(dim), 32).float()
        head[B_, 0] = head[C, 1] = head[A, 2] = 2.0
        head[A, 3], head[B_, 3], head[C, 3] = 0.5, 0.4, 0.3
    model.generation_config.eos_token_id = 0  # never greedy here
    return model


def test_a_tree_accepts_more_tokens_per_forward_than_the_chain():
    model = cycle_model()
    prompt = [5, 7, C]  # greedy: A B C A B C ...
    assert hf_greedy(model, prompt, 13) == ([A, B_, C] * 5)[:13]
    forwards = {}
    for shape in (CHAIN, TreeShape((1,)), TreeShape((2,)), TreeShape((3,), masks="top"), TreeShape((3,))):
        rows = tree_decode(model, [prompt], 4, shape, [13])
        assert rows.token_ids == [([A, B_, C] * 5)[:13]], shape
        forwards[shape.label] = rows.forwards[0]
    # B = 4, 13 tokens; the first forward has no drafts and takes one token
    assert forwards == {
        "chain+masks:top": 10,  # drafts A A A: after C one holds (2 tokens), else none; masks only after the third
        "chain": 10,  # masks after every node do not help drafts that are wrong
        "top2": 6,  # drafts from {A, B}: up to the next C, so 3 tokens a forward from C on
        "top3+masks:top": 6,  # the true path always holds (4 tokens), but no mask group follows it: then 1
        "top3": 4,  # 1 + 4 + 4 + 4: the true path holds every step and its mask group drafts the next
    }
    # the chain tree is today's lossless mode here too, where its drafts hold now and then
    chain = decode_no_cache(model, [prompt], slots=4, settings=[Setting(lossless=True)], room=[13],
                            stop_ids=torch.tensor([0]), mask_id=MASK)
    assert chain.forwards == [10]


def test_the_teacher_forced_ceiling_simulates_the_reference_forward_for_forward():
    """benchmarks/tree_ceiling.py: one forward of mask groups after every position, then each shape's
    decode simulated on them, gives the reference's forwards (fp32, no near-ties here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from tree_ceiling import force, simulate

    cycle, random_model = cycle_model(), mars_model("llama")
    cases = [(cycle, [[5, 7, C]], [13], [CHAIN, TreeShape((2,)), TreeShape((3,), masks="top"), TreeShape((3,))]),
             (random_model, random_prompts(), ROOMS, [TreeShape((VOCAB, 1), masks=2)])]
    for model, prompts, rooms, shapes in cases:
        stops = {model.generation_config.eos_token_id}
        for shape in shapes:
            rows = tree_decode(model, prompts, 4, shape, rooms)
            forced = [force(model, p, t, r, 4, MASK, max(shape.top_k)) for p, t, r in zip(prompts, rows.token_ids, rooms)]
            simulated = [simulate(f, shape, 4, stops, VOCAB)[:2] for f in forced]
            assert simulated == [(len(t), n) for t, n in zip(rows.token_ids, rows.forwards)], shape


# ------------------------------------------------------------------------------------------- the cached tree

class PathBackend(TorchBackend):
    """The real torch backend, recording each commit's counts and kept window entries."""

    def __init__(self, model, lean=None):
        super().__init__(model, lean)
        self.commits = []

    def commit(self, n_accept, keep=None):
        self.commits.append((n_accept.tolist(), None if keep is None else keep.tolist()))
        super().commit(n_accept, keep)


def cached_tree(backend, prompts, block_size, shape, rooms, **kwargs):
    eos = backend.model.generation_config.eos_token_id
    return decode_cached(backend, prompts, slots=block_size, settings=[Setting(lossless=True, tree=shape)] * len(prompts),
                         room=rooms, stop_ids=torch.tensor([eos]), mask_id=MASK, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cached_tree_lossless_is_the_reference_forward_for_forward(arch):
    """Token-level cache (one batch, batch 1, refilled rows), block-level cache (C = B, C = 2B + 1) and the
    generic model forward: the no-cache reference's tokens (= HF greedy) and forwards, ragged rows."""
    model = mars_model(arch)
    prompts = random_prompts()
    for block_size in (2, 4, 8):
        for shape in SHAPES[1:]:
            reference = tree_decode(model, prompts, block_size, shape, ROOMS)
            for kwargs in (dict(), dict(max_rows=1), dict(max_rows=4), dict(b_cache=block_size),
                           dict(b_cache=2 * block_size + 1), dict(lean=False)):
                backend = TorchBackend(model, lean=kwargs.pop("lean", None))
                rows = cached_tree(backend, prompts, block_size, shape, ROOMS, **kwargs)
                assert (rows.token_ids, rows.forwards, rows.stopped) == \
                    (reference.token_ids, reference.forwards, reference.stopped), (block_size, shape, kwargs)


def test_only_the_accepted_path_enters_the_cache():
    """Every step keeps the real tokens it forwarded and the nodes of the path it accepted, in path order:
    the cache then holds exactly a plain prefill's entries of the prompt and every token but the newest."""
    model = mars_model("llama")
    prompt, room = random_prompts()[2], 16
    for shape in (TreeShape((VOCAB, 1), masks=2), TreeShape((3, 2), 10, masks=3)):
        backend = PathBackend(model)
        batch = CachedBatch(backend, block_size=4, stop_ids=torch.tensor([-1]), mask_id=MASK)
        batch.add([DecodeRow(prompt, room, Setting(lossless=True, tree=shape))])
        generated = []
        while len(batch):
            for update in batch.step():
                generated = update.token_ids
            if len(batch):  # compare before the finished row leaves the batch
                committed = int(backend.cache.length[0])
                plain = TorchBackend(model)
                plain.start([prompt + batch.seq[0, len(prompt): int(batch.length[0])].tolist()[:-1]])
                assert committed == int(plain.cache.length[0])
                for mine, theirs in zip(backend.cache.keys + backend.cache.values, plain.cache.keys + plain.cache.values):
                    assert torch.allclose(mine[0, :, :committed], theirs[0, :, :committed], atol=1e-5), shape
        assert generated == hf_greedy(model, prompt, room)
        # where drafts hold (every token at depth 0), accepted paths skip siblings: their entries moved up
        assert shape.top_k[0] < VOCAB or any(keep[0][: n[0]] != list(range(n[0])) for n, keep in backend.commits), shape


def test_tree_rows_mix_with_tau_and_chain_rows_as_if_alone():
    model = mars_model("llama")
    prompts = random_prompts()
    settings = [Setting(lossless=True, tree=TreeShape((3,), 8)), Setting(tau=0.5), Setting(lossless=True),
                Setting(lossless=True, tree=TreeShape((VOCAB, 1), masks=2), width=3), Setting(), Setting(tau=0.9)]
    eos = torch.tensor([EOS_OF["llama"]])

    def run(indices, max_rows=None):
        return decode_cached(TorchBackend(model), [prompts[i] for i in indices], slots=4,
                             settings=[settings[i] for i in indices], room=[ROOMS[i] for i in indices],
                             stop_ids=eos, mask_id=MASK, max_rows=max_rows)

    alone = [run([i]) for i in range(6)]
    for max_rows in (None, 2):
        mixed = run(range(6), max_rows)
        assert mixed.token_ids == [a.token_ids[0] for a in alone] and mixed.forwards == [a.forwards[0] for a in alone]
    for i in (0, 2, 3, 4):  # the lossless rows, tree or chain, and tau = 1: greedy
        assert alone[i].token_ids[0] == hf_greedy(model, prompts[i], ROOMS[i])


def test_a_row_may_switch_between_chain_tree_and_tau_between_steps():
    """The serving policy replaces a row's setting between steps; greedy settings stay greedy token for token."""
    model = cycle_model()
    prompt, room = [5, 7, C], 40
    cycle = [Setting(lossless=True), Setting(lossless=True, tree=TreeShape((3,))), Setting(),
             Setting(lossless=True, tree=TreeShape((2,), 4)), Setting(lossless=True, width=2)]
    batch = CachedBatch(TorchBackend(model), block_size=4, stop_ids=torch.tensor([0]), mask_id=MASK)
    row = DecodeRow(prompt, room)
    batch.add([row])
    step, out = 0, None
    while len(batch):
        row.setting = cycle[step % len(cycle)]
        step += 1
        for update in batch.step():
            out = update.token_ids
    assert out == hf_greedy(model, prompt, room)


def test_tree_rows_need_a_backend_that_takes_a_window_mask():
    class ChainOnly(TorchBackend):
        tree_windows = False

    model = mars_model("llama")
    with pytest.raises(MarsError, match="window mask"):
        cached_tree(ChainOnly(model), random_prompts()[:1], 4, TreeShape((2,)), [4])


def test_generate_decodes_trees_with_and_without_the_cache():
    model = mars_model("llama")
    prompts = random_prompts()
    expected = [hf_greedy(model, p, 12) for p in prompts]
    for tree in ("top2/6", TreeShape((3, 2), 10, masks=3), "off"):
        for kwargs in (dict(), dict(use_cache=False), dict(b_cache=8), dict(batch_size=2)):
            results = generate(model, None, prompts, mode="lossless", max_new_tokens=12, tree=tree, **kwargs)
            assert [r.token_ids for r in results] == expected, (tree, kwargs)
    with pytest.raises(MarsError, match="no-cache tree reference"):
        generate(model, None, prompts[:2], mode=["lossless", "tau"], tau=0.9, tree="top2", use_cache=False)
    with pytest.raises(ConfigError, match="tree: expected a tree shape"):
        generate(model, None, prompts[:1], mode="lossless", tree="top-2")


class ScriptedPolicy:
    """A policy that answers ``choose`` from a script and records what it is told."""

    def __init__(self, script):
        self.script, self.asked, self.records = itertools.cycle(script), [], []

    def choose(self, rows, named=(), greedy=True):
        self.asked.append((rows, list(named)))
        return next(self.script)

    def observe(self, step):
        self.records.append(step)


def test_steered_rows_decode_at_the_policys_setting_and_it_sees_every_step():
    model = cycle_model()
    prompt, room = [5, 7, C], 24
    top3 = Setting(lossless=True, tree=TreeShape((3,)))
    policy = ScriptedPolicy([top3])
    eos = torch.tensor([0])
    rows = decode_cached(TorchBackend(model), [prompt, prompt], slots=4, settings=[Setting(lossless=True), Setting(tau=0.9)],
                         room=[room, room], stop_ids=eos, mask_id=MASK, steering=Steering(policy), steered=[True, False])
    assert rows.token_ids[0] == hf_greedy(model, prompt, room)
    alone = decode_cached(TorchBackend(model), [prompt], slots=4, settings=[top3], room=[room], stop_ids=eos, mask_id=MASK)
    assert rows.forwards[0] == alone.forwards[0]  # the steered row decoded as a top-3 tree row does
    named = decode_cached(TorchBackend(model), [prompt], slots=4, settings=[Setting(tau=0.9)], room=[room],
                          stop_ids=eos, mask_id=MASK)
    assert (rows.token_ids[1], rows.forwards[1]) == (named.token_ids[0], named.forwards[0])  # the other kept its own
    assert len(policy.records) == rows.model_calls and policy.asked[0] == (2, [Setting(tau=0.9)])
    first, second = policy.records[:2]
    assert not first.clean and second.clean  # the prompts' step is a prefill, the next a decoding step
    assert second.slots == top3.slots(4) and (top3, 4) in second.yields  # the tree holds: 4 tokens a step


def test_tree_auto_is_greedy_token_for_token_whatever_it_chooses():
    model = mars_model("llama")
    prompts = random_prompts()
    expected = [hf_greedy(model, p, 12) for p in prompts]
    for kwargs in (dict(), dict(b_cache=8), dict(batch_size=2)):
        results = generate(model, None, prompts, mode="lossless", max_new_tokens=12, tree="auto", **kwargs)
        assert [r.token_ids for r in results] == expected, kwargs
        assert {r.tree for r in results} == {"auto"}
    mixed = generate(model, None, prompts, mode=["lossless", "tau"] * 3, tau=0.9, max_new_tokens=12, tree="auto")
    tau_only = generate(model, None, prompts[1::2], tau=0.9, max_new_tokens=12)
    assert [r.token_ids for r in mixed[1::2]] == [r.token_ids for r in tau_only]
    assert [r.tree for r in mixed] == ["auto", None] * 3
    with pytest.raises(MarsError, match="tree auto: .* needs the cache"):
        generate(model, None, prompts[:1], mode="lossless", tree="auto", use_cache=False)


def test_tree_auto_takes_a_tree_where_it_pays(monkeypatch):
    """On the cycle model a tree takes 3-4 tokens a step and the chain about 1.5; where a wide step costs little
    (a modelled step cost, so that a loaded machine's clock does not decide the test), the measured tokens/s
    put most steps on a tree."""
    chosen = []

    class Watched(Steering):
        def before_step(self, live, steered, narrow=None):
            chosen.append(super().before_step(live, steered, narrow))
            return chosen[-1]

        def after_step(self, updates, *, rows, slots, seconds, joined):
            super().after_step(updates, rows=rows, slots=slots, seconds=0.01 * (1 + 0.01 * slots), joined=joined)

    monkeypatch.setattr("mars.decoding.generate.Steering", Watched)
    model = cycle_model()
    model.config.mars = {"block_size": 4, "mask_token_id": MASK}
    prompts, room = [[5, 7, C]] * 4, 400
    auto = generate(model, None, prompts, mode="lossless", max_new_tokens=room, tree="auto", block_size=4)
    chain = generate(model, None, prompts, mode="lossless", max_new_tokens=room, block_size=4)
    assert [r.token_ids for r in auto] == [r.token_ids for r in chain]
    assert sum(s.tree is not None and s.tree.top_k[0] > 1 for s in chosen) > len(chosen) / 2
    assert auto.tokens_per_forward > 1.3 * chain.tokens_per_forward


def test_the_tree_knob_takes_off_auto_or_a_shape():
    assert tree_shape("off") is None and tree_shape(None) is None and tree_shape("top2/6") == TreeShape((2,), 6)
    assert tree_shape("auto", auto=True) == AUTO
    with pytest.raises(ConfigError, match="tree: auto is chosen per step"):
        tree_shape("auto")  # a request's or a no-cache loop's tree is one shape
    assert PolicyConfig(trees=("top2/6", "auto")).trees == (TreeShape((2,), 6), *AUTO_TREES)
    assert DecodeConfig(tree="auto").tree == "auto"


@pytest.mark.parametrize("label", ["chain", "top2", "top3/16", "(3,2,1)/10", "top2/16+masks:4", "chain+masks:top"])
def test_a_shape_label_parses_back_to_its_shape(label):
    assert TreeShape.parse(label).label == label


def test_a_tree_is_a_lossless_setting_and_its_window_bounds_the_step():
    with pytest.raises(ConfigError, match="lossless-mode"):
        Setting(tau=0.9, tree=TreeShape((2,)))
    shape = TreeShape((2,), 6)
    setting = Setting(lossless=True, tree=shape)
    assert setting.label(4) == "lossless:tree=top2/6" and Setting(lossless=True, width=2, tree=shape).label(4) == \
        "lossless:w=2:tree=top2/6"
    # B = 4: at most 6 nodes (2 + 4 at depth 2 would be 6; the budget stops there) and a group of 3 after
    # the root and each node: 6 + 7 x 3 window entries, and the root read
    assert shape.max_window(3) == 6 + 7 * 3 and setting.slots(4) == 1 + 27
    assert CHAIN.max_window(3) == 3 + 3 and Setting(lossless=True, tree=CHAIN).slots(4) == Setting(lossless=True).slots(4)
    for tree in (TreeShape((3,), 8), TreeShape((3, 2), 10, masks=3), TreeShape((4,), masks="top")):
        window = max(tree_window(build_tree(torch.randn(3, VOCAB).log_softmax(-1), tree), 3, MASK).ids.shape[0]
                     for _ in range(20))
        assert window <= tree.max_window(3)


def test_bench_decode_times_trees_beside_hf_the_chain_and_tau():
    from mars.decoding import speed

    model = mars_model("llama")
    prompts = random_prompts()
    shape = TreeShape((2,), 6)
    report = speed.run(model, None, prompts, batch_sizes=[1, 4], taus=[1.0, 0.9], block_size=4, max_new_tokens=8,
                       b_cache=None, repeats=1, prompt_lookup=3, trees=(shape, AUTO))
    rows = {(r["batch_size"], r["method"], r["tau"], r["tree"]) for r in report["rows"]}
    assert rows == {(b, m, t, tree) for b in (1, 4) for m, t, tree in
                    [("hf_generate", None, None), ("mars", 1.0, None), ("mars", 0.9, None), ("mars_lossless", None, None),
                     ("mars_tree", None, "top2/6"), ("mars_tree", None, "auto")]} | {(1, "hf_prompt_lookup", None, None)}
    for row in report["rows"]:
        if row["tree"] == "top2/6":  # greedy, and its ceiling priced at its widest window
            assert row["same_as_hf"] == len(prompts) and row["t_step_tree_ms"] > 0
        if row["tree"] == "auto":  # greedy; it has no one window, so no ceiling
            assert row["same_as_hf"] == len(prompts) and row["ceiling_speedup"] is None
    table = speed.format_table(report)
    assert "tree top2/6" in table and "tree auto" in table


@pytest.mark.slow
def test_smollm2_tree_lossless_is_hf_greedy(smollm2_dir):
    """Real weights (fp32) with a fresh mask token: trees of its slots' top tokens, cached (token and block
    level) and not, give HF greedy token for token and the reference's forwards."""
    from mars.core.mask_token import add_mask_token
    from mars.core.models import load_model
    from test_decoding import CHAT

    model, tokenizer = load_model(smollm2_dir)
    model.config.mars = {"block_size": 4, "mask_token_id": add_mask_token(model, tokenizer).token_id}
    counting = tokenizer("1, 2, 3, 4, 5, 6, 7, 8,", add_special_tokens=False)["input_ids"]
    prompts = CHAT + [counting]
    encoded = [r.prompt_token_ids for r in generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=1)]
    alone = [hf_greedy(model, ids, 10) for ids in encoded]
    verified = 0
    for block_size, shape in ((2, TreeShape((4,), 12)), (4, TreeShape((48, 2), 60, masks=3)), (8, TreeShape((2,), 8))):
        reference = generate(model, tokenizer, prompts, mode="lossless", tree=shape, block_size=block_size,
                             max_new_tokens=10, batch_size=3, use_cache=False)
        assert [r.token_ids for r in reference] == alone, (block_size, shape)
        for kwargs in (dict(batch_size=3), dict(batch_size=3, b_cache=block_size)):
            results = generate(model, tokenizer, prompts, mode="lossless", tree=shape, block_size=block_size,
                               max_new_tokens=10, **kwargs)
            assert [r.token_ids for r in results] == alone, (block_size, shape, kwargs)
            assert [r.forwards for r in results] == [r.forwards for r in reference], (block_size, shape, kwargs)
        verified += reference.tokens - reference.forwards
    assert verified > 0  # some drafts held: accepted paths went through the cache
