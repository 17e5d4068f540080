"""Prompts and scorers of the local tasks: the ones ``mars evaluate``'s benchmarks use, so a local task
through lm-eval and the same benchmark through ``mars evaluate`` give the same numbers.

lm-eval calls ``process_results(doc, results)`` with the model's (stop-cut) generation in
``results[0]``; the metric is ``score`` (0 or 1 per item, averaged), as in ``metrics/eval.json``.
"""

from __future__ import annotations


def heldout(doc: dict, results: list[str]) -> dict:
    from mars.training import suite

    return {"score": suite.score(doc["family"], results[0], doc["response"])}


def gsm_prompt(doc: dict) -> str:
    from mars.evaluation.benchmarks.gsm import GSM

    return f"{doc['question']}\n{GSM.options_defaults['instruction']}"


def gsm(doc: dict, results: list[str]) -> dict:
    from mars.evaluation.benchmarks.answers import number_matches

    return {"score": float(number_matches(results[0], doc["answer"]))}
