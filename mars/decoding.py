"""Decoding with a MARS checkpoint: up to B tokens per forward, accepted by a confidence threshold tau.

The rule (DESIGN.md, "Inference"): with n accepted tokens, put B-1 mask tokens at positions n..n+B-2 and
run one causal forward. Slot i (i = 0..B-1) is predicted by the logit at position n-1+i: slot 0 by the
last real token (an ordinary AR step), slot i >= 1 by a mask. Greedy tokens are accepted left to right
while their probability (float32 softmax) is >= tau; slot 0 always is; acceptance stops at the first
slot below tau and after a stop token (EOS). tau = 1.0 accepts slot 0 only and forwards no mask at all:
it is greedy AR, token for token (a float32 softmax can round a mask's probability to exactly 1.0, so
the threshold alone would not guarantee that). tau is per sequence, per call.

Three ways to run the same rule, all giving the same tokens:

* **no cache** (``use_cache=False``): every step re-runs prompt + accepted tokens + masks. Slow and plain:
  the reference the cached paths are tested against.
* **token-level cache** (``b_cache=None``, the default): after each step the cache keeps the tokens that
  were real inputs of that step and drops the mask entries. In a batch, rows accept different counts;
  the cache grows by the largest count and the shorter rows leave masked-out holes (positions stay
  exact: position ids are explicit).
* **block-level cache** (``b_cache=C``, paper Fig. 4): the cache grows one block of C positions at a
  time, for every row at once, so no holes. Inside a block each step forwards the whole uncached block
  (real tokens + masks, width C+B-1) against the shared prefix cache; a row that has filled its block
  waits at the boundary until every row has, then the block is committed.

Finished rows (stop token, token budget) leave the batch at once: their cache rows are dropped.

Backend interface
-----------------
The cached loop talks to the model only through four calls, so another runtime (ONNX Runtime in
mars.export) can serve it. All arguments are torch tensors; ids/positions are int64 on the backend's
``device``; ``b`` is the number of live rows (it shrinks through ``retain``).

``start(prefixes: list[list[int]]) -> None``
    Reset the cache and fill row i with the tokens ``prefixes[i]`` at positions 0..len-1 (a prefix may
    be empty). The decoder passes each prompt without its last token: that token is the first real
    token of the first window.
``forward(window_ids [b, W], positions [b, W], read [b, S] | None = None) -> logits``
    Score a window against each row's committed cache: window entry k of row i attends to row i's
    committed entries and to window entries 0..k (causal inside the window). The window's K/V entries
    are held as *pending* until ``commit``. Returns float logits ``[b, S, V]`` at window indices ``read``
    (``[b, W, V]`` when ``read`` is None). A window always starts with >= 1 real token per row and may
    end in mask tokens beyond what a row needs; a backend with a fixed width may pad it on the right
    with more mask tokens at the following positions (a trailing entry never changes an earlier one)
    and slice its logits. W <= 2B-1 (token level) or W = C+B-1 (block level).
``commit(n_accept [b]) -> None``
    Keep the first ``n_accept[i]`` pending entries of row i in its cache and drop the rest. The
    decoder only commits entries that were real tokens in that forward. Rows may commit different
    counts (a backend may store them as masked holes) or 0.
``retain(rows [k]) -> None``
    Keep only these rows (indices into the current rows, increasing) in the cache; rows that finished
    stop costing compute.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Protocol, Sequence

import torch

from mars.errors import ConfigError, MarsError


# --------------------------------------------------------------------------------------------- config


@dataclass
class DecodeConfig:
    """The ``decode:`` section of params.yaml."""

    block_size: int | None = None  # None: the checkpoint's config.mars.block_size
    tau: float = 0.9
    max_new_tokens: int = 256
    batch_size: int = 8
    b_cache: int | None = None  # None: token-level cache; C >= B: block-level cache of C positions
    use_cache: bool = True

    def __post_init__(self):
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"block_size: must be >= 1, got {self.block_size}")
        if not 0.0 < self.tau <= 1.0:
            raise ConfigError(f"tau: must be in (0, 1], got {self.tau}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.b_cache is not None and self.b_cache < 1:
            raise ConfigError(f"b_cache: must be >= 1 (or null for the token-level cache), got {self.b_cache}")


# --------------------------------------------------------------------------------------------- results


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only; ends with the stop token when one was generated
    text: str  # token_ids decoded, special tokens skipped
    forwards: int  # decoding forward passes this sequence took part in (the prompt prefill not counted)
    tau: float
    block_size: int
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens or the model's context)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_forward": self.tokens_per_forward}


class Generations(list):
    """The results of one :func:`generate` call, in prompt order, with totals over all sequences."""

    def __init__(self, results: Iterable[GenerationResult], model_calls: int, seconds: float):
        super().__init__(results)
        self.model_calls = model_calls  # batched decoding forward passes actually run
        self.seconds = seconds

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self)

    @property
    def forwards(self) -> int:
        return sum(r.forwards for r in self)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def summary(self) -> dict:
        return {"sequences": len(self), "tokens": self.tokens, "forwards": self.forwards,
                "tokens_per_forward": self.tokens_per_forward, "model_calls": self.model_calls,
                "seconds": self.seconds}


# --------------------------------------------------------------------------------------------- accept rule


def accept(logits: torch.Tensor, tau: torch.Tensor, greedy: torch.Tensor, stop_ids: torch.Tensor,
           room: torch.Tensor):
    """The accept rule on the slot logits of one step.

    logits ``[b, S, V]`` (slot order), tau ``[b]``, greedy ``[b]`` (tau == 1: slot 0 only), stop_ids
    ``[k]``, room ``[b]`` (tokens a row may still take, >= 0). Returns ``(tokens [b, S], n [b],
    stopped [b])``: the greedy token per slot, how many leading slots are accepted, and whether the
    accepted ones end in a stop token.
    """
    logits = logits.float()
    tokens = logits.argmax(-1)  # the same pick as HF greedy (first index on ties)
    prob = torch.softmax(logits, -1).amax(-1)
    slots = torch.arange(tokens.shape[1], device=tokens.device)
    ok = (prob >= tau[:, None]) | (slots == 0)
    ok &= ~(greedy[:, None] & (slots > 0))
    is_stop = torch.isin(tokens, stop_ids)
    stop_before = (is_stop.cumsum(1) - is_stop.long()) > 0
    ok &= ~stop_before & (slots[None, :] < room[:, None])
    keep = ok.long().cumprod(1).bool()
    n = keep.sum(1)
    stopped = (keep & is_stop).any(1)
    return tokens, n, stopped


# --------------------------------------------------------------------------------------------- backends


class DecodeBackend(Protocol):
    """See the module docstring, "Backend interface"."""

    device: torch.device

    def start(self, prefixes: list[list[int]]) -> None: ...

    def forward(self, window_ids: torch.Tensor, positions: torch.Tensor,
                read: torch.Tensor | None = None) -> torch.Tensor: ...

    def commit(self, n_accept: torch.Tensor) -> None: ...

    def retain(self, rows: torch.Tensor) -> None: ...


def _attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed [b, q, k]`` in the form the model's attention takes as a 4D mask (used as given)."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "sdpa":
        return allowed[:, None]
    if impl == "eager":  # eager adds the mask to the scores: a boolean mask would be silently wrong
        zero = torch.zeros((), dtype=model.dtype, device=allowed.device)
        return torch.where(allowed[:, None], zero, torch.finfo(model.dtype).min)
    raise MarsError(f"decoding needs attn_implementation 'sdpa' or 'eager' (4D masks), the model uses {impl!r}")


class TorchBackend:
    """The backend for a transformers causal LM, on a DynamicCache with a per-row key-validity mask."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model
        self.device = model.device
        self._new_cache = lambda: DynamicCache(config=model.config)
        _attention_mask(model, torch.ones(1, 1, 1, dtype=torch.bool))  # fail early on flash/flex attention
        self.cache = None
        self.key_valid = None  # [b, T] bool: which cache entries each row may attend to
        self._pending = 0

    @torch.inference_mode()
    def start(self, prefixes: list[list[int]]) -> None:
        b, width = len(prefixes), max(map(len, prefixes))
        self.cache = self._new_cache()
        self._pending = 0
        ids = torch.zeros(b, width, dtype=torch.long)
        valid = torch.zeros(b, width, dtype=torch.bool)
        for i, prefix in enumerate(prefixes):  # left padding
            if prefix:
                ids[i, width - len(prefix):] = torch.tensor(prefix)
                valid[i, width - len(prefix):] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        self.key_valid = valid
        if width == 0:
            return
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=self.device)
        allowed = (causal & valid[:, None, :]) | (eye & ~valid[:, :, None])  # a pad query sees itself only
        self.model(input_ids=ids, position_ids=positions, attention_mask=_attention_mask(self.model, allowed),
                   cache=self.cache, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def forward(self, window_ids, positions, read=None):
        b, width = window_ids.shape
        window_ids, positions = window_ids.to(self.device), positions.to(self.device)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        allowed = torch.cat([self.key_valid[:, None, :].expand(b, width, -1), causal.expand(b, -1, -1)], -1)
        # Only the logits that are read go through the LM head (it is a large share of a small model).
        first = 0 if read is None else int(read.min())
        out = self.model(input_ids=window_ids, position_ids=positions,
                         attention_mask=_attention_mask(self.model, allowed), cache=self.cache, use_cache=True,
                         logits_to_keep=width - first)
        self._pending = width
        if read is None:
            return out.logits
        index = (read.to(self.device) - first)[:, :, None].expand(-1, -1, out.logits.shape[-1])
        return out.logits.gather(1, index)

    def commit(self, n_accept):
        n_accept = n_accept.to(self.device)
        keep = int(n_accept.max()) if n_accept.numel() else 0
        if self._pending > keep:
            self.cache.crop(keep - self._pending)
        new = torch.arange(keep, device=self.device)[None, :] < n_accept[:, None]
        self.key_valid = torch.cat([self.key_valid, new], 1)
        self._pending = 0

    def retain(self, rows):
        rows = rows.to(self.device)
        self.key_valid = self.key_valid[rows]
        # Also drop cache columns no remaining row attends to (the padding of a longer, finished prompt).
        columns = self.key_valid.any(0)
        shrink = not bool(columns.all())
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", False) or layer.keys.numel() == 0:
                continue
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
            if shrink:
                layer.keys, layer.values = layer.keys[:, :, columns], layer.values[:, :, columns]
        if shrink:
            self.key_valid = self.key_valid[:, columns]
