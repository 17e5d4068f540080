"""Options several verbs share, and how they become params and typed configs."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from mars.config import DEFAULT_PARAMS, build, load_params, section


def add_params_arguments(parser: argparse.ArgumentParser) -> None:
    """The two options every stage verb takes to read its params."""
    parser.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file (default: params.yaml)")
    parser.add_argument(
        "-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one param, as `dvc exp run -S` does (repeatable)",
    )


def params_from_args(args: argparse.Namespace) -> dict:
    return load_params(args.params, args.overrides)


def seed_of(params: dict) -> int:
    """The top-level ``seed`` (model init and training)."""
    return build(int, params.get("seed", 0), "seed")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and in which dtype the decoding verbs load their model."""
    parser.add_argument("--device", help="cpu | cuda (default: cuda where available)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, "
                                                      "bfloat16 on CUDA)")


def load_model_from_args(source: str, args: argparse.Namespace):
    """``(model, tokenizer)`` of ``source`` on ``--device`` in ``--dtype``."""
    import torch

    from mars.core.models import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return load_model(source, dtype=dtype, device=device)


def decode_config(args: argparse.Namespace):
    """The ``decode:`` section; its defaults when the default params.yaml is absent (``mars generate``
    works outside the project), which are the same values as params.yaml's."""
    from mars.decoding.generate import DecodeConfig

    if args.params == str(DEFAULT_PARAMS) and not Path(args.params).is_file() and not args.overrides:
        return DecodeConfig()
    return section(params_from_args(args), "decode", DecodeConfig)


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", help="store URI (default: $MARS_STORE_URI or store.uri)")


def store_config(params: dict, uri: str | None = None):
    """The ``store`` section; ``uri`` (the --store flag), else $MARS_STORE_URI, replaces ``store.uri``."""
    from mars.release.store import StoreConfig

    cfg = section(params, "store", StoreConfig)
    override = uri or os.environ.get("MARS_STORE_URI")
    return dataclasses.replace(cfg, uri=override) if override else cfg


def stand_in_from_params(params: dict, out: str | Path) -> Path:
    """The profile's base model (params ``model``, ``seed``) as a stand-in MARS checkpoint of ``train.mars.block_size``,
    for the export benchmarks and checks that run where no trained checkpoint is."""
    from mars.release.export import stand_in_checkpoint
    from mars.training.base import ModelConfig
    from mars.training.trainer import TrainConfig

    block_size = section(params, "train", TrainConfig).mars.block_size
    return stand_in_checkpoint(section(params, "model", ModelConfig), seed_of(params), block_size, out)
