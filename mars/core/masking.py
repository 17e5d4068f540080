"""The structured attention mask of MARS, from one definition, in three forms.

A dual-stream sequence lays out a clean copy of ``x`` and a noisy copy (response tokens replaced by
the mask token) side by side, with the same position ids. Every token carries three attributes:
its stream (clean/noisy), its position ``t`` and its block ``blk(t) = (t + offset) // B``. Whether
query ``q`` may attend to key ``k`` is a function of those attributes alone (DESIGN.md):

    clean -> clean : k <= q                         (causal)
    clean -> noisy : never
    noisy -> clean : blk(k) < blk(q)                (clean tokens of earlier blocks)
    noisy -> noisy : blk(k) == blk(q) and k <= q    (causal inside the block)

Padding keys are never attended; a padding query attends to itself only, so no row is empty (an
empty row makes sdpa return NaN). :func:`allowed` is that rule; the boolean (sdpa), additive float
(eager) and flex-attention forms are all built from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars.errors import MarsError

CLEAN, NOISY = 0, 1


def block_ids(positions: torch.Tensor, block_size: int, block_offset: int | torch.Tensor = 0) -> torch.Tensor:
    """``blk(t)``: blocks counted from position 0 (shifted by ``block_offset`` in ``[0, B)``)."""
    if block_size < 1:
        raise MarsError(f"block_size must be >= 1, got {block_size}")
    return torch.div(positions + block_offset, block_size, rounding_mode="floor")


def noisy_start(prompt_len: int, block_size: int, block_offset: int = 0) -> int:
    """First position the noisy stream needs when its prompt part is dropped.

    The first L_mask target is the first response token, predicted from position ``prompt_len - 1``;
    noisy tokens only see noisy tokens of their own block, so everything before the start of that
    position's block can go. Returns a position >= 0.
    """
    last_prompt = max(prompt_len - 1, 0)
    blk = (last_prompt + block_offset) // block_size
    return max(blk * block_size - block_offset, 0)


@dataclass
class TokenLayout:
    """Per-token attributes of a (batched) dual-stream sequence, each ``[batch, T]``."""

    stream: torch.Tensor  # CLEAN / NOISY
    position: torch.Tensor  # position id (shared by both streams)
    block: torch.Tensor  # blk(position)
    valid: torch.Tensor  # False for padding

    def allowed(self) -> torch.Tensor:
        """Boolean mask ``[batch, T, T]``: True where query (dim 1) may attend to key (dim 2)."""
        return allowed(
            self.stream[:, :, None], self.position[:, :, None], self.block[:, :, None], self.valid[:, :, None],
            self.stream[:, None, :], self.position[:, None, :], self.block[:, None, :], self.valid[:, None, :],
            same_token=torch.eye(self.stream.shape[1], dtype=torch.bool, device=self.stream.device)[None],
        )


def allowed(sq, pq, bq, vq, sk, pk, bk, vk, same_token):
    """The MARS attention rule on broadcastable attribute tensors (q = query, k = key)."""
    clean_q, clean_k = sq == CLEAN, sk == CLEAN
    causal = pk <= pq
    rule = (
        (clean_q & clean_k & causal)
        | (~clean_q & clean_k & (bk < bq))
        | (~clean_q & ~clean_k & (bk == bq) & causal)
    )
    # Padding keys are invisible; a padding query sees only itself so that no row is empty.
    return (rule & vk & vq) | (same_token & ~vq)


def dual_stream_layout(seq_len: int, block_size: int, block_offset: int = 0, noisy_from: int = 0) -> TokenLayout:
    """Layout of one sequence as ``[clean 0..L-1 | noisy noisy_from..L-1]`` (batch of 1)."""
    if seq_len < 1:
        raise MarsError(f"seq_len must be >= 1, got {seq_len}")
    if not 0 <= block_offset < max(block_size, 1):
        raise MarsError(f"block_offset must be in [0, {block_size}), got {block_offset}")
    clean_pos = torch.arange(seq_len)
    noisy_pos = torch.arange(noisy_from, seq_len)
    position = torch.cat([clean_pos, noisy_pos])[None]
    stream = torch.cat([torch.full_like(clean_pos, CLEAN), torch.full_like(noisy_pos, NOISY)])[None]
    return TokenLayout(
        stream=stream,
        position=position,
        block=block_ids(position, block_size, block_offset),
        valid=torch.ones_like(position, dtype=torch.bool),
    )


def dual_stream_mask(seq_len: int, block_size: int, prompt_len: int = 0, *, block_offset: int = 0,
                     drop_prompt: bool = False) -> torch.Tensor:
    """Boolean mask (True = may attend) for one sequence laid out as ``[clean | noisy]``.

    Returns ``[2L, 2L]``. With ``drop_prompt=True`` the noisy stream starts at
    ``noisy_start(prompt_len, ...)`` instead of 0 (DESIGN.md allows it: that part carries no loss and
    no loss-bearing token sees it), giving ``[L + L - start, L + L - start]``.
    """
    if not 0 <= prompt_len <= seq_len:
        raise MarsError(f"prompt_len must be in [0, seq_len={seq_len}], got {prompt_len}")
    start = noisy_start(prompt_len, block_size, block_offset) if drop_prompt else 0
    return dual_stream_layout(seq_len, block_size, block_offset, start).allowed()[0]


def causal_layout(valid: torch.Tensor, position: torch.Tensor | None = None) -> TokenLayout:
    """A clean-only (plain AR) layout: the same rule reduces to a causal mask with padding."""
    if position is None:
        position = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    zeros = torch.zeros_like(position)
    return TokenLayout(stream=zeros, position=position, block=zeros, valid=valid.bool())


def to_sdpa(mask: torch.Tensor) -> torch.Tensor:
    """``[batch, T, T]`` bool -> ``[batch, 1, T, T]`` bool, as sdpa takes it (True = attend)."""
    return mask[:, None] if mask.dim() == 3 else mask


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool mask -> additive float mask (0 = attend, finfo.min = blocked), as eager attention adds it.

    A boolean mask given to eager attention is silently wrong, so eager models must get this form.
    """
    mask = to_sdpa(mask)
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


def to_block_mask(layout: TokenLayout, block_size_kernel: int = 128):
    """The same rule as a flex-attention ``BlockMask`` (sparse: skips fully blocked tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    stream, position, block, valid = layout.stream, layout.position, layout.block, layout.valid
    batch, length = stream.shape

    def mask_mod(b, h, q, k):
        return allowed(stream[b, q], position[b, q], block[b, q], valid[b, q],
                       stream[b, k], position[b, k], block[b, k], valid[b, k], same_token=q == k)

    kernel_block = min(block_size_kernel, max(length, 1))
    return create_block_mask(mask_mod, batch, None, length, length, device=str(stream.device),
                             BLOCK_SIZE=kernel_block)


def for_model(layout: TokenLayout, attn_implementation: str | None, dtype: torch.dtype = torch.float32):
    """The mask form a model's attention implementation takes as ``attention_mask``."""
    impl = attn_implementation or "sdpa"
    if impl == "flex_attention":
        return to_block_mask(layout)
    mask = layout.allowed()
    if impl == "eager":
        return to_additive(mask, dtype)
    return to_sdpa(mask)
