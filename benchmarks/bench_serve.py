"""Load benchmark of `mars serve`: the fixed settings (tau = 1.0, a fixed tau < 1, the lossless mode at B and
narrower) against the adaptive tau policy, with no floor (the server's default: greedy output) and with
``--tau-floor`` where one is given.

Each setting is its own `mars serve --model DIR` on 127.0.0.1 (a subprocess on a free port: the load
generator does not share the server's interpreter), warmed up, then kept for the whole run. At each level
(a fixed number of concurrent streams, each sending its share of a fixed number of requests; then a bursty
trace that moves between levels) the settings take turns in every round, each round one further along the
list, so that none always runs first or last; a cell shows the median of ``--repeats`` rounds. Then, per
level and adaptive server: its tokens/s against the best fixed setting and against tau = 1.0 within each
round (they ran back to back, so the machine's drift cancels), the median and the spread of those ratios
(a goal inside the spread is met within the benchmark's own noise), and where the policy spent its steps.
Requests are the held-out prompts of the prepared data (token ids through /v1/completions, greedy,
streamed), so each run also gives the held-out score of what each setting generated.

    python benchmarks/bench_serve.py --model checkpoints/mars/final --data data/prepared --repeats 3
    python benchmarks/bench_serve.py --model build/study-smollm2/checkpoints/mars/final \
        --data build/study-smollm2/data/prepared --dtype bfloat16 --tau-floor 0.9 --repeats 3 --json out.json

Loopback only: it binds and connects to 127.0.0.1 and nothing else. Wall-clock numbers are only as good as
the machine is quiet; on a small machine ``--server-cpus`` and ``--client-cpus`` (taskset-style lists) keep
the servers and the load generator apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def cpu_list(text: str, flag: str) -> set[int]:
    """A taskset-style CPU list ("0", "0-1", "0,2-3") as a set, checked against the CPUs this process may use."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} is not a CPU list like 0 or 0-1 or 0,2-3") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise SystemExit(f"{flag}: {text!r} names CPUs outside the ones available here ({sorted(allowed)})")
    return cpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mars serve --model DIR` in a subprocess on 127.0.0.1."""

    def __init__(self, model: str, *, policy: str, tau: float, floor: float | None, max_batch: int, dtype: str,
                 threads: int | None, mode: str = "tau", block_size: int | None = None, prefix_cache: bool = True,
                 cpus: set[int] | None = None):
        self.mode, self.block_size = mode, block_size  # what every request asks for
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mars.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port",
             str(self.port), "--tau-policy", policy, "--tau", str(tau), "--max-batch", str(max_batch),
             "--max-queue", "100000", "--dtype", dtype, "--log-level", "warning",
             *(["--tau-floor", str(floor)] if floor is not None else []),
             "--prefix-cache" if prefix_cache else "--no-prefix-cache",
             *(["--threads", str(threads)] if threads else [])],
            env=env, stderr=subprocess.PIPE, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"mars serve did not start: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def server_counters(server: Server) -> dict:
    """From the server's /metrics: its decoding steps so far by the setting its tau policy chose
    (``mars_policy_steps_total``), and its seconds in steps (``mars_step_seconds_sum``), of them in steps that
    took new prompts (``mars_joining_step_seconds_total``); and what its policy decides on (``policy_state``:
    step costs by "BUCKETxWINDOW", tokens per row and step by setting), kept in --json."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    counters = {"policy_steps": {}, "step_seconds": 0.0, "joining_seconds": 0.0}
    state: dict[str, dict] = {"step_cost": {}, "tokens_per_forward": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mars_policy_steps_total":
                counters["policy_steps"][sample.labels["setting"]] = sample.value
            elif sample.name == "mars_step_seconds_sum":
                counters["step_seconds"] = sample.value
            elif sample.name == "mars_joining_step_seconds_total":
                counters["joining_seconds"] = sample.value
            elif sample.name == "mars_step_cost_seconds":
                state["step_cost"][f"{sample.labels['batch']}x{sample.labels['window']}"] = sample.value
            elif sample.name == "mars_tokens_per_forward":
                state["tokens_per_forward"][sample.labels["setting"]] = sample.value
    counters["policy_state"] = state
    return counters


async def one_request(client: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"mode": server.mode} if server.mode != "tau" else {}),
            **({"block_size": server.block_size} if server.block_size else {})}
    start = time.perf_counter()
    first, text, usage = None, [], None
    async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
    end = time.perf_counter()
    return {"latency": end - start, "ttft": (first or end) - start, "text": "".join(text),
            "tokens": usage["completion_tokens"], "forwards": usage["forwards"]}


async def run_phase(server: Server, items: list[dict], start: int, streams: int, requests: int,
                    max_tokens: int) -> list[dict]:
    """``requests`` requests over ``streams`` concurrent streams (each sends its share back to back)."""
    queue = list(range(start, start + requests))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def stream():
            while queue:
                i = queue.pop(0)
                item = items[i % len(items)]
                result = await one_request(client, server, item["prompt"], max_tokens)
                results.append({**result, "item": i % len(items)})

        await asyncio.gather(*(stream() for _ in range(streams)))
    return results


def summarize(results: list[dict], seconds: float, items: list[dict]) -> dict:
    from mars.training import suite

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]

    tokens = sum(r["tokens"] for r in results)
    forwards = sum(r["forwards"] for r in results)
    lat, ttft = [r["latency"] for r in results], [r["ttft"] for r in results]
    scores = [suite.score(items[r["item"]]["family"], r["text"], items[r["item"]]["reference"]) for r in results]
    return {"requests": len(results), "seconds": seconds, "tokens_per_s": tokens / seconds,
            "requests_per_s": len(results) / seconds,
            **{f"latency_p{q}": pct(lat, q) for q in (50, 95, 99)},
            **{f"ttft_p{q}": pct(ttft, q) for q in (50, 95, 99)},
            "tokens_per_forward": tokens / forwards if forwards else 0.0, "score": statistics.fmean(scores)}


def load_levels(levels: str, bursty: str, per_stream: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """``(name, phases)`` per level: each steady level of ``levels`` (STREAMS, with ``per_stream`` requests a
    stream, or STREAMS:REQUESTS) one phase, then the ``bursty`` trace (STREAMS:REQUESTS phases; '' for none)."""
    out = []
    for level in levels.split(","):
        if ":" not in level and per_stream < 1:
            raise ValueError(f"--levels: {level!r}: give STREAMS:REQUESTS")
        try:
            streams, requests = (int(v) for v in level.split(":")) if ":" in level else (int(level), 0)
        except ValueError:
            raise ValueError(f"--levels: {level!r} is not STREAMS or STREAMS:REQUESTS") from None
        requests = requests or streams * per_stream
        if streams < 1 or requests < 1:
            raise ValueError(f"--levels: {level!r}: streams and requests must be >= 1")
        out.append((f"{streams} stream{'s' if streams > 1 else ''}", [(streams, requests)]))
    if bursty:
        try:
            trace = [(int(a), int(b)) for a, b in (phase.split(":") for phase in bursty.split(","))]
        except ValueError:
            raise ValueError(f"--bursty: {bursty!r} is not STREAMS:REQUESTS,STREAMS:REQUESTS,...") from None
        if any(streams < 1 or requests < 1 for streams, requests in trace):
            raise ValueError(f"--bursty: {bursty!r}: streams and requests must be >= 1")
        out.append((f"bursty {bursty}", trace))
    return out


def held_out(data_dir: str, n: int) -> list[dict]:
    from mars.training import data

    by_family: dict[str, list[dict]] = {}
    for row in sorted(data.load_split(data_dir, "heldout"), key=lambda r: r["id"]):
        by_family.setdefault(row["family"], []).append(row)
    # round robin over the families: every phase's requests mix them, as the heldout benchmark's sample does
    rows = [group[i] for i in range(max(map(len, by_family.values()))) for group in by_family.values()
            if i < len(group)]
    rows = rows[:n] if n else rows
    return [{"prompt": list(r["input_ids"][: r["prompt_len"]]), "reference": r["response"], "family": r["family"]}
            for r in rows]


def provenance(argv: list[str]) -> dict:
    """What a results file needs to say where it came from: the code's commit (+ "dirty" with local changes),
    the machine, the date and the command."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    return {"commit": git("rev-parse", "--short", "HEAD") + (" (dirty)" if git("status", "--porcelain", "mars") else ""),
            "machine": f"{cpu}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(["python benchmarks/bench_serve.py", *argv])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="MARS checkpoint directory")
    parser.add_argument("--data", required=True, help="prepared data directory (its held-out split: prompts, score)")
    parser.add_argument("--items", type=int, default=0, help="held-out items to cycle through (0: all)")
    parser.add_argument("--levels", default="1,4,16",
                        help="the steady levels: STREAMS (--per-stream requests a stream) or STREAMS:REQUESTS")
    parser.add_argument("--per-stream", type=int, default=6, help="requests per stream at a level given as STREAMS")
    parser.add_argument("--bursty", default="1:6,16:48,4:12,16:48,1:6",
                        help="the bursty trace: STREAMS:REQUESTS phases run back to back ('' to skip)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--fixed-tau", type=float, default=0.9, help="the fixed tau < 1 compared")
    parser.add_argument("--tau-floor", type=float,
                        help="also run an adaptive server with this floor (mars serve --tau-floor; default: none)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=16, help="requests at 4 streams before measuring")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, help="torch threads of the server (mars serve --threads)")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="every server computes the chat template's head once (mars serve --prefix-cache; "
                             "default: on)")
    parser.add_argument("--lossless", action=argparse.BooleanOptionalAction, default=True,
                        help="also run every request in the lossless mode (default: on)")
    parser.add_argument("--lossless-block-sizes", default="2",
                        help="with --lossless, also at these block sizes below the checkpoint's ('' for none)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of each level, the policies taking turns in each; a cell shows the median round")
    parser.add_argument("--server-cpus", help="run every server on these CPUs (a taskset-style list: 0, 0-1, 0,2)")
    parser.add_argument("--client-cpus", help="run the load generator on these CPUs (keep them apart from the servers')")
    parser.add_argument("--json", help="write every number here too")
    args = parser.parse_args(argv)
    origin = provenance(sys.argv[1:] if argv is None else argv)
    if args.repeats < 1:
        parser.error(f"--repeats: must be >= 1, got {args.repeats}")
    server_cpus = cpu_list(args.server_cpus, "--server-cpus") if args.server_cpus else None
    if args.client_cpus:
        os.sched_setaffinity(0, cpu_list(args.client_cpus, "--client-cpus"))
    items = held_out(args.data, args.items)
    narrow = [int(w) for w in args.lossless_block_sizes.split(",") if w] if args.lossless else []
    # (label, policy, tau, floor, mode, block size): the fixed settings, then the adaptive servers
    policies = [("tau=1.0 fixed", "fixed", 1.0, None, "tau", None),
                (f"tau={args.fixed_tau:g} fixed", "fixed", args.fixed_tau, None, "tau", None),
                *([("lossless fixed", "fixed", 1.0, None, "lossless", None)] if args.lossless else []),
                *((f"lossless w={w} fixed", "fixed", 1.0, None, "lossless", w) for w in narrow),
                ("adaptive", "adaptive", args.fixed_tau, None, "tau", None),
                *([(f"adaptive floor={args.tau_floor:g}", "adaptive", args.fixed_tau, args.tau_floor, "tau", None)]
                  if args.tau_floor is not None else [])]
    try:
        levels = load_levels(args.levels, args.bursty, args.per_stream)
    except ValueError as err:
        parser.error(str(err))
    table: dict[str, dict[str, dict]] = {name: {} for name, _ in levels}
    # All servers up at once, the policies taking turns at each level: a neighbour's load on a shared
    # machine then hits them alike rather than whichever ran at the time.
    servers = []
    try:
        for label, policy, tau, tau_floor, mode, block_size in policies:
            servers.append((label, Server(args.model, policy=policy, tau=tau, floor=tau_floor,
                                          max_batch=args.max_batch, dtype=args.dtype, threads=args.threads, mode=mode,
                                          block_size=block_size, prefix_cache=args.prefix_cache, cpus=server_cpus)))
            asyncio.run(run_phase(servers[-1][1], items, 0, 4, args.warmup, args.max_tokens))
        for name, phases in levels:
            runs: dict[str, list[dict]] = {label: [] for label, _ in servers}
            for round_ in range(args.repeats):
                turn = round_ % len(servers)
                for label, server in servers[turn:] + servers[:turn]:
                    before = server_counters(server)
                    started, results, offset = time.perf_counter(), [], 0
                    for streams, requests in phases:
                        results += asyncio.run(run_phase(server, items, offset, streams, requests, args.max_tokens))
                        offset += requests
                    runs[label].append(summarize(results, time.perf_counter() - started, items))
                    after = server_counters(server)
                    steps = {arm: n - before["policy_steps"].get(arm, 0.0) for arm, n in after["policy_steps"].items()}
                    runs[label][-1]["policy_steps"] = {arm: n for arm, n in steps.items() if n}
                    if label.startswith("adaptive"):
                        runs[label][-1]["policy_state"] = after["policy_state"]
                    stepping = after["step_seconds"] - before["step_seconds"]
                    runs[label][-1]["joining_share"] = ((after["joining_seconds"] - before["joining_seconds"]) / stepping
                                                        if stepping else None)
                    print(f"  {label:>18} {name} (round {round_ + 1}): {runs[label][-1]['tokens_per_s']:.1f} tokens/s",
                          file=sys.stderr)
            for label, rounds in runs.items():  # the median round by throughput
                table[name][label] = sorted(rounds, key=lambda r: r["tokens_per_s"])[len(rounds) // 2]
                table[name][label]["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in rounds]
                # in --json: where the policy spent each round's steps (the first round at a load is where it learns)
                table[name][label]["rounds_policy_steps"] = [r["policy_steps"] for r in rounds]
    finally:
        for _, server in servers:
            server.close()

    head = (f"{'level':<28} {'policy':<19} {'tok/s':>8} {'req/s':>7} {'lat p50':>8} {'p95':>7} {'p99':>7} "
            f"{'ttft p50':>9} {'p95':>7} {'p99':>7} {'tok/fwd':>8} {'score':>6}")
    print("# " + ", ".join(f"{key}: {value}" for key, value in origin.items()))
    print(f"model {args.model}, {len(items)} held-out items, max_tokens {args.max_tokens}, max_batch {args.max_batch}, "
          f"{args.repeats} rounds, prefix cache {'on' if args.prefix_cache else 'off'}, "
          f"CPUs: servers {args.server_cpus or 'any'}, load generator {args.client_cpus or 'any'}")
    print(head)
    for name, row in table.items():
        for k, (label, s) in enumerate(row.items()):
            print(f"{name if k == 0 else '':<28} {label:<19} {s['tokens_per_s']:>8.1f} {s['requests_per_s']:>7.2f} "
                  f"{s['latency_p50']:>8.3f} {s['latency_p95']:>7.3f} {s['latency_p99']:>7.3f} {s['ttft_p50']:>9.3f} "
                  f"{s['ttft_p95']:>7.3f} {s['ttft_p99']:>7.3f} {s['tokens_per_forward']:>8.2f} {s['score']:>6.3f}")
        rounds = {label: s["rounds_tokens_per_s"] for label, s in row.items()}
        fixed = [label for label in rounds if not label.startswith("adaptive")]
        print(f"{'':<28} rounds' tok/s: " + ", ".join(f"{label} {min(r):.0f}-{max(r):.0f}"
                                                     for label, r in rounds.items()))
        for label in (label for label in rounds if label.startswith("adaptive")):
            # within each round, against the best fixed setting of that round and against tau = 1.0
            vs_best = [rounds[label][k] / max(rounds[f][k] for f in fixed) for k in range(args.repeats)]
            vs_ar = [rounds[label][k] / rounds["tau=1.0 fixed"][k] for k in range(args.repeats)]
            row[label]["vs_best_fixed"], row[label]["vs_tau_1"] = vs_best, vs_ar
            print(f"{'':<28} {label} / best fixed: median {statistics.median(vs_best):.3f}x "
                  f"(rounds {min(vs_best):.3f}-{max(vs_best):.3f}); / tau=1.0: median "
                  f"{statistics.median(vs_ar):.2f}x (rounds {min(vs_ar):.2f}-{max(vs_ar):.2f})")
            chosen = row[label]["policy_steps"]
            if chosen:
                total = sum(chosen.values())
                print(f"{'':<28} {label}'s steps: " + ", ".join(
                    f"{setting} {n / total:.0%}" for setting, n in sorted(chosen.items(), key=lambda kv: -kv[1])))
        shares = {label: s["joining_share"] for label, s in row.items()}
        if None not in shares.values():  # prefill beside decoding: a cost every setting pays, per request
            print(f"{'':<28} step time in steps with joining prompts: "
                  + ", ".join(f"{label} {share:.0%}" for label, share in shares.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": origin, "args": vars(args), "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
