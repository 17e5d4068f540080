"""The ``reasoning`` benchmark: reasoning-gym held-out items, each scored by its family's own verifier.

Items are the held-out split of the ``tasks:`` families (:mod:`mars.training.tasks`), disjoint from
the distillation pool's train split; ``options.families`` picks which (null: every family in
``tasks``), so families absent from the pool (``pool: false``) measure what distillation did
elsewhere. Each row records ``in_pool``.

A small instruct model rarely answers in the verifier's exact format ("1 + 5 = 6", "The GCD of 7
and 7 is 7."), so a completion is scored by the best verifier score over a few readings of it: the
whole text, its last line, the text after the last "answer is", and its first and last number.
Every checkpoint gets the same readings, so paired comparisons stay fair.
"""

from __future__ import annotations

import re

from mars.errors import ConfigError
from mars.evaluation.benchmarks.answers import _NUMBER
from mars.evaluation.benchmarks.base import Benchmark, Item, register

_ANSWER_IS = re.compile(r"answer is[:\s]*(.+?)(?:\.\s|\.?$)", re.IGNORECASE | re.MULTILINE)


def readings(text: str) -> list[str]:
    """The candidate answers read from one completion, most literal first."""
    text = text.strip()
    out = [text]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines:
        out.append(lines[-1].rstrip("."))
    found = _ANSWER_IS.findall(text)
    if found:
        out.append(found[-1].strip())
    numbers = [n.replace(",", "") for n in _NUMBER.findall(text)]
    if numbers:
        out += [numbers[-1], numbers[0]]
    return list(dict.fromkeys(out))


def verify(family: str, completion: str, entry: dict) -> tuple[float, str]:
    """The best verifier score over the readings of ``completion``, and the reading that got it."""
    from mars.training.tasks import scorer

    score_answer = scorer(family)
    best, which = 0.0, ""
    for reading in readings(completion):
        try:
            score = float(score_answer(reading, entry) or 0.0)
        except Exception:  # a verifier may choke on text it cannot parse: that reading scores 0
            score = 0.0
        if score > best:
            best, which = score, reading
    return best, which


@register
class Reasoning(Benchmark):
    """reasoning-gym held-out items x verifiers; ``options.families``: a list of ``tasks`` families or null."""

    kind = "reasoning"
    options_defaults = {"families": None}

    def _tasks(self):
        tasks = self.context.tasks
        if tasks is None:
            raise ConfigError(f"benchmark {self.name}: needs the tasks: section (mars evaluate passes it)")
        names = self.options["families"] or list(tasks.families)
        unknown = [n for n in names if n not in tasks.families]
        if unknown:
            raise ConfigError(f"evaluate.benchmarks.{self.name}.options.families: {', '.join(unknown)} not in "
                              f"tasks.families")
        return tasks, names

    def items(self) -> list[Item]:
        from mars.training import tasks as rg

        tasks, names = self._tasks()
        self._entries: dict[str, dict] = {}
        pool = []
        for name in names:
            for i, entry in enumerate(rg.heldout(tasks, name)):
                item = Item(f"{name}-heldout-{i}", entry["question"], entry["answer"], name)
                self._entries[item.id] = entry
                pool.append(item)
        return self.sample(pool)

    def score(self, items: list[Item], completions: list[str]) -> list[dict]:
        tasks, _ = self._tasks()
        out = []
        for item, completion in zip(items, completions):
            score, reading = verify(item.family, completion, self._entries[item.id])
            out.append({"score": score, "answer": reading, "in_pool": tasks.families[item.family].pool})
        return out
