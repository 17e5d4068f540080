"""Reading an answer out of a completion: the final number."""

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
