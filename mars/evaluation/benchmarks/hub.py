"""``hub``: a Hugging Face data set by name (``preset``: ifeval, bbh, mmlu_pro, gpqa, gsm8k, humaneval).
It needs network or a filled cache and fails offline with a message that says so."""

from __future__ import annotations

import random
import string
from typing import Callable

from mars.errors import ConfigError, MarsError
from mars.evaluation.benchmarks.answers import extract_answer, extract_choice, number_matches
from mars.evaluation.benchmarks.base import Benchmark, Item, register
from mars.evaluation.benchmarks.humaneval import HumanEval, score_humaneval
from mars.evaluation.benchmarks.ifeval import INSTRUCTIONS, ifeval_score

_LETTERS = string.ascii_uppercase


def _choice_prompt(question: str, options: list[str]) -> str:
    lines = [question.strip(), ""] + [f"({_LETTERS[i]}) {opt}" for i, opt in enumerate(options)]
    lines += ["", 'Think step by step, then finish with "The answer is (X)" where X is the letter of your choice.']
    return "\n".join(lines)


def _gpqa_row(row: dict, idx: int, seed: int) -> Item:
    options = [row["Correct Answer"], row["Incorrect Answer 1"], row["Incorrect Answer 2"], row["Incorrect Answer 3"]]
    order = list(range(4))
    random.Random(f"gpqa:{seed}:{idx}").shuffle(order)  # the correct answer is not always (A)
    shuffled = [options[i].strip() for i in order]
    return Item(f"gpqa-{idx}", _choice_prompt(row["Question"], shuffled), _LETTERS[order.index(0)])


# preset -> (dataset path, config, split, row -> Item, scorer kind)
HUB_PRESETS: dict[str, tuple[str, str | None, str, Callable[[dict, int, int], Item], str]] = {
    "gsm8k": ("openai/gsm8k", "main", "test",
              lambda r, i, s: Item(f"gsm8k-{i}", r["question"] + "\nSolve step by step; end with the final number.",
                                   r["answer"].split("####")[-1].strip()), "number"),
    "humaneval": ("openai/openai_humaneval", None, "test",
                  lambda r, i, s: Item(r["task_id"], HumanEval.CHAT_PROMPT.format(prompt=r["prompt"]),
                                       {k: r[k] for k in ("prompt", "test", "entry_point")}), "humaneval"),
    "ifeval": ("google/IFEval", None, "train",
               lambda r, i, s: Item(f"ifeval-{r['key']}", r["prompt"],
                                    {"instruction_id_list": r["instruction_id_list"], "kwargs": r["kwargs"]}), "ifeval"),
    "bbh": ("lukaemon/bbh", "boolean_expressions", "test",
            lambda r, i, s: Item(f"bbh-{i}", r["input"] + '\nFinish with "The answer is X".', r["target"]), "exact"),
    "mmlu_pro": ("TIGER-Lab/MMLU-Pro", None, "test",
                 lambda r, i, s: Item(f"mmlu_pro-{r.get('question_id', i)}", _choice_prompt(r["question"], r["options"]),
                                      r["answer"], r.get("category", "")), "choice"),
    "gpqa": ("Idavidrein/gpqa", "gpqa_diamond", "train", _gpqa_row, "choice"),
}


@register
class Hub(Benchmark):
    """A hub data set by preset (``options.preset``); ``options.dataset/config/split`` override the preset's."""

    kind = "hub"
    options_defaults = {"preset": "", "dataset": "", "config": "", "split": ""}

    def __init__(self, name, config, context):
        super().__init__(name, config, context)
        preset = self.options["preset"] or name
        if preset not in HUB_PRESETS:
            raise ConfigError(f"evaluate.benchmarks.{name}.options.preset: unknown {preset!r} "
                              f"(known: {', '.join(HUB_PRESETS)})")
        path, cfg, split, self.convert, self.scorer = HUB_PRESETS[preset]
        self.path = self.options["dataset"] or path
        self.hub_config = self.options["config"] or cfg
        self.split = self.options["split"] or split

    def load_rows(self) -> list[dict]:
        try:
            import datasets

            ds = datasets.load_dataset(self.path, self.hub_config, split=self.split)
        except Exception as err:  # connection errors come in many types (requests, httpx, OSError, ...)
            raise MarsError(
                f"benchmark {self.name}: could not load the hub data set {self.path}"
                f"{'/' + self.hub_config if self.hub_config else ''} split {self.split} "
                f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}). It needs network "
                f"or a filled HF_DATASETS_CACHE; offline, disable it: -S evaluate.benchmarks.{self.name}.enabled=false"
            ) from None
        return list(ds)

    def items(self) -> list[Item]:
        rows = self.load_rows()
        items = [self.convert(row, i, self.context.seed) for i, row in enumerate(rows)]
        if self.scorer == "ifeval":
            supported = [it for it in items if all(k in INSTRUCTIONS for k in it.reference["instruction_id_list"])]
            if not supported:
                raise MarsError(f"benchmark {self.name}: none of its instructions has a check here")
            items = supported  # the checks written here cover a subset of IFEval's instruction ids
        return self.sample(items)

    def score(self, items: list[Item], completions: list[str]) -> list[dict]:
        if self.scorer == "humaneval":
            return score_humaneval(items, completions, "chat", self.context)
        if self.scorer == "ifeval":
            return [ifeval_score(it, c) for it, c in zip(items, completions)]
        return super().score(items, completions)

    def score_one(self, item: Item, completion: str) -> float:
        if self.scorer == "number":
            return float(number_matches(completion, item.reference))
        if self.scorer == "choice":
            return float(extract_choice(completion, _LETTERS[:10]) == item.reference)
        return float(extract_answer(completion).strip().lower() == str(item.reference).strip().lower())
