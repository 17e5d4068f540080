"""The serving engine in-process, no HTTP: fixed settings against the adaptive tau policy.

`mars serve`'s :class:`~mars.serving.engine.Engine` driven from this process (``bench_serve``'s held-out
requests and levels, greedy, without a server or a load generator on the same cores), one engine per
setting, kept for the whole run, the settings taking turns in each round. Settings: ``1`` (tau = 1.0), a
tau such as ``0.9``, ``lossless``, ``lossless:W`` (every request names it), ``adaptive`` (the default
policy: greedy settings only) and ``adaptive:FLOOR`` (``mars serve --tau-floor FLOOR``). Printed per level:
tokens/s, the steps that took prompts against those that only decoded, where each adaptive policy spent
its steps, what it predicts per candidate, the step costs it measured, and it against the best fixed
setting and tau = 1.0 within each round.

    python benchmarks/bench_engine.py --model checkpoints/mars/final --data data/prepared --threads 1 \\
        --levels 1:24,4:48 --settings 1,lossless,lossless:2,adaptive,adaptive:0.9
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import held_out, load_levels  # noqa: E402  (the same requests and levels as the served benchmark)

from mars.decoding.setting import GREEDY, Setting  # noqa: E402
from mars.errors import MarsError  # noqa: E402
from mars.serving.config import ServeConfig  # noqa: E402
from mars.serving.engine import Engine, Finished, GenerationRequest  # noqa: E402
from mars.serving.served_model import ServedModel, load_checkpoint  # noqa: E402
from mars.serving.server import start_engine  # noqa: E402
from mars.decoding.tau_policy import PolicyConfig  # noqa: E402


class StepLog:
    """The engine's metrics hook (``ServerMetrics.step``'s signature): steps that took prompts apart from
    decoding steps, and the steps by the label of the setting the policy chose."""

    def __init__(self):
        self.split = {"prompt": [0, 0.0], "decode": [0, 0.0]}  # steps, seconds
        self.settings: Counter = Counter()

    def step(self, seconds, decoding, tokens, queue_depth, setting=None, prefix_tokens=0):
        cell = self.split["decode" if decoding else "prompt"]
        cell[0], cell[1] = cell[0] + 1, cell[1] + seconds
        if setting is not None:
            self.settings[setting] += 1

    @property
    def steps(self) -> int:
        return self.split["prompt"][0] + self.split["decode"][0]

    def snapshot(self) -> tuple[dict, Counter]:
        return {k: list(v) for k, v in self.split.items()}, Counter(self.settings)


@dataclasses.dataclass
class Bench:
    name: str  # as --settings names it
    engine: Engine
    log: StepLog
    setting: Setting | None  # what every request names; None: the engine's adaptive policy chooses


def parse_setting(name: str) -> Setting | PolicyConfig:
    """A --settings name as the Setting every request names, or the adaptive policy's config."""
    head, sep, arg = name.partition(":")
    try:
        if head == "adaptive":
            return PolicyConfig(tau_floor=float(arg) if sep else None)
        if head == "lossless":
            return Setting(lossless=True, width=int(arg) if sep else None)
        if not sep:
            return Setting(tau=float(name))
    except MarsError as err:  # a value out of range
        raise SystemExit(f"--settings: {name!r}: {err}") from None
    except ValueError:  # not a number
        pass
    raise SystemExit(f"--settings: {name!r} is not 1, a tau, lossless, lossless:W, adaptive or adaptive:FLOOR")


def start(name: str, model: ServedModel, max_batch: int) -> Bench:
    parsed, log = parse_setting(name), StepLog()
    adaptive = isinstance(parsed, PolicyConfig)
    cfg = ServeConfig(max_batch=max_batch, max_queue=10**6, policy=parsed if adaptive else PolicyConfig("fixed"))
    return Bench(name, start_engine(model, cfg, log), log, None if adaptive else parsed)


async def run_phases(bench: Bench, items: list[dict], phases: list[tuple[int, int]], max_tokens: int) -> int:
    """Each phase's requests over its streams, back to back (the held-out items in turn); returns the tokens
    generated."""
    loop, generated, offset = asyncio.get_running_loop(), 0, 0
    for streams, requests in phases:
        queue = list(range(offset, offset + requests))
        offset += requests

        async def stream():
            nonlocal generated
            while queue:
                request = GenerationRequest(items[queue.pop(0) % len(items)]["prompt"], max_tokens,
                                            setting=bench.setting)
                async for item in bench.engine.submit(request, loop).events():
                    if isinstance(item, Finished):
                        generated += len(item.token_ids)

        await asyncio.gather(*(stream() for _ in range(streams)))
    return generated


def measure(bench: Bench, items: list[dict], phases: list[tuple[int, int]], max_tokens: int) -> dict:
    split, settings = bench.log.snapshot()
    started = time.perf_counter()
    tokens = asyncio.run(run_phases(bench, items, phases, max_tokens))
    seconds = time.perf_counter() - started
    settle(bench)
    after, settings_after = bench.log.snapshot()
    return {"tokens_per_s": tokens / seconds,
            **{kind: [after[kind][i] - split[kind][i] for i in (0, 1)] for kind in split},
            "settings": settings_after - settings}


def settle(bench: Bench) -> None:
    """Until the engine has filed its last step: it hands a step's tokens out before the policy and the
    metrics hook see the step, so the last request can finish before its step is counted."""
    while True:
        seen = bench.log.steps
        time.sleep(0.01)
        if bench.log.steps == seen and not bench.engine.running and not bench.engine.queue_depth:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="MARS checkpoint directory")
    parser.add_argument("--data", required=True, help="prepared data directory (its held-out prompts)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--levels", default="1:24,4:48,16:96", help="the steady levels: STREAMS:REQUESTS")
    parser.add_argument("--bursty", default="", help="a trace of STREAMS:REQUESTS phases run back to back ('': none)")
    parser.add_argument("--settings", default="1,0.9,lossless,lossless:2,adaptive",
                        help="comma-separated: 1, a tau < 1, lossless, lossless:W, adaptive, adaptive:FLOOR")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=16, help="requests at 4 streams per setting before measuring")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: must be >= 1, got {args.repeats}")
    try:
        levels = load_levels(args.levels, args.bursty, 0)
    except ValueError as err:
        parser.error(str(err))
    names = args.settings.split(",")
    if len(set(names)) < len(names):
        parser.error(f"--settings: {args.settings!r} names a setting twice")
    for name in names:  # a typo fails here, not after the model loaded
        parse_setting(name)
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.model, name="bench", dtype=args.dtype)
    if not model.block_size or model.block_size < 2:
        parser.error(f"--model {args.model}: not a MARS checkpoint")
    items = held_out(args.data, 0)
    benches = [start(name, model, args.max_batch) for name in names]
    print(f"model {args.model} (B={model.block_size}), {args.dtype}, {args.threads} threads, max_tokens "
          f"{args.max_tokens}, max_batch {args.max_batch}, {args.repeats} rounds")
    try:
        for bench in benches:
            measure(bench, items, [(4, args.warmup)], args.max_tokens)
        for level, phases in levels:
            rounds: dict[str, list[dict]] = {b.name: [] for b in benches}
            for round_ in range(args.repeats):
                turn = round_ % len(benches)
                for bench in benches[turn:] + benches[:turn]:
                    rounds[bench.name].append(measure(bench, items, phases, args.max_tokens))
            report(level, rounds, benches)
            rows = sorted({min(streams, args.max_batch) for streams, _ in phases})
            for bench in benches:
                if bench.setting is None:
                    report_policy(bench, rows)
    finally:
        for bench in benches:
            bench.engine.close(drain=False, timeout=30)
    return 0


def report(level: str, rounds: dict[str, list[dict]], benches: list[Bench]) -> None:
    print(f"\n{level}")
    for name, runs in rounds.items():
        tps = [r["tokens_per_s"] for r in runs]
        (p_steps, p_sec), (d_steps, d_sec) = ([sum(r[kind][i] for r in runs) for i in (0, 1)]
                                              for kind in ("prompt", "decode"))
        print(f"  {name:>13}: {statistics.median(tps):7.1f} tok/s (rounds {', '.join(f'{t:.0f}' for t in tps)}); "
              f"steps taking prompts {p_steps} ({1000 * p_sec / max(p_steps, 1):.1f} ms each), decoding only "
              f"{d_steps} ({1000 * d_sec / max(d_steps, 1):.1f} ms each)")
        chosen = sum((r["settings"] for r in runs), Counter())
        if chosen:
            total = sum(chosen.values())
            print(f"  {'':>13}  steps by setting: "
                  + ", ".join(f"{s} {n / total:.0%}" for s, n in chosen.most_common()))
    fixed = [b.name for b in benches if b.setting is not None]
    one = next((b.name for b in benches if b.setting == GREEDY), None)
    for name in (b.name for b in benches if b.setting is None and fixed):
        tps = [r["tokens_per_s"] for r in rounds[name]]
        against = {"best fixed": [max(rounds[f][k]["tokens_per_s"] for f in fixed) for k in range(len(tps))]}
        if one is not None:
            against["tau = 1.0"] = [r["tokens_per_s"] for r in rounds[one]]
        for what, base in against.items():
            ratios = [a / b for a, b in zip(tps, base)]
            print(f"  {name} / {what} in each round: {', '.join(f'{x:.3f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.3f}x)")


def report_policy(bench: Bench, rows: list[int]) -> None:
    """What an adaptive engine's policy predicts for each candidate at the level's rows (tokens/s, '-':
    not measured yet) and the step costs it measured."""
    policy, block_size = bench.engine.policy, bench.engine.model.block_size
    snap = policy.snapshot
    for n in rows:
        print(f"  {bench.name} predicts at {n} rows (tok/s): " + ", ".join(
            f"{s.label(block_size)} {'-' if (v := policy.predict(s, n)) is None else f'{v:.0f}'}"
            for s in policy.candidates[True]))
    print(f"  {bench.name} step costs (ms) by rows bucket x slots: " + ", ".join(
        f"{rows_}x{slots} {1000 * seconds:.1f}" for (rows_, slots), seconds in sorted(snap.step_cost.items())))


if __name__ == "__main__":
    raise SystemExit(main())
