"""``mars params``: params.yaml as the stages see it, every section validated against its typed config."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from dataclasses import dataclass, field

from mars.cli.options import add_params_arguments, params_from_args
from mars.config import build
from mars.errors import ConfigError


@dataclass
class SweepConfig:
    """The ``sweep:`` section, which only sweep/dvc.yaml reads (through DVC's templating)."""

    block_sizes: list[int] = field(default_factory=lambda: [4, 8, 16])
    w_ar: list[float] = field(default_factory=lambda: [1.0, 0.0])

    def __post_init__(self):
        if not self.block_sizes or min(self.block_sizes) < 1:
            raise ConfigError(f"block_sizes: give B values >= 1, got {self.block_sizes}")
        if not self.w_ar or min(self.w_ar) < 0:
            raise ConfigError(f"w_ar: give weights >= 0, got {self.w_ar}")


# Every top-level key of params.yaml (``profiles`` aside) -> the type its readers build it into.
SECTIONS: dict[str, str] = {
    "profile": "builtins:str",
    "seed": "builtins:int",
    "model": "mars.training.base:ModelConfig",
    "tasks": "mars.training.tasks:TasksConfig",
    "distill": "mars.training.distill:DistillConfig",
    "data": "mars.training.data:DataConfig",
    "train": "mars.training.trainer:TrainConfig",
    "export": "mars.release.export:ExportConfig",
    "store": "mars.release.store:StoreConfig",
    "decode": "mars.decoding.generate:DecodeConfig",
    "evaluate": "mars.evaluation.evaluate:EvalConfig",
    "gate": "mars.evaluation.gate:GateConfig",
    "flow": "flows.pipeline:FlowConfig",
    "sweep": "mars.cli.params:SweepConfig",
}


def section_type(name: str) -> type:
    if name not in SECTIONS:
        raise ConfigError(f"{name}: unknown section (known: {', '.join(SECTIONS)}, profiles)")
    module, _, attr = SECTIONS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def validate(params: dict) -> dict:
    """Every section of resolved ``params`` built into its type (unknown sections and keys are errors)."""
    return {name: build(section_type(name), value, name) for name, value in params.items()}


def main(argv: list[str], verb: str = "params") -> int:
    parser = argparse.ArgumentParser(
        prog=f"mars {verb}",
        description="Print params.yaml as the stages see it (profile and -S overrides applied, defaults filled in), "
                    "after validating every section.")
    add_params_arguments(parser)
    parser.add_argument("--section", help="print one section only")
    args = parser.parse_args(argv)
    typed = validate(params_from_args(args))
    if args.section:
        section_type(args.section)  # an unknown name is an error, not a null
        typed = {args.section: typed.get(args.section)}
    shown = {name: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
             for name, value in typed.items()}
    print(json.dumps(shown, indent=2))
    return 0
