"""``mars export``: the fixed-window block forward of a MARS checkpoint as ONNX (+ TensorRT where CUDA is).

What is exported is the forward the block-level KV cache decoder runs at every step: a window of
``W`` tokens per row against that row's prefix KV cache (conventions in :mod:`mars.decoding.onnx_backend`). Batch
and ``W`` are fixed; the prefix length is the one dynamic axis of the ONNX graph. TensorRT gets a
fully static graph instead: the prefix axis is fixed at its maximum and the mask hides unused slots
(no zero-length dimension, one optimisation profile).

The export directory is self-contained for a downstream service: ``model.onnx`` (+ ``model.onnx.data``
with external data), ``config.json`` (with ``config.mars``), the tokenizer files, ``model_trt.ep``
where TensorRT was built, and ``manifest.json`` (shapes, dtypes, opset, checkpoint hash, sha256 of
every file, parity figures). It is built in a temporary directory next to the target and renamed
into place, so a failed export leaves nothing half-written and an older export untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mars.core.atomic import atomic_dir
from mars.core.checkpoint_info import CheckpointInfo
from mars.core.digest import sha256_file, sha256_tree
from mars.decoding.onnx_backend import FORMAT_VERSION, INPUT_NAMES, MANIFEST, OUTPUT_NAMES, BlockSpec, window_mask
from mars.errors import ConfigError, MarsError

ONNX_FILE = "model.onnx"
TRT_FILE = "model_trt.ep"
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ExportError(MarsError):
    pass


@dataclass
class ExportConfig:
    batch_size: int = 4
    window: int = 16
    max_context: int = 256
    opset: int = 18
    external_data: bool = False
    parity_atol: float = 1e-4
    tensorrt: bool = True
    trt_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    latency_iters: int = 50

    def __post_init__(self):
        for name in ("batch_size", "window", "max_context", "latency_iters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.window > self.max_context:
            raise ConfigError(f"window: W={self.window} is larger than max_context={self.max_context}")
        if self.max_context - self.window < 2:  # the prefix cache axis needs a range to be dynamic
            raise ConfigError(f"window: W={self.window} leaves {self.max_context - self.window} of max_context="
                              f"{self.max_context} for the prefix cache; it needs at least 2")
        if self.opset < 18:
            raise ConfigError(f"opset: the dynamo exporter needs opset >= 18, got {self.opset}")
        if self.parity_atol <= 0:
            raise ConfigError(f"parity_atol: must be > 0, got {self.parity_atol}")


# --------------------------------------------------------------------------------------------------
# The block forward as a module


def block_spec(config, batch_size: int, window: int, max_context: int) -> BlockSpec:
    text = config.get_text_config()
    heads = text.num_attention_heads
    return BlockSpec(
        batch_size=batch_size, window=window, max_context=max_context,
        num_layers=text.num_hidden_layers,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=text.vocab_size,
    )


def _block_forward_class():
    import torch

    class BlockForward(torch.nn.Module):
        """``(ids, positions, additive mask, past K, past V) -> (logits, window K, window V)`` on a HF causal LM."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids, attention_mask, past_keys, past_values):
            from transformers import DynamicCache

            past = past_keys.shape[3]
            cache = DynamicCache(ddp_cache_data=[(past_keys[i], past_values[i]) for i in range(past_keys.shape[0])])
            logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                cache=cache, use_cache=True).logits
            keys = torch.stack([layer.keys[:, :, past:] for layer in cache.layers])
            values = torch.stack([layer.values[:, :, past:] for layer in cache.layers])
            return logits, keys, values

    return BlockForward


def block_forward(model):
    """The block forward module of ``model`` (eval mode; the model's own weights, not a copy)."""
    return _block_forward_class()(model).eval()


def example_inputs(spec: BlockSpec, prefix_lens, past: int, *, dtype=None, device="cpu", generator=None):
    """Random block-forward inputs: windows at positions ``prefix_lens[r] ..``, random prefix caches
    (entries beyond a row's length are noise the mask must hide)."""
    import torch

    from mars.core.masking import to_additive

    dtype = dtype or torch.float32
    b, w = spec.batch_size, spec.window
    lens = torch.as_tensor(prefix_lens, dtype=torch.long)
    ids = torch.randint(0, spec.vocab_size, (b, w), generator=generator)
    positions = lens[:, None] + torch.arange(w)[None]
    mask = to_additive(torch.from_numpy(window_mask(lens.numpy(), past, w)) == 0, dtype)
    keys = torch.randn(spec.cache_shape(past), generator=generator).to(dtype)
    values = torch.randn(spec.cache_shape(past), generator=generator).to(dtype)
    return tuple(t.to(device) for t in (ids, positions, mask, keys, values))


def parity_prefix_lengths(spec: BlockSpec) -> list[int]:
    """Prefix lengths the parity check covers: empty, one, half and the maximum (rows ragged below)."""
    top = spec.max_prefix
    return sorted({0, min(1, top), top // 2, top})


def _ragged(length: int, batch: int) -> list[int]:
    # Rows of one call hold different prefix lengths; the longest sets the cache axis.
    return [max(0, length - 3 * r) for r in range(batch)]


# Parity runs on text, not random ids: random ids drive a real model's activations far outside what it
# sees (SmolLM2: ~4e-4 fp32 noise at 40 random tokens, ~5e-5 on text, as torch sdpa vs float64).
PARITY_TEXT = (
    "Mask autoregression lets a causal language model emit several tokens in one forward pass. "
    "Work out 17 + 25: the answer is 42. Sort 9, 4, 7 and 1 in ascending order: 1, 4, 7, 9. "
    "Monday, Tuesday, Wednesday, Thursday, Friday. {\"name\": \"Ann\", \"age\": 31}\n"
)


def text_inputs(model, tokenizer, spec: BlockSpec, prefix_lens, past: int, *, generator=None):
    """Block-forward inputs from text: row r's prefix cache comes from running ``model`` over its first
    ``prefix_lens[r]`` tokens, its window holds the next ``W``; cache slots beyond a row's prefix hold
    noise that the mask must hide. fp32 on CPU (cast and move for another runtime)."""
    import torch
    from transformers import DynamicCache

    b, w = spec.batch_size, spec.window
    base = tokenizer(PARITY_TEXT, add_special_tokens=False)["input_ids"]
    need = spec.max_context + 7 * b
    stream = torch.tensor((base * (need // len(base) + 1))[:need])
    keys = torch.randn(spec.cache_shape(past), generator=generator)
    values = torch.randn(spec.cache_shape(past), generator=generator)
    ids = torch.empty(b, w, dtype=torch.long)
    for r, n in enumerate(prefix_lens):
        seq = stream[7 * r: 7 * r + n + w]  # rows read the text from different offsets
        ids[r] = seq[n:]
        if n:
            cache = DynamicCache()
            with torch.no_grad():
                model(input_ids=seq[None, :n], position_ids=torch.arange(n)[None], cache=cache, use_cache=True)
            keys[:, r, :, :n] = torch.stack([layer.keys[0] for layer in cache.layers])
            values[:, r, :, :n] = torch.stack([layer.values[0] for layer in cache.layers])
    lens = torch.as_tensor(prefix_lens, dtype=torch.long)
    positions = lens[:, None] + torch.arange(w)[None]
    mask = torch.from_numpy(window_mask(lens.numpy(), past, w))
    return ids, positions, mask, keys, values


# --------------------------------------------------------------------------------------------------
# Checkpoint checks


def check_checkpoint(checkpoint: Path) -> CheckpointInfo:
    """The ``config.mars`` record of a MARS checkpoint, or a clear error saying what is missing."""
    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint}: no such checkpoint directory")
    if not (checkpoint / "config.json").is_file():
        raise ExportError(f"{checkpoint}: not a model checkpoint (no config.json)")
    info = CheckpointInfo.read(checkpoint)
    if not any((checkpoint / name).is_file() for name in TOKENIZER_MARKERS):
        raise ExportError(
            f"{checkpoint}: no tokenizer files ({', '.join(TOKENIZER_MARKERS)}); the export must carry the "
            "tokenizer the checkpoint was trained with"
        )
    return info


def check_shapes(cfg: ExportConfig, config, info: CheckpointInfo) -> None:
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and cfg.max_context > limit:
        raise ConfigError(f"export.max_context: {cfg.max_context} exceeds the model's max_position_embeddings={limit}")
    if cfg.window < info.block_size:
        raise ConfigError(
            f"export.window: W={cfg.window} is smaller than the checkpoint's block size B={info.block_size}"
        )


# --------------------------------------------------------------------------------------------------
# ONNX


def export_onnx(module, spec: BlockSpec, out_dir: Path, cfg: ExportConfig) -> list[str]:
    """Write the ONNX graph (past axis dynamic) and check it; returns the files written."""
    import onnx
    import torch
    from torch.export import Dim

    past = Dim("past", min=0, max=spec.max_prefix)
    # Trace with a mid-sized past so the dynamic axis is not specialised to 0 or 1.
    example_past = max(2, min(spec.max_prefix, 5))
    args = example_inputs(spec, [example_past] * spec.batch_size, example_past,
                          generator=torch.Generator().manual_seed(0))
    dynamic = {"input_ids": None, "position_ids": None, "attention_mask": {3: past + spec.window},
               "past_keys": {3: past}, "past_values": {3: past}}
    path = out_dir / ONNX_FILE
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), dynamo=True, opset_version=cfg.opset,
                          external_data=cfg.external_data, input_names=list(INPUT_NAMES),
                          output_names=list(OUTPUT_NAMES), dynamic_shapes=dynamic, verbose=False)
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as err:
        raise ExportError(f"{path}: onnx.checker rejected the exported graph: {err}") from None
    return sorted(p.name for p in out_dir.iterdir() if p.name.startswith(ONNX_FILE))


def onnx_parity(model, tokenizer, spec: BlockSpec, onnx_path: Path) -> dict:
    """Max |ORT - PyTorch| of logits and new K/V at several prefix lengths (same inputs, fp32)."""
    import onnxruntime as ort
    import torch

    module = block_forward(model)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(1)
    figures = {}
    for length in parity_prefix_lengths(spec):
        lens = _ragged(length, spec.batch_size)
        args = text_inputs(model, tokenizer, spec, lens, max(lens), generator=generator)
        with torch.no_grad():
            ref = module(*args)
        got = session.run(list(OUTPUT_NAMES), dict(zip(INPUT_NAMES, (a.numpy() for a in args))))
        figures[str(length)] = {
            name: float(abs(torch.from_numpy(g) - r).max()) for name, g, r in zip(OUTPUT_NAMES, got, ref)
        }
    worst = max(v["logits"] for v in figures.values())
    return {"prefix_lengths": figures, "max_abs_logits": worst, "inputs": "text (PARITY_TEXT), ragged rows"}


# --------------------------------------------------------------------------------------------------
# TensorRT


def tensorrt_unavailable_reason() -> str | None:
    """None where a TensorRT build can run here, else why not."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import torch_tensorrt  # noqa: F401
    except Exception as err:  # a missing TensorRT raises a bare Exception, not ImportError
        return f"torch_tensorrt not importable ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})"
    return None


def _latency_ms(fn, args, iters: int, sync) -> float:
    import torch

    with torch.no_grad():
        for _ in range(3):
            fn(*args)
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        sync()
    return (time.perf_counter() - start) / iters * 1000


def build_tensorrt(model, tokenizer, spec: BlockSpec, out_dir: Path, cfg: ExportConfig, device: str = "cuda") -> dict:
    """Compile the block forward with Torch-TensorRT (static shapes, prefix axis at its maximum, masked)
    in ``cfg.trt_dtype`` and save it as ``model_trt.ep``; returns its manifest entry with parity and
    latency against PyTorch eager on the same GPU."""
    import inspect

    import torch
    import torch_tensorrt

    from mars.core.masking import to_additive

    dtype = getattr(torch, cfg.trt_dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # Copies: the caller's fp32 CPU model stays as it is (its ONNX export is already written).
    gpu = block_forward(copy.deepcopy(model)).to(device, dtype)
    past = spec.max_prefix
    generator = torch.Generator().manual_seed(2)
    args = example_inputs(spec, [past] * spec.batch_size, past, dtype=dtype, device=device, generator=generator)
    with torch.no_grad():
        program = torch.export.export(gpu, args, strict=False)
    options = {"arg_inputs": list(args), "min_block_size": 1}
    if "use_explicit_typing" in inspect.signature(torch_tensorrt.dynamo.compile).parameters:
        options["use_explicit_typing"] = True  # the graph is already in trt_dtype; keep it so
    else:
        options["enabled_precisions"] = {dtype}
    start = time.perf_counter()
    compiled = torch_tensorrt.dynamo.compile(program, **options)
    build_s = time.perf_counter() - start
    torch_tensorrt.save(compiled, str(out_dir / TRT_FILE), output_format="exported_program",
                        arg_inputs=list(args), retrace=True)

    # Parity: TRT (trt_dtype) vs eager in the same dtype and vs eager fp32, on ragged prefixes.
    fp32 = block_forward(copy.deepcopy(model)).to(device, torch.float32)
    parity = {}
    for length in parity_prefix_lengths(spec):
        host = text_inputs(model, tokenizer, spec, _ragged(length, spec.batch_size), past, generator=generator)
        ids, positions, mask, keys, values = (t.to(device) for t in host)
        # rebuilt, not cast: float32's finfo.min overflows to -inf in float16
        inputs = (ids, positions, to_additive(mask == 0, dtype), keys.to(dtype), values.to(dtype))
        with torch.no_grad():
            got = compiled(*inputs)[0].float()
            same = gpu(*inputs)[0].float()
            ref = fp32(ids, positions, mask, keys, values)[0]
        parity[str(length)] = {
            "max_abs_logits_vs_eager_same_dtype": float((got - same).abs().max()),
            "max_abs_logits_vs_eager_fp32": float((got - ref).abs().max()),
            "argmax_agreement_vs_eager_fp32": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        }
    trt_ms = _latency_ms(compiled, args, cfg.latency_iters, sync)
    eager_ms = _latency_ms(gpu, args, cfg.latency_iters, sync)
    return {
        "status": "built",
        "file": TRT_FILE,
        "format": "torch_tensorrt exported program (torch_tensorrt.load(path).module())",
        "torch_tensorrt_version": torch_tensorrt.__version__,
        "dtype": cfg.trt_dtype,
        "past_axis": {"kind": "static", "size": past, "note": "unused slots are hidden by the mask"},
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "build_s": round(build_s, 2),
        "parity": parity,
        "latency_ms": {"tensorrt": round(trt_ms, 4), "eager": round(eager_ms, 4),
                       "speedup": round(eager_ms / trt_ms, 3)},
    }


# --------------------------------------------------------------------------------------------------
# The export


def _io_table(spec: BlockSpec, dtype: str) -> dict:
    b, w, L, h, d = spec.batch_size, spec.window, spec.num_layers, spec.kv_heads, spec.head_dim
    return {
        "inputs": {
            "input_ids": {"shape": [b, w], "dtype": "int64"},
            "position_ids": {"shape": [b, w], "dtype": "int64"},
            "attention_mask": {"shape": [b, 1, w, "past + W"], "dtype": dtype,
                               "meaning": "additive: 0 attend, finfo.min blocked; keys = [past | window]"},
            "past_keys": {"shape": [L, b, h, "past", d], "dtype": dtype, "meaning": "after rotary embedding"},
            "past_values": {"shape": [L, b, h, "past", d], "dtype": dtype},
        },
        "outputs": {
            "logits": {"shape": [b, w, spec.vocab_size], "dtype": dtype},
            "new_keys": {"shape": [L, b, h, w, d], "dtype": dtype},
            "new_values": {"shape": [L, b, h, w, d], "dtype": dtype},
        },
        "past_axis": {"kind": "dynamic", "min": 0, "max": spec.max_prefix},
    }


def export_checkpoint(checkpoint: str | Path, out: str | Path, cfg: ExportConfig | None = None, *,
                      log=print) -> dict:
    """Export ``checkpoint`` into directory ``out`` (atomically); returns the manifest."""
    cfg = cfg or ExportConfig()
    checkpoint, out = Path(checkpoint), Path(out)
    info = check_checkpoint(checkpoint)

    from mars.core.models import load_model

    model, tokenizer = load_model(checkpoint, dtype="float32", attn_implementation="sdpa")
    check_shapes(cfg, model.config, info)
    mask_id = info.mask_token_id
    if mask_id not in tokenizer.all_special_ids:
        found = repr(tokenizer.convert_ids_to_tokens(mask_id)) if mask_id < len(tokenizer) else "not in the tokenizer"
        raise ExportError(f"{checkpoint}: config.mars.mask_token_id {mask_id} is {found}, not a special token of its "
                          f"tokenizer ({len(tokenizer)} tokens): the tokenizer files do not match the checkpoint")
    spec = block_spec(model.config, cfg.batch_size, cfg.window, cfg.max_context)

    with atomic_dir(out) as tmp:
        log(f"export: ONNX block forward B={info.block_size} batch={spec.batch_size} W={spec.window} "
            f"past<={spec.max_prefix} (opset {cfg.opset})")
        started = time.perf_counter()
        onnx_files = export_onnx(block_forward(model), spec, tmp, cfg)
        log(f"export: {', '.join(onnx_files)} written and checked ({time.perf_counter() - started:.0f} s)")
        started = time.perf_counter()
        parity = onnx_parity(model, tokenizer, spec, tmp / ONNX_FILE)
        log(f"export: onnxruntime vs PyTorch max |logits diff| = {parity['max_abs_logits']:.3g} at prefix lengths "
            f"{', '.join(parity['prefix_lengths'])} ({time.perf_counter() - started:.0f} s)")
        if parity["max_abs_logits"] > cfg.parity_atol:
            raise ExportError(
                f"ONNX parity check failed: max |logits diff| {parity['max_abs_logits']:.3g} > "
                f"export.parity_atol={cfg.parity_atol} (per prefix length: {parity['prefix_lengths']})"
            )
        tokenizer_files = sorted({Path(p).name for p in tokenizer.save_pretrained(tmp) if Path(p).is_file()})
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:  # its stop tokens are the decoder's
            model.generation_config.save_pretrained(tmp)

        if not cfg.tensorrt:
            trt = {"status": "skipped", "reason": "export.tensorrt is false"}
        elif (reason := tensorrt_unavailable_reason()) is not None:
            trt = {"status": "unavailable", "reason": reason}
        else:
            log(f"export: building TensorRT ({cfg.trt_dtype})")
            trt = build_tensorrt(model, tokenizer, spec, tmp, cfg)
        log(f"export: tensorrt: {trt['status']}" + (f" ({trt['reason']})" if "reason" in trt else ""))

        import onnx
        import onnxruntime
        import torch
        import transformers

        manifest = {
            "format_version": FORMAT_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "checkpoint": {"path": str(checkpoint), "sha256": sha256_tree(checkpoint)},
            "mars": info.to_dict(),
            "block": dataclasses.asdict(spec),
            "export_config": dataclasses.asdict(cfg),
            **_io_table(spec, "float32"),
            "onnx": {"file": ONNX_FILE, "files": onnx_files, "opset": cfg.opset,
                     "external_data": cfg.external_data, "parity": parity, "parity_atol": cfg.parity_atol},
            "tensorrt": trt,
            "tokenizer_files": tokenizer_files,
            "model_config": "config.json",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        }
        manifest["files"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"export: wrote {out} ({len(manifest['files'])} files + {MANIFEST})")
    return manifest


def stand_in_checkpoint(model_cfg, seed: int, block_size: int, out: str | Path) -> Path:
    """The profile's base model (a :class:`mars.training.base.ModelConfig`, random weights) saved as a MARS
    checkpoint of block size B.

    For latency and TensorRT build checks where no trained checkpoint exists: shapes, not weights,
    decide the timings. ``config.mars.base`` says it is a stand-in.
    """
    from mars.training.base import build_base

    model, tokenizer, mask = build_base(model_cfg, seed)
    CheckpointInfo(block_size=block_size, mask_token_id=mask.token_id, objective="mars", w_ar=1.0, stage="mars",
                   block_offset="fixed", base="stand-in: random weights").write_to(model.config)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out)
