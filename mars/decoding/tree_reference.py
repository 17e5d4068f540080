"""The no-cache reference of tree-verified lossless decoding (issue #43), as :mod:`mars.decoding.reference`
is the chain's: every step re-runs prompt + accepted tokens + the tree window (:mod:`mars.decoding.tree`)
with the tree's attention as a 4D mask and explicit positions, and no KV cache.

Slow and plain, it is what the cached tree paths will be tested against, token for token and forward for
forward. Its output is greedy AR token for token (fp32) for any tree shape.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mars.decoding.accept import greedy_tokens
from mars.decoding.reference import DecodedRows
from mars.decoding.stop_strings import StopStrings
from mars.decoding.torch_backend import attention_mask
from mars.decoding.tree import ROOT_ONLY, TreeShape, TreeWindow, build_tree, tree_window, verify


def window_mask(window: TreeWindow, n: int) -> torch.Tensor:
    """``[n + T, n + T]`` bool (True = attend) over an accepted prefix of ``n`` tokens then ``window``:
    causal over the prefix, every window entry sees the whole prefix, and the window's own rule inside."""
    t = window.ids.shape[0]
    out = torch.zeros(n + t, n + t, dtype=torch.bool)
    out[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    out[n:, :n] = True
    out[n:, n:] = window.allowed
    return out


@torch.inference_mode()
def decode_tree_no_cache(model, prompts: Sequence[Sequence[int]], *, block_size: int, shape: TreeShape,
                         room: Sequence[int], stop_ids: Sequence[int], mask_id: int,
                         stop_strings: StopStrings | None = None) -> DecodedRows:
    """Decode ``prompts`` greedily with a transformers causal LM ``model``, verifying a tree of ``shape``
    drafts per step (B = ``block_size``: trees up to B - 1 deep, B - 1 masks per group); ``room`` is the
    token budget per prompt. The first step, and a step after a path that ends where no mask group was
    placed, has no drafts (the root and its mask group only). A row also ends at the token that completes
    one of ``stop_strings``."""
    seqs, room = [list(p) for p in prompts], list(room)
    stops = set(int(t) for t in stop_ids)
    trees = [ROOT_ONLY] * len(prompts)
    out = DecodedRows([[] for _ in prompts], [0] * len(prompts), [False] * len(prompts), 0)
    live = list(range(len(prompts)))
    dev = model.device
    while live:
        windows = [tree_window(trees[i], block_size - 1, mask_id) for i in live]
        sizes = [len(seqs[i]) + w.ids.shape[0] for i, w in zip(live, windows)]
        width = max(sizes)
        ids = torch.zeros(len(live), width, dtype=torch.long)
        positions = torch.zeros(len(live), width, dtype=torch.long)
        allowed = torch.eye(width, dtype=torch.bool).repeat(len(live), 1, 1)  # padding sees itself: no empty row
        for k, (i, w) in enumerate(zip(live, windows)):  # left padding, so every row's window ends the input
            n, pad = len(seqs[i]), width - sizes[k]
            ids[k, pad:] = torch.cat([torch.tensor(seqs[i]), w.ids])
            positions[k, pad:] = torch.cat([torch.arange(n), n + w.depth])
            allowed[k, pad:, pad:] = window_mask(w, n)
        reads = 1 + max(w.ids.shape[0] for w in windows)  # the root, then the widest window
        logits = model(input_ids=ids.to(dev), attention_mask=attention_mask(model, allowed.to(dev)),
                       position_ids=positions.to(dev), logits_to_keep=reads).logits.float().cpu()
        out.model_calls += 1
        for k, (i, w) in enumerate(zip(live, windows)):
            tree = trees[i]
            row = logits[k, reads - 1 - w.ids.shape[0]:]  # the root's logits, then the window's
            verdict = verify(tree, greedy_tokens(row[: 1 + len(tree)]).tolist(), stops, room[i])
            seqs[i] += verdict.tokens
            out.token_ids[i] += verdict.tokens
            out.forwards[i] += 1
            out.stopped[i] = verdict.stopped
            room[i] -= len(verdict.tokens)
            keep = stop_strings.cut(out.token_ids[i], len(verdict.tokens)) if stop_strings else None
            if keep is not None:
                out.token_ids[i], out.stopped[i] = out.token_ids[i][:keep], True
            # the group after the node that read the last token predicts the tokens after it; the path and
            # its bonus token take at most the room left, so the next tree is at most room - 1 deep
            group, depth = tree.group_of(verdict.node), min(block_size - 1, room[i] - 1)
            if group is None or depth < 1 or out.stopped[i]:
                trees[i] = ROOT_ONLY
            else:
                start = 1 + w.group_start[group]
                trees[i] = build_tree(row[start: start + depth].log_softmax(-1), shape)
        live = [i for i in live if not out.stopped[i] and room[i] > 0]
    return out
