"""The accept rule of one decoding step: which of a window's slot tokens a row keeps.

The rule (DESIGN.md, "Inference"): with n accepted tokens, B-1 mask tokens sit at positions n..n+B-2 and
one causal forward runs. Slot i (i = 0..B-1) is predicted by the logit at position n-1+i: slot 0 by the
last real token (an ordinary AR step), slot i >= 1 by a mask. Greedy tokens are accepted left to right
while their probability (float32 softmax) is >= tau; slot 0 always is; acceptance stops at the first
slot below tau and after a stop token (EOS). A row at tau = 1.0 reads slot 0 only and forwards no mask:
it is greedy AR, token for token (a float32 softmax can round a mask's probability to exactly 1.0, so
the threshold alone would not guarantee that).

**Lossless mode** (blockwise parallel decoding, Stern et al. 2018): the mask slots' greedy tokens are
*drafts* that the next forward checks. That forward reads the last accepted token and each pending
draft, where the logits are exact greedy AR steps, so draft j is kept while it equals the greedy token
read before it; the first wrong draft is replaced by that greedy token. When every draft holds, the
token read after the last draft is taken too. The output is greedy AR token for token; tau plays no part.
"""

from __future__ import annotations

import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token per slot: HF greedy's pick (its argmax of the float32 logits, the first index on
    ties). ``max`` returns the first index too and is faster than ``argmax`` on CPU, on the logits' own
    dtype: widening bf16 to float32 is exact, so it changes no order."""
    return logits.max(-1).indices


def accept(logits: torch.Tensor, tau: torch.Tensor, greedy: torch.Tensor, stop_ids: torch.Tensor,
           room: torch.Tensor, lossless: torch.Tensor | None = None, drafts: torch.Tensor | None = None,
           tokens: torch.Tensor | None = None):
    """The accept rule on the slot logits of one step.

    logits ``[b, S, V]`` (slot order), tau ``[b]``, greedy ``[b]`` (tau == 1: slot 0 only), stop_ids
    ``[k]``, room ``[b]`` (tokens a row may still take, >= 0). Lossless rows (``lossless [b]``) verify
    instead: their reads 0..m sit at the last accepted token and at their m pending ``drafts``
    (``[b, S-1]``, -1 past them), so slot j's greedy token is exact while drafts 0..j-1 equal the greedy
    tokens read before them. Returns ``(tokens [b, S], n [b], stopped [b])``: the greedy token per slot,
    how many leading slots are accepted, and whether the accepted ones end in a stop token. ``tokens``
    ``[b, S]`` replaces the greedy pick where rows sample (:mod:`mars.decoding.sampling`); tau is still
    compared with each slot's top probability.
    """
    if tokens is None:
        tokens = greedy_tokens(logits)
    is_stop = torch.isin(tokens, stop_ids)
    if tokens.shape[1] == 1:  # one slot (tau = 1 everywhere): always accepted, no probability needed
        n = (room > 0).long()
        return tokens, n, is_stop[:, 0] & (n > 0)
    slots = torch.arange(tokens.shape[1], device=tokens.device)
    reads_prob = ~greedy if lossless is None else ~(greedy | lossless)  # tau = 1 and lossless rows need none
    if bool(reads_prob.any()):
        prob = logits.float().softmax(-1).amax(-1)  # one fused kernel: faster on CPU than max, subtract, exp and sum
        ok = (prob >= tau[:, None]) & reads_prob[:, None]
    else:
        ok = torch.zeros_like(is_stop)
    if lossless is not None:
        ok[:, 1:] = torch.where(lossless[:, None], drafts == tokens[:, :-1], ok[:, 1:])
    ok &= slots < room[:, None]
    ok[:, 0] = room > 0  # slot 0 always is (when the row has room)
    ok[:, 1:] &= ~is_stop[:, :-1]  # nothing after a stop token (the cumprod carries the cut on)
    keep = ok.long().cumprod(1).bool()
    n = keep.sum(1)
    stopped = (keep & is_stop).any(1)
    return tokens, n, stopped
