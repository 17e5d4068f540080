"""``heldout``: the held-out split of the prepared data (exact match or final number per task family,
:func:`mars.training.suite.score`); prompts are the prepared token ids, so formatting matches training."""

from __future__ import annotations

from mars.errors import ConfigError
from mars.evaluation.benchmarks.base import Benchmark, Item, register


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
        rng = self.rng()
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
