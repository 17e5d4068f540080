"""``mars bench-decode``: flags and params ``decode`` -> :func:`mars.decoding.speed.run`, printed as a table."""

from __future__ import annotations

import argparse

from mars.cli.options import add_model_arguments, add_params_arguments, decode_config, load_model_from_args


def _numbers(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str], verb: str = "bench-decode") -> int:
    import torch

    from mars.core.atomic import write_json
    from mars.decoding import speed
    from mars.decoding.tree_shape import AUTO, TreeShape

    parser = argparse.ArgumentParser(prog=f"mars {verb}", description=speed.__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/mars/final", help="checkpoint dir (default: %(default)s)")
    parser.add_argument("--data", help="prepared data dir: benchmark on its held-out prompts")
    parser.add_argument("--prompts", help="prompt file: one prompt per line, or .jsonl with a 'prompt' field")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--taus", default="1.0,0.95,0.9,0.8")
    parser.add_argument("--lossless", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the lossless mode: greedy output, mask slots as verified drafts (default: on)")
    parser.add_argument("--trees", nargs="*", default=["top2/16"], metavar="SHAPE",
                        help="also time the lossless mode with these draft trees (top2/16, '(3,2,1)/10', "
                             "top4/16+masks:4, auto: chosen per step by measured tokens/s; none: off; "
                             "default: %(default)s)")
    parser.add_argument("--prompt-lookup", type=int, default=10, metavar="N",
                        help="also time HF prompt-lookup decoding at batch 1 (prompt_lookup_num_tokens=N; 0: off; "
                             "default: %(default)s)")
    parser.add_argument("--block-size", type=int, help="default: decode.block_size, else config.mars.block_size")
    parser.add_argument("--max-new-tokens", type=int, help="default: decode.max_new_tokens")
    parser.add_argument("--b-cache", type=int, help="default: decode.b_cache")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--json", help="also write the report as JSON to this file")
    add_model_arguments(parser)
    add_params_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = decode_config(args)
    model, tokenizer = load_model_from_args(args.model, args)
    prompts = speed.load_prompts(tokenizer, args.num_prompts, data_dir=args.data, prompts_file=args.prompts)
    report = speed.run(model, tokenizer, prompts, batch_sizes=[int(x) for x in _numbers(args.batch_sizes)],
                       taus=_numbers(args.taus), block_size=args.block_size or cfg.block_size,
                       max_new_tokens=args.max_new_tokens or cfg.max_new_tokens,
                       b_cache=cfg.b_cache if args.b_cache is None else args.b_cache, repeats=args.repeats,
                       lossless=args.lossless, prompt_lookup=args.prompt_lookup or None,
                       trees=tuple(AUTO if t == AUTO else TreeShape.parse(t, "--trees") for t in args.trees))
    report.update(model=str(args.model), device=str(model.device), threads=torch.get_num_threads())
    print(speed.format_table(report))
    if args.json:
        write_json(args.json, report)
    return 0
