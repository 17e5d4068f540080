"""What every benchmark shares: its item, config and context types, the base class and the registry."""

from __future__ import annotations

import dataclasses
import importlib
import random
from dataclasses import dataclass, field
from typing import Any

from mars.errors import ConfigError
from mars.evaluation.sandbox import SandboxLimits


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
    sweep_n: int | None = None  # items decoded at the taus below 1.0 (a seeded subset); None: evaluate.sweep_n
    options: dict[str, Any] = field(default_factory=dict)  # benchmark-specific (see each class)

    def __post_init__(self):
        if self.n < 0:
            raise ConfigError(f"n: must be >= 0, got {self.n}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.sweep_n is not None and self.sweep_n < 1:
            raise ConfigError(f"sweep_n: must be >= 1 (or null: evaluate.sweep_n), got {self.sweep_n}")


@dataclass
class Context:
    """What benchmarks may need besides their own config."""

    seed: int = 0
    data_dir: str | None = None
    sandbox: SandboxLimits = dataclasses.field(default_factory=SandboxLimits)
    sandbox_workers: int = 2
    tasks: Any = None  # the tasks: section (mars.training.tasks.TasksConfig) for the reasoning benchmark


class Benchmark:
    """Base class: ``items`` builds the questions, ``score`` grades completions (0.0 .. 1.0 each)."""

    kind: str = ""
    options_defaults: dict[str, Any] = {}
    quality: bool = True  # the score says whether an answer is right: the gate may judge it (False: a surface
                          # check, reported; the gate judges it only where gate.benchmarks names it)

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

    def rng(self) -> random.Random:
        """A generator seeded by the evaluation seed and this benchmark's name: the same items every run."""
        return random.Random(f"mars-eval:{self.context.seed}:{self.name}")

    def sample(self, pool: list) -> list:
        """``n`` members of ``pool`` drawn with :meth:`rng` (all when n is 0 or >= len)."""
        n = self.config.n
        if n == 0 or n >= len(pool):
            return list(pool)
        return self.rng().sample(list(pool), n)


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
