"""Doubled words that tau < 1 adds (issue #44): outputs at a lower tau with an immediately repeated word ("The
capital of of France") that the tau = 1 output of the same prompt does not have. Accepting a mask slot's token
on confidence can repeat the token before it; greedy decoding rarely does.

From an evaluation's outputs (the ``chat`` benchmark of a study; no decoding):

    python benchmarks/doubled_words.py --eval build/study-smollm2/eval --checkpoint mars --benchmark chat --tau 0.9

or decoding prompts here, tokens/forward of both printed beside the count:

    python benchmarks/doubled_words.py --model checkpoints/mars/final --prompts benchmarks/prompts/user_oriented.jsonl --n 50
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mars.evaluation.benchmarks.chat import added


def from_eval(folder: Path, checkpoint: str, benchmark: str, tau: float) -> tuple[int, list[tuple[str, list[str]]]]:
    """The items of ``checkpoint`` x ``benchmark`` decoded at ``tau`` and at 1.0, and those with added doubled words."""
    def rows(point: str) -> dict[str, str]:
        path = folder / checkpoint / benchmark / f"{point}.jsonl"
        if not path.is_file():
            raise SystemExit(f"doubled_words: {path}: no such file (was {checkpoint} evaluated on {benchmark} there?)")
        return {r["id"]: r["text"] for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}
    greedy, lossy = rows("tau=1.0"), rows(f"tau={float(tau)}")
    hits = [(i, sorted(added(greedy[i], text))) for i, text in lossy.items() if i in greedy]
    return len(hits), [(i, words) for i, words in hits if words]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", type=Path, help="an evaluation's output folder (mars evaluate --out)")
    parser.add_argument("--checkpoint", default="mars", help="with --eval: the checkpoint's outputs")
    parser.add_argument("--benchmark", default="chat", help="with --eval: the benchmark's outputs")
    parser.add_argument("--model", help="MARS checkpoint directory (decode here)")
    parser.add_argument("--prompts", default="benchmarks/prompts/user_oriented.jsonl", help="JSONL of {'prompt': text}")
    parser.add_argument("--n", type=int, default=50, help="with --model: the first N prompts (--eval: every item)")
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if (args.eval is None) == (args.model is None):
        parser.error("give --eval (an evaluation's outputs) or --model (decode here)")
    if args.eval is not None:
        n, hits = from_eval(args.eval, args.checkpoint, args.benchmark, args.tau)
        print(f"{args.eval}: {args.checkpoint} on {args.benchmark}, {n} items decoded at tau = 1 and {args.tau:g}")
    else:
        from mars.core.models import load_model
        from mars.decoding.generate import generate

        rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.n]
        texts = [r["prompt"] for r in rows]
        model, tokenizer = load_model(args.model, dtype=args.dtype)
        kwargs = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        greedy = generate(model, tokenizer, texts, tau=1.0, **kwargs)
        lossy = generate(model, tokenizer, texts, tau=args.tau, **kwargs)
        n = len(texts)
        hits = [(r.get("id", i), sorted(added(g.text, lo.text))) for i, (r, g, lo) in enumerate(zip(rows, greedy, lossy))]
        hits = [(i, words) for i, words in hits if words]
        print(f"{args.model}: {n} prompts of {args.prompts}, at most {args.max_new_tokens} tokens, {args.dtype}")
        print(f"tau = 1: {greedy.tokens_per_forward:.2f} tokens/forward; tau = {args.tau:g}: "
              f"{lossy.tokens_per_forward:.2f} tokens/forward")
    print(f"outputs at tau = {args.tau:g} with a doubled word the tau = 1 output lacks: {len(hits)} of {n}")
    for i, words in hits:
        print(f"  {i}: {', '.join(words)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
