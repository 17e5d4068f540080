"""Run the app on uvicorn, with a graceful SIGTERM: stop taking requests (503), finish the taken ones,
then exit.

:func:`build` assembles what ``mars serve`` runs (model, engine, tau policy, metrics, release watch)
from a :class:`~mars.serving.config.ServeConfig`; :class:`MarsServer` is uvicorn's server with the
drain on the first SIGTERM/SIGINT (a second one exits at once).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from mars.serving.app import Limits, Serving, create_app
from mars.serving.config import ServeConfig
from mars.serving.engine import Engine
from mars.serving.metrics import ServerMetrics
from mars.serving.release_watch import ReleaseWatch, fetch_release
from mars.serving.served_model import ServedModel, load_checkpoint, load_release
from mars.decoding.tau_policy import make_policy

log = logging.getLogger("mars.serve")


def start_engine(model: ServedModel, cfg: ServeConfig, metrics: ServerMetrics) -> Engine:
    policy = make_policy(cfg.policy, block_size=model.block_size or 1, default_tau=model.default_tau,
                         release_floor=model.tau_floor)
    return Engine(model, policy, max_batch=cfg.max_batch, max_queue=cfg.max_queue, metrics=metrics,
                  prefix=model.prompt_head if cfg.prefix_cache else ())


@dataclass
class Built:
    serving: Serving
    watch: ReleaseWatch | None


def build(cfg: ServeConfig, *, release: str | None = None, stage: str = "prod", store=None,
          cache: str | Path | None = None, model_dir: str | Path | None = None, name: str | None = None,
          tau: float | None = None, api_key: str | None = None) -> Built:
    """The serving state for a release at a stage of ``store`` (pulled into ``cache``) or a checkpoint."""
    if cfg.threads is not None:
        import torch

        torch.set_num_threads(cfg.threads)
    metrics = ServerMetrics()
    load = dict(backend=cfg.backend, device=cfg.device, dtype=cfg.dtype)
    if release is not None:
        directory, _ = fetch_release(store, release, stage, cache)
        model = load_release(directory, **load)
    else:
        from mars.decoding.generate import DecodeConfig

        model_dir = Path(model_dir)
        model = load_checkpoint(model_dir, name=name or model_dir.name, default_tau=DecodeConfig.tau if tau is None
                                else tau, export_dir=model_dir, **load)
    log.info("serving %s", model.describe())
    serving = Serving(start_engine(model, cfg, metrics), metrics, api_key=api_key,
                      limits=Limits(max_tokens=cfg.max_tokens, default_max_tokens=cfg.default_max_tokens,
                                    max_request_bytes=cfg.max_request_bytes))
    watch = None
    if release is not None and cfg.poll_seconds > 0:
        watch = ReleaseWatch(store, release, stage, cache, serving,
                             lambda d: start_engine(load_release(d, **load), cfg, metrics), cfg.poll_seconds)
    return Built(serving, watch)


class MarsServer(uvicorn.Server):
    """uvicorn, draining on the first exit signal: 503 for new requests, taken ones finish."""

    def __init__(self, config: uvicorn.Config, serving: Serving, drain_seconds: float):
        super().__init__(config)
        self.serving, self.drain_seconds = serving, drain_seconds

    def handle_exit(self, sig, frame) -> None:
        if self.serving.draining:  # a second signal: now
            self.should_exit = self.force_exit = True
            return

        def drain():
            if self.serving.drain(timeout=self.drain_seconds):
                log.info("drained")
            else:
                log.warning("drain timed out after %s s: the unfinished requests were cancelled", self.drain_seconds)
            self.should_exit = True

        log.info("shutting down: finishing %d running and %d waiting requests", self.serving.running(),
                 self.serving.queue_depth())
        self.serving.draining = True
        threading.Thread(target=drain, name="mars-drain", daemon=True).start()


def make_server(built: Built, cfg: ServeConfig, log_level: str = "info") -> MarsServer:
    config = uvicorn.Config(create_app(built.serving), host=cfg.host, port=cfg.port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, int(cfg.drain_seconds)), lifespan="off")
    return MarsServer(config, built.serving, cfg.drain_seconds)


def serve(built: Built, cfg: ServeConfig, log_level: str = "info") -> None:
    """Run until SIGTERM/SIGINT (drained) ends it."""
    server = make_server(built, cfg, log_level)
    if built.watch is not None:
        built.watch.start()
    try:
        server.run()
    finally:
        if built.watch is not None:
            built.watch.stop()
