"""Sampling with MARS: temperature, top-p and a per-sequence seed.

How MARS accepts tokens when it samples (DESIGN.md, "Self-distillation and serving"): slot 0 (read at the
last real token) is an ordinary AR sample from the tempered, top-p filtered distribution. A mask slot is
accepted while its *confidence* is >= tau, and the accepted slot's token is then sampled from that
slot's own tempered, top-p filtered distribution; acceptance stops at the first slot below tau, as in
greedy decoding. The confidence is the slot's top probability under the model's own softmax
(temperature 1, no top-p): the number tau means in greedy decoding and in the gate's measurements, so a
request's tau keeps its meaning whatever its temperature. At tau = 1.0 only slot 0 is read (no masks
are forwarded), so sampling is exactly AR sampling: each token is drawn from the model's next-token
distribution given everything before it.

``temperature = 0`` is greedy: the decoder takes the argmax and never calls a sampler.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from mars.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # None: a fresh random seed per sequence

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or math.isnan(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ConfigError(f"temperature: must be in [0, 100], got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or math.isnan(self.top_p) \
                or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed: must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``logits [..., V]`` -> the distribution a slot samples from: softmax(logits / T), top-p filtered and
    renormalised (the highest-probability token is always kept)."""
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
        sorted_p = torch.where(before < top_p, sorted_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Sampler:
    """Draws one token per slot for one sequence, from its own seeded generator (reproducible per seed,
    whatever else shares the batch)."""

    def __init__(self, params: SamplingParams):
        if params.greedy:
            raise ConfigError("temperature: 0 is greedy decoding, which needs no sampler")
        self.params = params
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [S, V]`` (one row's slots) -> one sampled token id per slot, ``[S]``."""
        probs = filtered_probs(logits.cpu(), self.params.temperature, self.params.top_p)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0].to(logits.device)
