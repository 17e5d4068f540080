"""``mars generate``: decode prompts with a checkpoint; flags win over params ``decode``."""

from __future__ import annotations

import argparse
import json
import sys

from mars.cli.options import add_model_arguments, add_params_arguments, decode_config, load_model_from_args


def main(argv: list[str], verb: str = "generate") -> int:
    from mars.decoding.generate import MODES, generate

    parser = argparse.ArgumentParser(
        prog=f"mars {verb}", description="Decode prompts with a MARS checkpoint (defaults: params.yaml decode:).")
    parser.add_argument("--model", required=True, help="checkpoint directory (or 'smollm2', or a hub id)")
    parser.add_argument("--block-size", type=int, help="B (default: decode.block_size, else config.mars.block_size)")
    parser.add_argument("--tau", type=float, help="accept threshold in (0, 1]; 1.0 = greedy AR")
    parser.add_argument("--mode", choices=MODES, help="tau (the accept rule) | lossless (greedy output, mask slots "
                                                      "as verified drafts); default: decode.mode")
    parser.add_argument("--tree", help="lossless mode: draft tree shape (top2/16, (3,2,1)/10, +masks:K; off: the chain "
                                       "of top-1 drafts; auto: per step what yields most tokens/s here); default: "
                                       "decode.tree")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--b-cache", type=int, help="block-level cache of this many positions (default: token level)")
    parser.add_argument("--no-cache", action="store_true", help="run the no-cache reference loop")
    parser.add_argument("--allow-untrained", action="store_true", help="decode below tau = 1 a model never trained "
                                                                         "with masks (confidently wrong there)")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text ('-' reads one prompt per line "
                                                                      "from stdin)")
    add_model_arguments(parser)
    add_params_arguments(parser)
    args = parser.parse_args(argv)
    cfg = decode_config(args)
    prompts = [line for p in args.prompts for line in (sys.stdin.read().splitlines() if p == "-" else [p])]
    model, tokenizer = load_model_from_args(args.model, args)
    pick = lambda value, default: default if value is None else value  # noqa: E731
    results = generate(
        model, tokenizer, prompts,
        block_size=pick(args.block_size, cfg.block_size), tau=pick(args.tau, cfg.tau), mode=pick(args.mode, cfg.mode),
        max_new_tokens=pick(args.max_new_tokens, cfg.max_new_tokens),
        batch_size=pick(args.batch_size, cfg.batch_size), b_cache=pick(args.b_cache, cfg.b_cache),
        use_cache=cfg.use_cache and not args.no_cache, progress=not args.json and len(prompts) > 1,
        allow_untrained=args.allow_untrained, tree=pick(args.tree, cfg.tree),
    )
    for prompt, result in zip(prompts, results):
        if args.json:
            print(json.dumps({"prompt": prompt, **result.to_dict()}), flush=True)
        else:
            print(result.text, flush=True)
            print(f"[{len(result.token_ids)} tokens, {result.forwards} forwards, "
                  f"{result.tokens_per_forward:.2f} tokens/forward, {result.finish_reason}]", file=sys.stderr)
    total = results.summary()
    print(f"total: {total['tokens']} tokens in {total['forwards']} forwards ({total['tokens_per_forward']:.2f} "
          f"tokens/forward), {total['model_calls']} model calls, {total['seconds']:.2f} s", file=sys.stderr)
    return 0
