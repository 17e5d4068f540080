"""``TreeShape``: how a draft tree is drawn from the mask slots' distributions (issue #43; the trees
themselves, their window and their verification: :mod:`mars.decoding.tree`). A small frozen value that
crosses from a request, a config or a serving policy into the decoding loop; no torch here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mars.errors import ConfigError


@dataclass(frozen=True)
class TreeShape:
    """How a tree is drawn from the mask slots' distributions.

    ``top_k``: candidates per depth, the last entry for every deeper depth (``(1,)`` is the chain).
    ``max_nodes``: the node budget, the most probable paths first (None: every top-k product).
    ``masks``: where the mask groups go. ``"every"``: after the root and every node; ``"top"``: after the
    end of the most probable path only (the chain's placement today); an int k: after the k nodes (root
    included) most likely to end the accepted path, by the drafts' own probabilities.
    """

    top_k: tuple[int, ...] = (1,)
    max_nodes: int | None = None
    masks: str | int = "every"

    def __post_init__(self):
        object.__setattr__(self, "top_k", tuple(self.top_k))
        if not self.top_k or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.top_k):
            raise ConfigError(f"tree top_k: integers >= 1 per depth, got {self.top_k!r}")
        if self.max_nodes is not None and (isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int)
                                           or self.max_nodes < 0):
            raise ConfigError(f"tree max_nodes: an integer >= 0 or null, got {self.max_nodes!r}")
        if self.masks not in ("every", "top") and (isinstance(self.masks, bool) or not isinstance(self.masks, int)
                                                   or self.masks < 1):
            raise ConfigError(f"tree masks: 'every', 'top' or an integer >= 1, got {self.masks!r}")

    def k(self, depth: int) -> int:
        return self.top_k[min(depth, len(self.top_k) - 1)]

    def max_window(self, masks_per_group: int) -> int:
        """The most window entries a step of this shape forwards after the root, with trees up to
        ``masks_per_group`` (B - 1) deep: its nodes, then ``masks_per_group`` masks per group."""
        nodes, level = 0, 1
        for d in range(masks_per_group):
            level *= self.k(d)
            nodes += level
            if self.max_nodes is not None and nodes >= self.max_nodes:
                nodes = self.max_nodes
                break
        groups = nodes + 1 if self.masks == "every" else 1 if self.masks == "top" else min(self.masks, nodes + 1)
        return nodes + groups * masks_per_group

    @classmethod
    def parse(cls, text: str, key: str = "tree") -> "TreeShape":
        """The shape a :attr:`label` names: ``chain``, ``top2``, ``top3/16``, ``(3,2,1)/10``, each optionally
        ``+masks:top`` or ``+masks:K``; a ConfigError naming ``key`` otherwise."""
        m = re.fullmatch(r"\s*(chain|top(\d+)|\(([\d,\s]+)\))(?:/(\d+))?(?:\+masks:(top|every|\d+))?\s*", str(text))
        if m is None:
            raise ConfigError(f"{key}: expected a tree shape such as chain, top2, top3/16, (3,2,1)/10 or "
                              f"top2/16+masks:4, got {text!r}")
        if m.group(1) == "chain":
            top_k = (1,)
        elif m.group(2) is not None:
            top_k = (int(m.group(2)),)
        else:
            top_k = tuple(int(k) for k in m.group(3).split(",") if k.strip())
        masks = m.group(5) or "every"
        try:
            return cls(top_k, None if m.group(4) is None else int(m.group(4)),
                       int(masks) if masks.isdigit() else masks)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None

    @property
    def label(self) -> str:
        """``chain``, ``top2``, ``top3/16`` (budget), ``(3,2,1)``; ``+masks:top`` / ``+masks:4`` where not every."""
        ks = self.top_k
        name = "chain" if ks == (1,) else f"top{ks[0]}" if len(set(ks)) == 1 else str(ks).replace(" ", "")
        if self.max_nodes is not None:
            name += f"/{self.max_nodes}"
        return name if self.masks == "every" else f"{name}+masks:{self.masks}"


AUTO = "auto"  # the tree knob's third value: the adaptive policy chooses per step (tau_policy.AUTO_TREES)


def tree_shape(tree: TreeShape | str | None, key: str = "tree", auto: bool = False) -> TreeShape | str | None:
    """The draft tree a ``tree`` argument names: None or ``"off"`` for the chain of top-1 drafts, a
    :class:`TreeShape`, or its label (``top2/16``; :meth:`TreeShape.parse`). Where ``auto`` is allowed,
    ``"auto"`` (:data:`AUTO`): each step the shape of :data:`mars.decoding.tau_policy.AUTO_TREES`, the chain
    or greedy AR that the measured tokens/s favour."""
    if tree is None or tree is False or isinstance(tree, TreeShape):  # False: YAML 1.1 reads a bare off as false
        return tree or None
    if isinstance(tree, str):
        if tree.strip() == AUTO:
            if auto:
                return AUTO
            raise ConfigError(f"{key}: auto is chosen per step by a decoding loop; give off or a shape here")
        return None if tree.strip() == "off" else TreeShape.parse(tree, key)
    raise ConfigError(f"{key}: expected off,{' auto,' if auto else ''} a tree shape or its label (top2/16), "
                      f"got {tree!r}")
