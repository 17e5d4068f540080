"""Teacher-forced ceiling of tree-verified lossless decoding (issue #43): the tokens per forward each draft
tree shape would give on a MARS checkpoint, from one forward per prompt instead of a decode per shape.

Each prompt is decoded greedily (tau = 1) for its reference continuation. One forward then runs the
prompt + continuation with a group of B - 1 masks after every position, each group seeing the tokens up
to its position: the distributions every mask slot would offer wherever a decode could stand. Printed per
prompt set: where the greedy token ranks in each slot's distribution, and, per tree shape, a decode
simulated on those distributions with :mod:`mars.decoding.tree`'s own ``build_tree`` and ``verify``:
tokens per forward, and the window entries a forward carries (the root, the nodes, the masks), which is
what a wider tree costs. ``--check N`` decodes the first N prompts of each set with the no-cache tree
reference for every shape and compares the forwards (equal in fp32 but for near-ties).

    python benchmarks/tree_ceiling.py --model checkpoints/mars/final
    python benchmarks/tree_ceiling.py --model checkpoints/mars/final --data data/prepared --n 32 --check 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import held_out  # noqa: E402  (the held-out prompts the served benchmark draws)

from mars.core.checkpoint_info import CheckpointInfo  # noqa: E402
from mars.core.models import load_model  # noqa: E402
from mars.decoding.generate import context_length_of, encode_prompts, generate, stop_token_ids_of  # noqa: E402
from mars.decoding.tree import CHAIN, ROOT_ONLY, TreeShape, build_tree, verify  # noqa: E402
from mars.decoding.torch_backend import attention_mask  # noqa: E402
from mars.decoding.tree_reference import decode_tree_no_cache  # noqa: E402

CHAT = Path(__file__).resolve().parent / "prompts" / "chat.jsonl"
SHAPES = {  # label: what the row measures
    "chain+masks:top": "chain today",
    "chain": "chain, masks after every node",
    "top2+masks:top": "top-2 tree, masks after the top path",
    "top2": "top-2 tree",
    "top3": "top-3 tree",
    "top4": "top-4 tree",
    "top4/8": "top-4, 8 nodes",
    "top4/16": "top-4, 16 nodes",
    "top4/32": "top-4, 32 nodes",
    "top4/16+masks:4": "top-4, 16 nodes, masks after 4",
    "top2/8": "top-2, 8 nodes",
    "top2/16": "top-2, 16 nodes",
    "top2/16+masks:4": "top-2, 16 nodes, masks after 4",
}
RANKS = 4  # ranks 0..3 are counted apart, the rest together


@dataclass
class Forced:
    """One prompt teacher-forced: its tokens, and per position c the top candidates of the group of
    masks after c (``[L, B-1, K]`` log-probabilities and ids, c = P-1 .. P+L-2) and the greedy token's rank."""

    ids: list[int]
    prompt_len: int
    room: int  # the decode's token budget (the continuation ends earlier where it stops)
    logp: torch.Tensor
    top: torch.Tensor
    rank: torch.Tensor  # [L, B-1], -1 where the slot's token lies past the continuation


@torch.inference_mode()
def force(model, prompt: list[int], continuation: list[int], room: int, block_size: int, mask_id: int, keep: int,
          chunk: int = 64) -> Forced:
    """The mask groups after every position of prompt + continuation, ``chunk`` groups a forward."""
    x = prompt + continuation
    p, m, total = len(prompt), block_size - 1, len(x)
    contexts = list(range(p - 1, max(total - 1, p)))  # one group at least: a one-token continuation needs none
    logps, tops, ranks = [], [], []
    for at in range(0, len(contexts), chunk):
        cs = torch.tensor(contexts[at: at + chunk])
        g = len(cs)
        width = total + g * m
        ids = torch.tensor(x + [mask_id] * (g * m))
        j = torch.arange(m)
        positions = torch.cat([torch.arange(total), (cs[:, None] + 1 + j).reshape(-1)])
        allowed = torch.zeros(width, width, dtype=torch.bool)
        allowed[:total, :total] = torch.ones(total, total, dtype=torch.bool).tril()
        owner = cs.repeat_interleave(m)  # the position each group entry follows
        allowed[total:, :total] = torch.arange(total)[None, :] <= owner[:, None]
        allowed[total:, total:] = torch.block_diag(*[torch.ones(m, m, dtype=torch.bool).tril()] * g)
        logits = model(input_ids=ids[None].to(model.device), position_ids=positions[None].to(model.device),
                       attention_mask=attention_mask(model, allowed[None].to(model.device))).logits[0, total:]
        logp = logits.float().log_softmax(-1).cpu().reshape(g, m, -1)
        target = cs[:, None] + 2 + j  # mask j after position c predicts the token at c + 2 + j
        inside = target < total
        gold = torch.tensor(x)[target.clamp(max=total - 1)]
        gold_logp = logp.gather(2, gold[:, :, None])
        ranks.append(torch.where(inside, (logp > gold_logp).sum(-1), -1))
        values, top = logp.topk(keep, dim=-1)
        logps.append(values)
        tops.append(top)
    return Forced(x, p, room, torch.cat(logps), torch.cat(tops), torch.cat(ranks))


def simulate(forced: Forced, shape: TreeShape, block_size: int, stops: set[int], vocab: int) -> tuple[int, int, int]:
    """Decode ``forced``'s continuation with ``shape``'s trees on the forced distributions: (tokens,
    forwards, window entries) — the same steps as :func:`decode_tree_no_cache` but for near-ties."""
    x, p = forced.ids, forced.prompt_len
    r, tree_from, forwards, entries = p - 1, None, 0, 0  # r: the root's index; tree_from: its tree's group
    while r < len(x) - 1:
        room = forced.room - (r - (p - 1))
        depth = min(block_size - 1, room - 1)
        if tree_from is None or depth < 1:
            tree = ROOT_ONLY
        else:
            logp = torch.full((depth, vocab), float("-inf"))
            logp.scatter_(1, forced.top[tree_from, :depth], forced.logp[tree_from, :depth])
            tree = build_tree(logp, shape)
        # teacher forced: the greedy token read at the root, or at a node of depth d on the true path, is
        # the continuation's; verify never reads a node off the accepted path
        greedy = [x[r + 1]] + [x[min(r + 2 + d, len(x) - 1)] for d in tree.depths]
        verdict = verify(tree, greedy, stops, room)
        forwards += 1
        entries += 1 + len(tree) + len(tree.groups) * (block_size - 1)
        r += len(verdict.tokens)
        tree_from = r - 1 - (p - 1) if verdict.node in tree.groups and not verdict.stopped else None
        if verdict.stopped:
            break
    return r - (p - 1), forwards, entries


def prompt_sets(args, tokenizer) -> dict[str, list[list[int]]]:
    sets = {}
    if args.prompts:
        rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        sets[f"{Path(args.prompts).stem} prompts"] = encode_prompts(tokenizer, [r["prompt"] for r in rows[: args.n]])
    if args.data:
        sets["held-out prompts"] = [r["prompt"] for r in held_out(args.data, args.n)]
    return sets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="MARS checkpoint directory")
    parser.add_argument("--prompts", default=str(CHAT), help="JSONL of {'prompt': text} ('' to skip)")
    parser.add_argument("--data", help="prepared data directory: its held-out split's prompts, reported apart")
    parser.add_argument("--n", type=int, default=32, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, help="B (default: the checkpoint's)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="tree labels (TreeShape.parse)")
    parser.add_argument("--check", type=int, default=0, help="decode this many prompts per set with the tree reference")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    info = CheckpointInfo.from_config(model.config)
    block_size = args.block_size or info.block_size
    shapes = [TreeShape.parse(s, "--shapes") for s in args.shapes]
    keep = max(max(s.top_k) for s in shapes)
    stops = set(stop_token_ids_of(model, tokenizer))
    vocab = model.config.vocab_size
    context = context_length_of(model.config)
    print(f"{args.model}: B = {block_size}, {args.dtype}, at most {args.max_new_tokens} new tokens a prompt")
    for name, prompts in prompt_sets(args, tokenizer).items():
        results = generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=args.max_new_tokens, batch_size=16)
        rooms = [args.max_new_tokens if context is None else min(args.max_new_tokens, context - len(r.prompt_token_ids))
                 for r in results]
        forced = [force(model, r.prompt_token_ids, r.token_ids, room, block_size, info.mask_token_id, keep)
                  for r, room in zip(results, rooms)]
        total = sum(len(r.token_ids) for r in results)
        print(f"\n{name}: {len(prompts)}, {total} generated tokens")
        ranks = torch.cat([f.rank for f in forced])
        print("greedy token's rank in each mask slot's distribution (share of positions):")
        print("  slot (depth) " + "".join(f"{f'rank {k}':>9}" for k in range(RANKS)) + f"{f'>= {RANKS}':>9}")
        for j in range(block_size - 1):
            col = ranks[:, j][ranks[:, j] >= 0]
            shares = [(col == k).float().mean().item() for k in range(RANKS)] + [(col >= RANKS).float().mean().item()]
            print(f"  {j + 1} ({j}){'':9}" + "".join(f"{s:9.3f}" for s in shares))
        print(f"  {'tree':<18} {'what':<38} {'tokens/forward':>14} {'entries/forward':>16}")
        for shape in shapes:
            runs = [simulate(f, shape, block_size, stops, vocab) for f in forced]
            tokens, forwards, entries = (sum(col) for col in zip(*runs))
            assert tokens == total, (shape, tokens, total)  # the simulation regenerates every continuation
            what = SHAPES.get(shape.label, "")
            print(f"  {shape.label:<18} {what:<38} {tokens / forwards:14.2f} {entries / forwards:16.1f}")
            if args.check:
                some = results[: args.check]
                decoded = decode_tree_no_cache(model, [r.prompt_token_ids for r in some], block_size=block_size,
                                               shape=shape, room=rooms[: len(some)],
                                               stop_ids=sorted(stops), mask_id=info.mask_token_id)
                same = [d == r.token_ids for d, r in zip(decoded.token_ids, some)]
                agree = [f == run[1] for f, run in zip(decoded.forwards, runs)]
                print(f"  {'':<18} check: tokens as greedy {sum(same)}/{len(some)}, forwards as simulated "
                      f"{sum(agree)}/{len(some)}")
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
