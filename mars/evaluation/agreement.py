"""What MARS must preserve: agreement with a reference model's greedy output, and that model's view of it.

MARS at tau = 1.0 should decode like the model it was trained from, and below tau it should say what
that model would have said. For every evaluated ``(checkpoint, benchmark, tau)`` and each item, against
the reference checkpoint's tau = 1.0 output on the same item (``evaluate.reference``, e.g. the base):

- ``agree_exact``: the generated token ids are identical (1.0 / 0.0);
- ``agree_prefix``: how many leading tokens match (the matched prefix), and ``agree_prefix_frac`` that
  count over the reference's length;
- ``ref_logprob``: the reference model's mean log-probability per generated token (EOS included),
  teacher-forced on the item's prompt. The reference's own greedy outputs set the bar; an output the
  reference finds much less likely has drifted from it even when the verifier cannot tell.

Entries get the means over items (``ref_logprob`` weighted by tokens: total log-probability over total
tokens); per-item values go into the rows, for paired comparisons.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mars.errors import MarsError


def matched_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(rows: list[dict], reference: list[dict]) -> list[dict]:
    """Per row: agreement of its ``token_ids`` with the reference row of the same ``id``."""
    by_id = {r["id"]: r for r in reference}
    out = []
    for row in rows:
        ref = by_id.get(row["id"])
        if ref is None:
            raise MarsError(f"agreement: the reference has no output for item {row['id']!r}")
        n = matched_prefix(row["token_ids"], ref["token_ids"])
        out.append({"agree_exact": float(row["token_ids"] == ref["token_ids"]), "agree_prefix": n,
                    "agree_prefix_frac": n / len(ref["token_ids"]) if ref["token_ids"] else float(not row["token_ids"])})
    return out


@torch.no_grad()
def token_logprobs(model, rows: list[dict], batch_size: int = 8,
                   memo: dict[tuple, tuple[float, int]] | None = None) -> list[tuple[float, int]]:
    """Per row: (sum of log p(token | prompt, earlier tokens) over its ``token_ids``, token count), in float32.

    Logits are projected for the generated spans only (a boolean ``logits_to_keep``): the vocabulary projection
    over the prompts was a quarter of the cost. ``memo`` (prompt and output ids -> result) spares a second forward
    for an output another entry already scored (a lossless output and its tau = 1 twin, a tau that decoded the
    same tokens)."""
    memo = {} if memo is None else memo
    out: list[tuple[float, int] | None] = [None] * len(rows)
    todo: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        key = (tuple(row["prompt_token_ids"]), tuple(row["token_ids"]))
        if key in memo:
            out[i] = memo[key]
        elif not row["token_ids"]:
            out[i] = memo[key] = (0.0, 0)
        else:
            todo.setdefault(key, []).append(i)
    keys = sorted(todo, key=lambda k: -len(k[0]) - len(k[1]))
    device = next(model.parameters()).device
    for start in range(0, len(keys), batch_size):
        group = keys[start:start + batch_size]
        width = max(len(p) + len(t) for p, t in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        keep = torch.zeros(len(group), width, dtype=torch.bool)
        for k, (p, t) in enumerate(group):
            ids[k, :len(p) + len(t)] = torch.tensor(p + t)
            mask[k, :len(p) + len(t)] = 1
            keep[k, len(p) - 1:len(p) - 1 + len(t)] = True  # the positions that predict the generated tokens
        # right padding: the default positions 0..W-1 are every row's own
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                       logits_to_keep=keep.to(device)).logits  # (kept positions, V), row by row
        logp = logits.float().log_softmax(-1)
        picked = logp.gather(-1, torch.tensor([x for _, t in group for x in t], device=device)[:, None])[:, 0]
        offset = 0
        for p, t in group:
            memo[(p, t)] = (float(picked[offset:offset + len(t)].sum()), len(t))
            offset += len(t)
            for i in todo[(p, t)]:
                out[i] = memo[(p, t)]
    return out  # type: ignore[return-value]


def annotate(rows: list[dict], reference: list[dict], model, batch_size: int = 8,
             memo: dict[tuple, tuple[float, int]] | None = None) -> dict:
    """Add the per-item measures to ``rows`` (in place); return their means for the metrics entry."""
    if not rows:
        return {}
    for row, agreement, (total, n) in zip(rows, compare(rows, reference), token_logprobs(model, rows, batch_size, memo)):
        row.update(agreement, ref_logprob=total / n if n else 0.0, ref_logprob_sum=total)
    tokens = sum(len(r["token_ids"]) for r in rows)
    return {
        "agree_exact": sum(r["agree_exact"] for r in rows) / len(rows),
        "agree_prefix": sum(r["agree_prefix"] for r in rows) / len(rows),
        "agree_prefix_frac": sum(r["agree_prefix_frac"] for r in rows) / len(rows),
        "ref_logprob": sum(r["ref_logprob_sum"] for r in rows) / tokens if tokens else 0.0,
    }
