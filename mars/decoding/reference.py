"""The no-cache reference loop: every step re-runs prompt + accepted tokens (+ a lossless row's drafts) +
masks with a plain causal mask and no KV cache.

Slow and plain, it is what the cached paths (:mod:`mars.decoding.batch`) are tested against, token for
token and forward for forward; ``generate(use_cache=False)`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mars.decoding.accept import accept
from mars.decoding.setting import Setting
from mars.decoding.stop_strings import StopStrings


@dataclass
class DecodedRows:
    """What a decoding loop (this one, or :func:`mars.decoding.generate.decode_cached`) returns for its
    rows, in input order."""

    token_ids: list[list[int]]
    forwards: list[int]
    stopped: list[bool]
    model_calls: int


@torch.inference_mode()
def decode_no_cache(model, prompts: Sequence[Sequence[int]], *, slots: int, settings: Sequence[Setting],
                    room: Sequence[int], stop_ids: torch.Tensor, mask_id: int,
                    stop_strings: StopStrings | None = None) -> DecodedRows:
    """Decode ``prompts`` (a transformers causal LM ``model``), one :class:`Setting` per prompt, every row
    reading ``slots`` slots a step (B, or 1 when no row needs masks: ``generate`` gives its rows one
    width); ``room`` is the token budget per prompt. A row also ends at the token that completes one of
    ``stop_strings``."""
    seqs, room = [list(p) for p in prompts], list(room)
    tau = torch.tensor([s.tau for s in settings])
    lossless = torch.tensor([s.lossless for s in settings])
    drafts: list[list[int]] = [[] for _ in prompts]
    out = DecodedRows([[] for _ in prompts], [0] * len(prompts), [False] * len(prompts), 0)
    live = list(range(len(prompts)))
    dev = model.device
    while live:
        inputs = [seqs[i] + drafts[i] + [mask_id] * (slots - 1) for i in live]
        width = max(map(len, inputs))
        reads = slots + max(len(drafts[i]) for i in live)
        ids = torch.zeros(len(live), width, dtype=torch.long)
        attn = torch.zeros(len(live), width, dtype=torch.long)
        for k, x in enumerate(inputs):  # left padding, so every row's reads are its last positions
            ids[k, width - len(x):] = torch.tensor(x)
            attn[k, width - len(x):] = 1
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=positions.to(dev),
                       logits_to_keep=reads).logits
        # row k's reads start at its last accepted token; past them it re-reads its last position (unused)
        first = torch.tensor([reads - slots - len(drafts[i]) for i in live])
        index = (first[:, None] + torch.arange(reads)).clamp(max=reads - 1)
        logits = logits.gather(1, index.to(dev)[:, :, None].expand(-1, -1, logits.shape[-1]))
        live_t = torch.tensor(live)
        draft_ids = torch.tensor([drafts[i] + [-1] * (reads - 1 - len(drafts[i])) for i in live], dtype=torch.long)
        limit = [min(room[i], len(drafts[i]) + 1 if lossless[i] else slots) for i in live]
        tokens, n, stopped = accept(logits, tau[live_t].to(dev), (tau[live_t] >= 1.0).to(dev), stop_ids.to(dev),
                                    torch.tensor(limit, device=dev), lossless[live_t].to(dev), draft_ids.to(dev))
        out.model_calls += 1
        for k, i in enumerate(live):
            row, taken = tokens[k].tolist(), int(n[k])
            new = row[:taken]
            seqs[i] += new
            out.token_ids[i] += new
            out.forwards[i] += 1
            room[i] -= len(new)
            out.stopped[i] = bool(stopped[k])
            keep = stop_strings.cut(out.token_ids[i], len(new)) if stop_strings and new else None
            if keep is not None:
                out.token_ids[i], out.stopped[i] = out.token_ids[i][:keep], True
            verified = bool(lossless[i]) and taken == len(drafts[i]) + 1 and not out.stopped[i]
            m = len(drafts[i])
            drafts[i] = row[m + 1: m + 1 + max(0, min(slots - 1, room[i] - 1))] if verified else []
        live = [i for i in live if not out.stopped[i] and room[i] > 0]
    return out

