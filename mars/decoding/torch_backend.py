"""The PyTorch decode backend: a per-row KV cache and a lean pass over the model's own layers.

:class:`mars.decoding.batch.CachedBatch` drives any backend through ``start / forward / commit / retain / reset``
(see :mod:`mars.decoding.batch`, "Backend interface"). This one serves a transformers causal LM.

The cache (:class:`RowCache`) is preallocated per layer as ``[rows, kv_heads, capacity, head_dim]``;
entry ``j`` of row ``i`` is row i's token at position ``j`` of its own sequence, so there is no padding
and no hole: row i's committed entries are ``0 .. length[i] - 1``. A forward writes its window right
after them and a query at window index ``k`` attends to entries ``<= length[i] + k``. Whatever the
accept rule rejects (mask entries, unaccepted tokens) lies beyond the committed length and is
overwritten by the next window, so ``commit`` only moves ``length``; no copy, no crop. A prompt head
shared by many rows (a chat template's system turn) is computed once (``cache_prefix``) and copied into
each row that starts with it (``load_prefix``): a key at position j depends only on tokens 0..j.

For Llama and Qwen2 (dense attention, no sliding window) the forward runs the model's own modules
(norms, projections, rotary embedding, the configured attention function, MLP) in a plain loop over
the layers with three savings that do not change a single operation on a used token:

* **ragged windows**: a row only needs its window up to the last slot it reads (the decoder pads rows
  up to the widest row, a new prompt's for instance); when that skips at least half of the window,
  entries past it are not computed at all. The per-token work (projections, MLP) runs on the packed
  tokens; attention runs on a padded layout per group of rows (:class:`AttentionGroups`): where a few
  rows are far wider than the rest (a new prompt joining a decoding batch), those rows attend in their
  own call at their width and the others at theirs. In one padded call every row would carry the
  prompt's width of queries: on SmolLM2 in bf16, a 62-token prompt joining 15 rows decoding 3-token
  windows cost 200 ms a step that way, against 71 ms for the 16 decoding rows and 37 ms for the prompt alone.
* **LM head at read positions only**: the final norm and LM head see ``[rows, slots]`` hidden states,
  not ``[rows, W]``.
* **grouped-query attention without copies**: transformers' sdpa attention repeats each key/value head
  for its query heads (a copy of the cache span per layer) whenever a window has more than one query;
  here the query heads sharing a key/value head are stacked as extra queries instead, at every width (what
  transformers itself does for one query), the same dot products in the same kernel. On SmolLM2 in bf16 (9 query
  heads, 3 key/value heads) a 16-row step of 3-token windows spent 1.0 ms a layer in attention that way
  and 0.2 ms this way (an ad-hoc microbenchmark; outputs equal bit for bit).
* no mask building, no cache bookkeeping and no output capturing of the generic model forward.

Other architectures run the generic ``model(...)`` forward with the same cache (it duck-types the
``update`` call of a transformers ``Cache``) and an explicit 4D mask.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from mars.core.masking import to_additive, to_sdpa
from mars.errors import MarsError

LEAN_MODEL_TYPES = ("llama", "qwen2")


def attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed [b, q, k]`` in the form the model's attention takes as a 4D mask (used as given)."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "sdpa":
        return to_sdpa(allowed)
    if impl == "eager":  # eager adds the mask to the scores: a boolean mask would be silently wrong
        return to_additive(allowed, model.dtype)
    raise MarsError(f"decoding needs attn_implementation 'sdpa' or 'eager' (4D masks), the model uses {impl!r}")


class RowCache:
    """Keys and values per layer, ``[rows, kv_heads, capacity, head_dim]``, entry j = position j of the row."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, *, dtype, device, capacity: int = 64):
        shape = (rows, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = torch.zeros(rows, dtype=torch.long, device=device)  # committed entries per row
        self._write = None  # (row index [N], entry index [N]) of the window being written, see `window`
        self._span = 0  # entries the window's attention reads

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def window(self, width: int, where: tuple[torch.Tensor, torch.Tensor] | None = None,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Prepare a forward of ``width`` entries per row; ``where`` (row, window index) lists the entries
        computed, row by row (None: all of them).

        Returns the boolean attention mask ``[b, W, span]`` over the entries attention reads (``span =
        length.max() + width``): window entry k of row i sees every committed entry of row i and the window
        entries ``allowed[i, k]`` (``[b, W, W]``, lower triangular; None: entries 0..k, causal).
        """
        b = self.length.shape[0]
        slots = self.length[:, None] + torch.arange(width, device=self.length.device)  # [b, W]
        span = int(self.length.max()) + width if b else width
        if span > self.capacity:
            self._grow(max(span, 2 * self.capacity))
        if where is None:
            self._write = (torch.arange(b, device=slots.device).repeat_interleave(width), slots.reshape(-1))
        else:
            self._write = (where[0], slots[where])
        self._span = span
        entries = torch.arange(span, device=slots.device)
        mask = entries[None, None, :] <= slots[:, :, None]
        if allowed is None:
            return mask
        k = entries[None, :] - self.length[:, None]  # [b, span]: the window index of each entry
        inside = (k >= 0) & (k < width)
        own = allowed.gather(2, k.clamp(0, width - 1)[:, None, :].expand(b, width, span))
        return torch.where(inside[:, None, :], own, mask)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Store the window's ``keys``/``values`` ``[N, kv_heads, head_dim]`` (packed, in ``window`` order);
        returns the layer's entries that the window's attention reads, ``[b, kv_heads, span, head_dim]``."""
        rows, slots = self._write
        self.keys[layer][rows, :, slots] = keys
        self.values[layer][rows, :, slots] = values
        return self.keys[layer][:, :, : self._span], self.values[layer][:, :, : self._span]

    def commit(self, n: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Keep ``n[i]`` entries of row i's last window: its first ones, or window indices ``keep[i, :n[i]]``
        (``[b, K]``, increasing: an accepted tree path), moved to follow the committed entries in that order."""
        if keep is not None:
            j = torch.arange(keep.shape[1], device=keep.device)
            rows, cols = ((j < n[:, None]) & (keep != j)).nonzero(as_tuple=True)
            if rows.numel():
                src, dst = self.length[rows] + keep[rows, cols], self.length[rows] + cols
                for layer in range(len(self.keys)):  # the right side is gathered first: overlaps are safe
                    self.keys[layer][rows, :, dst] = self.keys[layer][rows, :, src]
                    self.values[layer][rows, :, dst] = self.values[layer][rows, :, src]
        self.length = self.length + n  # out of place: the caller may hold no inference mode

    def reset(self, rows: torch.Tensor) -> None:
        self.length = self.length.index_fill(0, rows, 0)  # the old entries lie past 0: masked, then overwritten

    def fill(self, rows: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Rows ``rows`` (empty) start with the same committed entries: per layer ``[kv_heads, P, head_dim]``."""
        p = keys[0].shape[1]
        if p > self.capacity:
            self._grow(max(p, 2 * self.capacity))
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.keys[layer][rows, :, :p] = k
            self.values[layer][rows, :, :p] = v
        self.length = self.length.index_fill(0, rows, p)

    def extend(self, count: int) -> None:
        """``count`` empty rows after the current ones."""
        self.keys = [torch.cat([k, k.new_zeros(count, *k.shape[1:])]) for k in self.keys]
        self.values = [torch.cat([v, v.new_zeros(count, *v.shape[1:])]) for v in self.values]
        self.length = torch.cat([self.length, self.length.new_zeros(count)])

    def retain(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.length = self.length[rows]

    def _grow(self, capacity: int) -> None:
        def grown(t):
            out = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
            out[:, :, : t.shape[2]] = t
            return out

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]

    # The generic model forward calls this (transformers' Cache.update signature) with [b, kv_heads, W, d].
    def update(self, keys, values, layer_idx, *args, **kwargs):
        return self.write(layer_idx, keys.transpose(1, 2).flatten(0, 1), values.transpose(1, 2).flatten(0, 1))


class TorchBackend:
    """The decode backend for a transformers causal LM (see the module docstring)."""

    def __init__(self, model, lean: bool | None = None):
        self.model = model
        self.device = model.device
        config = model.config
        attention_mask(model, torch.ones(1, 1, 1, dtype=torch.bool))  # fail early on flash/flex attention
        self.lean = self.supports_lean(model) if lean is None else lean
        if self.lean and not self.supports_lean(model):
            raise MarsError(f"the lean forward supports {', '.join(LEAN_MODEL_TYPES)} without sliding windows, "
                            f"not {config.model_type!r}")
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache: RowCache | None = None
        self._prefix: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # see cache_prefix
        # query heads per key/value head, stacked as queries in sdpa (see the module docstring)
        self.kv_groups = config.num_attention_heads // config.num_key_value_heads
        self.stack_gqa = self.lean and config._attn_implementation == "sdpa" and self.kv_groups > 1
        if self.lean:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            module = importlib.import_module(type(model).__module__)
            self._rope = module.apply_rotary_pos_emb
            self._attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
                                                                 module.eager_attention_forward)

    @staticmethod
    def supports_lean(model) -> bool:
        config = model.config
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        return (config.model_type in LEAN_MODEL_TYPES and all(t == "full_attention" for t in layer_types)
                and hasattr(model, "lm_head") and hasattr(getattr(model, "model", None), "layers"))

    @torch.inference_mode()
    def start(self, prefixes: list[list[int]]) -> None:
        config = self.model.config
        b, width = len(prefixes), max(map(len, prefixes), default=0)
        self.cache = RowCache(config.num_hidden_layers, b, config.num_key_value_heads, self.head_dim,
                              dtype=self.model.dtype, device=self.device, capacity=max(64, 2 * width))
        if width == 0:
            return
        ids = torch.zeros(b, width, dtype=torch.long)
        for i, prefix in enumerate(prefixes):  # right padding: a row's pad entries lie past its length
            ids[i, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
        positions = torch.arange(width)[None].expand(b, -1)
        self._run(ids.to(self.device), positions.to(self.device), read=None, logits=False)
        self.cache.commit(torch.tensor([len(p) for p in prefixes], device=self.device))

    tree_windows = True  # forward takes a window mask and commit a path: draft trees (mars.decoding.tree)

    @torch.inference_mode()
    def forward(self, window_ids, positions, read=None, allowed=None):
        return self._run(window_ids, positions, read, allowed=allowed)

    @torch.inference_mode()
    def commit(self, n_accept, keep=None):
        self.cache.commit(n_accept.to(self.device), None if keep is None else keep.to(self.device))

    def retain(self, rows):
        self.cache.retain(rows.to(self.device))

    def reset(self, rows):
        self.cache.reset(rows.to(self.device))

    def extend(self, count: int):
        self.cache.extend(count)

    @torch.inference_mode()
    def cache_prefix(self, ids: list[int]) -> None:
        """Compute once the cache entries of ``ids`` at positions 0..P-1, for :meth:`load_prefix`."""
        alone = TorchBackend(self.model, self.lean)
        alone.start([list(ids)])
        p = len(ids)
        self._prefix = ([k[0, :, :p].clone() for k in alone.cache.keys],
                        [v[0, :, :p].clone() for v in alone.cache.values])

    def load_prefix(self, rows: torch.Tensor) -> None:
        """Rows ``rows``, just emptied (``reset``, ``extend``, ``start``), start with the cached prefix committed."""
        self.cache.fill(rows.to(self.device), *self._prefix)

    # ------------------------------------------------------------------------------------------ forwards

    def _run(self, ids, positions, read, logits: bool = True, allowed=None):
        """The window ``ids [b, W]`` of every row -> logits at ``read`` (every entry when None)."""
        if not self.lean:
            return self._generic(ids, positions, read, logits, allowed)
        b, width = ids.shape
        where = groups = None  # (row, window index) of the entries computed, row by row; None: every entry
        if read is not None and width > 1:
            needed = read.amax(1) + 1  # a row's entries past its last read slot are trailing masks
            # Packing costs a few gathers per layer: it pays when it skips most of the window (a new
            # prompt next to short decoding windows), not for the odd trailing mask.
            if 2 * int(needed.sum()) <= b * width:
                where = (torch.arange(width, device=ids.device)[None, :] < needed[:, None]).nonzero(as_tuple=True)
        allowed = self.cache.window(width, where, allowed)
        if where is None:
            mask = self._mask(allowed)
        else:
            groups = AttentionGroups(needed, where, allowed, self._mask)
        base = self.model.model
        if where is None:
            h = base.embed_tokens(ids.reshape(-1))
            pos = positions.reshape(1, -1)
        else:
            h = base.embed_tokens(ids[where])
            pos = positions[where][None]
        cos, sin = base.rotary_emb(h, pos)  # [1, N, head_dim]
        cos, sin = cos[0], sin[0]
        n = h.shape[0]
        for layer_idx, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(n, -1, self.head_dim)
            k = attn.k_proj(x).view(n, -1, self.head_dim)
            v = attn.v_proj(x).view(n, -1, self.head_dim)
            q, k = self._rope(q, k, cos, sin)  # [N, heads, d] with cos [N, d]: unsqueeze_dim=1 broadcasts
            keys, values = self.cache.write(layer_idx, k, v)
            if groups is None:
                out = self._attention(attn, q.view(b, width, -1, self.head_dim).transpose(1, 2), keys, values, mask)
                out = out.reshape(n, -1)
            else:
                out = groups.attend(lambda q_, k_, v_, m_: self._attention(attn, q_, k_, v_, m_), q, keys, values)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if not logits:
            return None
        # Hidden states at the read slots: row i's window entry k sits at packed index start[i] + k.
        if where is None:
            start = torch.arange(b, device=ids.device) * width
        else:
            start = needed.cumsum(0) - needed
        index = start[:, None] + (torch.arange(width, device=ids.device)[None, :] if read is None else read)
        return self.model.lm_head(base.norm(h[index]))

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """``allowed [b, W, span]`` as :meth:`_attention` takes it for a window of W queries."""
        mask = attention_mask(self.model, allowed)
        if self.stack_gqa:  # query row g * W + k is query k of the group's head g
            mask = mask.repeat(1, 1, self.kv_groups, 1)
        return mask

    def _attention(self, attn, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor):
        """One layer's attention: ``q [b, heads, W, d]`` against the cache span ``[b, kv_heads, span, d]``
        -> ``[b, W, heads, d]``; ``mask`` from :meth:`_mask`."""
        if not self.stack_gqa:
            return self._attend(attn, q, keys, values, mask, dropout=0.0, scaling=attn.scaling)[0]
        b, heads, width, d = q.shape
        kv_heads = keys.shape[1]
        out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, heads // kv_heads * width, d), keys, values,
                                             attn_mask=mask, scale=attn.scaling)
        return out.view(b, heads, width, d).transpose(1, 2)

    def _generic(self, ids, positions, read, logits: bool, allowed=None):
        """Any other causal LM: its own forward, with the row cache behind transformers' Cache.update."""
        b, width = ids.shape
        allowed = self.cache.window(width, allowed=allowed)
        first = 0 if read is None else int(read.min())
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=attention_mask(self.model, allowed),
                         cache=self.cache, use_cache=True, logits_to_keep=width - first if logits else 1)
        if not logits or read is None:
            return out.logits
        return out.logits[torch.arange(b, device=ids.device)[:, None], read - first]


class AttentionGroups:
    """Attention of a packed ragged window in one or two padded calls: every row at the width the narrow
    rows need, and the few far wider rows (new prompts) again at theirs. Splitting pays when it drops
    most of the padded queries; two calls per layer cost more than one where the widths are close (a
    lossless row's 7 slots beside tau = 1 rows' 1), so those stay one group.

    ``needed [b]``: entries each row computes; ``where``: their (row, window index), row by row, which is
    the packed order; ``allowed [b, W, span]``: the window's attention mask; ``to_mask``: the form the
    backend's attention takes of a boolean mask."""

    MIN_SAVED = 64  # padded queries a split must save, below which the second call costs more than it saves

    def __init__(self, needed: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], allowed: torch.Tensor, to_mask):
        b, width = allowed.shape[0], allowed.shape[1]
        self.rows, self.slots = where
        self.n = self.rows.shape[0]
        ordered = needed.sort(descending=True).values.tolist()
        # m widest rows apart: b x (the (m+1)-th widest) queries for all rows, m x width for the wide ones
        cost, m = min((b * ordered[m] + m * ordered[0], m) for m in range(b))
        narrow_width = ordered[m]
        if b * ordered[0] - cost < max(self.MIN_SAVED, b * ordered[0] // 4):
            m, narrow_width = 0, width
        self.groups = []  # (rows or None for all, width, mask, packed entries or None for all, their row, slot)
        if m == 0:
            self.groups.append((None, width, to_mask(allowed), None, self.rows, self.slots))
            return
        wide = needed > narrow_width
        in_wide = wide[self.rows]
        narrow_sel = (~in_wide).nonzero()[:, 0]
        self.groups.append((None, narrow_width, to_mask(allowed[:, :narrow_width]), narrow_sel,
                            self.rows[narrow_sel], self.slots[narrow_sel]))
        wide_rows = wide.nonzero()[:, 0]
        local = torch.full((b,), -1, dtype=torch.long, device=needed.device)
        local[wide_rows] = torch.arange(wide_rows.shape[0], device=needed.device)
        wide_sel = in_wide.nonzero()[:, 0]
        self.groups.append((wide_rows, width, to_mask(allowed[wide_rows]), wide_sel,
                            local[self.rows[wide_sel]], self.slots[wide_sel]))

    def attend(self, attend, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``q [N, heads, d]`` packed -> the attention output ``[N, heads x d]`` packed; ``attend(q, k, v,
        mask)`` is the model's attention on ``q [rows, heads, W, d]``, returning ``[rows, W, heads, d]``."""
        heads, d = q.shape[1], q.shape[2]
        out = None
        for rows, width, mask, sel, row, slot in self.groups:
            count = keys.shape[0] if rows is None else rows.shape[0]
            mine = q if sel is None else q[sel]
            padded = q.new_zeros(count, width, heads, d).index_put_((row, slot), mine)
            k, v = (keys, values) if rows is None else (keys[rows], values[rows])
            got = attend(padded.transpose(1, 2), k, v, mask)[row, slot].reshape(-1, heads * d)
            if sel is None:
                return got
            if out is None:
                out = got.new_empty(self.n, heads * d)
            out[sel] = got
        return out
