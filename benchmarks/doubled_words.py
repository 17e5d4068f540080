"""Doubled words that tau < 1 adds (issue #44): decode everyday prompts at tau = 1 and at a lower tau, and
count the outputs with an immediately repeated word ("The capital of of France") that the tau = 1 output
of the same prompt does not have. Accepting a mask slot's token on confidence can repeat the token before
it; greedy decoding rarely does. Tokens/forward of both are printed beside the count.

    python benchmarks/doubled_words.py --model checkpoints/mars/final --prompts benchmarks/prompts/user_oriented.jsonl --n 50
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

WORD = re.compile(r"[A-Za-z']+")


def doubled(text: str) -> set[str]:
    """Words that follow themselves in ``text`` (case-insensitive; across spaces and line breaks, not
    across other punctuation: "no, no" is not a doubled word, "of of" is)."""
    out = set()
    tokens = re.findall(r"[A-Za-z']+|[^\sA-Za-z']", text)
    for a, b in zip(tokens, tokens[1:]):
        if WORD.fullmatch(a) and a.lower() == b.lower():
            out.add(a.lower())
    return out


def added(greedy: str, lossy: str) -> set[str]:
    """The doubled words of ``lossy`` that ``greedy`` does not have."""
    return doubled(lossy) - doubled(greedy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="MARS checkpoint directory")
    parser.add_argument("--prompts", default="benchmarks/prompts/user_oriented.jsonl", help="JSONL of {'prompt': text}")
    parser.add_argument("--n", type=int, default=50, help="the first N prompts")
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    from mars.core.models import load_model
    from mars.decoding.generate import generate

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.n]
    texts = [r["prompt"] for r in rows]
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    kwargs = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    greedy = generate(model, tokenizer, texts, tau=1.0, **kwargs)
    lossy = generate(model, tokenizer, texts, tau=args.tau, **kwargs)
    hits = [(r.get("id", i), sorted(added(g.text, l.text))) for i, (r, g, l) in enumerate(zip(rows, greedy, lossy))]
    hits = [(i, words) for i, words in hits if words]
    print(f"{args.model}: {len(texts)} prompts of {args.prompts}, at most {args.max_new_tokens} tokens, {args.dtype}")
    print(f"tau = 1: {greedy.tokens_per_forward:.2f} tokens/forward; tau = {args.tau:g}: "
          f"{lossy.tokens_per_forward:.2f} tokens/forward")
    print(f"outputs at tau = {args.tau:g} with a doubled word the tau = 1 output lacks: {len(hits)} of {len(texts)}")
    for i, words in hits:
        print(f"  {i}: {', '.join(words)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
