"""The OpenAI wire format: request bodies (validated, the bad field named), responses, error bodies.

MARS knobs travel as extra body fields, which the ``openai`` client sends with ``extra_body``:
``tau`` (in (0, 1]; absent: the server's tau policy), ``mode`` (``tau`` | ``lossless``: greedy output,
mask slots as verified drafts; needs temperature 0), ``tree`` (the lossless mode's draft tree, a shape
label such as ``top2/16``; absent: the chain of top-1 drafts) and ``block_size`` (1..B of the checkpoint: at
most that many tokens per forward). ``usage`` carries ``forwards`` (decoding forwards the request took
part in), ``tokens_per_forward`` and ``tau`` (the mean tau its steps ran at) beside the token counts.
Every field is range-checked here, before any of it reaches the decoder; an OpenAI field the server does
not implement is refused unless it holds its neutral value (``_NEUTRAL``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, *, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# OpenAI fields this server does not implement, with the values that leave the output as if they were absent:
# a request may send those (or null); any other value is refused rather than silently ignored.
_NEUTRAL: dict[str, tuple] = {
    "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False,),
    "top_logprobs": (0,), "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none", "auto"),
    "functions": ([],), "function_call": ("none", "auto"), "modalities": (["text"],), "audio": (),
    "best_of": (1,), "echo": (False,), "suffix": ("",),
}

# OpenAI's range for a seed; torch's generator would take [-2**63, 2**64) and raise outside it
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_STOP_CHARS = 256  # the step thread decodes as many tokens back as the longest stop string spans, every token


class _Request(BaseModel):
    # other OpenAI fields (user, metadata, store ...) change no output: accepted, unused
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    # not implemented: only their neutral values pass (_NEUTRAL)
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    best_of: Any = None
    echo: Any = None
    suffix: Any = None
    # MARS
    tau: float | None = Field(None, gt=0.0, le=1.0)
    mode: Literal["tau", "lossless"] = "tau"
    tree: str | None = Field(None, max_length=64)
    block_size: int | None = Field(None, ge=1)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported")
        return n

    @field_validator(*_NEUTRAL)
    @classmethod
    def _neutral_only(cls, value, info: ValidationInfo):
        neutral = _NEUTRAL[info.field_name]
        if value is not None and value not in neutral:
            allowed = " or ".join([json.dumps(v) for v in neutral] + ["null"])
            raise ValueError(f"not supported by this server (only {allowed})")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"up to 4 non-empty stop strings of at most {MAX_STOP_CHARS} characters")
        return stops

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]

    def budget(self) -> int | None:
        return self.max_tokens

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request", "prompt")
            p = p[0]
        if not p:
            raise APIError(400, "the prompt is empty", "prompt")
        return p


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` (parsed JSON) as ``model``, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", "body")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        # a union's members show up in the location ("prompt", "list[int]", 0): keep the field path
        path = [str(p) for p in first["loc"] if not (isinstance(p, str) and (p in _TYPE_NAMES or "[" in p))]
        param = ".".join(path) or None
        raise APIError(400, f"{param}: {first['msg']}", param) from None


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list"}


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, forwards: int, taus: list[float],
          lossless_steps: int = 0) -> dict:
    """OpenAI's token counts, plus MARS's: forwards, tokens/forward, the mean tau over the request's steps
    and how many of them ran in the lossless mode."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "forwards": forwards,
            "tokens_per_forward": completion_tokens / forwards if forwards else 0.0,
            "tau": sum(taus) / len(taus) if taus else None, "lossless_steps": lossless_steps}


def now() -> int:
    return int(time.time())
