"""``mars serve``: an OpenAI-compatible service of a release (``--release NAME --stage prod``) or a checkpoint
(``--model DIR``) -> :mod:`mars.serving`. Defaults: :class:`mars.serving.config.ServeConfig`."""

from __future__ import annotations

import argparse
import logging
import os

from mars.cli.options import add_params_arguments, add_store_argument, params_from_args, store_config
from mars.errors import MarsError


def _floor(text: str) -> float | str:
    if text == "release":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tau in (0, 1] or 'release'") from None


def _widths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of widths") from None


def _parser(verb: str):
    from mars.serving.config import ServeConfig

    d = ServeConfig()
    parser = argparse.ArgumentParser(
        prog=f"mars {verb}", description="Serve a MARS release or checkpoint over an OpenAI-compatible HTTP API "
        "(continuous batching; a tau or mode per request, and for the rest the setting with the most measured "
        "tokens/s).")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--release", metavar="NAME", help="serve the release a stage of the store points to "
                                                         "(pulled and verified into --cache)")
    which.add_argument("--model", metavar="DIR", help="serve a checkpoint directory instead")
    parser.add_argument("--stage", help="stage pointer to serve and follow (default: store.stage)")
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "mars", "releases"),
                        help="where pulled releases are kept (default: ~/.cache/mars/releases)")
    parser.add_argument("--name", help="--model: the model id requests name (default: the directory's name)")
    parser.add_argument("--tau", type=float, help="--model: the default tau (default: decode.tau's default, 0.9); "
                                                   "--tau-policy fixed serves it")
    policy = parser.add_argument_group("tau policy", "the setting of requests that name no tau or mode")
    p = d.policy
    policy.add_argument("--tau-policy", choices=("fixed", "adaptive"), default=p.kind,
                        help="adaptive: the setting with the most measured tokens/s among tau = 1 and the lossless "
                             "mode (greedy output), and the --tau-floor where one is named; fixed: the default tau "
                             f"(default: {p.kind})")
    policy.add_argument("--tau-floor", type=_floor, default=p.tau_floor, metavar="TAU|release",
                        help="adaptive: also consider this lossy tau < 1 ('release': the floor the release's gate "
                             "accepted); default: none, the output stays greedy")
    policy.add_argument("--lossless-widths", type=_widths, default=p.lossless_widths, metavar="W[,W...]",
                        help="adaptive: lossless widths below the checkpoint's block size to consider, '' for none "
                             f"(default: {','.join(map(str, p.lossless_widths))})")
    policy.add_argument("--trees", nargs="*", default=list(p.trees), metavar="SHAPE",
                        help="adaptive: draft trees (lossless at the block size) to consider, e.g. top2/16 top2/6, or "
                             "auto (chain top2/16+masks:4 top4/8 top4/16): measured like every candidate, so the "
                             "budget that pays at each batch size is chosen (default: none)")
    policy.add_argument("--decide-every", type=int, default=p.decide_every,
                        help=f"adaptive: steps between decisions, and an exploration's length (default: {p.decide_every})")
    policy.add_argument("--switch-margin", type=float, default=p.switch_margin,
                        help="adaptive: the predicted gain a setting needs to replace the one in use "
                             f"(default: {p.switch_margin:g})")
    policy.add_argument("--explore-every", type=int, default=p.explore_every,
                        help="adaptive: steps between re-measuring the setting measured longest ago "
                             f"(default: {p.explore_every})")
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
    parser.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                        help=f"a larger request body gets 413 (default: {d.max_request_bytes}, 1 MiB)")
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
    if args.release and (args.tau is not None or args.name):
        parser.error("--name and --tau go with --model (a release brings its name and tau)")
    from mars.serving.config import ServeConfig
    from mars.serving.server import build, serve
    from mars.decoding.tau_policy import PolicyConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        policy = PolicyConfig(kind=args.tau_policy, tau_floor=args.tau_floor, lossless_widths=args.lossless_widths,
                              trees=tuple(args.trees),
                              decide_every=args.decide_every, switch_margin=args.switch_margin,
                              explore_every=args.explore_every)
    except MarsError as err:
        parser.error(str(err))
    cfg = ServeConfig(host=args.host, port=args.port, backend=args.backend, device=args.device, dtype=args.dtype,
                      threads=args.threads, max_batch=args.max_batch, max_queue=args.max_queue, policy=policy,
                      prefix_cache=args.prefix_cache,
                      max_tokens=args.max_tokens, default_max_tokens=args.default_max_tokens,
                      max_request_bytes=args.max_request_bytes,
                      poll_seconds=args.poll_seconds, drain_seconds=args.drain_seconds)
    api_key = args.api_key or os.environ.get("MARS_API_KEY") or None
    if args.release:
        from mars.release.store import open_store

        store_cfg = store_config(params_from_args(args), args.store)
        built = build(cfg, release=args.release, stage=args.stage or store_cfg.stage, store=open_store(store_cfg),
                      cache=args.cache, api_key=api_key)
    else:
        built = build(cfg, model_dir=args.model, name=args.name, tau=args.tau, api_key=api_key)
    serve(built, cfg, log_level=args.log_level)
    return 0
