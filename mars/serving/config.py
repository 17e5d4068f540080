"""``ServeConfig``: how ``mars serve`` runs (the one source of its defaults; the CLI flags override them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mars.errors import ConfigError
from mars.decoding.tau_policy import PolicyConfig


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # 0.0.0.0 in a container (infra/k8s)
    port: int = 8000
    backend: Literal["torch", "onnx"] = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None  # torch CPU threads (None: torch's default, every core)
    max_batch: int = 16  # rows decoding at once
    max_queue: int = 64  # requests waiting for a row; beyond: 429
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # the setting of requests that name none
    prefix_cache: bool = True  # the chat template's head (system turn) is computed once, not per request
    max_tokens: int = 2048  # the most a request may ask for
    default_max_tokens: int = 128
    max_request_bytes: int = 1 << 20  # a larger request body gets 413 (prompts fill the context long before)
    poll_seconds: float = 30.0  # how often a --release server checks its stage pointer (0: never)
    drain_seconds: float = 60.0  # how long SIGTERM waits for taken requests

    def __post_init__(self):
        for key in ("max_batch", "max_queue", "max_tokens", "default_max_tokens", "max_request_bytes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads: must be >= 1 (or null), got {self.threads}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port: must be in 1..65535, got {self.port}")
        if self.default_max_tokens > self.max_tokens:
            raise ConfigError(f"default_max_tokens: {self.default_max_tokens} is above max_tokens {self.max_tokens}")
        if self.poll_seconds < 0 or self.drain_seconds < 0:
            raise ConfigError("poll_seconds, drain_seconds: must be >= 0")
        if self.backend not in ("torch", "onnx"):
            raise ConfigError(f"backend: must be torch or onnx, got {self.backend!r}")
