"""Draft trees for lossless decoding (issue #43; DESIGN.md section 4): more than one draft per mask slot.

The chain (:mod:`mars.decoding.accept`) drafts one token per mask slot, its top-1. A tree drafts the top-k
tokens of each slot and keeps the most probable paths. Depth d of a tree holds candidates for the token
d + 1 places after the **root**, the last accepted token; they come from the mask slot d + 1 of the step
before (its mask d), so a tree is at most B - 1 deep. With n accepted tokens (root included), a node at
depth d sits at position n + d.

One forward verifies every node: a node attends to the accepted prefix, its ancestors and itself. The
greedy token read at the root, or at a node whose draft held, is exact; the longest path whose every
token equals the greedy token read at its parent is accepted, plus the greedy token read at its last node
(the "bonus" token). Output = greedy AR, whatever the tree.

**No draft-less steps**: the same forward carries a group of B - 1 masks after each node that can end the
accepted path (the root included). Group entry j after a node at depth d sits at position n + d + 1 + j
(the root's depth is -1) and sees the node's path and the group's earlier entries, so it predicts the
token j + 2 places after that node: whichever path is accepted, the group after its last node holds the
next tree's distributions. The chain places one group, after its last draft, so after a wrong draft the
next step has no drafts (``masks="top"``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from mars.decoding.tree_shape import TreeShape

ROOT = -1  # the root's index wherever a node index is expected


CHAIN = TreeShape((1,), masks="top")  # today's lossless mode: the top-1 drafts, masks after the last one


@dataclass(frozen=True)
class Tree:
    """Draft tokens under the root. Nodes are listed parents first: ``parents[j] < j`` (or ROOT)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    logp: tuple[float, ...]  # log-probability of the path to the node: the sum of its drafts' log-probabilities
    groups: tuple[int, ...]  # the nodes followed by a mask group (ROOT: the root), in window order

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> tuple[int, ...]:
        depths: list[int] = []
        for p in self.parents:
            depths.append(0 if p == ROOT else depths[p] + 1)
        return tuple(depths)

    def path(self, node: int) -> list[int]:
        """The nodes from depth 0 down to ``node`` (empty for the root)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestors(self) -> torch.Tensor:
        """``[N, N]`` bool: ``[j, i]`` is True where node i is node j or one of its ancestors."""
        n = len(self)
        out = torch.eye(n, dtype=torch.bool)
        for j, p in enumerate(self.parents):
            if p != ROOT:
                out[j] |= out[p]  # parents come first: row p is complete
        return out

    def group_of(self, node: int) -> int | None:
        """Index in ``groups`` of the mask group after ``node`` (ROOT: the root); None where it has none."""
        return self.groups.index(node) if node in self.groups else None


ROOT_ONLY = Tree((), (), (), (ROOT,))  # no drafts: the root and its mask group (the first step, or after a miss)


def build_tree(logp: torch.Tensor, shape: TreeShape) -> Tree:
    """The tree of ``shape`` from the log-probabilities ``logp [D, V]`` of depths 0..D-1 (D <= B - 1: the
    caller cuts it to the room left): the most probable paths (sum of log-probabilities) among the top-k
    candidates per depth, up to the node budget. Children of a node come most probable first, so the chain
    ``(1,)`` is each depth's greedy token (the lowest index on ties, as the greedy pick).

    Best-first: a node enters only after its parent and its more probable siblings, so the kept set is
    always a tree; the heap holds one candidate per open sibling list and per node's first child.
    """
    depth, vocab = logp.shape
    if depth == 0 or shape.max_nodes == 0:
        return ROOT_ONLY
    ks = [min(shape.k(d), vocab) for d in range(depth)]
    # topk, not a sort of the vocabulary (~30x faster at 49k tokens); then the lowest index first on ties
    top = logp.float().topk(max(ks), dim=-1)
    pairs = [sorted(zip(v, i), key=lambda p: (-p[0], p[1])) for v, i in zip(top.values.tolist(), top.indices.tolist())]
    values = [[v for v, _ in row] for row in pairs]
    ids = [[i for _, i in row] for row in pairs]
    budget = math.inf if shape.max_nodes is None else shape.max_nodes
    tokens: list[int] = []
    parents: list[int] = []
    logps: list[float] = []
    # heap entry: (-path logp, tie-break, parent node, parent's path logp, depth, rank among the siblings)
    heap = [(-values[0][0], 0, ROOT, 0.0, 0, 0)]
    pushed = 1
    while heap and len(tokens) < budget:
        neg, _, parent, base, d, r = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[d][r])
        parents.append(parent)
        logps.append(-neg)
        if r + 1 < ks[d]:  # the next sibling
            heapq.heappush(heap, (-(base + values[d][r + 1]), pushed, parent, base, d, r + 1))
            pushed += 1
        if d + 1 < depth:  # the first child
            heapq.heappush(heap, (-(-neg + values[d + 1][0]), pushed, node, -neg, d + 1, 0))
            pushed += 1
    return Tree(tuple(tokens), tuple(parents), tuple(logps), _groups(parents, logps, shape.masks))


def _groups(parents: list[int], logp: list[float], masks: str | int) -> tuple[int, ...]:
    nodes = [ROOT, *range(len(parents))]
    if masks == "every":
        return tuple(nodes)
    children: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        children.setdefault(p, []).append(j)
    if masks == "top":  # follow the most probable child (listed first) down to a leaf
        node = ROOT
        while node in children:
            node = children[node][0]
        return (node,)

    # P(the accepted path ends at X) = P(X holds) * P(none of its children holds), were the drafts'
    # probabilities calibrated and independent: the estimate that ranks where masks pay.
    def ending(node: int) -> float:
        base = 0.0 if node == ROOT else logp[node]
        held = sum(math.exp(logp[c] - base) for c in children.get(node, ()))
        return math.exp(base) * max(0.0, 1.0 - held)

    ranked = sorted(nodes, key=lambda x: -ending(x))  # stable: the root first, then node order, on ties
    return tuple(sorted(ranked[:masks]))


@dataclass(frozen=True, eq=False)
class TreeWindow:
    """What a step forwards after the root: the tree's nodes, then a group of ``B - 1`` masks after each
    of ``tree.groups``. Every entry also sees the whole accepted prefix (the root included)."""

    ids: torch.Tensor  # [T] node tokens, then the mask groups
    depth: torch.Tensor  # [T] position - n (n accepted tokens): a node's depth; group entry j after X: depth(X) + 1 + j
    allowed: torch.Tensor  # [T, T] bool: entry q may attend to entry k
    group_start: tuple[int, ...]  # window index of each group's first mask


def tree_window(tree: Tree, masks_per_group: int, mask_id: int) -> TreeWindow:
    """The window of ``tree`` with ``masks_per_group`` (B - 1) masks per group: a node sees its ancestors
    and itself; a group entry sees its node's path and the group's entries up to itself."""
    n, m = len(tree), masks_per_group
    width = n + m * len(tree.groups)
    depths = tree.depths
    ids = torch.full((width,), mask_id, dtype=torch.long)
    ids[:n] = torch.tensor(tree.tokens, dtype=torch.long)
    depth = torch.zeros(width, dtype=torch.long)
    depth[:n] = torch.tensor(depths, dtype=torch.long)
    allowed = torch.zeros(width, width, dtype=torch.bool)
    ancestors = tree.ancestors()
    allowed[:n, :n] = ancestors
    starts = []
    for g, node in enumerate(tree.groups):
        s = n + g * m
        starts.append(s)
        depth[s: s + m] = (ROOT if node == ROOT else depths[node]) + 1 + torch.arange(m)
        if node != ROOT:
            allowed[s: s + m, :n] = ancestors[node]
        allowed[s: s + m, s: s + m] = torch.ones(m, m, dtype=torch.bool).tril()
    return TreeWindow(ids, depth, allowed, tuple(starts))


@dataclass(frozen=True)
class Verdict:
    """What one forward accepts for one row."""

    tokens: tuple[int, ...]  # the verified drafts, then the greedy token read after them
    node: int  # where the last token was read (ROOT or the last verified node): its mask group predicts what follows
    stopped: bool  # the tokens end in a stop token


def verify(tree: Tree, greedy: Sequence[int], stop_ids: Collection[int], room: int) -> Verdict:
    """Accept the longest path of ``tree`` whose every token is the greedy token read at its parent, plus
    the greedy token read at its last node. ``greedy[0]`` is read at the root, ``greedy[1 + j]`` at node j
    (entries of nodes off the accepted path are never used). Nothing is taken after a stop token, and at
    most ``room`` tokens (>= 1)."""
    children = {(p, t): j for j, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    node, read_at, tokens = ROOT, ROOT, []
    while len(tokens) < room:
        token = int(greedy[node + 1])
        tokens.append(token)
        read_at = node
        if token in stop_ids:
            return Verdict(tuple(tokens), read_at, True)
        child = children.get((node, token))
        if child is None:
            break  # no draft is the greedy token: it is the bonus token
        node = child
    return Verdict(tuple(tokens), read_at, False)


class TreeSteps:
    """The tree rows' part of one :class:`~mars.decoding.batch.CachedBatch` step: the rows whose setting
    drafts a tree (lossless, ``tree`` set, width > 1), their windows after their real tokens (:meth:`place`),
    their verification (:meth:`verify`) and the trees their next step drafts (:meth:`next_trees`).

    ``trees`` holds each row's tree from the step before (ROOT_ONLY: no drafts); a row that is not a tree
    row now starts its next tree from the root."""

    def __init__(self, settings: Sequence, slots: int, trees: Sequence[Tree], mask_id: int):
        self.settings = settings
        self.rows = [k for k, s in enumerate(settings) if s.tree is not None and s.needs_masks(slots)]
        self.trees = [ROOT_ONLY] * len(settings)
        self.masks: dict[int, int] = {}  # masks per group (w - 1): a tree is at most that deep
        self.windows: dict[int, TreeWindow] = {}
        self.is_tree = torch.zeros(len(settings), dtype=torch.bool)
        self.width = torch.zeros(len(settings), dtype=torch.long)  # tree window entries per row
        for k in self.rows:
            self.trees[k] = trees[k]
            self.masks[k] = settings[k].at(slots) - 1
            self.windows[k] = tree_window(trees[k], self.masks[k], mask_id)
            self.is_tree[k], self.width[k] = True, self.windows[k].ids.shape[0]
        self.placed: list[int] = []
        self.verdicts: dict[int, Verdict] = {}

    def __bool__(self) -> bool:
        return bool(self.rows)

    def place(self, ids: torch.Tensor, positions: torch.Tensor, u: torch.Tensor, length: torch.Tensor,
              stepping: torch.Tensor | None) -> torch.Tensor:
        """Write each stepping tree row's window after its ``u`` real tokens into the step's ``ids`` and
        ``positions`` ``[b, W]`` (in place; a node at depth d sits at position length + d) and return the
        window's attention ``[b, W, W]``: causal, and a tree window's own rule inside it."""
        b, width = ids.shape
        allowed = torch.ones(width, width, dtype=torch.bool).tril().repeat(b, 1, 1)
        self.placed = [k for k in self.rows if stepping is None or bool(stepping[k])]
        for k in self.placed:
            w, a = self.windows[k], int(u[k])
            t = w.ids.shape[0]
            ids[k, a: a + t] = w.ids
            positions[k, a: a + t] = length[k] + w.depth
            allowed[k, a: a + t, a: a + t] = w.allowed
        return allowed

    def verify(self, tokens: torch.Tensor, n: torch.Tensor, stopped: torch.Tensor, stop_ids: Collection[int],
               room: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Verify each placed row's tree on the greedy ``tokens [b, S]`` read at its root and nodes: its
        accepted tokens, count and stop go into ``tokens``, ``n`` and ``stopped`` (in place), at most
        ``room`` tokens. Returns the window entries each row keeps in the cache, ``[b, K]``: a tree row's
        real tokens and its accepted path, the first entries (as many as it commits) for the others."""
        keep_rows = {}
        for k in self.placed:
            tree = self.trees[k]
            verdict = verify(tree, tokens[k, : 1 + len(tree)].tolist(), stop_ids, int(room[k]))
            tokens[k, : len(verdict.tokens)] = torch.tensor(verdict.tokens)
            n[k], stopped[k] = len(verdict.tokens), verdict.stopped
            self.verdicts[k] = verdict
            a = int(u[k])
            keep_rows[k] = [*range(a), *(a + j for j in tree.path(verdict.node))]
        width = max(int(u.max()) + int(n.max()), 1)
        keep = torch.arange(width).repeat(len(u), 1)
        for k, entries in keep_rows.items():
            keep[k, : len(entries)] = torch.tensor(entries)
        return keep

    def next_trees(self, logits: torch.Tensor, stopped: torch.Tensor, room: torch.Tensor) -> list[Tree]:
        """Each row's tree for its next step: a placed row's from the mask group after the node that read
        its last token (``logits [b, S, V]`` at the root and its window), at most ``room - 1`` deep; no
        drafts where that node had no group or the row stopped; a waiting row keeps its own."""
        out = list(self.trees)
        for k in self.placed:
            verdict, tree = self.verdicts[k], self.trees[k]
            group, depth = tree.group_of(verdict.node), min(self.masks[k], int(room[k]) - 1)
            if group is None or depth < 1 or bool(stopped[k]):
                out[k] = ROOT_ONLY
            else:
                start = 1 + self.windows[k].group_start[group]
                out[k] = build_tree(logits[k, start: start + depth].float().log_softmax(-1), self.settings[k].tree)
        return out
