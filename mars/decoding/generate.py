"""``generate``: decode prompts with a MARS checkpoint, up to B tokens per forward, each prompt at its own
tau (the accept rule, :mod:`mars.decoding.accept`) or in the lossless mode (greedy output, the mask slots'
tokens as verified drafts), chosen per call with no reload.

Three ways to run the same rule, all giving the same tokens:

* **no cache** (``use_cache=False``, :mod:`mars.decoding.reference`): every step re-runs the whole sequence.
  The reference the cached paths are tested against.
* **token-level cache** (``b_cache=None``, the default; :mod:`mars.decoding.batch`): each row's cache grows
  by what it accepts, and a finished row takes the next waiting prompt in the same step (continuous
  batching: ``batch_size`` rows stay busy while prompts wait).
* **block-level cache** (``b_cache=C >= B``, paper Fig. 4; :mod:`mars.decoding.batch`): the cache grows one
  block of C positions at a time for every row at once; prompts go in consecutive batches.

The arguments become one :class:`~mars.decoding.setting.Setting` per prompt and a :class:`DecodeConfig`,
which validate them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Literal, Sequence

import torch

from mars.core.checkpoint_info import CheckpointInfo
from mars.decoding.batch import CachedBatch, DecodeBackend, DecodeRow
from mars.decoding.reference import DecodedRows, decode_no_cache
from mars.decoding.setting import Setting
from mars.decoding.stop_strings import StopStrings
from mars.decoding.torch_backend import TorchBackend
from mars.decoding.tau_policy import AUTO_TREES, AdaptivePolicy, PolicyConfig, Steering
from mars.decoding.tree_shape import AUTO, TreeShape, tree_shape
from mars.decoding.tree_reference import decode_tree_no_cache
from mars.errors import ConfigError, MarsError

MODES = ("tau", "lossless")


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
    tree: str | None = None  # lossless mode: None (or off) the chain of top-1 drafts; a tree shape (top2/16); auto:
                             # each step the setting of AUTO_TREES, the chain or greedy AR with the most tokens/s

    def __post_init__(self):
        Setting(self.tau, width=self.block_size)  # tau and block_size are checked as a row's setting is
        tree_shape(self.tree, auto=True)
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.b_cache is not None and self.b_cache < 1:
            raise ConfigError(f"b_cache: must be >= 1 (or null for the token-level cache), got {self.b_cache}")
        if self.use_cache and self.b_cache is not None and self.b_cache < (self.block_size or 1):
            raise ConfigError(f"b_cache: the cache block ({self.b_cache}) must be at least the block size "
                              f"({self.block_size})")


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
    tree: str | None = None  # the lossless mode's draft tree (its label, or auto), None for the chain

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


def decode_cached(backend: DecodeBackend, prompts: Sequence[Sequence[int]], *, slots: int,
                  settings: Sequence[Setting], room: Sequence[int], stop_ids: torch.Tensor, mask_id: int,
                  b_cache: int | None = None, max_rows: int | None = None,
                  on_finish: Callable[[int], None] | None = None,
                  stop_strings: StopStrings | None = None, steering: Steering | None = None,
                  steered: Sequence[bool] = ()) -> DecodedRows:
    """The cached decoding loop (token level, or block level with ``b_cache``) over :class:`CachedBatch`.

    ``slots`` is the batch's block size (B, or 1 when no row needs masks), ``settings`` one per prompt,
    ``room`` the token budget per prompt. At most ``max_rows`` rows decode at once (default: all). With
    the token-level cache a row that finishes takes the next waiting prompt in the same step (continuous batching), so
    the batch stays full while prompts wait; the block-level cache steps its rows in lockstep and takes
    one batch (``max_rows`` >= the prompts). ``on_finish(k)`` is called as k sequences finish. A row also
    ends at the token that completes one of ``stop_strings``. With ``steering`` the rows whose ``steered``
    flag is set decode each step at its policy's setting (``tree="auto"``), and the policy sees every step.
    """
    count = len(prompts)
    b = count if max_rows is None else min(count, max_rows)
    if b < count and (b_cache is not None or not callable(getattr(backend, "reset", None))):
        raise ValueError("max_rows below the prompt count needs the token-level cache and a backend with reset")
    # steered rows report every step's tokens: the policy's yields
    waiting = deque(DecodeRow(prompts[i], int(room[i]), settings[i], stop_strings=stop_strings,
                              stream=steering is not None, key=i) for i in range(count))
    batch = CachedBatch(backend, block_size=slots, stop_ids=stop_ids, mask_id=mask_id, b_cache=b_cache)
    batch.add([waiting.popleft() for _ in range(b)])
    out = DecodedRows([[] for _ in range(count)], [0] * count, [False] * count, 0)
    joined = True
    while len(batch):
        if steering is not None:
            live = batch.live
            steering.before_step(live, [r for r in live if steered[r.key]])
            rows, started = len(live), time.perf_counter()
        updates = batch.step()
        if steering is not None:
            steering.after_step(updates, rows=rows, slots=batch.last_slots, seconds=time.perf_counter() - started,
                                joined=joined)
        finished = [u for u in updates if u.done]
        for update in finished:
            i = update.row.key
            out.token_ids[i], out.forwards[i], out.stopped[i] = update.token_ids, update.forwards, update.stopped
        if finished and on_finish is not None:
            on_finish(len(finished))
        joining = [waiting.popleft() for _ in range(min(len(finished), len(waiting)))]
        batch.add(joining)
        joined = bool(joining)
    out.model_calls = batch.model_calls
    return out


def context_length_of(config) -> int | None:
    """The model's context in positions, where its config gives one."""
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


def _per_prompt(key: str, value, count: int, one: str) -> list:
    """``value`` for every prompt, or its items where it gives one per prompt."""
    values = [value] * count if isinstance(value, (str, int, float)) else list(value)
    if len(values) != count:
        raise MarsError(f"{key}: got {len(values)} values for {count} prompts (give {one}, or one per prompt)")
    return values


def _settings(taus: list, modes: list, width: int | None, tree: TreeShape | None = None) -> list[Setting]:
    """One :class:`Setting` per prompt (a lossless prompt's tau is checked, then unused; ``tree`` is its
    draft tree). A bad value names its key, with the prompt's index where the prompts' values differ."""
    each_tau, each_mode = len(set(map(str, taus))) > 1, len(set(map(str, modes))) > 1
    settings = []
    for i, (t, m) in enumerate(zip(taus, modes)):
        tau = Setting.check_tau(t, f"tau[{i}]" if each_tau else "tau")
        if m not in MODES:
            raise MarsError(f"mode{f'[{i}]' if each_mode else ''}: must be one of {', '.join(MODES)}, got {m!r}")
        settings.append(Setting(lossless=True, width=width, tree=tree) if m == "lossless" else Setting(tau, width=width))
    return settings


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
             progress: bool = False, allow_untrained: bool = False,
             tree: TreeShape | str | None = DecodeConfig.tree) -> Generations:
    """Decode ``prompts`` with MARS: block size B, threshold ``tau`` (one float, or one per prompt).

    ``mode`` (one, or one per prompt, mixed freely with per-prompt tau in one batch): ``"tau"`` accepts
    mask slots on confidence (the paper's rule, lossy below tau = 1); ``"lossless"`` ignores tau and
    takes the mask slots' tokens as drafts that the next forward verifies, so the output is greedy AR
    token for token at up to B tokens per forward (:mod:`mars.decoding.accept`). ``tree`` (lossless
    prompts): the drafts as a tree of this shape, verified in one forward, still greedy token for token
    (:mod:`mars.decoding.tree`; ``"top2/16"``, a :class:`TreeShape`; None or ``"off"``: the chain);
    ``"auto"``: each step the lossless rows decode at the setting among the chain, the shapes of
    :data:`~mars.decoding.tau_policy.AUTO_TREES` and greedy AR (all exact) that yields the most tokens/s as
    measured on this batch and hardware (:class:`~mars.decoding.tau_policy.AdaptivePolicy`; cached decoding only).

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
    if block_size is None:
        block_size = CheckpointInfo.block_size_of(config)
    taus = _per_prompt("tau", tau, len(prompts), "one float")
    modes = _per_prompt("mode", mode, len(prompts), "one mode")
    shape = tree_shape(tree, auto=True)
    auto = shape == AUTO
    settings = _settings(taus, modes, block_size, None if auto else shape)
    if block_size is None:
        if any(s.tau < 1.0 or s.lossless for s in settings):
            raise MarsError("block_size: not given and the checkpoint has no config.mars.block_size")
        block_size = 1
    DecodeConfig(block_size=block_size, max_new_tokens=max_new_tokens, batch_size=batch_size, b_cache=b_cache,
                 use_cache=use_cache)  # checks the token budget, the batch and the cache block
    mask_id = 0  # with one slot per step no window holds a mask; any valid id fills the unused tail
    if any(s.needs_masks(block_size) for s in settings):
        from mars.core.mask_token import mask_token_id

        mask_id = mask_token_id(model, tokenizer)  # raises MaskTokenError for a non-MARS checkpoint
        if not allow_untrained and any(s.tau < 1.0 for s in settings):
            check_mask_trained(config)
    encoded = encode_prompts(tokenizer, prompts)
    context = context_length_of(config)
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
    steering = steered = None
    if auto and any(s.lossless for s in settings):
        if not use_cache:
            raise MarsError("tree auto: chooses by measured step costs, so it needs the cache (use_cache=True); "
                            "the no-cache reference takes one tree shape")
        # one policy for the whole call: what a group measured, the next one starts from
        steering = Steering(AdaptivePolicy(PolicyConfig(lossless_widths=(), trees=AUTO_TREES), block_size))
        steered = [s.lossless for s in settings]

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
        settings_g = [settings[i] for i in group]
        slots = block_size if any(s.needs_masks(block_size) for s in settings_g) else 1
        kwargs = dict(slots=slots, settings=settings_g, room=[rooms[i] for i in group], stop_ids=stops,
                      mask_id=mask_id, stop_strings=stop_text)
        if use_cache:
            rows = decode_cached(backend, prompts_g, b_cache=b_cache, max_rows=batch_size if continuous else None,
                                 on_finish=bar.update if bar is not None else None, steering=steering,
                                 steered=[steered[i] for i in group] if steered else (), **kwargs)
        elif any(s.tree is not None for s in settings_g):
            if len({s.tree for s in settings_g}) > 1 or not all(s.lossless for s in settings_g):
                raise MarsError("use_cache=False with a tree: every prompt decodes in lossless mode (the no-cache "
                                "tree reference takes one tree shape)")
            rows = decode_tree_no_cache(model, prompts_g, block_size=slots, shape=settings_g[0].tree,
                                        room=kwargs["room"], stop_ids=stops.tolist(), mask_id=mask_id,
                                        stop_strings=stop_text)
        else:
            rows = decode_no_cache(model, prompts_g, **kwargs)
        if not use_cache and bar is not None:
            bar.update(len(group))
        calls += rows.model_calls
        for k, i in enumerate(group):
            ids = rows.token_ids[k]
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
            label = AUTO if steered and steered[i] else None if settings[i].tree is None else settings[i].tree.label
            results[i] = GenerationResult(encoded[i], ids, text, rows.forwards[k], taus[i], block_size,
                                          "stop" if rows.stopped[k] else "length", modes[i], label)
    if bar is not None:
        bar.close()
    return Generations(results, calls, time.perf_counter() - started)
