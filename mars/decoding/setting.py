"""``Setting``: how one row decodes (tau, lossless mode, width), the value that crosses from a request or a
serving policy into the decoding loop and back into the policy's observations."""

from __future__ import annotations

from dataclasses import dataclass

from mars.decoding.tree_shape import TreeShape
from mars.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """One row's decoding setting.

    ``tau``: the accept threshold in (0, 1]; 1.0 is greedy AR with no masks. ``lossless``: greedy output
    with the mask slots' tokens as drafts that the next forward verifies (``tau`` is then 1.0). ``width``:
    at most this many tokens a step (w - 1 masks, and in the lossless mode w - 1 drafts); None is the
    checkpoint's block size B, and a width above B decodes at B. ``tree``: in the lossless mode, drafts as a
    tree of this shape (:mod:`mars.decoding.tree`) instead of the chain of top-1 drafts (None).
    """

    tau: float = 1.0
    lossless: bool = False
    width: int | None = None
    tree: TreeShape | None = None

    def __post_init__(self):
        object.__setattr__(self, "tau", self.check_tau(self.tau))
        if self.lossless and self.tau != 1.0:
            raise ConfigError(f"tau: the lossless mode decodes greedily (tau 1.0), got {self.tau!r}")
        if self.width is not None and (isinstance(self.width, bool) or not isinstance(self.width, int)
                                       or self.width < 1):
            raise ConfigError(f"block_size: must be an integer >= 1, got {self.width!r}")
        if self.tree is not None and not self.lossless:
            raise ConfigError(f"tree: draft trees are a lossless-mode setting, got tau {self.tau:g} with tree "
                              f"{self.tree.label}")

    @staticmethod
    def check_tau(value, key: str = "tau") -> float:
        """``value`` as a tau in (0, 1], or a ConfigError naming ``key``: the one check of every tau a config,
        request or call gives (``key`` says where: ``tau[2]``, ``taus``, ``speed_tau``)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            raise ConfigError(f"{key}: must be in (0, 1], got {value!r}")
        return float(value)

    def at(self, block_size: int) -> int:
        """The width this setting decodes at in a batch of block size B."""
        return max(1, min(self.width or block_size, block_size))

    def needs_masks(self, block_size: int) -> bool:
        return (self.tau < 1.0 or self.lossless) and self.at(block_size) > 1

    def slots(self, block_size: int) -> int:
        """Window slots a step reads for the row: 1 at tau = 1, w at a tau < 1, 2w - 1 in the lossless mode
        (the last token, w - 1 drafts, w - 1 masks), 1 + the widest tree window with a tree. A step costs
        what its widest row reads."""
        if not self.needs_masks(block_size):
            return 1
        w = self.at(block_size)
        if self.tree is not None:
            return 1 + self.tree.max_window(w - 1)
        return 2 * w - 1 if self.lossless else w

    def label(self, block_size: int | None = None) -> str:
        """``tau=1``, ``tau=0.9``, ``lossless`` (at B), ``lossless:w=2``: the name in logs and /metrics."""
        if self.lossless:
            narrow = self.width is not None and (block_size is None or self.width < block_size)
            name = f"lossless:w={self.width}" if narrow else "lossless"
            return name if self.tree is None else f"{name}:tree={self.tree.label}"
        return f"tau={self.tau:g}" + (f":w={self.width}" if self.width is not None else "")


GREEDY = Setting()  # tau = 1: greedy AR, one token a step
