"""Releases for the server: pull the one a stage points to into a local cache, and follow the stage.

:func:`fetch_release` resolves the stage pointer, verifies the manifest against it and pulls the
release (every file checked against the manifest, :func:`mars.release.promote.pull`) into
``<cache>/<name>/<version>``, reusing a complete earlier pull. :class:`ReleaseWatch` polls the pointer;
when it moves, the new release is pulled and loaded *beside* the old one, new requests switch to it
and the old engine drains (:meth:`mars.serving.app.Serving.swap`). A release that fails to pull or load
leaves the old one serving; the error is logged and that version is not retried until the pointer
moves again.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from mars.release.promote import MANIFEST_FILE, pull, resolve_release

log = logging.getLogger("mars.serve")


def fetch_release(store, name: str, stage: str, cache: str | Path) -> tuple[Path, dict]:
    """``(directory, manifest)`` of the release ``stage`` points to, pulled verified into ``cache``."""
    manifest, _ = resolve_release(store, name, stage)
    dest = Path(cache) / name / manifest["version"]
    if not (dest / MANIFEST_FILE).is_file():
        pull(store, name, dest, stage=None, version=manifest["version"], log=log.info)
    return dest, manifest


class ReleaseWatch:
    def __init__(self, store, name: str, stage: str, cache: str | Path, serving, start_engine: Callable[[Path], object],
                 interval: float = 30.0):
        self.store, self.name, self.stage, self.cache = store, name, stage, Path(cache)
        self.serving, self.start_engine, self.interval = serving, start_engine, interval
        self.failed: set[str] = set()
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """One poll: True when a new release now serves new requests."""
        manifest, _ = resolve_release(self.store, self.name, self.stage)
        version = manifest["version"]
        current = self.serving.current.model.version
        if version == current or version in self.failed:
            return False
        try:
            directory, _ = fetch_release(self.store, self.name, self.stage, self.cache)
            engine = self.start_engine(directory)
        except Exception as err:  # any failure keeps the old release serving
            self.failed.add(version)
            self.last_error = f"{self.name} {version}: {type(err).__name__}: {err}"
            self.serving.metrics.swap_failures.inc()
            log.error("release %s %s did not load, %s keeps serving: %s", self.name, version, current, self.last_error)
            return False
        self.serving.swap(engine)
        log.info("now serving %s %s (was %s)", self.name, version, current)
        return True

    def start(self) -> None:
        def loop():
            while not self._stop.wait(self.interval):
                try:
                    self.check()
                except Exception as err:  # an unreachable store now is no reason to stop serving
                    log.warning("could not check %s at stage %s: %s", self.name, self.stage, err)

        self._thread = threading.Thread(target=loop, name="mars-release-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
