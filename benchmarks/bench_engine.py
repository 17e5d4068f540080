"""The serving engine in-process, no HTTP: the fixed settings and the adaptive tau policy, and where a step's time goes.

`mars serve`'s own :class:`~mars.serving.engine.Engine` (continuous batching, the tau policy, tokens handed
to an asyncio loop) driven from this process: ``STREAMS`` coroutines each submit their share of a level's
requests back to back (greedy, ``--max-tokens`` a request), as ``bench_serve``'s load generator does but
with no server, no HTTP and no load generator on the same cores: what is left is the engine, its policy
and the model. One engine per setting, each warmed up and then kept for the whole run (the adaptive
policy keeps what it measured, as a server does); at each level the settings take turns in every round,
each round one further along the list. Settings: ``1`` (tau = 1.0), a tau such as ``0.9``, ``lossless``
(every request in the lossless mode at the checkpoint's B), ``lossless:W`` (at block size W) and
``adaptive`` (``mars serve --tau-policy adaptive``: the rows name no tau, the policy picks between
``--tau-floor`` and 1.0 and the lossless arms).

Printed per level and setting: generated tokens/s (the median round), the steps that took new prompts
against those that only decoded (count and mean time), where the adaptive policy spent its steps, and
the adaptive policy against the best fixed setting within each round (they ran back to back) and against
tau = 1.0; with ``--costs``, the step costs the adaptive policy measured against its cost model.

    python benchmarks/bench_engine.py --model build/study-smollm2/checkpoints/mars/final \\
        --data build/study-smollm2/data/prepared --dtype bfloat16 --threads 2 --levels 1:24,4:48,16:96
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

from mars.serving.config import ServeConfig  # noqa: E402
from mars.serving.engine import Engine, Finished, GenerationRequest  # noqa: E402
from mars.serving.metrics import arm_label  # noqa: E402
from mars.serving.served_model import ServedModel, load_checkpoint  # noqa: E402
from mars.serving.server import start_engine  # noqa: E402
from mars.serving.tau_policy import arm_block_size, is_lossless  # noqa: E402


class StepLog:
    """The engine's metrics hook (what ``ServerMetrics.step`` receives): steps that took prompts apart from
    decoding steps, and the arm the policy chose for each."""

    def __init__(self):
        self.split = {"prompt": [0, 0.0], "decode": [0, 0.0]}  # steps, seconds
        self.arms: Counter = Counter()

    def step(self, rows, slots, seconds, decoding, tokens, policy, queue_depth, arm=None, prefix_tokens=0):
        cell = self.split["decode" if decoding else "prompt"]
        cell[0], cell[1] = cell[0] + 1, cell[1] + seconds
        if arm is not None:
            self.arms[arm_label(arm)] += 1

    @property
    def steps(self) -> int:
        return self.split["prompt"][0] + self.split["decode"][0]

    def snapshot(self) -> tuple[dict, Counter]:
        return {k: list(v) for k, v in self.split.items()}, Counter(self.arms)


@dataclasses.dataclass
class Setting:
    name: str
    engine: Engine
    log: StepLog
    mode: str = "tau"  # what every request asks for
    block_size: int | None = None


def setting_tau(name: str) -> float | None:
    """The tau a setting names (``1``, ``0.9``); None for lossless, lossless:W and adaptive."""
    if name == "adaptive" or is_lossless(name):
        return None
    try:
        tau = float(name)
    except ValueError:
        raise SystemExit(f"--settings: {name!r} is not 1, a tau, lossless, lossless:W or adaptive") from None
    if not 0.0 < tau <= 1.0:
        raise SystemExit(f"--settings: tau {name!r} is outside (0, 1]")
    return tau


def start_setting(name: str, model: ServedModel, floor: float, max_batch: int) -> Setting:
    log = StepLog()
    if name == "adaptive":
        served = dataclasses.replace(model, default_tau=floor, tau_floor=floor)
        engine = start_engine(served, ServeConfig(tau_policy="adaptive", max_batch=max_batch, max_queue=10**6), log)
        return Setting(name, engine, log)
    if is_lossless(name):
        engine = start_engine(dataclasses.replace(model, default_tau=1.0, tau_floor=1.0),
                              ServeConfig(max_batch=max_batch, max_queue=10**6), log)
        return Setting(name, engine, log, "lossless", arm_block_size(name, model.block_size))
    tau = setting_tau(name)
    served = dataclasses.replace(model, default_tau=tau, tau_floor=tau)
    return Setting(name, start_engine(served, ServeConfig(max_batch=max_batch, max_queue=10**6), log), log)


async def run_phases(setting: Setting, items: list[dict], phases: list[tuple[int, int]], max_tokens: int) -> int:
    """Each phase's requests over its streams, back to back (the held-out items in turn); returns the tokens
    generated."""
    loop, generated, offset = asyncio.get_running_loop(), 0, 0
    for streams, requests in phases:
        queue = list(range(offset, offset + requests))
        offset += requests

        async def stream():
            nonlocal generated
            while queue:
                prompt = items[queue.pop(0) % len(items)]["prompt"]
                request = GenerationRequest(prompt, max_tokens, mode=setting.mode, block_size=setting.block_size)
                async for item in setting.engine.submit(request, loop).events():
                    if isinstance(item, Finished):
                        generated += len(item.token_ids)

        await asyncio.gather(*(stream() for _ in range(streams)))
    return generated


def measure(setting: Setting, items: list[dict], phases: list[tuple[int, int]], max_tokens: int) -> dict:
    split, arms = setting.log.snapshot()
    started = time.perf_counter()
    tokens = asyncio.run(run_phases(setting, items, phases, max_tokens))
    seconds = time.perf_counter() - started
    settle(setting)
    after, arms_after = setting.log.snapshot()
    policy, rows = setting.engine.policy, min(phases[-1][0], setting.engine.max_batch)
    # what the adaptive policy predicts for each arm at the last phase's rows (tokens/s; None: unmeasured)
    predicted = {arm_label(arm): policy.predict(arm, [], rows, setting.engine.model.block_size)
                 for arm in getattr(policy, "candidates", ())}
    return {"tokens_per_s": tokens / seconds,
            **{kind: [after[kind][0] - split[kind][0], after[kind][1] - split[kind][1]] for kind in split},
            "arms": dict(arms_after - arms), "predicted": predicted}


def settle(setting: Setting) -> None:
    """Until the engine has filed its last step: it hands a step's tokens out before the policy and the
    metrics hook see the step, so the last request can finish before its step is counted."""
    while True:
        seen = setting.log.steps
        time.sleep(0.01)
        if setting.log.steps == seen and not setting.engine.running and not setting.engine.queue_depth:
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
                        help="comma-separated: 1, a tau < 1, lossless, lossless:W, adaptive")
    parser.add_argument("--tau-floor", type=float, default=0.9, help="the adaptive policy's floor (its range: floor..1)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=16, help="requests at 4 streams per setting before measuring")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--costs", action="store_true",
                        help="after each level, the adaptive policy's measured step costs against its cost model")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: must be >= 1, got {args.repeats}")
    try:
        levels = load_levels(args.levels, args.bursty, 0)
    except ValueError as err:
        parser.error(str(err))
    names = args.settings.split(",")
    for name in names:  # a typo fails here, not after the model loaded
        setting_tau(name)
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.model, name="bench", dtype=args.dtype)
    if not model.block_size or model.block_size < 2:
        parser.error(f"--model {args.model}: not a MARS checkpoint")
    items = held_out(args.data, 0)
    settings = [start_setting(name, model, args.tau_floor, args.max_batch) for name in names]
    print(f"model {args.model}, {args.dtype}, {args.threads} threads, max_tokens {args.max_tokens}, "
          f"max_batch {args.max_batch}, adaptive range [{args.tau_floor:g}, 1] + lossless, {args.repeats} rounds")
    try:
        for setting in settings:
            measure(setting, items, [(4, args.warmup)], args.max_tokens)
        for level, phases in levels:
            rounds: dict[str, list[dict]] = {s.name: [] for s in settings}
            for round_ in range(args.repeats):
                turn = round_ % len(settings)
                for setting in settings[turn:] + settings[:turn]:
                    rounds[setting.name].append(measure(setting, items, phases, args.max_tokens))
            report(level, rounds)
            if args.costs:
                for setting in settings:
                    if setting.name == "adaptive":
                        report_costs(setting.engine.policy)
    finally:
        for setting in settings:
            setting.engine.close(drain=False, timeout=30)
    return 0


def report(level: str, rounds: dict[str, list[dict]]) -> None:
    print(f"\n{level}")
    for name, runs in rounds.items():
        tps = [r["tokens_per_s"] for r in runs]
        (p_steps, p_sec), (d_steps, d_sec) = ([sum(r[kind][i] for r in runs) for i in (0, 1)]
                                              for kind in ("prompt", "decode"))
        print(f"  {name:>11}: {statistics.median(tps):7.1f} tok/s (rounds {', '.join(f'{t:.0f}' for t in tps)}); "
              f"steps taking prompts {p_steps} ({1000 * p_sec / max(p_steps, 1):.1f} ms each), decoding only "
              f"{d_steps} ({1000 * d_sec / max(d_steps, 1):.1f} ms each)")
        arms = sum((Counter(r["arms"]) for r in runs), Counter())
        if arms:
            total = sum(arms.values())
            print(f"  {'':>11}  steps by arm: " + ", ".join(f"{a} {n / total:.0%}" for a, n in arms.most_common()))
        if runs[-1]["predicted"]:
            print(f"  {'':>11}  predicted tok/s after the last round: " + ", ".join(
                f"{a} {'-' if v is None else f'{v:.0f}'}" for a, v in runs[-1]["predicted"].items()))
    fixed = [name for name in rounds if name != "adaptive"]
    if "adaptive" not in rounds or not fixed:
        return
    adaptive = [r["tokens_per_s"] for r in rounds["adaptive"]]
    per_round = [a / max(rounds[name][k]["tokens_per_s"] for name in fixed) for k, a in enumerate(adaptive)]
    print(f"  adaptive / best fixed in each round: {', '.join(f'{x:.3f}' for x in per_round)} "
          f"(median {statistics.median(per_round):.3f}x)")
    one = next((name for name in fixed if setting_tau(name) == 1.0), None)
    if one is not None:
        ratio = [a / rounds[one][k]["tokens_per_s"] for k, a in enumerate(adaptive)]
        print(f"  adaptive / tau = 1.0 in each round: {', '.join(f'{x:.3f}' for x in ratio)} "
              f"(median {statistics.median(ratio):.3f}x)")


def report_costs(policy) -> None:
    """The adaptive policy's decoding cells: the median of a cell's last samples, how many, and what its cost
    model reads there (the policy compares arms on the model wherever a compared window is thinly measured)."""
    print(f"  {'':>11}  step costs (ms) by rows x window: median (samples) / model")
    for batch, slots, seconds, samples, model in policy.cost_cells():
        print(f"  {'':>11}    {batch:2d} x {slots}: {1000 * seconds:6.1f} ({samples:2d}) / "
              f"{'-' if model is None else f'{1000 * model:.1f}'}")


if __name__ == "__main__":
    raise SystemExit(main())
