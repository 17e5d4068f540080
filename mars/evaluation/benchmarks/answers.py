"""Reading an answer out of a completion: the final number, the text after "the answer is", a choice letter."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number in ``text`` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def number_matches(prediction: str, reference: str) -> bool:
    pred, ref = final_number(prediction), final_number(reference)
    return pred is not None and ref is not None and abs(pred - ref) < 1e-6


_ANSWER_IS = re.compile(r"answer is[:\s]*\(?([^\n]*?)\)?\s*(?:\.|$)", re.IGNORECASE | re.MULTILINE)


def extract_answer(text: str) -> str:
    """The text after the last "the answer is", else the last non-empty line."""
    found = _ANSWER_IS.findall(text)
    if found:
        return found[-1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def extract_choice(text: str, letters: str) -> str | None:
    """The chosen option letter: after "answer is", else the last standalone letter among ``letters``."""
    pattern = re.compile(rf"\b([{letters}])\b")
    answer = _ANSWER_IS.findall(text)
    found = pattern.findall(answer[-1]) if answer else []
    if found:
        return found[0]
    found = pattern.findall(text)
    return found[-1] if found else None
