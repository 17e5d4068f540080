"""The MARS loss: ``L = L_mask + w_ar * L_AR``, each a mean cross-entropy over its own targets.

``L_AR`` is the clean stream's ordinary next-token loss; ``L_mask`` is the noisy stream's loss on
masked response tokens. Without ``L_AR`` the AR share of the signal falls as 1/B and quality
collapses at large B; ``w_ar = 0`` is kept trainable as the paper's ablation. The ``ar`` objective
is the same computation on a clean-only batch (``L = L_AR``).

With a teacher (``train.mars.ar_loss: kl``, the stage's initial model, frozen), ``L_AR`` is instead
the KL divergence from the teacher's next-token distribution to the model's at every clean target:
on self-distilled data the targets are the teacher's own greedy tokens, and cross-entropy on them
sharpens every near-tie towards the token one sample happened to take, while the KL holds the whole
distribution where it was and leaves ``L_mask`` to move only what the mask slots need. It is 0 at
the first step, when the model is the teacher (up to rounding: the teacher's clean-only forward and
the model's dual-stream one round differently under bf16 autocast, ~1e-3 on SmolLM2).

Logits are computed only at positions that have a target: the LM head over the full 2L x vocab
tensor would dominate memory, and every other position is discarded anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mars.core.batch import IGNORE, DualStreamBatch
from mars.core.masking import CLEAN, NOISY


@dataclass
class LossOutput:
    loss: torch.Tensor  # what backward() is called on
    l_mask: torch.Tensor  # mean CE over noisy targets (0 when there are none)
    l_ar: torch.Tensor  # mean CE over clean targets
    n_mask: int
    n_ar: int

    def log_dict(self) -> dict[str, float]:
        return {"loss": float(self.loss), "l_mask": float(self.l_mask), "l_ar": float(self.l_ar),
                "n_mask": self.n_mask, "n_ar": self.n_ar}


def target_logits(model, batch: DualStreamBatch, attn_implementation: str | None = None,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at every position that has a target, and those targets (flattened, same order)."""
    impl = attn_implementation or getattr(model.config, "_attn_implementation", None) or "sdpa"
    dtype = dtype or next(model.parameters()).dtype
    mask = batch.attention_mask(impl, dtype)
    selected = batch.labels != IGNORE
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is not None and head is not None and not getattr(model.config, "final_logit_softcapping", None):
        hidden = decoder(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                         use_cache=False).last_hidden_state
        logits = head(hidden[selected])
    else:  # models with extra logit processing: take the full forward
        logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                       use_cache=False).logits[selected]
    return logits, batch.labels[selected]


def mars_loss(logits: torch.Tensor, targets: torch.Tensor, streams: torch.Tensor, w_ar: float = 1.0,
              denominators: tuple[float, float] | None = None,
              teacher_logits: torch.Tensor | None = None) -> LossOutput:
    """Combine the two streams' losses.

    ``logits [N, V]``, ``targets [N]`` and ``streams [N]`` are the target positions only.
    ``denominators = (n_mask, n_ar)`` overrides the local token counts, so that data-parallel workers
    can normalise by the global counts and match a single process exactly. ``teacher_logits
    [N_ar, V]`` (the clean targets' rows, in order) make ``L_AR`` the KL divergence from the teacher.
    """
    logits = logits.float()
    is_mask, is_ar = streams == NOISY, streams == CLEAN
    n_mask, n_ar = int(is_mask.sum()), int(is_ar.sum())
    d_mask, d_ar = denominators if denominators is not None else (n_mask, n_ar)
    ce = F.cross_entropy(logits, targets, reduction="none")
    zero = ce.sum() * 0.0  # keeps the graph connected when a stream has no targets
    l_mask = ce[is_mask].sum() / d_mask if d_mask else zero
    if teacher_logits is None:
        ar_terms = ce[is_ar]
    else:
        if teacher_logits.shape != (n_ar, logits.shape[-1]):
            raise ValueError(f"teacher_logits: expected shape {(n_ar, logits.shape[-1])}, got {tuple(teacher_logits.shape)}")
        log_q = F.log_softmax(teacher_logits.float(), dim=-1)
        ar_terms = F.kl_div(F.log_softmax(logits[is_ar], dim=-1), log_q, log_target=True, reduction="none").sum(-1)
    l_ar = ar_terms.sum() / d_ar if d_ar else zero
    # a clean-only (ar objective) batch has no mask targets anywhere: L = L_AR
    loss = l_mask + w_ar * l_ar if d_mask else l_ar
    return LossOutput(loss=loss, l_mask=l_mask, l_ar=l_ar, n_mask=n_mask, n_ar=n_ar)


def compute_loss(model, batch: DualStreamBatch, w_ar: float = 1.0, attn_implementation: str | None = None,
                 denominators: tuple[float, float] | None = None, teacher=None) -> LossOutput:
    """Forward the batch and return the MARS loss (or the plain AR loss for a clean-only batch).

    ``teacher`` (a frozen causal LM with the same tokenizer) makes ``L_AR`` the KL from its
    distribution; it sees the clean stream only, which is where ``L_AR``'s targets are.
    """
    logits, targets = target_logits(model, batch, attn_implementation)
    streams = batch.stream[batch.labels != IGNORE]
    teacher_logits = None
    if teacher is not None:
        with torch.no_grad():
            teacher_logits, _ = target_logits(teacher, batch.clean_view(), attn_implementation)
    return mars_loss(logits, targets, streams, w_ar, denominators, teacher_logits)
