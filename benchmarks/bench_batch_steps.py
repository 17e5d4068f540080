"""Where a full batch's time goes, per fixed setting, with no server: decoding steps against steps that take prompts.

A closed loop on :class:`mars.decoding.loop.CachedBatch` in this process (no HTTP, no event loop beside
the stepping thread): ``--streams`` rows stay busy, a finished row's place goes to the next held-out
prompt at the next step, as the server's engine does under a full queue; greedy, ``--max-tokens`` a
request. For each setting (tau = 1, a tau < 1, the lossless mode at B and at narrower block sizes), side
by side in one run and ``--repeats`` times in turn, it prints generated tokens/s and, split by steps that
took prompts and steps that only decoded, their count and mean time. The settings' ratio to tau = 1 at the
end is over the summed rounds.

    python benchmarks/bench_batch_steps.py --model build/study-smollm2/checkpoints/mars/final \
        --data build/study-smollm2/data/prepared --dtype bfloat16 --threads 2 --streams 16 --requests 96
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import held_out  # noqa: E402  (the same requests as the served benchmark)

from mars.decoding.loop import CachedBatch, DecodeRow  # noqa: E402
from mars.serving.served_model import load_checkpoint  # noqa: E402
from mars.serving.tau_policy import arm_block_size, is_lossless  # noqa: E402


def setting_row(prompt: list[int], max_tokens: int, setting: str, block_size: int) -> DecodeRow:
    """``1`` (tau = 1), a tau such as ``0.9``, or an arm of the lossless mode as the tau policy names it
    (``lossless`` at B, ``lossless:W``)."""
    if is_lossless(setting):
        return DecodeRow(prompt, max_tokens, 1.0, lossless=True, block_size=arm_block_size(setting, block_size),
                         stream=True)
    return DecodeRow(prompt, max_tokens, float(setting), stream=True)


def closed_loop(model, items: list[dict], setting: str, streams: int, requests: int, max_tokens: int) -> dict:
    batch = CachedBatch(model.new_backend(), block_size=model.block_size, stop_ids=torch.tensor(model.stop_ids),
                        mask_id=model.mask_id, prefix=model.prompt_head)
    split = {"prompt": [0, 0.0], "decode": [0, 0.0]}  # steps, seconds
    sent = done = live = tokens = 0
    started = time.perf_counter()
    while done < requests:
        joining = [setting_row(items[(sent + i) % len(items)]["prompt"], max_tokens, setting, model.block_size)
                   for i in range(min(streams - live, requests - sent))]
        sent, live = sent + len(joining), live + len(joining)
        step_started = time.perf_counter()
        batch.add(joining)
        updates = batch.step()
        cell = split["prompt" if joining else "decode"]
        cell[0], cell[1] = cell[0] + 1, cell[1] + time.perf_counter() - step_started
        tokens += sum(len(u.new_tokens) for u in updates)
        finished = sum(u.done for u in updates)
        done, live = done + finished, live - finished
    return {"seconds": time.perf_counter() - started, "tokens": tokens, **split}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="MARS checkpoint directory")
    parser.add_argument("--data", required=True, help="prepared data directory (its held-out prompts)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--streams", type=int, default=16, help="rows kept busy")
    parser.add_argument("--requests", type=int, default=96, help="requests a round")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--settings", default="1,0.9,lossless,lossless:2",
                        help="comma-separated: 1, a tau < 1, lossless, lossless:W")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if args.streams < 1 or args.requests < 1 or args.repeats < 1:
        parser.error("--streams, --requests and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.model, name="bench", dtype=args.dtype)
    if not model.block_size:
        parser.error(f"--model {args.model}: not a MARS checkpoint")
    items = held_out(args.data, 0)
    settings = args.settings.split(",")
    totals = {s: [0.0, 0] for s in settings}
    print(f"model {args.model}, {args.dtype}, {args.threads} threads, {args.streams} streams x {args.requests} requests, "
          f"max_tokens {args.max_tokens}")
    for round_ in range(args.repeats):
        for setting in settings:
            run = closed_loop(model, items, setting, args.streams, args.requests, args.max_tokens)
            totals[setting][0] += run["seconds"]
            totals[setting][1] += run["tokens"]
            (p_steps, p_sec), (d_steps, d_sec) = run["prompt"], run["decode"]
            print(f"round {round_ + 1} {setting:>11}: {run['tokens'] / run['seconds']:7.1f} tok/s; steps taking prompts "
                  f"{p_steps} ({p_sec:.2f} s, {1000 * p_sec / max(p_steps, 1):.1f} ms each), decoding only {d_steps} "
                  f"({d_sec:.2f} s, {1000 * d_sec / max(d_steps, 1):.1f} ms each)", flush=True)
    base = totals[settings[0]][1] / totals[settings[0]][0]
    print(" / ".join(f"{s} {t / sec / base:.3f}x" for s, (sec, t) in totals.items()) + f" (against {settings[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
