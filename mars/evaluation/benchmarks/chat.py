"""``chat``: everyday prompts with no verifier, for what MARS does to speed and to the surface of the text there.

Items are the rows of a JSONL file (``options.path``, default Self-Instruct's 252 user-oriented
instructions, never distilled; ``{"id", "prompt"}``). What the benchmark is for is tokens/forward at each
tau and lossless on requests unlike the reasoning tasks. Its score is a surface check: 1.0 when no word of
the output follows itself ("The capital of of France"). Greedy decoding rarely writes one; accepting a mask
slot's token on confidence can repeat the token before it, so the same checkpoint's score at tau = 1 against
a lower tau (paired, item by item) counts the doubled words the lower tau added.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mars.errors import DataError
from mars.evaluation.benchmarks.base import Benchmark, Item, register

WORD = re.compile(r"[A-Za-z']+")


def doubled(text: str) -> set[str]:
    """Words that follow themselves in ``text`` (case-insensitive; across spaces and line breaks, not
    across other punctuation: "no, no" is not a doubled word, "of of" is)."""
    tokens = re.findall(r"[A-Za-z']+|[^\sA-Za-z']", text)
    return {a.lower() for a, b in zip(tokens, tokens[1:]) if WORD.fullmatch(a) and a.lower() == b.lower()}


def added(greedy: str, lossy: str) -> set[str]:
    """The doubled words of ``lossy`` that ``greedy`` does not have."""
    return doubled(lossy) - doubled(greedy)


@register
class Chat(Benchmark):
    """Prompts of a JSONL file; the score: no doubled word (the outputs keep the words, for the paired count)."""

    kind = "chat"
    quality = False  # no verifier: the gate reports it unless gate.benchmarks names it
    options_defaults = {"path": "benchmarks/prompts/user_oriented.jsonl"}

    def items(self) -> list[Item]:
        path = Path(self.options["path"])
        where = f"evaluate.benchmarks.{self.name}.options.path"
        if not path.is_file():
            raise DataError(f"{where}: {path}: no such file")
        pool = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{where}: {path}:{line_no}: expected a JSON object with a 'prompt'") from None
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{where}: {path}:{line_no}: the prompt is empty")
            pool.append(Item(str(row.get("id", f"{path.stem}-{line_no}")), prompt, None, "chat"))
        if len({it.id for it in pool}) != len(pool):
            raise DataError(f"{where}: {path}: ids repeat")
        return self.sample(pool)

    def score(self, items: list[Item], completions: list[str]) -> list[dict]:
        out = []
        for completion in completions:
            words = sorted(doubled(completion))
            out.append({"score": float(not words), "doubled": words})
        return out
