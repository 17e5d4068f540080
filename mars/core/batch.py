"""Dual-stream batches: the clean copy of each example and its noisy copy, in one sequence.

An example is ``input_ids`` (prompt + response) and ``prompt_len``. For the ``mars`` objective each
row of the batch is ``[clean x, padded | noisy x, padded]``: the noisy copy has every response token
replaced by the mask token, and both copies carry the same position ids. For the ``ar`` objective
only the clean stream is built, so the two objectives share one code path.

Labels follow the AR alignment in both streams: the output at position ``t`` predicts ``x[t+1]``,
counted only where ``x[t+1]`` is a response token (in the noisy stream, every response token is a
mask). Lengths are padded up to a multiple of B. With ``drop_prompt`` the noisy stream starts at the
block holding the last prompt token (:func:`mars.core.masking.noisy_start`), which saves compute and
changes no loss-bearing output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from mars.errors import DataError, MarsError
from mars.core.masking import CLEAN, NOISY, TokenLayout, block_ids, for_model, noisy_start

IGNORE = -100
Objective = Literal["ar", "mars"]


@dataclass
class Example:
    input_ids: Sequence[int]
    prompt_len: int


@dataclass
class DualStreamBatch:
    input_ids: torch.Tensor  # [b, T]
    position_ids: torch.Tensor  # [b, T]
    labels: torch.Tensor  # [b, T], IGNORE where no loss
    layout: TokenLayout  # stream / position / block / valid, each [b, T]
    clean_len: int  # the clean stream occupies [:, :clean_len]

    @property
    def stream(self) -> torch.Tensor:
        return self.layout.stream

    def attention_mask(self, attn_implementation: str | None, dtype: torch.dtype = torch.float32):
        return for_model(self.layout, attn_implementation, dtype)

    def to(self, device) -> "DualStreamBatch":
        lay = self.layout
        return DualStreamBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            labels=self.labels.to(device),
            layout=TokenLayout(lay.stream.to(device), lay.position.to(device), lay.block.to(device), lay.valid.to(device)),
            clean_len=self.clean_len,
        )

    def clean_view(self) -> "DualStreamBatch":
        """The clean stream alone: the ``ar`` batch of the same examples (the clean stream attends to
        nothing else, so a model's outputs there are the same in either batch)."""
        c = (slice(None), slice(0, self.clean_len))
        lay = self.layout
        return DualStreamBatch(
            input_ids=self.input_ids[c], position_ids=self.position_ids[c], labels=self.labels[c],
            layout=TokenLayout(lay.stream[c], lay.position[c], lay.block[c], lay.valid[c]), clean_len=self.clean_len,
        )

    def num_targets(self) -> dict[str, int]:
        has = self.labels != IGNORE
        return {"ar": int((has & (self.stream == CLEAN)).sum()), "mask": int((has & (self.stream == NOISY)).sum())}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def validate_example(ex: Example, index: int = 0, max_length: int | None = None) -> None:
    """Raise DataError for an example no batch can hold (prepare counts and skips these instead)."""
    n = len(ex.input_ids)
    if not 0 < ex.prompt_len < n:
        what = "no response tokens" if ex.prompt_len >= n else "no prompt tokens"
        raise DataError(f"example {index}: {what} (prompt_len={ex.prompt_len}, length={n})")
    if max_length is not None and n > max_length:
        raise DataError(f"example {index}: length {n} exceeds max_length {max_length}")


def build_batch(
    examples: Sequence[Example | dict],
    *,
    objective: Objective,
    block_size: int,
    mask_token_id: int | None,
    pad_token_id: int,
    block_offset: Literal["fixed", "random"] = "fixed",
    drop_prompt: bool = True,
    generator: torch.Generator | None = None,
    max_length: int | None = None,
) -> DualStreamBatch:
    """Collate examples into one batch for ``objective`` (see module docstring)."""
    if block_size < 1:
        raise MarsError(f"block_size must be >= 1, got {block_size}")
    if objective not in ("ar", "mars"):
        raise MarsError(f"objective must be 'ar' or 'mars', got {objective!r}")
    if objective == "mars" and mask_token_id is None:
        raise MarsError("the mars objective needs a mask token id (see mars.core.mask_token.add_mask_token)")
    if not examples:
        raise MarsError("build_batch got no examples")
    exs = [e if isinstance(e, Example) else Example(e["input_ids"], int(e["prompt_len"])) for e in examples]
    for i, ex in enumerate(exs):
        validate_example(ex, i, max_length)

    batch = len(exs)
    lengths = [len(e.input_ids) for e in exs]
    clean_len = _round_up(max(lengths), block_size)
    if objective == "mars" and block_offset == "random":
        offsets = torch.randint(0, block_size, (batch,), generator=generator).tolist()
    else:
        offsets = [0] * batch
    starts = [noisy_start(e.prompt_len, block_size, o) if drop_prompt else 0 for e, o in zip(exs, offsets)]
    noisy_len = _round_up(max(n - s for n, s in zip(lengths, starts)), block_size) if objective == "mars" else 0
    total = clean_len + noisy_len

    input_ids = torch.full((batch, total), pad_token_id, dtype=torch.long)
    labels = torch.full((batch, total), IGNORE, dtype=torch.long)
    position = torch.zeros((batch, total), dtype=torch.long)
    stream = torch.full((batch, total), CLEAN, dtype=torch.long)
    stream[:, clean_len:] = NOISY
    valid = torch.zeros((batch, total), dtype=torch.bool)

    for i, ex in enumerate(exs):
        x = torch.as_tensor(list(ex.input_ids), dtype=torch.long)
        n, p = len(x), ex.prompt_len
        # target of position t is x[t+1] where t+1 is a response token
        target = torch.full((n,), IGNORE, dtype=torch.long)
        target[p - 1 : n - 1] = x[p:]
        input_ids[i, :n] = x
        labels[i, :n] = target
        position[i, :clean_len] = torch.arange(clean_len)
        valid[i, :n] = True
        if objective == "mars":
            s = starts[i]
            noisy = x.clone()
            noisy[p:] = mask_token_id
            span = slice(clean_len, clean_len + n - s)
            input_ids[i, span] = noisy[s:]
            labels[i, span] = target[s:]
            position[i, clean_len:] = torch.arange(s, s + noisy_len)
            valid[i, span] = True

    block = block_ids(position, block_size, torch.tensor(offsets)[:, None])
    layout = TokenLayout(stream=stream, position=position, block=block, valid=valid)
    return DualStreamBatch(input_ids=input_ids, position_ids=position, labels=labels, layout=layout, clean_len=clean_len)
