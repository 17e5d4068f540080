"""Run an exported MARS block forward (``mars export``) without PyTorch: onnxruntime + numpy.

The exported graph is one *block forward*: a window of ``W`` tokens per row against that row's prefix
KV cache. Conventions (also written into ``manifest.json`` by :mod:`mars.release.export`):

- ``input_ids``, ``position_ids``: int64 ``[batch, W]``; positions are absolute (``n_r + i`` for row r
  with ``n_r`` committed tokens), so rows of different lengths share one call.
- ``past_keys``, ``past_values``: ``[layers, batch, kv_heads, past, head_dim]``, keys after the rotary
  embedding. ``past`` is the one dynamic axis (``0 .. max_context - W``); row r's entries beyond
  ``n_r`` are padding, hidden by the mask.
- ``attention_mask``: additive float ``[batch, 1, W, past + W]`` (0 = attend, finfo.min = blocked);
  keys are ``[past entries | window entries]``. :func:`window_mask` builds it: prefix entries below
  ``n_r`` plus causal inside the window.
- outputs: ``logits [batch, W, vocab]`` and the window's own ``new_keys``/``new_values``
  ``[layers, batch, kv_heads, W, head_dim]``; the caller appends the accepted ones to its cache.

:class:`ExportedBlock` loads an export directory (verifying the manifest's checksums) and runs the
graph; :class:`OnnxBackend` keeps per-row prefix caches and serves the cached decoding loop of
:mod:`mars.decoding.batch` on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mars.core.atomic import read_json
from mars.core.checkpoint_info import CheckpointInfo
from mars.core.digest import sha256_file
from mars.errors import MarsError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
INPUT_NAMES = ("input_ids", "position_ids", "attention_mask", "past_keys", "past_values")
OUTPUT_NAMES = ("logits", "new_keys", "new_values")


class EngineError(MarsError):
    pass


def window_mask(prefix_lens, past: int, window: int, dtype=np.float32, allowed: np.ndarray | None = None,
                pending: int = 0) -> np.ndarray:
    """Additive mask ``[batch, 1, W, past + W]``: row r's query i sees prefix keys ``j < prefix_lens[r]``
    and window keys ``k <= i`` (so no row is ever empty, even with an empty prefix).

    ``allowed`` ``[batch, W, pending + W]`` (bool) replaces that rule for the last ``pending`` prefix keys of
    each row (entries of the same window, written by an earlier chunk) and the window's own keys: a draft
    tree's attention (:mod:`mars.decoding.tree`). The window's diagonal must stay True."""
    import torch  # here, not at the top: reading and checking an export needs no torch

    from mars.core.masking import to_additive

    lens = np.asarray(prefix_lens, dtype=np.int64)
    if lens.ndim != 1 or (lens < 0).any() or (lens > past).any():
        raise EngineError(f"prefix lengths {lens.tolist()} must lie in [0, past={past}]")
    out = np.zeros((len(lens), 1, window, past + window), dtype=bool)
    out[:, 0, :, :past] = np.arange(past)[None, None, :] < lens[:, None, None]
    out[:, 0, :, past:] = np.tril(np.ones((window, window), dtype=bool))[None]
    if allowed is not None:
        out[:, 0, :, past:] = allowed[:, :, pending:]
        if pending:
            # prefix key j of row r is the window's entry j - (lens[r] - pending), for the last `pending` keys
            rel = np.arange(past)[None, :] - (lens - pending)[:, None]  # [batch, past]
            inside = (rel >= 0) & (rel < pending)
            seen = np.take_along_axis(allowed, np.clip(rel, 0, pending - 1)[:, None, :].repeat(window, 1), 2)
            out[:, 0, :, :past] = np.where(inside[:, None, :], seen, out[:, 0, :, :past])
    torch_dtype = torch.from_numpy(np.zeros(0, dtype)).dtype  # the same float type on the torch side
    return to_additive(torch.from_numpy(out), torch_dtype).numpy()


@dataclass(frozen=True)
class BlockSpec:
    """The fixed shapes of one exported block forward."""

    batch_size: int
    window: int
    max_context: int
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def max_prefix(self) -> int:
        return self.max_context - self.window

    def cache_shape(self, past: int) -> tuple[int, ...]:
        return (self.num_layers, self.batch_size, self.kv_heads, past, self.head_dim)


def read_manifest(export_dir: str | Path, *, verify: bool = True) -> dict:
    """The manifest of an export directory; with ``verify`` every listed file's sha256 is checked."""
    export_dir = Path(export_dir)
    path = export_dir / MANIFEST
    if not path.is_file():
        raise EngineError(f"{export_dir}: not an export directory (no {MANIFEST}); run `mars export` first")
    manifest = read_json(path, error=EngineError)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise EngineError(f"{path}: not an export manifest (no 'files' object)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise EngineError(f"{path}: format_version {manifest.get('format_version')!r}, this runtime reads {FORMAT_VERSION}")
    if verify:
        for name, digest in manifest["files"].items():
            file = export_dir / name
            if not file.is_file():
                raise EngineError(f"{export_dir}: {name} is listed in {MANIFEST} but missing")
            if sha256_file(file) != digest:
                raise EngineError(f"{export_dir}: {name} does not match its sha256 in {MANIFEST} (corrupt or edited)")
    return manifest


class ExportedBlock:
    """The ONNX block forward of an export directory, on an onnxruntime session."""

    def __init__(self, export_dir: str | Path, *, providers: list[str] | None = None,
                 intra_op_threads: int | None = None, verify: bool = True):
        import onnxruntime as ort

        self.export_dir = Path(export_dir)
        self.manifest = read_manifest(self.export_dir, verify=verify)
        self.spec = BlockSpec(**self.manifest["block"])
        self.info = CheckpointInfo.from_section(self.manifest["mars"], str(self.export_dir / MANIFEST))
        self._config = self._generation_config = None
        options = ort.SessionOptions()
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        onnx_file = self.export_dir / self.manifest["onnx"]["file"]
        self.session = ort.InferenceSession(str(onnx_file), options,
                                            providers=providers or ["CPUExecutionProvider"])

    @property
    def mask_token_id(self) -> int:
        return self.info.mask_token_id

    @property
    def block_size(self) -> int:
        return self.info.block_size

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.export_dir)

    @property
    def config(self):
        """The checkpoint's config (with ``config.mars``) as :func:`mars.decoding.generate.generate` reads it; its
        context is the export's: committed prefixes stay within the graph's past axis."""
        if self._config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.export_dir)
            limit = self.spec.max_prefix + 1  # a sequence of n tokens commits at most n - 1 of them
            config.max_position_embeddings = min(getattr(config, "max_position_embeddings", limit) or limit, limit)
            self._config = config
        return self._config

    @property
    def generation_config(self):
        """Stop tokens as the checkpoint's generation config gives them (None where it has none)."""
        if self._generation_config is None and (self.export_dir / "generation_config.json").is_file():
            from transformers import GenerationConfig

            self._generation_config = GenerationConfig.from_pretrained(self.export_dir)
        return self._generation_config

    def generate(self, prompts, tokenizer=None, **kwargs):
        """:func:`mars.decoding.generate.generate` on this engine: the same loop, tau rule and results as the
        PyTorch decoder, with the block forward run by onnxruntime. ``batch_size`` is the export's."""
        from mars.decoding.generate import generate

        tokenizer = tokenizer if tokenizer is not None else self.load_tokenizer()
        kwargs.setdefault("batch_size", self.spec.batch_size)
        if kwargs["batch_size"] > self.spec.batch_size:
            raise EngineError(f"batch_size {kwargs['batch_size']} exceeds the export's batch of {self.spec.batch_size}")
        if kwargs.get("use_cache") is False:
            raise EngineError("the exported block forward always runs against a KV cache (use_cache=True)")
        return generate(self, tokenizer, prompts, backend=OnnxBackend(self), **kwargs)

    def __call__(self, input_ids, position_ids, attention_mask, past_keys, past_values):
        """One block forward: numpy in, ``(logits, new_keys, new_values)`` numpy out."""
        feeds = dict(zip(INPUT_NAMES, (input_ids, position_ids, attention_mask, past_keys, past_values)))
        return tuple(self.session.run(list(OUTPUT_NAMES), feeds))


class OnnxBackend:
    """The decoding backend of :mod:`mars.decoding.batch` (start / forward / commit / retain / reset /
    extend) on an :class:`ExportedBlock`.

    Each row's cache lives in a preallocated buffer ``[layers, batch, kv_heads, max_context, head_dim]``;
    row r has ``n_r`` committed entries at ``[0, n_r)``. A forward writes the window's K/V right after
    them, pending, and ``commit`` only advances ``n_r``: entries past ``n_r`` are overwritten by the next
    window and hidden by the mask meanwhile. Windows narrower than ``W`` are padded on the right with
    mask tokens at the following positions; wider ones (and prompts at ``start``) run as consecutive
    chunks of ``W``, each seeing the chunks before it as prefix. Rows beyond the live ones are padding.
    """

    def __init__(self, engine: ExportedBlock):
        import torch

        self.engine, self.spec = engine, engine.spec
        self.device = torch.device("cpu")
        self.pad_id = engine.mask_token_id
        shape = self.spec.cache_shape(self.spec.max_context)
        dtype = np.dtype(engine.manifest["inputs"]["past_keys"]["dtype"])
        self.keys, self.values = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.lens = np.zeros(self.spec.batch_size, np.int64)
        self.rows = 0

    def _run_chunk(self, ids: np.ndarray, positions: np.ndarray, offset: int,
                   allowed: np.ndarray | None = None) -> np.ndarray:
        """One graph call on a ``[batch, W]`` chunk whose entries follow ``offset`` pending ones; ``allowed``
        ``[batch, W, offset + W]``: what the chunk's queries see of the window so far (None: causal)."""
        spec, lens = self.spec, self.lens + offset
        past = int(lens.max())
        if past > spec.max_prefix:
            raise EngineError(f"a row's prefix would reach {past} tokens; the export holds at most "
                              f"{spec.max_prefix} (max_context {spec.max_context} - W {spec.window})")
        logits, new_k, new_v = self.engine(
            ids, positions, window_mask(lens, past, spec.window, self.keys.dtype, allowed, offset),
            np.ascontiguousarray(self.keys[:, :, :, :past]), np.ascontiguousarray(self.values[:, :, :, :past]))
        for r in range(spec.batch_size):
            self.keys[:, r, :, lens[r]: lens[r] + spec.window] = new_k[:, r]
            self.values[:, r, :, lens[r]: lens[r] + spec.window] = new_v[:, r]
        return logits

    def _run(self, ids: np.ndarray, positions: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        """Window ``[rows, width]`` (width >= 1) -> logits ``[rows, width, vocab]``; K/V left pending.
        ``allowed [rows, width, width]``: the window's attention (None: causal)."""
        w = self.spec.window
        rows, width = ids.shape
        if rows > self.spec.batch_size:
            raise EngineError(f"{rows} rows, the export's batch is {self.spec.batch_size}")
        chunks = -(-width // w)
        # Right padding: pad tokens at the following positions (a trailing entry changes no earlier one).
        extra = chunks * w - width
        ids = np.concatenate([ids, np.full((rows, extra), self.pad_id, np.int64)], 1)
        positions = np.concatenate([positions, positions[:, -1:] + 1 + np.arange(extra)], 1)
        ids, positions = self._pad_rows(ids, positions)
        full = None
        if allowed is not None:  # padded entries and rows: causal
            full = np.tril(np.ones((chunks * w, chunks * w), dtype=bool))[None].repeat(self.spec.batch_size, 0)
            full[:rows, :width, :width] = allowed
        out = [self._run_chunk(ids[:, c * w:(c + 1) * w], positions[:, c * w:(c + 1) * w], c * w,
                               None if full is None else full[:, c * w:(c + 1) * w, :(c + 1) * w])
               for c in range(chunks)]
        return np.concatenate(out, 1)[:rows, :width]

    def start(self, prefixes: list[list[int]]) -> None:
        self.rows = len(prefixes)
        self.lens[:] = 0
        width = max((len(p) for p in prefixes), default=0)
        if width == 0:
            return
        lens = np.array([len(p) for p in prefixes])
        for begin in range(0, width, self.spec.window):
            # Every row takes its next (up to) W prompt tokens; a row whose prompt is done idles on padding.
            take = np.clip(lens - begin, 0, self.spec.window)
            ids = np.full((self.rows, self.spec.window), self.pad_id, np.int64)
            for r, prefix in enumerate(prefixes):
                ids[r, : take[r]] = prefix[begin: begin + take[r]]
            positions = self.lens[: self.rows, None] + np.arange(self.spec.window)
            self._run_chunk(*self._pad_rows(ids, positions), 0)
            self.lens[: self.rows] += take

    def _pad_rows(self, ids: np.ndarray, positions: np.ndarray):
        """Fill the export's fixed batch: rows beyond the live ones are pad tokens at positions 0.. ."""
        full_ids = np.full((self.spec.batch_size, ids.shape[1]), self.pad_id, np.int64)
        full_pos = np.tile(np.arange(ids.shape[1], dtype=np.int64), (self.spec.batch_size, 1))
        full_ids[: len(ids)], full_pos[: len(ids)] = ids, positions
        return full_ids, full_pos

    tree_windows = True  # forward takes a window mask and commit a path: draft trees (mars.decoding.tree)

    def forward(self, window_ids, positions, read=None, allowed=None):
        import torch

        logits = torch.from_numpy(self._run(window_ids.cpu().numpy(), positions.cpu().numpy(),
                                            None if allowed is None else allowed.cpu().numpy()))
        if read is None:
            return logits
        return logits.gather(1, read.cpu()[:, :, None].expand(-1, -1, logits.shape[-1]))

    def commit(self, n_accept, keep=None) -> None:
        """Keep ``n[r]`` pending entries of row r: its first ones, or window indices ``keep[r, :n[r]]``
        (increasing: a tree's accepted path), moved up behind the committed entries."""
        n = np.asarray(n_accept.cpu().numpy() if hasattr(n_accept, "cpu") else n_accept, dtype=np.int64)
        if keep is not None:
            keep = np.asarray(keep.cpu().numpy() if hasattr(keep, "cpu") else keep, dtype=np.int64)
            for r in range(self.rows):
                src = keep[r, : n[r]]
                moved = src != np.arange(n[r])
                if moved.any():
                    # index the row's view: an int and an index array apart would move the array's axis first
                    base, row_k, row_v = self.lens[r], self.keys[:, r], self.values[:, r]
                    row_k[:, :, base: base + n[r]] = row_k[:, :, base + src]
                    row_v[:, :, base: base + n[r]] = row_v[:, :, base + src]
        self.lens[: self.rows] += n

    def reset(self, rows) -> None:
        """Empty these rows (a new sequence takes each): their old entries lie past 0, masked, then overwritten."""
        self.lens[np.asarray(rows.cpu().numpy() if hasattr(rows, "cpu") else rows, dtype=np.int64)] = 0

    def extend(self, count: int) -> None:
        """``count`` empty rows after the live ones, within the export's fixed batch."""
        if self.rows + count > self.spec.batch_size:
            raise EngineError(f"{self.rows + count} rows, the export's batch is {self.spec.batch_size}")
        self.lens[self.rows: self.rows + count] = 0
        self.rows += count

    def retain(self, rows) -> None:
        keep = np.asarray(rows.cpu().numpy() if hasattr(rows, "cpu") else rows, dtype=np.int64)
        k = len(keep)
        self.keys[:, :k], self.values[:, :k] = self.keys[:, keep], self.values[:, keep]
        self.lens[:k] = self.lens[keep]
        self.lens[k:] = 0
        self.rows = k
