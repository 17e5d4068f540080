"""One entry of metrics/eval.json: a score beside the decoding work that produced it.

Built here for the built-in benchmarks (mars.evaluation.evaluate) and lm-eval tasks
(mars.evaluation.harness) alike, so the gate, plots and report read one layout.
"""

from __future__ import annotations


def metrics_entry(score: float, tokens: int, forwards: int, seconds: float, n: int, tau: float | None,
                  block_size: int) -> dict:
    """``tau=None``: the lossless mode."""
    return {
        "score": float(score),
        "tokens_per_forward": tokens / forwards if forwards else 0.0,
        "tokens": tokens,
        "forwards": forwards,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "n": n,
        "tau": None if tau is None else float(tau),
        "mode": "lossless" if tau is None else "tau",
        "block_size": block_size,
    }
