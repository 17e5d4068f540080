"""The HTTP API (FastAPI): OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``,
plus ``/health`` and ``/metrics``.

Every error is an OpenAI-style body naming the field (:class:`mars.serving.protocol.APIError`): a bad
field, an OpenAI field this server does not implement (set to anything but its neutral value) or malformed
JSON 400, a prompt over the context 400 (``context_length_exceeded``), a body over ``max_request_bytes``
413, an unknown model 404, a wrong or missing API key 401, a full queue 429 with ``Retry-After``, a
server draining 503. The API key (when set) is compared in constant time and never logged; ``/health``
and ``/metrics`` stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from mars.decoding.generate import encode_prompts
from mars.decoding.sampling import SamplingParams
from mars.decoding.setting import Setting
from mars.decoding.tree_shape import tree_shape
from mars.errors import MarsError
from mars.serving.engine import Closed, Engine, Finished, GenerationRequest, QueueFull
from mars.serving.metrics import ServerMetrics
from mars.serving.protocol import (APIError, ChatRequest, CompletionRequest, completion_id, now, parse, usage)
from mars.serving.text_stream import TextStream

log = logging.getLogger("mars.serve")


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 2048  # the most a request may ask for
    default_max_tokens: int = 128  # when it asks for none
    retry_after_s: int = 1  # the Retry-After of a 429
    max_request_bytes: int = 1 << 20  # a larger body gets 413


class Serving:
    """The engines behind the app: ``current`` takes new requests; a replaced one drains in the background."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, *, api_key: str | None = None,
                 limits: Limits = Limits()):
        self.current, self.metrics, self.limits = engine, metrics, limits
        self._api_key = api_key.encode() if api_key else None
        self.retired: list[Engine] = []
        self.draining = False
        self.lock = threading.Lock()
        metrics.set_release(engine.model.name, engine.model.version)

    def authorized(self, header: str | None) -> bool:
        if self._api_key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key)

    def swap(self, engine: Engine) -> Engine:
        """New requests go to ``engine``; the old one finishes what it holds and stops."""
        with self.lock:
            old, self.current = self.current, engine
            self.retired.append(old)
        self.metrics.set_release(engine.model.name, engine.model.version, (old.model.name, old.model.version))

        def drain():
            old.close(drain=True)
            with self.lock:
                self.retired.remove(old)
            log.info("drained %s %s", old.model.name, old.model.version)

        threading.Thread(target=drain, name="mars-drain", daemon=True).start()
        return old

    def engines(self) -> list[Engine]:
        with self.lock:
            return [self.current, *self.retired]

    def queue_depth(self) -> int:
        return sum(e.queue_depth for e in self.engines())

    def running(self) -> int:
        return sum(e.running for e in self.engines())

    def drain(self, timeout: float | None = None) -> bool:
        """Answer new requests 503, finish the taken ones; True when all finished within ``timeout``, else
        the unfinished ones are cancelled (their clients get a 503 error)."""
        self.draining = True
        engines = self.engines()
        done = [e.close(drain=True, timeout=timeout) for e in engines]
        for engine, finished in zip(engines, done):
            if not finished:
                engine.close(drain=False, timeout=5)
        return all(done)


def _model_object(model) -> dict:
    """OpenAI's model object, plus what MARS decodes it with."""
    return {"id": model.name, "object": "model", "created": now(), "owned_by": "mars", "version": model.version,
            "block_size": model.block_size, "tau": model.default_tau, "tau_floor": model.tau_floor,
            "context_length": model.context}


def _prompt_ids(req, engine: Engine) -> tuple[list[int], str]:
    tokenizer = engine.model.tokenizer
    if isinstance(req, ChatRequest):
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as err:
            raise APIError(400, f"messages: {err}", "messages") from None
        try:
            return encode_prompts(tokenizer, [messages])[0], "messages"
        except MarsError as err:
            raise APIError(400, f"messages: {err}", "messages") from None
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer(prompt)["input_ids"]], "prompt"
    vocab = len(tokenizer)
    if any(t < 0 or t >= vocab for t in prompt):
        raise APIError(400, f"prompt: token ids must lie in [0, {vocab})", "prompt")
    return list(prompt), "prompt"


def _generation_request(req, engine: Engine, limits: Limits) -> GenerationRequest:
    model = engine.model
    ids, field = _prompt_ids(req, engine)
    if not ids:
        raise APIError(400, f"{field}: the prompt has no tokens", field)
    if model.context is not None and len(ids) >= model.context:
        raise APIError(400, f"{field}: {len(ids)} prompt tokens, the model's context is {model.context}: no room "
                       "to generate", field, code="context_length_exceeded")
    budget_field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    max_tokens = req.budget() if req.budget() is not None else limits.default_max_tokens
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"{budget_field}: at most {limits.max_tokens}, got {max_tokens}", budget_field)
    room = max_tokens if model.context is None else min(max_tokens, model.context - len(ids))
    mars_model = model.block_size is not None and model.block_size > 1
    if req.tau is not None and req.tau < 1.0 and not mars_model:
        raise APIError(400, "tau: this model is not a MARS checkpoint: only tau = 1.0", "tau")
    if req.mode == "lossless" and not mars_model:
        raise APIError(400, "mode: lossless needs a MARS checkpoint", "mode")
    if req.mode == "lossless" and req.temperature > 0:
        raise APIError(400, "mode: lossless decoding is greedy: set temperature to 0", "mode")
    if req.block_size is not None and (model.block_size is None or req.block_size > model.block_size):
        raise APIError(400, f"block_size: this checkpoint allows 1..{model.block_size or 1}, got {req.block_size}",
                       "block_size")
    try:
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed)
    except MarsError as err:
        raise APIError(400, str(err), str(err).split(":")[0]) from None
    tree = None
    if req.tree is not None:
        if req.mode != "lossless":
            raise APIError(400, "tree: draft trees are a lossless-mode setting: set mode to lossless", "tree")
        try:
            tree = tree_shape(req.tree)
        except MarsError as err:
            raise APIError(400, str(err), "tree") from None
    if req.mode == "lossless":
        setting = Setting(lossless=True, width=req.block_size, tree=tree)
    else:
        setting = None if req.tau is None else Setting(tau=req.tau, width=req.block_size)
    return GenerationRequest(ids, room, setting=setting, sampling=sampling, stop=req.stop_list(),
                             block_size=req.block_size)


class InternalErrors:
    """ASGI middleware: an exception no route turned into an HTTP error is answered as a JSON 500 in OpenAI's
    shape and logged once. Starlette's own 500 handler re-raises to the server, which answered in text/plain
    and dropped the keep-alive connection (the next request on it was reset). A stream that already started
    cannot be answered again: its exception goes on to the server."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if started:
                raise
            log.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            error = APIError(500, "internal error (logged by the server)", kind="server_error", code="internal_error")
            await JSONResponse(error.body(), status_code=500)(scope, receive, send)


def create_app(serving: Serving) -> FastAPI:
    app = FastAPI(title="mars serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.add_middleware(InternalErrors)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        serving.metrics.requests.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    def admit(request: Request) -> Engine:
        if serving.draining:
            raise APIError(503, "the server is shutting down", kind="server_error", code="shutting_down")
        if not serving.authorized(request.headers.get("authorization")):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authorization",
                           code="invalid_api_key")
        return serving.current

    async def body_of(request: Request) -> Any:
        limit = serving.limits.max_request_bytes
        too_large = APIError(413, f"body: the request is over {limit} bytes", "body", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refused before reading a byte of it
            raise too_large
        raw = bytearray()
        async for chunk in request.stream():  # a chunked body names no length: counted as it arrives
            raw += chunk
            if len(raw) > limit:
                raise too_large
        try:
            return json.loads(raw)
        except ValueError as err:
            raise APIError(400, f"body: malformed JSON ({err})", "body") from None

    @app.get("/health")
    async def health():
        model = serving.current.model
        if serving.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "model": model.name, "version": model.version}

    @app.get("/metrics")
    async def metrics():
        engine = serving.current
        return Response(serving.metrics.render(serving.queue_depth(), serving.running(), engine.policy,
                                               engine.model.block_size),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [_model_object(admit(request).model)]}

    @app.get("/v1/models/{model_id:path}")  # an id may hold a slash (org/name)
    async def retrieve_model(model_id: str, request: Request):
        model = admit(request).model
        if model_id != model.name:
            raise APIError(404, f"model: {model_id!r} is not served here (this server serves {model.name!r})",
                           "model", code="model_not_found")
        return _model_object(model)

    async def generate(request: Request, kind: type):
        admit(request)
        req = parse(kind, await body_of(request))
        while True:
            engine = serving.current
            if req.model != engine.model.name:
                raise APIError(404, f"model: {req.model!r} is not served here (this server serves "
                               f"{engine.model.name!r})", "model", code="model_not_found")
            # the chat template and the tokenizer take a while on a long prompt: off the loop, which
            # hands every running stream its tokens
            gen = await asyncio.to_thread(_generation_request, req, engine, serving.limits)
            try:
                handle = engine.submit(gen, asyncio.get_running_loop())
                break
            except QueueFull as err:
                raise APIError(429, f"too many requests: {err}; retry later", kind="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(serving.limits.retry_after_s)}) from None
            except Closed as err:
                if serving.draining or serving.current is engine:
                    raise APIError(503, str(err), kind="server_error", code="shutting_down") from None
                # a hot swap retired this engine between our look and the submit: the new one takes it
        chat = kind is ChatRequest
        meta = {"id": completion_id("chatcmpl" if chat else "cmpl"), "created": now(), "model": engine.model.name,
                "system_fingerprint": engine.model.version}
        text = TextStream(engine.model.tokenizer, gen.stop)
        if req.stream:
            events = _sse(engine, handle, text, meta, chat, len(gen.prompt_ids), req.include_usage(), serving.metrics)
            return StreamingResponse(events, media_type="text/event-stream")
        finished, gone = asyncio.ensure_future(_finished(handle, text)), asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            answered = finished.done()
            if not answered:  # the client hung up (or the server cancelled this handler): stop decoding it
                finished.cancel()
                engine.cancel(handle)
        if not answered:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        try:
            item = finished.result()
        except Closed as err:
            raise APIError(503, str(err), kind="server_error", code="shutting_down") from None
        except MarsError as err:
            raise APIError(500, str(err), kind="server_error") from None
        content = text.text()
        choice = {"index": 0, "finish_reason": item.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": content}} if chat else {"text": content})
        serving.metrics.requests.labels("200").inc()
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": usage(len(gen.prompt_ids), len(item.token_ids), item.forwards, item.taus, item.lossless_steps)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest)

    return app


async def _finished(handle, text: TextStream) -> Finished:
    """A non-streaming request's :class:`Finished` record, its tokens collected in ``text``."""
    async for item in handle.events():
        if not isinstance(item, Finished):
            text.token_ids.extend(item)  # decoded once, at the end
    return item


async def _client_gone(request: Request) -> None:
    """Returns when the client hangs up. Awaited once the body is read: the next ASGI message is then the
    disconnect, the one a streaming response listens for."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(engine: Engine, handle, text: TextStream, meta: dict, chat: bool, prompt_tokens: int,
               include_usage: bool, metrics):
    """Server-sent events as OpenAI streams them: chunks, a last chunk with the finish reason, the usage
    chunk when asked for, then ``[DONE]``. A client that goes away cancels its request."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"

    finished = False
    try:
        if chat:
            yield chunk(None, role=True)
        async for item in handle.events():
            if isinstance(item, Finished):
                finished = True
                rest = text.finish()
                if rest:
                    yield chunk(rest)
                yield chunk(None, item.finish_reason)
                if include_usage:
                    counts = usage(prompt_tokens, len(item.token_ids), item.forwards, item.taus, item.lossless_steps)
                    yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': counts})}\n\n"
            else:
                delta = text.push(item)
                if delta:
                    yield chunk(delta)
        metrics.requests.labels("200").inc()
    except MarsError as err:
        finished = True
        metrics.requests.labels("500").inc()
        yield f"data: {json.dumps(APIError(500, str(err), kind='server_error').body())}\n\n"
    finally:
        if not finished:  # the client disconnected (the generator is closed or cancelled mid-stream)
            engine.cancel(handle)
    yield "data: [DONE]\n\n"
