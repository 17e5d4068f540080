"""Decoding with a MARS checkpoint: up to B tokens per forward, accepted by a confidence threshold tau.

The rule (DESIGN.md, "Inference"): with n accepted tokens, put B-1 mask tokens at positions n..n+B-2 and
run one causal forward. Slot i (i = 0..B-1) is predicted by the logit at position n-1+i: slot 0 by the
last real token (an ordinary AR step), slot i >= 1 by a mask. Greedy tokens are accepted left to right
while their probability (float32 softmax) is >= tau; slot 0 always is; acceptance stops at the first
slot below tau and after a stop token (EOS). tau = 1.0 accepts slot 0 only and forwards no mask at all:
it is greedy AR, token for token (a float32 softmax can round a mask's probability to exactly 1.0, so
the threshold alone would not guarantee that). tau is per sequence, per call.

**Lossless mode** (``mode="lossless"``, per sequence like tau; blockwise parallel decoding, Stern et
al. 2018): the mask slots' greedy tokens are *drafts* that the next forward checks. Each forward feeds
the last accepted token, the m pending drafts as real tokens, then B-1 masks (consecutive positions).
The logit at the last accepted token and at each draft is an exact greedy AR step, so draft j is kept
while it equals the greedy token read before it; the first wrong draft is replaced by that greedy
token, and the step ends. When every draft holds, the token read at the last draft is taken too and
the mask slots give the next B-1 drafts (as many as the token budget can use); after a wrong draft
the next forward starts from the corrected token and fresh masks. Only verified tokens are committed
to the cache. The output is greedy AR token for token, at 1..B tokens per forward (1 for the prompt's
forward and after a wrong draft); tau plays no part. Windows are at most 2B-1 wide, as in tau mode.
A row's own block size w < B (``DecodeRow.block_size``) makes it w-1 drafts and w-1 masks: a 2w-1 window,
the same greedy tokens (where a wide step costs much, a narrow one yields more tokens per second).

Three ways to run the same rule, all giving the same tokens:

* **no cache** (``use_cache=False``): every step re-runs prompt + accepted tokens (+ drafts) + masks. Slow and plain:
  the reference the cached paths are tested against.
* **token-level cache** (``b_cache=None``, the default): after each step the cache keeps the tokens that
  were real inputs of that step (and verified drafts) and drops the rest. In a batch, rows accept different counts
  and each row's cache grows by its own count (positions are explicit per row).
* **block-level cache** (``b_cache=C >= B``, paper Fig. 4): the cache grows one block of C positions
  at a time, for every row at once. Inside a block each step forwards the whole uncached
  block (real tokens + masks) against the shared prefix cache; a row that has filled its block waits
  at the boundary until every row has; that step commits the block and every row steps. A row is never
  cut short at the boundary (it may run past it by up to B tokens), so the tokens are the same as with
  the token-level cache.

With the token-level cache a finished row (stop token, token budget) hands its place to the next
waiting prompt in the same step (continuous batching: ``batch_size`` rows stay busy while prompts
wait); once none waits, finished rows leave the batch and their cache rows are dropped.

Backend interface
-----------------
The cached loop talks to the model only through four calls, so another runtime (ONNX Runtime in
mars.release.export) can serve it. All arguments are torch tensors; ids/positions are int64 on the backend's
``device``; ``b`` is the number of live rows (it shrinks through ``retain``).

``start(prefixes: list[list[int]]) -> None``
    Reset the cache and fill row i with the tokens ``prefixes[i]`` at positions 0..len-1 (a prefix may
    be empty). With the block-level cache the decoder passes each prompt without its last token (that
    token is the first real token of the first window); with the token-level cache it passes empty
    prefixes and the first window is the whole prompt, so the prefill is also the first decoding step.
``forward(window_ids [b, W], positions [b, W], read [b, S] | None = None) -> logits``
    Score a window against each row's committed cache: window entry k of row i attends to row i's
    committed entries and to window entries 0..k (causal inside the window). The window's K/V entries
    are held as *pending* until ``commit``. Returns float logits ``[b, S, V]`` at window indices ``read``
    (``[b, W, V]`` when ``read`` is None). A window always starts with >= 1 real token per row and may
    end in mask tokens beyond what a row needs (row i needs entries up to ``read[i].max()``, the rest
    only pad the batch: a backend may skip them); a backend with a fixed width may pad it on the right
    with more mask tokens at the following positions (a trailing entry never changes an earlier one)
    and slice its logits. W <= 2B-1 (token level; the first window: the longest prompt + B-1),
    W <= C+2B-1 (block level).
``commit(n_accept [b]) -> None``
    Keep the first ``n_accept[i]`` pending entries of row i in its cache and drop the rest. The
    decoder only commits entries that were real tokens in that forward. Rows may commit different
    counts (a backend may store them as masked holes) or 0.
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

import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Literal, Protocol, Sequence

import torch

from mars.core.checkpoint_info import CheckpointInfo
from mars.errors import ConfigError, MarsError
from mars.decoding.stop_strings import StopStrings
from mars.decoding.torch_backend import TorchBackend

MODES = ("tau", "lossless")


# --------------------------------------------------------------------------------------------- config


@dataclass
class DecodeConfig:
    """The ``decode:`` section of params.yaml."""

    block_size: int | None = None  # None: the checkpoint's config.mars.block_size
    tau: float = 0.9
    mode: Literal["tau", "lossless"] = "tau"  # lossless: greedy output, mask slots as verified drafts
    max_new_tokens: int = 128
    batch_size: int = 8
    b_cache: int | None = None  # None: token-level cache; C >= B: block-level cache of C positions
    use_cache: bool = True

    def __post_init__(self):
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"block_size: must be >= 1, got {self.block_size}")
        if not 0.0 < self.tau <= 1.0:
            raise ConfigError(f"tau: must be in (0, 1], got {self.tau}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.b_cache is not None and self.b_cache < 1:
            raise ConfigError(f"b_cache: must be >= 1 (or null for the token-level cache), got {self.b_cache}")


# --------------------------------------------------------------------------------------------- results


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only; ends with the stop token when one was generated
    text: str  # token_ids decoded, special tokens skipped
    forwards: int  # decoding forward passes this sequence took part in (the prompt prefill not counted)
    tau: float
    block_size: int
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens or the model's context)
    mode: str = "tau"  # "tau" or "lossless" (tau unused: greedy output)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_forward": self.tokens_per_forward}


class Generations(list):
    """The results of one :func:`generate` call, in prompt order, with totals over all sequences."""

    def __init__(self, results: Iterable[GenerationResult], model_calls: int, seconds: float):
        super().__init__(results)
        self.model_calls = model_calls  # batched decoding forward passes actually run
        self.seconds = seconds

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self)

    @property
    def forwards(self) -> int:
        return sum(r.forwards for r in self)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def summary(self) -> dict:
        return {"sequences": len(self), "tokens": self.tokens, "forwards": self.forwards,
                "tokens_per_forward": self.tokens_per_forward, "model_calls": self.model_calls,
                "seconds": self.seconds}


# --------------------------------------------------------------------------------------------- accept rule


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token per slot: HF greedy's pick (its argmax of the float32 logits, the first index on
    ties). ``max`` returns the first index too and runs in under half of ``argmax``'s time on CPU (SmolLM2's
    49k vocabulary, 48 slots: 0.6 ms against 1.6), on the logits' own dtype: widening bf16 to float32 is exact,
    so it changes no order."""
    return logits.max(-1).indices


def accept(logits: torch.Tensor, tau: torch.Tensor, greedy: torch.Tensor, stop_ids: torch.Tensor,
           room: torch.Tensor, lossless: torch.Tensor | None = None, drafts: torch.Tensor | None = None,
           tokens: torch.Tensor | None = None):
    """The accept rule on the slot logits of one step.

    logits ``[b, S, V]`` (slot order), tau ``[b]``, greedy ``[b]`` (tau == 1: slot 0 only), stop_ids
    ``[k]``, room ``[b]`` (tokens a row may still take, >= 0). Lossless rows (``lossless [b]``) verify
    instead: their reads 0..m sit at the last accepted token and at their m pending ``drafts``
    (``[b, S-1]``, -1 past them), so slot j's greedy token is exact while drafts 0..j-1 equal the greedy
    tokens read before them. Returns ``(tokens [b, S], n [b], stopped [b])``: the greedy token per slot,
    how many leading slots are accepted, and whether the accepted ones end in a stop token. ``tokens``
    ``[b, S]`` replaces the greedy pick where rows sample (:mod:`mars.decoding.sampling`); tau is still
    compared with each slot's top probability.
    """
    if tokens is None:
        tokens = greedy_tokens(logits)
    is_stop = torch.isin(tokens, stop_ids)
    if tokens.shape[1] == 1:  # one slot (tau = 1 everywhere): always accepted, no probability needed
        n = (room > 0).long()
        return tokens, n, is_stop[:, 0] & (n > 0)
    slots = torch.arange(tokens.shape[1], device=tokens.device)
    reads_prob = ~greedy if lossless is None else ~(greedy | lossless)  # tau = 1 and lossless rows need none
    if bool(reads_prob.any()):
        prob = logits.float().softmax(-1).amax(-1)  # one fused kernel: faster on CPU than max, subtract, exp and sum
        ok = (prob >= tau[:, None]) & reads_prob[:, None]
    else:
        ok = torch.zeros_like(is_stop)
    if lossless is not None:
        ok[:, 1:] = torch.where(lossless[:, None], drafts == tokens[:, :-1], ok[:, 1:])
    ok &= slots < room[:, None]
    ok[:, 0] = room > 0  # slot 0 always is (when the row has room)
    ok[:, 1:] &= ~is_stop[:, :-1]  # nothing after a stop token (the cumprod carries the cut on)
    keep = ok.long().cumprod(1).bool()
    n = keep.sum(1)
    stopped = (keep & is_stop).any(1)
    return tokens, n, stopped


# --------------------------------------------------------------------------------------------- backends


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


# --------------------------------------------------------------------------------------------- the loops


@dataclass
class _Rows:
    """What a decoding loop returns for its rows, in input order."""

    token_ids: list[list[int]]
    forwards: list[int]
    stopped: list[bool]
    model_calls: int


@dataclass(eq=False)
class DecodeRow:
    """One sequence for :class:`CachedBatch`: its prompt ids, token budget and per-sequence settings.

    ``tau`` and ``lossless`` may be changed between steps (the serving policy does; a row leaving the
    lossless mode drops its pending drafts, which were never output); ``sampler`` (None: greedy) draws a
    token per slot from the slot logits ``[S, V]`` (:class:`mars.decoding.sampling.Sampler`);
    ``block_size`` w (<= the batch's B; None: B) caps the tokens a step may accept and the masks it
    forwards (w - 1; a lossless row's drafts + 1 and its next drafts); ``stream`` rows report their
    accepted tokens after every step, the others only when they finish. A row whose ``cancelled`` is set
    (any thread) leaves the batch before the next step, with no update. ``key`` is the caller's.
    """

    prompt: Sequence[int]
    room: int
    tau: float = 1.0
    lossless: bool = False
    sampler: Callable[[torch.Tensor], torch.Tensor] | None = None
    stop_strings: StopStrings | None = None
    stream: bool = False
    key: object = None
    block_size: int | None = None
    cancelled: bool = False

    @property
    def needs_masks(self) -> bool:
        return (self.tau < 1.0 or self.lossless) and (self.block_size is None or self.block_size > 1)

    def slots(self, block_size: int) -> int:
        """The slots a step reads for this row in a batch of B = ``block_size``: 1 at tau = 1; its own
        block size w (<= B) at a tau < 1; 2w - 1 in the lossless mode (the last token, w - 1 drafts, w - 1
        masks). A serving policy times steps by the widest row's."""
        if not self.needs_masks or block_size < 2:
            return 1
        w = min(self.block_size or block_size, block_size)
        return 2 * w - 1 if self.lossless else w


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
    (:meth:`step`), accepted tokens and finished rows out. :func:`generate` and the server both drive it.

    Token-level cache (``b_cache=None``): rows may join at any step. A finished row's place goes to the
    next row added before the next step (its cache row is reset: continuous batching); finished rows
    not refilled by then leave the batch (``retain``), and rows beyond the finished ones join at the end
    (``extend``) or, into an empty batch, through ``start``. With a ``prefix`` (and a backend with
    ``load_prefix``) a joining row whose prompt starts with it gets its cache entries copied in and
    forwards only the rest of its prompt. Each step reads B slots when some live row
    needs masks (tau < 1 or lossless), else 1; a row forwards only its own masks (none at tau = 1, w - 1
    with its own block size w), and the window is as wide as the widest row needs. The block-level cache
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

    @torch.inference_mode()  # the bookkeeping tensors are the steps' (inference) tensors
    def add(self, rows: Sequence[DecodeRow]) -> None:
        """Rows that join at the next step (see the class docstring for where they go)."""
        rows = list(rows)
        if not rows:
            return
        for row in rows:
            if not row.prompt or row.room < 1:
                raise ValueError("a row needs a non-empty prompt and room >= 1")
            if row.lossless and row.sampler is not None:
                raise ValueError("lossless rows are greedy (no sampler)")
        self._fit(max(len(r.prompt) + r.room for r in rows))
        if self.b_cache is not None:
            if self.started:
                raise ValueError("the block-level cache takes its rows in one batch, before the first step")
            # At tau = 1 every row takes one token per step, so one-position blocks are exact and cheapest.
            masks = self.block_size > 1 and any(r.needs_masks for r in rows)
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
            # Computed at first use, by the thread that steps the batch: after one forward in another thread
            # (the server's event loop builds the engine), that thread's steps ran ~45% slower on this CPU
            # (two OpenMP thread teams).
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
        tau = torch.tensor([r.tau for r in rows], dtype=torch.float32)
        lossless = torch.tensor([r.lossless for r in rows])
        block = self.block
        slots = self.slots if block is not None else (
            self.block_size if any(r.needs_masks for r in rows) else 1)
        length, cached, drafts = self.length, self.cached, self.drafts
        left = ~lossless & (drafts > 0)  # rows moved out of the lossless mode: their drafts go back to masks
        if bool(left.any()):
            spots = torch.arange(int(drafts.max()))
            seq.scatter_(1, torch.where(left[:, None] & (spots < drafts[:, None]), length[:, None] + spots, trash),
                         self.mask_id)
            drafts = self.drafts = torch.where(left, 0, drafts)
        u = length - cached  # real tokens not in the cache yet (>= 1)
        # a tau row takes at most its own block size w (<= B) a step and forwards w-1 masks; a lossless row
        # verifies its drafts and forwards w-1 masks for the next ones; a tau = 1 row forwards no mask
        caps = [min(r.block_size or slots, slots) for r in rows]
        cap = torch.tensor(caps)
        masks = torch.tensor([c - 1 if r.needs_masks else 0 for r, c in zip(rows, caps)])
        need = u + drafts + masks  # window entries a row reads up to: its real tokens, drafts, masks
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
        self.last_slots = max(r.slots(slots) for r in rows)
        # A row reads its last real token, each draft (lossless) and each mask; past them it re-reads
        # its last entry (unused), and a waiting row's reads stay inside the window.
        read_slot = torch.arange(slots + int(drafts.max()))
        read = torch.minimum((u - 1)[:, None] + read_slot, (need - 1)[:, None]).clamp(max=width - 1)
        draft_ids = torch.where(read_slot[:-1] < drafts[:, None], seq.gather(1, (length[:, None] + read_slot[:-1])), -1)
        logits = self.backend.forward(put(seq.gather(1, index)), put(index), put(read))
        # a tau row takes at most its cap, a lossless row its drafts + 1; a waiting row takes nothing
        step_room = torch.minimum(self.room_left, torch.where(lossless, drafts + 1, cap))
        if stepping is not None:
            step_room = torch.where(stepping, step_room, 0)
        tokens, n, stopped = accept(logits, put(tau), put(tau >= 1.0), self.stop_d, put(step_room), put(lossless),
                                    put(draft_ids), tokens=self._sample(logits))
        if self.dev.type != "cpu":
            tokens, n, stopped = tokens.cpu(), n.cpu(), stopped.cpu()
        self.model_calls += 1
        if block is None:
            # the real tokens of the window, and a lossless row's verified drafts (all it accepted but the last)
            commit = u + torch.where(lossless, (n - 1).clamp(min=0), 0)
        else:
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
        fresh = lossless & (n == drafts + 1) & ~stopped
        new = torch.where(fresh, torch.minimum(self.room_left - 1, cap - 1), 0).clamp(min=0)
        if slots > 1:
            fresh_slot = torch.arange(slots - 1)
            src = tokens.gather(1, (drafts[:, None] + 1 + fresh_slot).clamp(max=tokens.shape[1] - 1))
            seq.scatter_(1, torch.where(fresh_slot < new[:, None], length[:, None] + fresh_slot, trash), src)
        self.drafts = torch.where(n > 0, new, drafts)
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


def decode_cached(backend: DecodeBackend, prompts: Sequence[Sequence[int]], *, slots: int, tau: torch.Tensor,
                  room: Sequence[int], stop_ids: torch.Tensor, mask_id: int, lossless: torch.Tensor | None = None,
                  b_cache: int | None = None, max_rows: int | None = None,
                  on_finish: Callable[[int], None] | None = None, stop_strings: StopStrings | None = None) -> _Rows:
    """The cached decoding loop (token level, or block level with ``b_cache``) over :class:`CachedBatch`.

    ``slots`` is the number of slots read per step (B, or 1 when every row has tau = 1: no masks at all),
    ``tau`` ``[n]``, ``lossless`` ``[n]`` (rows decoded in lossless mode; default none), ``room`` the token
    budget per prompt. At most ``max_rows`` rows decode at once (default: all). With the token-level
    cache a row that finishes takes the next waiting prompt in the same step (continuous batching), so
    the batch stays full while prompts wait; the block-level cache steps its rows in lockstep and takes
    one batch (``max_rows`` >= the prompts). ``on_finish(k)`` is called as k sequences finish. A row also
    ends at the token that completes one of ``stop_strings``.
    """
    count = len(prompts)
    b = count if max_rows is None else min(count, max_rows)
    if b < count and (b_cache is not None or not callable(getattr(backend, "reset", None))):
        raise ValueError("max_rows below the prompt count needs the token-level cache and a backend with reset")
    lossless = torch.zeros(count, dtype=torch.bool) if lossless is None else lossless
    taus, room = tau.tolist(), list(room)
    waiting = deque(DecodeRow(prompts[i], int(room[i]), float(taus[i]), bool(lossless[i]),
                              stop_strings=stop_strings, key=i) for i in range(count))
    batch = CachedBatch(backend, block_size=slots, stop_ids=stop_ids, mask_id=mask_id, b_cache=b_cache)
    batch.add([waiting.popleft() for _ in range(b)])
    out = _Rows([[] for _ in range(count)], [0] * count, [False] * count, 0)
    while len(batch):
        finished = [u for u in batch.step() if u.done]
        for update in finished:
            i = update.row.key
            out.token_ids[i], out.forwards[i], out.stopped[i] = update.token_ids, update.forwards, update.stopped
        if finished and on_finish is not None:
            on_finish(len(finished))
        batch.add([waiting.popleft() for _ in range(min(len(finished), len(waiting)))])
    out.model_calls = batch.model_calls
    return out


@torch.inference_mode()
def decode_no_cache(model, prompts: Sequence[Sequence[int]], *, slots: int, tau: torch.Tensor,
                    room: Sequence[int], stop_ids: torch.Tensor, mask_id: int,
                    lossless: torch.Tensor | None = None, stop_strings: StopStrings | None = None) -> _Rows:
    """The reference loop: every step re-runs prompt + accepted tokens (+ a lossless row's drafts) + masks
    with a plain causal mask."""
    seqs, room = [list(p) for p in prompts], list(room)
    lossless = torch.zeros(len(prompts), dtype=torch.bool) if lossless is None else lossless
    drafts: list[list[int]] = [[] for _ in prompts]
    out = _Rows([[] for _ in prompts], [0] * len(prompts), [False] * len(prompts), 0)
    live = list(range(len(prompts)))
    dev = model.device
    while live:
        inputs = [seqs[i] + drafts[i] + [mask_id] * (slots - 1) for i in live]
        width = max(map(len, inputs))
        reads = slots + max(len(drafts[i]) for i in live)
        ids = torch.zeros(len(live), width, dtype=torch.long)
        attn = torch.zeros(len(live), width, dtype=torch.long)
        for k, x in enumerate(inputs):  # left padding, so every row's reads are its last positions
            ids[k, width - len(x):] = torch.tensor(x)
            attn[k, width - len(x):] = 1
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=positions.to(dev),
                       logits_to_keep=reads).logits
        # row k's reads start at its last accepted token; past them it re-reads its last position (unused)
        first = torch.tensor([reads - slots - len(drafts[i]) for i in live])
        index = (first[:, None] + torch.arange(reads)).clamp(max=reads - 1)
        logits = logits.gather(1, index.to(dev)[:, :, None].expand(-1, -1, logits.shape[-1]))
        live_t = torch.tensor(live)
        draft_ids = torch.tensor([drafts[i] + [-1] * (reads - 1 - len(drafts[i])) for i in live], dtype=torch.long)
        limit = [min(room[i], len(drafts[i]) + 1 if lossless[i] else slots) for i in live]
        tokens, n, stopped = accept(logits, tau[live_t].to(dev), (tau[live_t] >= 1.0).to(dev), stop_ids.to(dev),
                                    torch.tensor(limit, device=dev), lossless[live_t].to(dev), draft_ids.to(dev))
        out.model_calls += 1
        for k, i in enumerate(live):
            row, taken = tokens[k].tolist(), int(n[k])
            new = row[:taken]
            seqs[i] += new
            out.token_ids[i] += new
            out.forwards[i] += 1
            room[i] -= len(new)
            out.stopped[i] = bool(stopped[k])
            keep = stop_strings.cut(out.token_ids[i], len(new)) if stop_strings and new else None
            if keep is not None:
                out.token_ids[i], out.stopped[i] = out.token_ids[i][:keep], True
            verified = bool(lossless[i]) and taken == len(drafts[i]) + 1 and not out.stopped[i]
            m = len(drafts[i])
            drafts[i] = row[m + 1: m + 1 + max(0, min(slots - 1, room[i] - 1))] if verified else []
        live = [i for i in live if not out.stopped[i] and room[i] > 0]
    return out


# --------------------------------------------------------------------------------------------- generate


def _context_length(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def encode_prompts(tokenizer, prompts: Sequence) -> list[list[int]]:
    """Token ids per prompt: a string goes through the chat template (a user turn + the generation
    prompt) when the tokenizer has one, else plain tokenization; a list of ``{"role", "content"}``
    messages through the chat template; a list of ints is used as is."""
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt.strip():
                raise MarsError(f"prompt {i}: empty prompt")
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            messages = list(prompt)
        elif isinstance(prompt, (list, tuple, torch.Tensor)):
            ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
            if not ids:
                raise MarsError(f"prompt {i}: empty list of token ids")
            encoded.append(ids)
            continue
        else:
            raise MarsError(f"prompt {i}: expected a string, chat messages or token ids, got {type(prompt).__name__}")
        if tokenizer is None:
            raise MarsError(f"prompt {i}: text prompts need a tokenizer")
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        elif isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            raise MarsError(f"prompt {i}: chat messages need a tokenizer with a chat template")
        encoded.append([int(t) for t in ids])
    return encoded


def stop_token_ids_of(model, tokenizer=None, extra: Iterable[int] = ()) -> list[int]:
    """EOS ids of the tokenizer and of the model's generation config, plus ``extra``."""
    ids = set(int(t) for t in extra)
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return sorted(ids)


def _taus(tau, count: int) -> list[float]:
    taus = [tau] * count if isinstance(tau, (int, float)) else list(tau)
    if len(taus) != count:
        raise MarsError(f"tau: got {len(taus)} values for {count} prompts (give one float, or one per prompt)")
    for i, t in enumerate(taus):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t <= 1.0 or math.isnan(t):
            raise MarsError(f"tau{'' if len(set(map(str, taus))) == 1 else f'[{i}]'}: must be in (0, 1], got {t!r}")
    return [float(t) for t in taus]


def _modes(mode, count: int) -> list[str]:
    modes = [mode] * count if isinstance(mode, str) else list(mode)
    if len(modes) != count:
        raise MarsError(f"mode: got {len(modes)} values for {count} prompts (give one mode, or one per prompt)")
    for i, m in enumerate(modes):
        if m not in MODES:
            raise MarsError(f"mode{'' if len(set(map(str, modes))) == 1 else f'[{i}]'}: must be one of "
                            f"{', '.join(MODES)}, got {m!r}")
    return modes


def check_mask_trained(config) -> None:
    """Refuse threshold decoding below tau = 1 on a model never trained with masks: no ``config.mars``
    (a base model, a plain causal LM) or ``config.mars.objective: ar`` (sft, ar_control). Such a model
    puts high probability on wrong tokens in the mask slots, so tau accepts them: confidently wrong."""
    info = CheckpointInfo.from_config(config)
    if info is not None and info.objective != "ar":
        return
    name = getattr(config, "_name_or_path", "") or "the model"
    what = ("it has no config.mars (a base model or a plain causal LM)" if info is None
            else f"config.mars.objective is ar (stage {info.stage})")
    raise MarsError(f"tau < 1: {name} was never trained with masks ({what}), and below tau = 1 it accepts "
                    "confidently wrong tokens; decode it at tau = 1.0 or in lossless mode, or pass "
                    "allow_untrained=True (mars generate --allow-untrained) to measure it anyway")


def generate(model, tokenizer, prompts: Sequence, *, block_size: int | None = None,
             tau: float | Sequence[float] = DecodeConfig.tau, mode: str | Sequence[str] = DecodeConfig.mode,
             max_new_tokens: int = DecodeConfig.max_new_tokens, batch_size: int = DecodeConfig.batch_size,
             use_cache: bool = True, b_cache: int | None = None, stop_token_ids: Iterable[int] = (),
             stop_strings: Sequence[str] = (), backend: DecodeBackend | None = None,
             progress: bool = False, allow_untrained: bool = False) -> Generations:
    """Decode ``prompts`` with MARS: block size B, threshold ``tau`` (one float, or one per prompt).

    ``mode`` (one, or one per prompt, mixed freely with per-prompt tau in one batch): ``"tau"`` accepts
    mask slots on confidence (the paper's rule, lossy below tau = 1); ``"lossless"`` ignores tau and
    takes the mask slots' tokens as drafts that the next forward verifies, so the output is greedy AR
    token for token at up to B tokens per forward (see the module docstring).

    ``model`` is a transformers causal LM (or, with ``backend``, anything with the checkpoint's
    ``config``); ``block_size`` defaults to the checkpoint's ``config.mars.block_size``. Returns one
    :class:`GenerationResult` per prompt, in order, as a :class:`Generations` list with totals.
    ``batch_size`` rows decode at once; with the token-level cache (``b_cache=None``) a finished row
    takes the next prompt at once, otherwise the prompts go in consecutive batches. ``b_cache``: C >= B
    for the block-level cache; ``use_cache=False`` runs the no-cache reference loop. Decoding stops at a
    stop token (EOS of the tokenizer and the generation config, plus ``stop_token_ids``), after the
    token that completes one of ``stop_strings`` (text; :mod:`mars.decoding.stop_strings`), at
    ``max_new_tokens`` or at the model's context.

    tau < 1 in ``"tau"`` mode is refused for a model never trained with masks (:func:`check_mask_trained`)
    unless ``allow_untrained`` (an evaluation that measures exactly that, e.g. the AR baselines' sweep).
    """
    started = time.perf_counter()
    config = getattr(model, "config", model)
    taus = _taus(tau, len(prompts))
    modes = _modes(mode, len(prompts))
    if max_new_tokens < 1:
        raise MarsError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise MarsError(f"batch_size: must be >= 1, got {batch_size}")
    if block_size is None:
        block_size = CheckpointInfo.block_size_of(config)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise MarsError(f"block_size: must be an integer >= 1, got {block_size!r}")
    needs_masks = any(t < 1.0 or m == "lossless" for t, m in zip(taus, modes))
    if block_size is None:
        if needs_masks:
            raise MarsError("block_size: not given and the checkpoint has no config.mars.block_size")
        block_size = 1
    mask_id = 0  # with one slot per step no window holds a mask; any valid id fills the unused tail
    if needs_masks and block_size > 1:
        from mars.core.mask_token import mask_token_id

        mask_id = mask_token_id(model, tokenizer)  # raises MaskTokenError for a non-MARS checkpoint
        if not allow_untrained and any(t < 1.0 and m == "tau" for t, m in zip(taus, modes)):
            check_mask_trained(config)
    if b_cache is not None and use_cache and b_cache < block_size:
        raise MarsError(f"b_cache: the cache block ({b_cache}) must be at least the block size ({block_size})")
    encoded = encode_prompts(tokenizer, prompts)
    context = _context_length(config)
    if context is not None and block_size > context:
        raise MarsError(f"block_size: {block_size} is more than the model's context ({context} positions)")
    rooms = []
    for i, ids in enumerate(encoded):
        if context is not None and len(ids) >= context:
            raise MarsError(f"prompt {i}: {len(ids)} tokens, the model's context is {context}: no room to generate")
        rooms.append(max_new_tokens if context is None else min(max_new_tokens, context - len(ids)))
    stops = torch.tensor(stop_token_ids_of(model, tokenizer, stop_token_ids), dtype=torch.long)
    stop_text = StopStrings(tokenizer, stop_strings) or None
    if use_cache and backend is None:
        backend = TorchBackend(model)

    # Similar lengths together: less padding. Results go back in prompt order.
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    results: list[GenerationResult | None] = [None] * len(encoded)
    calls = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(encoded), desc="generate", unit="seq")
    # The token-level cache refills finished rows from one queue; the block-level cache and the
    # no-cache reference take the prompts in consecutive batches.
    continuous = use_cache and b_cache is None and callable(getattr(backend, "reset", None))
    groups = [order] if continuous else [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    for group in groups:
        prompts_g = [encoded[i] for i in group]
        tau_g = torch.tensor([taus[i] for i in group])
        lossless_g = torch.tensor([modes[i] == "lossless" for i in group])
        slots = block_size if bool((tau_g < 1.0).any() or lossless_g.any()) else 1
        kwargs = dict(slots=slots, tau=tau_g, lossless=lossless_g, room=[rooms[i] for i in group], stop_ids=stops,
                      mask_id=mask_id, stop_strings=stop_text)
        if use_cache:
            rows = decode_cached(backend, prompts_g, b_cache=b_cache, max_rows=batch_size if continuous else None,
                                 on_finish=bar.update if bar is not None else None, **kwargs)
        else:
            rows = decode_no_cache(model, prompts_g, **kwargs)
            if bar is not None:
                bar.update(len(group))
        calls += rows.model_calls
        for k, i in enumerate(group):
            ids = rows.token_ids[k]
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
            results[i] = GenerationResult(encoded[i], ids, text, rows.forwards[k], taus[i], block_size,
                                          "stop" if rows.stopped[k] else "length", modes[i])
    if bar is not None:
        bar.close()
    return Generations(results, calls, time.perf_counter() - started)
