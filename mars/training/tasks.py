"""reasoning-gym task families: one spec (params ``tasks:``) for the distillation pool and the benchmark.

reasoning-gym generates procedural tasks (``reasoning_gym.create_dataset(name, size=, seed=, **config)``),
each with a verifier (``score_answer(answer, entry)``). The same family settings serve two splits:

- ``train``: the prompts the ``distill`` stage hands the base model (families with ``pool: true``);
- ``heldout``: the ``reasoning`` benchmark's items (every family, including ``pool: false`` ones,
  which the model was never distilled on), each question once.

A family must generate the same items in every process (the distill stage resumes by a digest of its
pool, and evaluation regenerates the held-out split): ``isomorphic_strings``, for one, iterates a set
of strings and draws differently under each ``PYTHONHASHSEED``. The default families are checked.

The splits come from seed ranges that do not overlap (reasoning-gym seeds item i with seed + i) and
are disjoint by content as well: a train item whose question is also a held-out question of its
family, or repeats an earlier one, is dropped (and counted), so a small content space (gcd of small
numbers) cannot leak an answer. Everything is a function of the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mars.errors import ConfigError

Split = Literal["train", "heldout"]
EVAL_ONLY = {"gsm_symbolic"}  # built from GSM8K *test* templates: never training data


@dataclass
class TaskFamily:
    """One reasoning-gym family: whether the pool uses it, and its difficulty settings."""

    pool: bool = True  # false: evaluation only (a family absent from the distillation data)
    config: dict[str, Any] = field(default_factory=dict)  # create_dataset keyword arguments (difficulty)


def default_families() -> dict[str, TaskFamily]:
    """Easy settings: SmolLM2-135M scores 20-70% on the first three and on lcm, products (pool: false),
    13-16% on count_bits and syllogism; the other pool families add diversity to the distillation data."""
    F = TaskFamily
    return {
        "basic_arithmetic": F(config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                      "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}),
        "gcd": F(config={"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 50}),
        "letter_counting": F(config={"min_words": 3, "max_words": 5}),
        "chain_sum": F(config={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
        "spell_backward": F(config={"min_word_len": 3, "max_word_len": 5}),
        "leg_counting": F(config={"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3}),
        "simple_equations": F(config={"min_terms": 2, "max_terms": 2, "min_value": 1, "max_value": 10}),
        "word_sequence_reversal": F(config={"min_words": 3, "max_words": 5}),
        "calendar_arithmetic": F(),
        "number_sorting": F(config={"min_numbers": 3, "max_numbers": 5, "min_decimals": 0, "max_decimals": 0,
                                    "min_value": 1, "max_value": 50}),
        "word_sorting": F(config={"min_words": 3, "max_words": 5}),
        "time_intervals": F(),
        "caesar_cipher": F(config={"min_words": 2, "max_words": 4}),
        "base_conversion": F(config={"min_value": 1, "max_value": 100}),
        "prime_factorization": F(config={"min_value": 4, "max_value": 60}),
        "lcm": F(pool=False, config={"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 20}),
        "products": F(pool=False, config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
        "count_bits": F(pool=False, config={"min_n": 1, "max_n": 16}),
        "syllogism": F(pool=False),
    }


@dataclass
class TasksConfig:
    """The ``tasks:`` section of params.yaml."""

    train_seed: int = 0
    heldout_seed: int = 1_000_000
    n_train: int = 40  # pool prompts per pool family (fewer when the content space runs out; counted)
    n_heldout: int = 32  # held-out items per family
    families: dict[str, TaskFamily] = field(default_factory=default_families)

    def __post_init__(self):
        if self.n_train < 1 or self.n_heldout < 1:
            raise ConfigError("n_train, n_heldout: must be positive")
        # reasoning-gym seeds item i with seed + i: seeds 1 and 2 share all but one item
        train = range(self.train_seed, self.train_seed + self.train_draw())
        held = range(self.heldout_seed, self.heldout_seed + self.heldout_draw())
        if train.start < held.stop and held.start < train.stop:
            raise ConfigError(f"heldout_seed: items {held.start}..{held.stop - 1} overlap the train draw "
                              f"{train.start}..{train.stop - 1} (reasoning-gym seeds item i with seed + i)")
        for name, fam in self.families.items():
            if fam.pool and name in EVAL_ONLY:
                raise ConfigError(f"families.{name}.pool: {name} comes from a benchmark's test set: evaluation only")

    def train_draw(self) -> int:
        """Items drawn per family for the train split: extra, so that dropped repeats still leave n_train."""
        return 2 * self.n_train + self.n_heldout

    def heldout_draw(self) -> int:
        """Items drawn per family for the held-out split: extra, so that dropped repeats still leave n_heldout."""
        return 2 * self.n_heldout

    def pool_families(self) -> list[str]:
        return [name for name, fam in self.families.items() if fam.pool]


def dataset(name: str, family: TaskFamily, size: int, seed: int):
    """The reasoning-gym dataset of ``name``; an unknown family or setting names the key."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ConfigError(f"tasks.families: unknown reasoning-gym family {name!r}")
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **family.config)
    except (TypeError, ValueError, AssertionError) as err:
        raise ConfigError(f"tasks.families.{name}.config: {err}") from None


def heldout(cfg: TasksConfig, name: str) -> list[dict]:
    """Up to ``n_heldout`` held-out entries of one family (question, answer, metadata), in draw order, each
    question once: a repeated question would count twice in a score and understate its standard error
    (fewer where the family's content space runs out)."""
    kept, seen = [], set()
    for entry in dataset(name, cfg.families[name], cfg.heldout_draw(), cfg.heldout_seed):
        if len(kept) == cfg.n_heldout:
            break
        if entry["question"] not in seen:
            seen.add(entry["question"])
            kept.append(entry)
    return kept


def train(cfg: TasksConfig, name: str) -> tuple[list[dict], int]:
    """Up to ``n_train`` train entries of one family, none with a held-out question or a repeated one;
    and how many generated entries were dropped for that."""
    held = {e["question"] for e in heldout(cfg, name)}
    drawn = dataset(name, cfg.families[name], cfg.train_draw(), cfg.train_seed)
    kept, seen, dropped = [], set(held), 0
    for entry in drawn:
        if len(kept) == cfg.n_train:
            break
        if entry["question"] in seen:
            dropped += 1
            continue
        seen.add(entry["question"])
        kept.append(entry)
    return kept, dropped


def scorer(name: str):
    """The family's verifier: ``score_answer(answer, entry) -> float`` in [0, 1]."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)
