"""What the server decodes with: a checkpoint or a pulled release, on the PyTorch or the ONNX backend.

A release (``mars pull`` layout, :mod:`mars.release.promote`) brings its default tau (``tau``) and the
tau floor its gate accepted (``tau_floor``, the lowest tau whose score loss the gate measured and
passed; a release without one has no tau below its default vouched for). The adaptive tau policy
(:mod:`mars.decoding.tau_policy`) may use that floor when the operator opts in (``--tau-floor release``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from mars.core.atomic import read_json
from mars.core.checkpoint_info import CheckpointInfo
from mars.decoding.setting import Setting
from mars.errors import MarsError

BACKENDS = ("torch", "onnx")


class ServeError(MarsError):
    pass


@dataclass
class ServedModel:
    """One loaded model: what requests name it (``name``), how to decode with it and its tau range."""

    name: str
    tokenizer: Any
    new_backend: Callable[[], Any]  # a fresh decode backend (one per engine)
    block_size: int | None  # B; None: not a MARS checkpoint (tau = 1 only)
    mask_id: int
    stop_ids: list[int]
    context: int | None  # positions a sequence may fill (prompt + generated)
    default_tau: float
    tau_floor: float
    max_rows: int | None = None  # rows the backend holds at most (an export's fixed batch)
    version: str | None = None  # the release version; None for a checkpoint directory
    source: str = ""
    backend: Literal["torch", "onnx"] = "torch"
    manifest: dict = field(default_factory=dict)
    prompt_head: list[int] = field(default_factory=list)  # what every chat prompt starts with (see chat_head)

    def describe(self) -> str:
        release = f" {self.version}" if self.version else ""
        return (f"{self.name}{release} from {self.source} ({self.backend}, B={self.block_size}, "
                f"tau {self.default_tau}, floor {self.tau_floor})")


def chat_head(tokenizer) -> list[int]:
    """The token ids every single-turn chat prompt starts with: the chat template's default system turn and
    the user header (SmolLM2-Instruct: 24 tokens). Empty without a chat template. A prompt only uses it
    where its own ids start with it (a template may merge the header with the first content token)."""
    from mars.decoding.generate import encode_prompts

    if not getattr(tokenizer, "chat_template", None):
        return []
    first, second = encode_prompts(tokenizer, ["A", "7 b"])
    n = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    return first[:n]


def load_checkpoint(path: str | Path, *, name: str, backend: str = "torch", default_tau: float = 0.9,
                    tau_floor: float | None = None, device: str = "cpu", dtype: str = "float32",
                    export_dir: str | Path | None = None, tokenizer_dir: str | Path | None = None,
                    version: str | None = None, manifest: dict | None = None) -> ServedModel:
    """A checkpoint directory (``backend="torch"``) or its export (``backend="onnx"``, ``export_dir``)."""
    from mars.decoding.generate import context_length_of, stop_token_ids_of

    default_tau = Setting.check_tau(default_tau, "tau")
    floor = default_tau if tau_floor is None else Setting.check_tau(tau_floor, "tau_floor")
    if floor > default_tau:
        raise ServeError(f"tau_floor: {floor} is above the default tau {default_tau}")
    if backend == "torch":
        from mars.core.models import load_model
        from mars.decoding.torch_backend import TorchBackend

        model, tokenizer = load_model(path, dtype=dtype, device=device)
        config, stops = model.config, stop_token_ids_of(model, tokenizer)
        info = CheckpointInfo.from_config(config)
        new_backend, max_rows = (lambda: TorchBackend(model)), None
    elif backend == "onnx":
        from transformers import AutoTokenizer

        from mars.decoding.onnx_backend import ExportedBlock, OnnxBackend

        if export_dir is None or not Path(export_dir).is_dir():
            raise ServeError(f"--backend onnx: no export next to {path} (run `mars export`, or serve with torch)")
        engine = ExportedBlock(export_dir)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or export_dir)
        config, stops, info = engine.config, stop_token_ids_of(engine, tokenizer), engine.info
        new_backend, max_rows = (lambda: OnnxBackend(engine)), engine.spec.batch_size
    else:
        raise ServeError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if info is None and floor < 1.0:
        raise ServeError(f"{path}: not a MARS checkpoint (no config.mars): it serves tau = 1.0 only")
    return ServedModel(name=name, tokenizer=tokenizer, new_backend=new_backend,
                       block_size=info.block_size if info else None, mask_id=info.mask_token_id if info else 0,
                       stop_ids=stops, context=context_length_of(config), default_tau=default_tau, tau_floor=floor,
                       max_rows=max_rows, version=version, source=str(path), backend=backend, manifest=manifest or {},
                       prompt_head=chat_head(tokenizer))


def load_release(release_dir: str | Path, *, backend: str = "torch", device: str = "cpu",
                 dtype: str = "float32") -> ServedModel:
    """A pulled release directory: its checkpoint (torch) or export (onnx), its tau and tau floor."""
    from mars.release.promote import MANIFEST_FILE, ReleaseError

    release_dir = Path(release_dir)
    manifest = read_json(release_dir / MANIFEST_FILE, "not a pulled release: run `mars pull`", ReleaseError)
    where = release_dir / MANIFEST_FILE
    tau = Setting.check_tau(manifest.get("tau", 1.0), f"{where}: tau")
    floor = Setting.check_tau(manifest.get("tau_floor", tau), f"{where}: tau_floor")
    if backend == "onnx" and "onnx" not in manifest.get("engines", {}):
        raise ServeError(f"{where}: release {manifest.get('version')} has no ONNX export; "
                         "serve it with --backend torch")
    return load_checkpoint(release_dir / "checkpoint", name=manifest["name"], backend=backend, default_tau=tau,
                           tau_floor=min(floor, tau), device=device, dtype=dtype, export_dir=release_dir / "export",
                           tokenizer_dir=release_dir / "tokenizer", version=manifest.get("version"), manifest=manifest)
