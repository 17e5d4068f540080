"""``mars serve``: an OpenAI-compatible service of a release (``--release NAME --stage prod``) or a checkpoint
(``--model DIR``) -> :mod:`mars.serving`. Defaults: :class:`mars.serving.config.ServeConfig`."""

from __future__ import annotations

import argparse
import logging
import os

from mars.cli.options import add_params_arguments, add_store_argument, params_from_args, store_config


def _parser(verb: str):
    from mars.serving.config import ServeConfig

    d = ServeConfig()
    parser = argparse.ArgumentParser(
        prog=f"mars {verb}", description="Serve a MARS release or checkpoint over an OpenAI-compatible HTTP API "
        "(continuous batching; tau per request and, with --tau-policy adaptive, under load).")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--release", metavar="NAME", help="serve the release a stage of the store points to "
                                                         "(pulled and verified into --cache)")
    which.add_argument("--model", metavar="DIR", help="serve a checkpoint directory instead")
    parser.add_argument("--stage", help="stage pointer to serve and follow (default: store.stage)")
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "mars", "releases"),
                        help="where pulled releases are kept (default: ~/.cache/mars/releases)")
    parser.add_argument("--name", help="--model: the model id requests name (default: the directory's name)")
    parser.add_argument("--tau", type=float, help="--model: the default tau (default: decode.tau's default, 0.9)")
    parser.add_argument("--tau-floor", type=float, help="--model: the adaptive policy's lowest tau (default: --tau)")
    parser.add_argument("--tau-policy", choices=("fixed", "adaptive"), default=d.tau_policy,
                        help="tau of requests that name none: the release's default, or the goodput-driven choice "
                             f"between the gate's floor and 1.0 (default: {d.tau_policy})")
    parser.add_argument("--adaptive-lossless", action=argparse.BooleanOptionalAction, default=d.adaptive_lossless,
                        help="the adaptive policy may decode greedy requests in the lossless mode (tau = 1.0's output, "
                             "drafts verified), at the checkpoint's block size or at 2, where that gives more "
                             "tokens/s (default: on)")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=d.prefix_cache,
                        help="compute the chat template's head (its default system turn and the user header, which "
                             "every chat prompt starts with) once and copy it into each joining request instead of "
                             "recomputing it (torch backend; default: on)")
    parser.add_argument("--backend", choices=("torch", "onnx"), default=d.backend,
                        help=f"PyTorch decoder or the release's ONNX export (default: {d.backend})")
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--dtype", default=d.dtype, help=f"float32 | bfloat16 | auto (default: {d.dtype})")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (default: every core)")
    parser.add_argument("--host", default=d.host, help=f"bind address (default: {d.host}; 0.0.0.0 in a container)")
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--max-batch", type=int, default=d.max_batch, help=f"rows decoding at once (default: "
                                                                          f"{d.max_batch})")
    parser.add_argument("--max-queue", type=int, default=d.max_queue,
                        help=f"requests waiting for a row; more get 429 (default: {d.max_queue})")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="the most a request may ask for")
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    parser.add_argument("--poll-seconds", type=float, default=d.poll_seconds,
                        help=f"--release: how often to check the stage pointer for a new release (0: never; "
                             f"default: {d.poll_seconds:g})")
    parser.add_argument("--drain-seconds", type=float, default=d.drain_seconds,
                        help="on SIGTERM, how long to finish taken requests")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $MARS_API_KEY; none: open)")
    parser.add_argument("--log-level", default="info")
    add_params_arguments(parser)
    add_store_argument(parser)
    return parser


def main(argv: list[str], verb: str = "serve") -> int:
    parser = _parser(verb)
    args = parser.parse_args(argv)
    if args.release and (args.tau is not None or args.tau_floor is not None or args.name):
        parser.error("--name, --tau and --tau-floor go with --model (a release brings its name, tau and floor)")
    from mars.serving.config import ServeConfig
    from mars.serving.server import build, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = ServeConfig(host=args.host, port=args.port, backend=args.backend, device=args.device, dtype=args.dtype,
                      threads=args.threads,
                      max_batch=args.max_batch, max_queue=args.max_queue, tau_policy=args.tau_policy,
                      adaptive_lossless=args.adaptive_lossless, prefix_cache=args.prefix_cache,
                      max_tokens=args.max_tokens, default_max_tokens=args.default_max_tokens,
                      poll_seconds=args.poll_seconds, drain_seconds=args.drain_seconds)
    api_key = args.api_key or os.environ.get("MARS_API_KEY") or None
    if args.release:
        from mars.release.store import open_store

        store_cfg = store_config(params_from_args(args), args.store)
        built = build(cfg, release=args.release, stage=args.stage or store_cfg.stage, store=open_store(store_cfg),
                      cache=args.cache, api_key=api_key)
    else:
        built = build(cfg, model_dir=args.model, name=args.name, tau=args.tau, tau_floor=args.tau_floor,
                      api_key=api_key)
    serve(built, cfg, log_level=args.log_level)
    return 0
