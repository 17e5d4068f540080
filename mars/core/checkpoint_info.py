"""What a MARS checkpoint says about itself: the ``mars`` section of its ``config.json``.

``mars train`` writes it into every checkpoint it saves (block size B, mask token id, objective, w_ar,
stage, block offset, base model), so a checkpoint folder stays a plain ``save_pretrained`` folder that
says how to decode it. Every reader and writer goes through :class:`CheckpointInfo`: the decoder,
the evaluation and the speed bench read B from it, the trainer and the export stand-in write it, the
export manifest and the release manifest copy it. A malformed section is refused with the key named
(``checkpoints/mars/final: config.mars.block_size: expected an integer, got 'four'``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mars.errors import ConfigError, MarsError

SECTION = "mars"


class CheckpointInfoError(MarsError):
    """A checkpoint's ``config.mars`` section is missing or malformed (the message names the key)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """``config.mars``. B and the mask token are always there; the rest is None where not recorded."""

    block_size: int  # B: the decoding window (AR checkpoints record the MARS stage's, to be compared at)
    mask_token_id: int
    objective: Literal["ar", "mars"] | None = None
    w_ar: float | None = None  # weight of L_AR in training
    stage: str | None = None  # sft | mars | ar_control
    block_offset: Literal["fixed", "random"] | None = None
    base: str | None = None  # the base model the training chain started from

    def __post_init__(self):
        if self.block_size < 1:
            raise ConfigError(f"block_size: must be >= 1, got {self.block_size}")
        if self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id: must be >= 0, got {self.mask_token_id}")
        if self.w_ar is not None and self.w_ar < 0:
            raise ConfigError(f"w_ar: must be >= 0, got {self.w_ar}")

    @classmethod
    def from_section(cls, section: Any, where: str) -> CheckpointInfo:
        """Validate a ``mars`` section (a mapping as read from JSON); ``where`` names its file in errors."""
        from mars.config import build

        if not isinstance(section, dict):
            raise CheckpointInfoError(f"{where}: config.{SECTION}: expected a mapping, got {section!r}")
        try:
            return build(cls, section, f"config.{SECTION}")
        except ConfigError as err:
            raise CheckpointInfoError(f"{where}: {err}") from None

    @classmethod
    def from_config(cls, config: Any) -> CheckpointInfo | None:
        """The section of a model, its ``PretrainedConfig`` or a parsed config.json; None where it has none
        (a base model, a plain hub checkpoint)."""
        if isinstance(config, dict):
            section, where = config.get(SECTION), config.get("_name_or_path") or "config.json"
        else:
            config = getattr(config, "config", config)
            section, where = getattr(config, SECTION, None), getattr(config, "_name_or_path", "") or "the model"
        return None if section is None else cls.from_section(section, where)

    @classmethod
    def block_size_of(cls, config: Any) -> int | None:
        """The B a checkpoint records (what decoding uses unless told otherwise); None where it has none."""
        info = cls.from_config(config)
        return info.block_size if info is not None else None

    @classmethod
    def read(cls, checkpoint: str | Path) -> CheckpointInfo:
        """The section of ``<checkpoint>/config.json``; a clear error if the folder is no MARS checkpoint."""
        from mars.core.atomic import read_json

        path = Path(checkpoint) / "config.json"
        config = read_json(path, "not a model checkpoint", CheckpointInfoError)
        if not isinstance(config, dict) or config.get(SECTION) is None:
            raise CheckpointInfoError(f"{path}: not a MARS checkpoint (no {SECTION} section with block_size and "
                                      "mask_token_id: use a checkpoint written by `mars train`)")
        return cls.from_section(config[SECTION], str(path))

    def to_dict(self) -> dict:
        """The section as written: keys that were not recorded are left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def write_to(self, config: Any) -> None:
        """Record it in a model's config (``save_pretrained`` writes it into config.json)."""
        setattr(getattr(config, "config", config), SECTION, self.to_dict())
