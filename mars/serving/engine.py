"""The serving engine: one model, its batch stepped by the process's step thread, requests joining at the next step.

Continuous batching at the level of decoding steps (:class:`mars.decoding.batch.CachedBatch`, the same
core :func:`mars.decoding.generate.generate` drives): before every step the engine moves waiting requests
into the batch (up to ``max_batch`` rows), gives the rows that named no setting the tau policy's
(:mod:`mars.decoding.tau_policy`), runs one step, hands each request the tokens it accepted and tells the
policy what the step cost and yielded. A request leaves the batch when it stops (a stop token or string)
or reaches its token budget. Each row carries its own :class:`~mars.decoding.setting.Setting` and sampler.

At most ``max_queue`` requests wait; :meth:`Engine.submit` refuses more (:class:`QueueFull`, the HTTP
layer answers 429) instead of letting the queue grow without bound. :meth:`Engine.close` stops taking
requests and, with ``drain``, finishes what was taken.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from mars.decoding.batch import CachedBatch, DecodeRow
from mars.decoding.sampling import Sampler, SamplingParams
from mars.decoding.setting import GREEDY, Setting
from mars.decoding.stop_strings import StopStrings
from mars.decoding.tau_policy import Steering
from mars.errors import MarsError
from mars.serving.served_model import ServedModel
from mars.serving.step_thread import StepThread

log = logging.getLogger("mars.serve")


class QueueFull(MarsError):
    pass


class Closed(MarsError):
    """The engine takes no new requests (draining, or replaced by a newer release)."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int  # already capped by the context
    setting: Setting | None = None  # None: the tau policy's
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    block_size: int | None = None  # a cap on the policy's width: at most this many tokens per forward


@dataclass
class Finished:
    token_ids: list[int]
    forwards: int
    finish_reason: str  # "stop" | "length"
    taus: list[float]  # the tau of each step (one value unless the policy moved it)
    lossless_steps: int = 0  # steps this request decoded in the lossless mode (its tau then reads 1.0)


class RequestHandle:
    """A submitted request: the engine thread hands it token lists, then a :class:`Finished` or an
    exception, through an asyncio queue of the server's event loop (:func:`deliver`)."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, row: DecodeRow):
        self.request, self.loop, self.row = request, loop, row
        self.queue: asyncio.Queue = asyncio.Queue()
        self.taus: list[float] = []
        self.lossless_steps = 0
        self.submitted = time.perf_counter()

    async def events(self):
        """Token lists as they are accepted, then the :class:`Finished` record (an error is raised)."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finished):
                return


def deliver(items: list[tuple[RequestHandle, object]]) -> None:
    """Hand a step's items to their requests with one wake-up of each event loop, not one per item: a wake-up
    (the loop's self-pipe, then the GIL back from the loop's thread) is a real share of a small model's step."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for handle, item in items:
        by_loop.setdefault(handle.loop, []).append((handle.queue, item))
    for loop, queued in by_loop.items():
        loop.call_soon_threadsafe(_put_all, queued)


def _put_all(queued: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in queued:
        queue.put_nowait(item)


class Engine:
    def __init__(self, model: ServedModel, policy, *, max_batch: int = 16, max_queue: int = 64, metrics=None,
                 prefix: Sequence[int] = ()):
        self.model, self.policy, self.metrics = model, policy, metrics
        self.prefix = list(prefix)  # a prompt head computed once per batch (CachedBatch's prefix)
        self.max_batch = min(max_batch, model.max_rows or max_batch)
        self.max_queue = max_queue
        self.stop_ids = torch.tensor(model.stop_ids, dtype=torch.long)
        self.batch = self._new_batch()
        self.waiting: deque[tuple[DecodeRow, RequestHandle]] = deque()
        self.handles: dict[int, RequestHandle] = {}  # id(row) -> handle, rows in the batch
        self.steering = Steering(policy)
        self.accepting, self.stopping = True, False
        self.finished = threading.Event()  # closed, and nothing left to step
        stepper = StepThread.shared()  # one thread steps every engine of the process (see step_thread)
        self.cv = stepper.cv
        stepper.add(self)

    def _new_batch(self) -> CachedBatch:
        return CachedBatch(self.model.new_backend(), block_size=self.model.block_size or 1, stop_ids=self.stop_ids,
                           mask_id=self.model.mask_id, prefix=self.prefix)

    # -- the request side (the server's event loop) --------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.handles)

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        sampler = None if request.sampling.greedy else Sampler(request.sampling)
        stops = StopStrings(self.model.tokenizer, list(request.stop)) or None
        # key: the request, whose setting (None: the policy's) and width cap the step reads
        setting = request.setting or (GREEDY if sampler else self.policy.snapshot.setting)  # lossless is greedy
        row = DecodeRow(request.prompt_ids, request.max_tokens, setting, sampler=sampler, stop_strings=stops,
                        stream=True, key=request)
        handle = RequestHandle(request, loop, row)
        with self.cv:
            if not self.accepting:
                raise Closed(f"{self.model.name} {self.model.version or ''}: not taking requests (shutting down)")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests waiting (the queue holds {self.max_queue})")
            self.waiting.append((row, handle))
            self.cv.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Drop a request nobody waits for any more (its client went away): out of the queue, or out of
        the batch before the next step."""
        with self.cv:
            for i, (_, waiting) in enumerate(self.waiting):
                if waiting is handle:
                    del self.waiting[i]
                    return
            if self.handles.pop(id(handle.row), None) is not None:
                handle.row.cancelled = True

    def close(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Take no new requests; with ``drain`` finish the taken ones (else fail them). True when the
        engine finished within ``timeout``."""
        with self.cv:
            self.accepting = False
            if not drain:
                self._fail_all(Closed("the server is shutting down"))
            self.stopping = True
            self.cv.notify()
        return self.finished.wait(timeout)

    # -- the step thread (mars.serving.step_thread) ------------------------------------------------------
    def take(self) -> list[DecodeRow] | None:
        """Called holding ``cv``: the waiting rows that join the next step (as many as fit), or None when
        there is nothing to step (a closing engine is then finished)."""
        if not self.waiting and not self.handles:
            if self.stopping:
                self.finished.set()
            return None
        joining = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.max_batch - len(self.handles)))]
        for row, handle in joining:
            self.handles[id(row)] = handle
        return [row for row, _ in joining]

    def step(self, joining: list[DecodeRow]) -> None:
        try:
            self._step(joining)
        except Exception as err:  # a failed step fails its requests, not the server
            log.exception("decoding step failed")
            with self.cv:
                self._fail_all(MarsError(f"decoding failed: {type(err).__name__}: {err}"), waiting=False)
            self.batch = self._new_batch()

    def _step(self, joining: list[DecodeRow]) -> None:
        # The cost the policy weighs is the whole iteration (joining rows, the step, handing tokens out):
        # on a small model the bookkeeping around a forward is a real share of it.
        started = time.perf_counter()
        batch, b_size = self.batch, self.model.block_size or 1
        hits = batch.prefix_hits
        batch.add(joining)
        copied = (batch.prefix_hits - hits) * len(batch.prefix)  # prompt tokens the prefix cache filled in
        live = batch.live

        chosen = self.steering.before_step(live, [r for r in live if r.key.setting is None], self._narrow)
        rows = len(batch)
        updates = batch.step()
        out: list[tuple[RequestHandle, object]] = []
        for u in updates:
            handle = self.handles.pop(id(u.row), None) if u.done else self.handles.get(id(u.row))
            if handle is None:  # failed by close(drain=False) meanwhile
                continue
            handle.taus.append(u.row.setting.tau)
            handle.lossless_steps += u.row.setting.lossless
            if u.new_tokens:
                out.append((handle, u.new_tokens))
            if u.done:
                out.append((handle, Finished(u.token_ids, u.forwards, "stop" if u.stopped else "length", handle.taus,
                                             handle.lossless_steps)))
        deliver(out)
        seconds = time.perf_counter() - started
        self.steering.after_step(updates, rows=rows, slots=batch.last_slots, seconds=seconds, joined=bool(joining))
        if self.metrics is not None:
            self.metrics.step(seconds, not joining, sum(len(u.new_tokens) for u in updates), self.queue_depth,
                              chosen.label(b_size) if chosen is not None else None, prefix_tokens=copied)

    def _narrow(self, row: DecodeRow, chosen: Setting) -> Setting:
        """The policy's choice for a row, its width capped at the request's own block size."""
        cap, b_size = row.key.block_size, self.model.block_size or 1
        return replace(chosen, width=cap) if cap is not None and chosen.needs_masks(b_size) and chosen.at(b_size) > cap \
            else chosen

    def _fail_all(self, error: Exception, waiting: bool = True) -> None:
        failed = list(self.handles.values()) + ([handle for _, handle in self.waiting] if waiting else [])
        deliver([(handle, error) for handle in failed])
        self.handles.clear()
        if waiting:
            self.waiting.clear()
