"""``gsm``: GSM-style word problems from ``reasoning-gym``'s ``gsm_symbolic`` (templates from the GSM8K
*test* set: evaluation only), scored by the final number."""

from __future__ import annotations

from mars.evaluation.benchmarks.answers import number_matches
from mars.evaluation.benchmarks.base import Benchmark, Item, register


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
