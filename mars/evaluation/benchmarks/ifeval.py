"""``ifeval``: instruction following with programmatic checks written here (the IFEval instruction ids
and keyword arguments, so the same checks score the hub's ``google/IFEval``)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Callable

from mars.evaluation.benchmarks.base import Benchmark, Item, register


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text)


def _compare(value: int, relation: str, target: int) -> bool:
    if relation == "less than":
        return value < target
    if relation == "at least":
        return value >= target
    raise ValueError(f"unknown relation {relation!r}")


def _json_ok(text: str) -> bool:
    body = text.strip().removeprefix("```json").removeprefix("```Json").removeprefix("```JSON")
    body = body.removeprefix("```").removesuffix("```").strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\s?\*\*\*\s?", text) if p.strip()]


@dataclass(frozen=True)
class Instruction:
    """One verifiable instruction: how it is phrased (from its kwargs) and how it is checked."""

    id: str
    describe: Callable[..., str]
    check: Callable[..., bool]
    draw: Callable[[random.Random], dict]  # kwargs for a generated prompt


_KEYWORDS = ["river", "window", "garden", "lantern", "journey", "silver", "harbor", "forest", "engine", "letter"]
_MARKERS = ["P.S.", "P.P.S"]
_ENDINGS = ["Is there anything else I can help with?", "Any other questions?", "That is all."]

INSTRUCTIONS: dict[str, Instruction] = {
    i.id: i
    for i in [
        Instruction("punctuation:no_comma", lambda: "Do not use any commas in your response.",
                    lambda r: "," not in r, lambda rng: {}),
        Instruction("change_case:english_lowercase",
                    lambda: "Your entire response should be in lowercase letters. No capital letters are allowed.",
                    lambda r: r == r.lower() and any(c.isalpha() for c in r), lambda rng: {}),
        Instruction("change_case:english_capital",
                    lambda: "Your entire response should be in English, and in all capital letters.",
                    lambda r: r == r.upper() and any(c.isalpha() for c in r), lambda rng: {}),
        Instruction("length_constraints:number_words",
                    lambda relation, num_words: f"Answer with {relation} {num_words} words.",
                    lambda r, relation, num_words: _compare(len(_words(r)), relation, num_words),
                    lambda rng: {"relation": rng.choice(["less than", "at least"]), "num_words": rng.choice([10, 20, 40])}),
        Instruction("keywords:existence",
                    lambda keywords: f"Include the keywords {', '.join(keywords)} in the response.",
                    lambda r, keywords: all(re.search(re.escape(k), r, re.IGNORECASE) for k in keywords),
                    lambda rng: {"keywords": rng.sample(_KEYWORDS, 2)}),
        Instruction("keywords:forbidden_words",
                    lambda forbidden_words: f"Do not include the words {', '.join(forbidden_words)} in the response.",
                    lambda r, forbidden_words: not any(
                        re.search(r"\b" + re.escape(w) + r"\b", r, re.IGNORECASE) for w in forbidden_words),
                    lambda rng: {"forbidden_words": rng.sample(_KEYWORDS, 2)}),
        Instruction("keywords:letter_frequency",
                    lambda letter, let_frequency, let_relation:
                        f"In your response, the letter {letter} should appear {let_relation} {let_frequency} times.",
                    lambda r, letter, let_frequency, let_relation:
                        _compare(r.lower().count(letter.lower()), let_relation, let_frequency),
                    lambda rng: {"letter": rng.choice("aeiou"), "let_frequency": rng.choice([3, 5, 8]),
                                 "let_relation": rng.choice(["less than", "at least"])}),
        Instruction("detectable_format:number_bullet_lists",
                    lambda num_bullets: (f"Your answer must contain exactly {num_bullets} bullet points. "
                                         "Use the markdown bullet points such as:\n* This is point 1."),
                    lambda r, num_bullets: len(re.findall(r"^\s*[*-]\s", r, re.MULTILINE)) == num_bullets,
                    lambda rng: {"num_bullets": rng.choice([2, 3, 4])}),
        Instruction("length_constraints:number_paragraphs",
                    lambda num_paragraphs: (f"There should be {num_paragraphs} paragraphs. Paragraphs are "
                                            "separated with the markdown divider: ***"),
                    lambda r, num_paragraphs: len(_paragraphs(r)) == num_paragraphs,
                    lambda rng: {"num_paragraphs": rng.choice([2, 3])}),
        Instruction("startend:end_checker",
                    lambda end_phrase: (f"Finish your response with this exact phrase {end_phrase}. "
                                        "No other words should follow this phrase."),
                    lambda r, end_phrase: r.strip().lower().endswith(end_phrase.strip().lower()),
                    lambda rng: {"end_phrase": rng.choice(_ENDINGS)}),
        Instruction("startend:quotation", lambda: "Wrap your entire response with double quotation marks.",
                    lambda r: len(r.strip()) > 1 and r.strip()[0] == '"' and r.strip()[-1] == '"', lambda rng: {}),
        Instruction("detectable_format:json_format",
                    lambda: "Entire output should be wrapped in JSON format. You can use markdown ticks such as ```.",
                    _json_ok, lambda rng: {}),
        Instruction("detectable_format:title",
                    lambda: "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.",
                    lambda r: any(t.strip() for t in re.findall(r"<<([^\n]+?)>>", r)), lambda rng: {}),
        Instruction("detectable_content:postscript",
                    lambda postscript_marker: (f"At the end of your response, please explicitly add a postscript "
                                               f"starting with {postscript_marker}"),
                    lambda r, postscript_marker: re.search(
                        r"\s*" + re.escape(postscript_marker.lower()).replace(r"\ ", r"\s*") + r".*$",
                        r.lower(), re.MULTILINE) is not None,
                    lambda rng: {"postscript_marker": rng.choice(_MARKERS)}),
    ]
}

_TASKS = [
    "Write a short note about {topic}.",
    "Describe {topic} to a friend.",
    "Give advice about {topic}.",
    "Write a short story about {topic}.",
    "Explain why people enjoy {topic}.",
]
_TOPICS = [
    "a rainy afternoon", "learning to cook", "a trip to the mountains", "an old bicycle", "the night sky",
    "a busy market", "planting a garden", "a favourite book", "moving to a new city", "a morning run",
    "a quiet library", "building a boat", "a summer festival", "a lost key", "the first day of school",
]
# Instructions that contradict each other are never drawn together.
_CONFLICTS = [{"change_case:english_lowercase", "change_case:english_capital"},
              {"keywords:existence", "keywords:forbidden_words"},
              {"detectable_format:json_format", "startend:quotation", "startend:end_checker",
               "detectable_content:postscript", "detectable_format:number_bullet_lists",
               "length_constraints:number_paragraphs"}]


def check_instructions(response: str, instruction_ids: list[str], kwargs: list[dict]) -> list[bool]:
    """Whether ``response`` follows each instruction (an empty response follows none)."""
    out = []
    for iid, kw in zip(instruction_ids, kwargs):
        kw = {k: v for k, v in (kw or {}).items() if v is not None}
        out.append(bool(response.strip()) and INSTRUCTIONS[iid].check(response, **kw))
    return out


def ifeval_score(item: Item, completion: str) -> dict:
    followed = check_instructions(completion, item.reference["instruction_id_list"], item.reference["kwargs"])
    return {"score": float(all(followed)), "followed": followed,
            "instruction_accuracy": sum(followed) / max(1, len(followed))}


@register
class IFEval(Benchmark):
    """Generated prompts with 1-``max_instructions`` verifiable instructions; score = all followed (strict)."""

    kind = "ifeval"
    options_defaults = {"max_instructions": 2}

    def items(self) -> list[Item]:
        rng = self.rng()
        items = []
        for i in range(self.config.n or 50):
            ids: list[str] = []
            for _ in range(rng.randint(1, self.options["max_instructions"])):
                free = [k for k in INSTRUCTIONS if k not in ids
                        and not any(k in group and set(ids) & group for group in _CONFLICTS)]
                ids.append(rng.choice(free))
            kwargs = [INSTRUCTIONS[k].draw(rng) for k in ids]
            task = rng.choice(_TASKS).format(topic=rng.choice(_TOPICS))
            prompt = " ".join([task] + [INSTRUCTIONS[k].describe(**kw) for k, kw in zip(ids, kwargs)])
            items.append(Item(f"ifeval-{self.context.seed}-{i}", prompt,
                              {"instruction_id_list": ids, "kwargs": kwargs}, family="+".join(ids)))
        return items

    def score(self, items: list[Item], completions: list[str]) -> list[dict]:
        return [ifeval_score(it, c) for it, c in zip(items, completions)]
