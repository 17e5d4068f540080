"""The one thread that steps every engine of a process.

PyTorch's CPU kernels run their parallel regions on an OpenMP team of the thread that calls them, and once a
second thread has run such kernels, every parallel region in the process runs about twice as slow (on a
2-core CPU, measured with torch's OpenMP build: a 64 x 576 bf16 linear took 112 us from one thread, and
210 us from either thread once two had, for good; SmolLM2 in bf16 in-process at 16 streams, tau = 1: 224
tokens/s with one engine, 109 beside a second engine that had stepped before and sat idle). Engines side by
side, a hot swap's old release draining beside the new one or a benchmark's settings, therefore share this
thread instead of each owning one: it steps each engine that has work in turn, one step each.
"""

from __future__ import annotations

import logging
import threading
from typing import ClassVar, Protocol

log = logging.getLogger("mars.serve")


class Steppable(Protocol):
    finished: threading.Event  # set once a closing engine has nothing left

    def take(self) -> list | None: ...  # under the lock: the rows joining its next step, None: nothing to step

    def step(self, joining: list) -> None: ...  # one step, outside the lock


class StepThread:
    _shared: ClassVar[StepThread | None] = None
    _guard: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls) -> StepThread:
        """The process's step thread (started with the first engine)."""
        with cls._guard:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self):
        self.cv = threading.Condition()  # engines submit, cancel and close under it and notify it
        self.engines: list[Steppable] = []
        self.thread = threading.Thread(target=self._run, name="mars-engine", daemon=True)
        self.thread.start()

    def add(self, engine: Steppable) -> None:
        with self.cv:
            self.engines.append(engine)

    def _run(self) -> None:
        while True:
            with self.cv:
                while True:
                    turn = [(engine, rows) for engine in self.engines if (rows := engine.take()) is not None]
                    self.engines = [engine for engine in self.engines if not engine.finished.is_set()]
                    if turn:
                        break
                    self.cv.wait()
            for engine, rows in turn:
                try:
                    engine.step(rows)
                except Exception:  # the engine fails its own requests; whatever escapes must not stop the others
                    log.exception("stepping an engine failed")
