"""The batch state of the cached decoding loop: rows in, one decoding step, accepted tokens out.

:class:`CachedBatch` is the step core that :func:`mars.decoding.generate.generate` and the server both
drive. Each :class:`DecodeRow` carries its own :class:`~mars.decoding.setting.Setting` (tau, lossless mode,
width), which a caller may replace between steps, so rows of any settings share one forward. Two caches:

* **token level** (``b_cache=None``): after each step the cache keeps the tokens that were real inputs of
  that step (and verified drafts) and drops the rest. Rows accept different counts and each row's cache
  grows by its own count (positions are explicit per row). Rows join at any step: a finished row hands its
  place to the next one (continuous batching), and finished rows leave the batch when none waits.
* **block level** (``b_cache=C >= B``, paper Fig. 4): the cache grows one block of C positions at a time,
  for every row at once. Inside a block each step forwards the whole uncached block (real tokens + masks)
  against the shared prefix cache; a row that has filled its block waits at the boundary until every row
  has; that step commits the block and every row steps. A row is never cut short at the boundary (it may
  run past it by up to B tokens), so the tokens are the same as with the token-level cache.

A lossless row's window is its last accepted token, its m pending drafts as real tokens, then w-1 masks
(consecutive positions); only verified tokens are committed to the cache, and after a wrong draft the next
forward starts from the corrected token and fresh masks. Windows are at most 2B-1 wide, as in tau mode.
A lossless row with a draft ``tree`` (:mod:`mars.decoding.tree`) forwards its last token, then the tree's
nodes and a group of w-1 masks after each node that may end the accepted path, under the tree's own
attention; the real tokens and the accepted path are committed (:class:`~mars.decoding.tree.TreeSteps`).

Backend interface
-----------------
The cached loop talks to the model only through these calls, so another runtime (ONNX Runtime in
:mod:`mars.decoding.onnx_backend`) can serve it. All arguments are torch tensors; ids/positions are int64
on the backend's ``device``; ``b`` is the number of live rows (it shrinks through ``retain``).

``start(prefixes: list[list[int]]) -> None``
    Reset the cache and fill row i with the tokens ``prefixes[i]`` at positions 0..len-1 (a prefix may
    be empty). With the block-level cache the decoder passes each prompt without its last token (that
    token is the first real token of the first window); with the token-level cache it passes empty
    prefixes and the first window is the whole prompt, so the prefill is also the first decoding step.
``forward(window_ids [b, W], positions [b, W], read [b, S] | None = None[, allowed [b, W, W]]) -> logits``
    Score a window against each row's committed cache: window entry k of row i attends to row i's
    committed entries and to window entries 0..k (causal inside the window). The window's K/V entries
    are held as *pending* until ``commit``. Returns float logits ``[b, S, V]`` at window indices ``read``
    (``[b, W, V]`` when ``read`` is None). A window always starts with >= 1 real token per row and may
    end in mask tokens beyond what a row needs (row i needs entries up to ``read[i].max()``, the rest
    only pad the batch: a backend may skip them); a backend with a fixed width may pad it on the right
    with more mask tokens at the following positions (a trailing entry never changes an earlier one)
    and slice its logits. W <= 2B-1 (token level; the first window: the longest prompt + B-1),
    W <= C+2B-1 (block level). A backend whose ``tree_windows`` is True also takes ``allowed``, the
    window's attention (lower triangular, the diagonal set; None: causal), which a tree row's window
    needs; its W then grows with the tree (``TreeShape.max_window``).
``commit(n_accept [b][, keep [b, K]]) -> None``
    Keep the first ``n_accept[i]`` pending entries of row i in its cache and drop the rest. The
    decoder only commits entries that were real tokens in that forward. Rows may commit different
    counts (a backend may store them as masked holes) or 0. With ``keep`` (``tree_windows`` backends)
    the kept entries are the window indices ``keep[i, :n_accept[i]]`` (increasing: a tree's accepted
    path), moved up behind the committed ones in that order.
``retain(rows [k]) -> None``
    Keep only these rows (indices into the current rows, increasing) in the cache; rows that finished
    stop costing compute.
``reset(rows [k]) -> None`` (optional)
    Empty these rows' caches: a new sequence takes each of them, and its first window is its whole
    prompt (next to the other rows' short windows). A backend that has it lets the token-level cache
    refill finished rows (continuous batching); without it the prompts go in consecutive batches.
``extend(count: int) -> None`` (optional)
    Add ``count`` empty rows after the current ones: sequences that join a running batch beyond the
    rows that finished (the server's continuous batching; :class:`CachedBatch`).
``cache_prefix(ids: list[int]) -> None`` and ``load_prefix(rows [k]) -> None`` (optional, together)
    Compute once the cache entries of a prompt head ``ids`` at positions 0..P-1; fill these just emptied
    rows with them, committed. A token-level :class:`CachedBatch` given a ``prefix`` copies it into every
    joining row whose prompt starts with it (a chat template's system turn) instead of recomputing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch

from mars.decoding.accept import accept, greedy_tokens
from mars.decoding.setting import GREEDY, Setting
from mars.decoding.stop_strings import StopStrings
from mars.decoding.tree import ROOT_ONLY, TreeSteps
from mars.errors import MarsError


class DecodeBackend(Protocol):
    """See the module docstring, "Backend interface"."""

    device: torch.device

    def start(self, prefixes: list[list[int]]) -> None: ...

    def forward(self, window_ids: torch.Tensor, positions: torch.Tensor,
                read: torch.Tensor | None = None) -> torch.Tensor: ...

    def commit(self, n_accept: torch.Tensor) -> None: ...

    def retain(self, rows: torch.Tensor) -> None: ...

    def reset(self, rows: torch.Tensor) -> None: ...  # optional, see above

    def extend(self, count: int) -> None: ...  # optional, see above



@dataclass(eq=False)
class DecodeRow:
    """One sequence for :class:`CachedBatch`: its prompt ids, token budget and decoding setting.

    ``setting`` (tau, lossless mode, width w: at most w tokens a step and w - 1 masks) may be replaced
    between steps (the serving policy does; a row leaving the lossless mode drops its pending drafts, which
    were never output); ``sampler`` (None: greedy) draws a token per slot from the slot logits ``[S, V]``
    (:class:`mars.decoding.sampling.Sampler`); ``stream`` rows report their accepted tokens after every
    step, the others only when they finish. A row whose ``cancelled`` is set (any thread) leaves the batch
    before the next step, with no update. ``key`` is the caller's.
    """

    prompt: Sequence[int]
    room: int
    setting: Setting = GREEDY
    sampler: Callable[[torch.Tensor], torch.Tensor] | None = None
    stop_strings: StopStrings | None = None
    stream: bool = False
    key: object = None
    cancelled: bool = False


@dataclass
class RowUpdate:
    """What one step did for one row: the tokens it accepted (``new_tokens``, streamed rows) and, once it
    is ``done``, all its generated ``token_ids``, its forwards and whether it ended at a stop."""

    row: DecodeRow
    new_tokens: list[int]
    done: bool = False
    token_ids: list[int] | None = None
    forwards: int = 0
    stopped: bool = False


class CachedBatch:
    """The step-level core of the cached decoding loop: rows in (:meth:`add`), one decoding step
    (:meth:`step`), accepted tokens and finished rows out (see the module docstring for its two caches).

    Token-level cache (``b_cache=None``): rows may join at any step. A finished row's place goes to the
    next row added before the next step (its cache row is reset: continuous batching); finished rows
    not refilled by then leave the batch (``retain``), and rows beyond the finished ones join at the end
    (``extend``) or, into an empty batch, through ``start``. With a ``prefix`` (and a backend with
    ``load_prefix``) a joining row whose prompt starts with it gets its cache entries copied in and
    forwards only the rest of its prompt. Each step reads B slots when some live row's setting needs
    masks (tau < 1 or lossless, at a width above 1), else 1; a row forwards only its own masks (none at
    tau = 1, w - 1 at its width w), and the window is as wide as the widest row needs. The block-level cache
    (``b_cache=C``) takes its rows in one :meth:`add` before the first step and steps them in lockstep.

    Bookkeeping lives in small CPU tensors; the backend sees one window per step and syncs once per step
    (the accepted counts decide the next window).
    """

    def __init__(self, backend: DecodeBackend, *, block_size: int, stop_ids: torch.Tensor, mask_id: int,
                 b_cache: int | None = None, prefix: Sequence[int] = ()):
        self.backend, self.block_size, self.mask_id, self.b_cache = backend, block_size, mask_id, b_cache
        # a prompt head most rows share (a chat template's system turn): computed once, copied into joining rows
        self.prefix = list(prefix) if b_cache is None and callable(getattr(backend, "load_prefix", None)) else []
        self.prefix_hits = 0  # rows that joined with the prefix copied in (each skipped len(prefix) tokens)
        self.dev = torch.device(backend.device)
        self.stop_d = self._put(stop_ids)
        self.stop_set = set(stop_ids.tolist())
        self.rows: list[DecodeRow] = []
        self.free: list[int] = []  # finished rows, refilled by the next add or dropped before the next step
        self.block: int | None = None  # the cache block (block level), fixed with the rows
        self.slots = block_size  # slots read per step (block level: fixed with the rows)
        self.started = False
        self.model_calls = 0
        self.last_slots = 0  # slots the last step read per row (the serving policy times steps by it)
        self.trash = 0  # the last column of `seq` takes the rejected slots
        self._alloc(0)

    def __len__(self) -> int:
        """Rows still decoding."""
        return len(self.live)

    @property
    def live(self) -> list[DecodeRow]:
        """The rows the next step decodes."""
        free = set(self.free)
        return [r for k, r in enumerate(self.rows) if k not in free and not r.cancelled]

    @property
    def grows(self) -> bool:
        """Whether rows can join a running batch (token-level cache and a backend with reset/extend)."""
        return self.b_cache is None and callable(getattr(self.backend, "reset", None))

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dev.type == "cpu" else t.to(self.dev, non_blocking=True)

    def _alloc(self, b: int) -> None:
        self.seq = torch.full((b, self.trash + 1), self.mask_id, dtype=torch.long)
        (self.prompt_len, self.length, self.cached, self.room_left, self.forwards,
         self.drafts) = (torch.zeros(b, dtype=torch.long) for _ in range(6))
        self.trees = [ROOT_ONLY] * b  # a tree row's drafts for its next step (mars.decoding.tree)

    def _fit(self, total: int) -> None:
        # Every step's window is a plain gather from `seq`: beyond each row's length it holds a lossless
        # row's pending drafts, then mask tokens, far enough for any window (the widest reaches a cache
        # block + 2B past the cached prefix).
        trash = total + (self.b_cache or 0) + 2 * self.block_size
        if trash > self.trash:
            seq = torch.full((self.seq.shape[0], trash + 1), self.mask_id, dtype=torch.long)
            seq[:, : self.trash] = self.seq[:, : self.trash]
            self.seq, self.trash = seq, trash
        self.offsets = torch.arange(self.trash)

    def _load(self, k: int, row: DecodeRow, prefilled: bool) -> None:
        """Row k takes ``row``, whose cache holds all but its last prompt token (``prefilled``) or nothing."""
        p = list(row.prompt)
        self.seq[k].fill_(self.mask_id)
        self.seq[k, : len(p)] = torch.tensor(p)
        self.prompt_len[k], self.length[k], self.room_left[k], self.forwards[k], self.drafts[k] = \
            len(p), len(p), row.room, 0, 0
        self.cached[k] = len(p) - 1 if prefilled else 0
        self.rows[k] = row
        self.trees[k] = ROOT_ONLY

    @torch.inference_mode()  # the bookkeeping tensors are the steps' (inference) tensors
    def add(self, rows: Sequence[DecodeRow]) -> None:
        """Rows that join at the next step (see the class docstring for where they go)."""
        rows = list(rows)
        if not rows:
            return
        for row in rows:
            if not row.prompt or row.room < 1:
                raise ValueError("a row needs a non-empty prompt and room >= 1")
            if row.setting.lossless and row.sampler is not None:
                raise ValueError("lossless rows are greedy (no sampler)")
        self._fit(max(len(r.prompt) + r.room for r in rows))
        if self.b_cache is not None:
            if self.started:
                raise ValueError("the block-level cache takes its rows in one batch, before the first step")
            # At tau = 1 every row takes one token per step, so one-position blocks are exact and cheapest.
            masks = any(r.setting.needs_masks(self.block_size) for r in rows)
            self.slots, self.block = (self.block_size, self.b_cache) if masks else (1, 1)
            self.rows = list(rows)
            self._alloc(len(rows))
            for k, row in enumerate(rows):
                self._load(k, row, prefilled=True)
            self.backend.start([list(r.prompt[:-1]) for r in rows])
            self.started = True
            return
        # Token level: the first window is the whole prompt (+ masks), so the prefill is also the first
        # decoding step (one forward fewer, as in HF generate), for a refilled row too.
        refill = []
        while rows and self.free:
            k = self.free.pop(0)
            self._load(k, rows.pop(0), prefilled=False)
            refill.append(k)
        if refill:
            self.backend.reset(self._put(torch.tensor(refill)))
            self._load_prefix(refill)
        if not rows:
            return
        self._compact()
        old = len(self.rows)
        if old and not self.grows:
            raise ValueError("rows join a running batch only with the token-level cache and a backend with reset")
        if old and not callable(getattr(self.backend, "extend", None)):
            raise ValueError("rows join a running batch beyond its finished ones only with a backend with extend")
        n = len(rows)
        self.seq = torch.cat([self.seq, torch.full((n, self.trash + 1), self.mask_id, dtype=torch.long)])
        for name in ("prompt_len", "length", "cached", "room_left", "forwards", "drafts"):
            setattr(self, name, torch.cat([getattr(self, name), torch.zeros(n, dtype=torch.long)]))
        self.rows += rows
        self.trees += [ROOT_ONLY] * n
        for k, row in enumerate(rows, start=old):
            self._load(k, row, prefilled=False)
        if old:
            self.backend.extend(len(rows))
        else:
            self.backend.start([[] for _ in rows])
        self._load_prefix(range(old, old + n))
        self.started = True

    def _load_prefix(self, ks: Iterable[int]) -> None:
        """Rows ``ks``, just emptied, whose prompt starts with the prefix (and goes on past it) start with
        its cache entries: their first window is the rest of the prompt."""
        p = len(self.prefix)
        hits = [k for k in ks if len(self.rows[k].prompt) > p and list(self.rows[k].prompt[:p]) == self.prefix] \
            if p else []
        if hits:
            # Computed at first use, by the thread that steps the batch: a forward in another thread first
            # (the server's event loop builds the engine) slows this thread's steps (two OpenMP thread teams).
            if not self.prefix_hits:
                self.backend.cache_prefix(self.prefix)
            self.backend.load_prefix(self._put(torch.tensor(hits)))
            self.cached[hits] = p
            self.prefix_hits += len(hits)

    def _compact(self) -> None:
        """Finished rows that were not refilled, and cancelled rows, leave the batch."""
        gone = set(self.free) | {k for k, r in enumerate(self.rows) if r.cancelled}
        if not gone:
            return
        keep = torch.tensor([k for k in range(len(self.rows)) if k not in gone], dtype=torch.long)
        if keep.numel():
            self.backend.retain(self._put(keep))
        self.rows = [self.rows[k] for k in keep.tolist()]
        self.trees = [self.trees[k] for k in keep.tolist()]
        for name in ("seq", "prompt_len", "length", "cached", "room_left", "forwards", "drafts"):
            setattr(self, name, getattr(self, name)[keep])
        self.free = []

    def _sample(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The sampled rows' tokens per slot (greedy rows: argmax); None when every row is greedy."""
        if all(r.sampler is None for r in self.rows):
            return None
        tokens = greedy_tokens(logits)
        for k, row in enumerate(self.rows):
            if row.sampler is not None:
                tokens[k] = row.sampler(logits[k])
        return tokens

    @torch.inference_mode()  # no autograd bookkeeping on the per-step bookkeeping ops either
    def step(self) -> list[RowUpdate]:
        """One decoding step of every live row. Returns an update per row that finished (a stop token,
        a stop string, its budget) and per streamed row that accepted tokens."""
        self._compact()
        if not self.rows:
            return []
        rows, put, seq, trash = self.rows, self._put, self.seq, self.trash
        settings = [r.setting for r in rows]
        tau = torch.tensor([s.tau for s in settings], dtype=torch.float32)
        lossless = torch.tensor([s.lossless for s in settings])
        block = self.block
        slots = self.slots if block is not None else (
            self.block_size if any(s.needs_masks(self.block_size) for s in settings) else 1)
        length, cached, drafts = self.length, self.cached, self.drafts
        trees = TreeSteps(settings, slots, self.trees, self.mask_id)  # the rows drafting trees, if any
        if trees and not getattr(self.backend, "tree_windows", False):
            raise MarsError(f"draft trees need a backend that takes a window mask (torch, onnx), "
                            f"not {type(self.backend).__name__}")
        # rows moved out of the chain's lossless mode: their drafts go back to masks
        left = (~lossless | trees.is_tree) & (drafts > 0)
        if bool(left.any()):
            spots = torch.arange(int(drafts.max()))
            seq.scatter_(1, torch.where(left[:, None] & (spots < drafts[:, None]), length[:, None] + spots, trash),
                         self.mask_id)
            drafts = self.drafts = torch.where(left, 0, drafts)
        u = length - cached  # real tokens not in the cache yet (>= 1)
        # a tau row takes at most its width w (<= B) a step and forwards w-1 masks; a lossless row verifies
        # its drafts and forwards w-1 masks for the next ones; a tau = 1 row forwards no mask
        caps = [s.at(slots) for s in settings]
        cap = torch.tensor(caps)
        masks = torch.tensor([c - 1 if s.needs_masks(slots) else 0 for s, c in zip(settings, caps)])
        need = u + drafts + masks  # window entries a row reads up to: its real tokens, drafts, masks
        if trees:  # a tree row reads its real tokens, then its tree window (seq reaches past the widest)
            need = torch.where(trees.is_tree, u + trees.width, need)
            self._fit(int(length.max()) + int(trees.width.max()))
            seq, trash = self.seq, self.trash
        if block is None:
            width, stepping = int(need.max()), None
            # Past its need (a refilled row's prompt widens the window) a row repeats its last entry:
            # trailing entries change nothing and stay inside its positions.
            index = cached[:, None] + torch.minimum(self.offsets[:width], (need - 1)[:, None])
        else:
            # The block is committed once every row has it filled with real tokens (u >= C); until
            # then a row past the boundary waits. The window spans the block and every stepping row's slots.
            commit_now = bool((u >= block).all())
            stepping = torch.ones_like(u, dtype=torch.bool) if commit_now else u <= block
            width = max(block, int(need[stepping].max()))
            index = cached[:, None] + self.offsets[:width]
        # the serving policy files a step's cost under this: a tree's widest window, whatever this step's tree
        self.last_slots = max(s.slots(slots) for s in settings)
        # A row reads its last real token, each draft (lossless) and each mask, or its tree window; past
        # them it re-reads its last entry (unused), and a waiting row's reads stay inside the window.
        read_slot = torch.arange(max(slots + int(drafts.max()), 1 + int(trees.width.max())))
        read = torch.minimum((u - 1)[:, None] + read_slot, (need - 1)[:, None]).clamp(max=width - 1)
        draft_ids = torch.where(read_slot[:-1] < drafts[:, None], seq.gather(1, (length[:, None] + read_slot[:-1])), -1)
        ids, positions = seq.gather(1, index), index
        allowed = trees.place(ids, positions, u, length, stepping) if trees else None
        logits = self.backend.forward(put(ids), put(positions), put(read), *(() if allowed is None else (put(allowed),)))
        # a tau row takes at most its cap, a lossless row its drafts + 1; a waiting row takes nothing
        step_room = torch.minimum(self.room_left, torch.where(lossless, drafts + 1, cap))
        if stepping is not None:
            step_room = torch.where(stepping, step_room, 0)
        tokens, n, stopped = accept(logits, put(tau), put(tau >= 1.0), self.stop_d, put(step_room), put(lossless),
                                    put(draft_ids), tokens=self._sample(logits))
        if self.dev.type != "cpu":
            tokens, n, stopped = tokens.cpu(), n.cpu(), stopped.cpu()
        self.model_calls += 1
        keep = trees.verify(tokens, n, stopped, self.stop_set, self.room_left, u) if trees else None
        if block is None:
            # the real tokens of the window, and a lossless row's verified drafts or tree path (all it
            # accepted but the last)
            commit = u + torch.where(lossless, (n - 1).clamp(min=0), 0)
            self.backend.commit(put(commit), *(() if keep is None else (put(keep),)))
        else:  # the block's real tokens only: a verified path is forwarded again as real tokens
            commit = torch.full_like(u, block if commit_now else 0)
            self.backend.commit(put(commit))
        cached += commit
        streamed = [k for k, r in enumerate(rows) if r.stream]
        before = length.tolist() if streamed else None
        seq.scatter_(1, torch.where(read_slot < n[:, None], length[:, None] + read_slot, trash), tokens)
        # drafts past the accepted ones were wrong: back to masks (a waiting row, n = 0, keeps its own)
        stale = (read_slot[:-1] >= n[:, None]) & (read_slot[:-1] < drafts[:, None]) & (n > 0)[:, None]
        seq.scatter_(1, torch.where(stale, length[:, None] + read_slot[:-1], trash), self.mask_id)
        length += n
        self.room_left -= n
        self.forwards += 1 if stepping is None else stepping.long()
        # All drafts verified: the mask slots' tokens are the next drafts (as many as the budget can use).
        # After a wrong draft the next forward starts from the corrected token and fresh masks.
        fresh = lossless & ~trees.is_tree & (n == drafts + 1) & ~stopped
        new = torch.where(fresh, torch.minimum(self.room_left - 1, cap - 1), 0).clamp(min=0)
        if slots > 1:
            fresh_slot = torch.arange(slots - 1)
            src = tokens.gather(1, (drafts[:, None] + 1 + fresh_slot).clamp(max=tokens.shape[1] - 1))
            seq.scatter_(1, torch.where(fresh_slot < new[:, None], length[:, None] + fresh_slot, trash), src)
        self.drafts = torch.where(n > 0, new, drafts)
        if trees:  # the mask group after where each tree row's accepted path ended drafts its next tree
            self.trees = trees.next_trees(logits, stopped, self.room_left)
        cut = [k for k, r in enumerate(rows) if r.stop_strings]
        for k in cut:  # a stop string ends its row at the token that completes it
            if n[k] > 0:
                keep = rows[k].stop_strings.cut(seq[k, self.prompt_len[k]: length[k]].tolist(), int(n[k]))
                if keep is not None:
                    length[k], stopped[k] = self.prompt_len[k] + keep, True
        done = stopped | (self.room_left == 0)
        updates = {k: RowUpdate(rows[k], seq[k, before[k]: length[k]].tolist()) for k in streamed
                   if length[k] > before[k] or done[k]}
        self.free = done.nonzero()[:, 0].tolist()
        for k in self.free:
            update = updates.setdefault(k, RowUpdate(rows[k], []))
            update.done, update.stopped = True, bool(stopped[k])
            update.token_ids = seq[k, self.prompt_len[k]: length[k]].tolist()
            update.forwards = int(self.forwards[k])
        return list(updates.values())

