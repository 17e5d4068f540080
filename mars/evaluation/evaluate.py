"""``mars evaluate``: every checkpoint x benchmark x tau, with accuracy next to decoding speed.

For each checkpoint (``--checkpoint NAME=DIR``, e.g. sft, ar_control, mars), each enabled benchmark
(:mod:`mars.evaluation.benchmarks`) and each tau of the sweep, the questions are decoded greedily with
:func:`mars.decoding.generate.generate` at the checkpoint's block size and scored. Written:

- ``<out>/<checkpoint>/<benchmark>/tau=<tau>.jsonl`` (``lossless.jsonl`` for the lossless mode, with
  ``evaluate.lossless``): one line per item (prompt ids, generated ids and text, forwards, score and
  the scorer's details), so every number traces back to its generations;
- ``metrics/eval.json``: one flat entry per ``<checkpoint>/<benchmark>/tau=<tau>`` (and ``.../lossless``:
  :mod:`mars.evaluation.metric_key`) with ``score``, ``tokens_per_forward`` (generated tokens / decoding
  forwards, summed over items), ``tokens``, ``forwards``, ``seconds`` (decoding wall clock),
  ``tokens_per_s``, ``n``, ``tau`` (null for lossless), ``mode``, ``block_size``,
  ``checkpoint_sha256`` (:func:`mars.core.digest.sha256_tree` of the folder evaluated: the gate binds to it)
  (+ ``agree_exact``, ``agree_prefix``, ``agree_prefix_frac``, ``ref_logprob`` against ``evaluate.reference``
  over the ``sweep_n`` items, and their count ``agreement_n``: :mod:`mars.evaluation.agreement`);
- ``<out>/plots/<benchmark>/<checkpoint>.json``: accuracy vs tokens/forward rows for ``dvc plots``;
- ``<out>/figures/*.png`` and ``<out>/report.md`` (:mod:`mars.evaluation.plots`).

With ``--work DIR`` every finished decoding is kept there too, and an interrupted evaluation resumes from
them (:mod:`mars.evaluation.resume`).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from mars.core.atomic import write_json, write_jsonl
from mars.core.digest import sha256_tree
from mars.core.checkpoint_info import CheckpointInfo
from mars.decoding.setting import Setting
from mars.decoding.tree_shape import AUTO, tree_shape
from mars.evaluation.benchmarks import BenchmarkConfig, Context, create
from mars.errors import ConfigError, MarsError
from mars.evaluation.harness import LmEvalConfig
from mars.evaluation.metric_key import MetricKey, sweep_order
from mars.evaluation.metrics_entry import metrics_entry
from mars.evaluation.resume import Resume, fingerprint
from mars.evaluation.sandbox import SandboxLimits


def _default_benchmarks() -> dict[str, BenchmarkConfig]:
    """params.yaml's table: the held-out split on; the rest off for the from-scratch tiny model."""
    return {
        "heldout": BenchmarkConfig(n=0, max_new_tokens=48),
        "humaneval": BenchmarkConfig(enabled=False, n=20, max_new_tokens=384, options={"prompt_format": "chat"}),
        "gsm": BenchmarkConfig(enabled=False, n=20, max_new_tokens=256),
        "ifeval": BenchmarkConfig(enabled=False, n=20, max_new_tokens=256, options={"max_instructions": 2}),
    }


@dataclass
class EvalConfig:
    """The ``evaluate:`` section of params.yaml."""

    taus: list[float] = field(default_factory=lambda: [1.0, 0.95, 0.9, 0.8, 0.7])
    block_size: int | None = None  # None: each checkpoint's config.mars.block_size
    batch_size: int = 16
    use_cache: bool = True
    b_cache: int | None = None  # None: token-level KV cache; C >= B: block-level cache
    dtype: str = "float32"
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    seed: int = 0
    threads: int | None = 1  # torch intra-op threads; None: torch's default
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    sandbox_workers: int = 2
    benchmarks: dict[str, BenchmarkConfig] = field(default_factory=_default_benchmarks)
    ar_taus: list[float] | None = None  # taus for AR checkpoints (objective ar); None: taus. [1.0] skips the sweep
                                        # below tau = 1, where a model never trained with masks is known to fail
    reference: str | None = None  # a checkpoint name: the outputs of the sweep_n items are compared with its
                                  # tau = 1.0 output (mars.evaluation.agreement); None: no agreement measures
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)  # lm-evaluation-harness tasks over the same
                                                                 # sweep (mars.evaluation.harness)
    lossless: bool = True  # also decode each benchmark in lossless mode (key <checkpoint>/<benchmark>/lossless):
                           # the tau = 1.0 output by construction, at the tokens/forward its drafts earn; in fp32
                           # the tau = 1.0 entry is taken from it (the same tokens), not decoded twice
    sweep_n: int | None = None  # items per benchmark decoded at taus below 1.0 (a seeded subset; None: all; a
                                # benchmark's own sweep_n wins); tau = 1.0 and lossless, which the gate pairs, decode
                                # every item
    tree: str | None = None  # the lossless mode's drafts: None the chain, a draft tree shape (top2/16) or auto
                             # (per step, what yields most tokens/s here): the same tokens, the tokens/forward
                             # the drafts earn

    def __post_init__(self):
        if not self.taus:
            raise ConfigError("taus: give at least one tau")
        for t in self.taus:
            Setting.check_tau(t, "taus")
        if len(set(self.taus)) != len(self.taus):
            raise ConfigError(f"taus: duplicate values in {self.taus}")
        Setting(width=self.block_size)  # the decoding block size, checked as a row's width is
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be >= 1, got {self.batch_size}")
        if not any(b.enabled for b in self.benchmarks.values()) and not self.lm_eval.tasks:
            raise ConfigError("benchmarks: none is enabled (and lm_eval.tasks is empty)")
        if self.ar_taus is not None and (not self.ar_taus or not all(t in self.taus for t in self.ar_taus)):
            raise ConfigError(f"ar_taus: must be a non-empty subset of taus {self.taus}, got {self.ar_taus}")
        if self.sweep_n is not None and self.sweep_n < 1:
            raise ConfigError(f"sweep_n: must be >= 1 (or null: every item), got {self.sweep_n}")
        shape = tree_shape(self.tree, auto=True)
        self.tree = shape if shape in (None, AUTO) else shape.label  # off (or a bare YAML off) is the chain: no tree
        if self.reference is not None and 1.0 not in self.taus:
            raise ConfigError("reference: the comparison is with the reference's tau = 1.0 output; taus lacks 1.0")

    def taus_for(self, model) -> list[float]:
        """The sweep of one checkpoint: ``ar_taus`` for an AR checkpoint where set, else ``taus``."""
        info = CheckpointInfo.from_config(model)
        return self.ar_taus if self.ar_taus is not None and info is not None and info.objective == "ar" else self.taus

    def swept(self, benchmark: str, items: list) -> list:
        """The items of ``benchmark`` decoded at the taus below 1.0: its own ``sweep_n``, else ``sweep_n``."""
        own = self.benchmarks[benchmark].sweep_n if benchmark in self.benchmarks else None
        return sweep_items(items, self.sweep_n if own is None else own, self.seed, benchmark)

    def block_size_for(self, name: str, model) -> int:
        """B of one checkpoint: ``block_size``, else its ``config.mars.block_size``."""
        block_size = self.block_size or CheckpointInfo.block_size_of(model)
        if block_size is None:
            raise MarsError(f"checkpoint {name}: no config.mars.block_size; set evaluate.block_size")
        return block_size


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summarize(rows: list[dict], seconds: float, tau: float | None, block_size: int) -> dict:
    """The metrics entry of one (checkpoint, benchmark, tau) from its per-item rows; ``tau=None``: the
    lossless mode."""
    score = sum(r["score"] for r in rows) / len(rows) if rows else 0.0
    return metrics_entry(score, sum(len(r["token_ids"]) for r in rows), sum(r["forwards"] for r in rows), seconds,
                         len(rows), tau, block_size)


def sweep_items(items: list, n: int | None, seed: int, benchmark: str) -> list:
    """The items decoded below tau = 1.0: ``n`` of them, a seeded sample kept in benchmark order (families
    stay mixed where the benchmark lists them family by family)."""
    if n is None or n >= len(items):
        return items
    keep = set(random.Random(f"mars-sweep:{seed}:{benchmark}").sample(range(len(items)), n))
    return [it for i, it in enumerate(items) if i in keep]


def _as_tau_one(row: dict) -> dict:
    """A lossless row as the tau = 1.0 row it equals in fp32: the same tokens, one forward each."""
    return {**row, "forwards": len(row["token_ids"]), "tokens_per_forward": 1.0 if row["token_ids"] else 0.0,
            "derived_from": "lossless"}


def evaluate_model(name: str, model, tokenizer, benchmarks: dict, items: dict, cfg: EvalConfig, out_dir: Path,
                   log=print, digest: str | None = None, resume: Resume | None = None) -> dict:
    """Evaluate one loaded model on every benchmark x tau (+ lossless); writes per-item outputs, returns metrics
    entries. ``resume``: finished decodings of an earlier run of the same checkpoint (``digest``) are reused."""
    import torch

    from mars.decoding.generate import generate

    resume = Resume(None) if resume is None else resume  # None: nothing kept, nothing reused
    block_size = cfg.block_size_for(name, model)
    taus = cfg.taus_for(model)
    # AR checkpoints at ar_taus only: their lossless drafts come from untrained mask slots
    lossless = cfg.lossless and not (cfg.ar_taus is not None and taus == cfg.ar_taus and taus != cfg.taus)
    # lossless mode is greedy AR token for token in fp32 (bf16 rounds with the window width: decoded apart)
    reuse = lossless and 1.0 in taus and next(model.parameters()).dtype == torch.float32
    modes: list[float | None] = ([None] if lossless else []) + [t for t in taus if not (reuse and t == 1.0)]
    entries: dict[str, dict] = {}

    def record(key: MetricKey, rows: list[dict], seconds: float, tau: float | None, bench, reused: bool) -> None:
        write_jsonl(key.outputs_path(out_dir), rows)
        entry = summarize(rows, seconds, tau, block_size)
        if rows and "derived_from" in rows[0]:
            entry["derived_from"] = rows[0]["derived_from"]
        if not bench.quality:
            entry["quality"] = False  # a surface check: the gate reports it (mars.evaluation.gate)
        if reused:
            entry["reused"] = True  # decoded by an earlier run: its seconds are that run's
        entries[key.format()] = entry
        log(f"{key.format()}: score {entry['score']:.3f}  tokens/forward {entry['tokens_per_forward']:.2f}  "
            + ("(the lossless tokens)" if "derived_from" in entry else f"{entry['tokens_per_s']:.0f} tok/s"))

    for bench_name, bench in benchmarks.items():
        for tau in modes:  # None: the lossless mode
            bench_items = items[bench_name] if tau in (None, 1.0) else cfg.swept(bench_name, items[bench_name])
            key = MetricKey(name, bench_name, None if tau is None else float(tau))
            tree = cfg.tree if tau is None else None
            print_ = fingerprint(key, digest, bench, bench_items, {
                "block_size": block_size, "dtype": str(next(model.parameters()).dtype), "device": cfg.device,
                "attn_implementation": cfg.attn_implementation,
                "batch_size": cfg.batch_size, "use_cache": cfg.use_cache, "b_cache": cfg.b_cache, "tree": tree})
            kept = resume.get(key, print_, [it.id for it in bench_items])
            if kept is not None:
                decoded, seconds = kept
            else:
                gens = generate(model, tokenizer, [it.prompt for it in bench_items], block_size=block_size,
                                tau=1.0 if tau is None else tau, mode="lossless" if tau is None else "tau",
                                max_new_tokens=bench.config.max_new_tokens, batch_size=cfg.batch_size,
                                use_cache=cfg.use_cache, b_cache=cfg.b_cache, tree=tree,
                                allow_untrained=True)  # the AR baselines below tau = 1: the gate's speed check
                decoded = [{"id": it.id, "prompt_token_ids": g.prompt_token_ids, "token_ids": g.token_ids,
                            "text": g.text, "forwards": g.forwards, "tokens_per_forward": g.tokens_per_forward,
                            "finish_reason": g.finish_reason} for it, g in zip(bench_items, gens)]
                seconds = gens.seconds
                resume.put(key, print_, decoded, seconds)
            # scored here, reused or not: a scorer's fix reaches every decoding kept in the work folder
            scored = bench.score(bench_items, [d["text"] for d in decoded])
            rows = [{"id": it.id, "family": it.family, "prompt": it.prompt if isinstance(it.prompt, str) else None,
                     **{k: v for k, v in d.items() if k != "id"}, "reference": it.reference, **s}
                    for it, d, s in zip(bench_items, decoded, scored)]
            record(key, rows, seconds, tau, bench, kept is not None)
            if tau is None and cfg.tree is not None:
                entries[MetricKey(name, bench_name, None).format()]["tree"] = cfg.tree
            if tau is None and reuse:
                record(MetricKey(name, bench_name, 1.0), [_as_tau_one(r) for r in rows], 0.0, 1.0, bench, False)
    order = list(benchmarks)
    return {k: entries[k] for k in sorted(entries, key=lambda k: (order.index(MetricKey.parse(k).benchmark),
                                                                  sweep_order(MetricKey.parse(k).tau)))}


def build_benchmarks(cfg: EvalConfig, data_dir: str | None, tasks=None) -> tuple[dict, dict]:
    """The enabled benchmarks and their items (built once, shared by every checkpoint); ``tasks``: the
    ``tasks:`` section (:class:`mars.training.tasks.TasksConfig`) for the reasoning benchmark."""
    context = Context(seed=cfg.seed, data_dir=data_dir, sandbox=cfg.sandbox, sandbox_workers=cfg.sandbox_workers,
                      tasks=tasks)
    benchmarks = {name: create(name, bc, context) for name, bc in cfg.benchmarks.items() if bc.enabled}
    items = {}
    for name, bench in benchmarks.items():
        items[name] = bench.items()
        if not items[name]:
            raise MarsError(f"benchmark {name}: no items")
    return benchmarks, items


def write_plot_data(metrics: dict, out_dir: Path) -> list[Path]:
    """``<out>/plots/<benchmark>/<checkpoint>.json``: rows of (tau, mode, tokens_per_forward, score) for dvc
    plots, the tau sweep from 1.0 down, then the lossless point (tau null)."""
    series: dict[tuple[str, str], list[dict]] = {}
    for key, entry in metrics.items():
        parsed = MetricKey.parse(key)
        series.setdefault((parsed.benchmark, parsed.checkpoint), []).append(
            {"checkpoint": parsed.checkpoint, "tau": parsed.tau, "mode": parsed.mode,
             "tokens_per_forward": entry["tokens_per_forward"], "score": entry["score"],
             "tokens_per_s": entry["tokens_per_s"]})
    written = []
    for (bench, ckpt), rows in series.items():
        path = out_dir / "plots" / bench / f"{ckpt}.json"
        write_json(path, sorted(rows, key=lambda r: sweep_order(r["tau"])))  # type: ignore[arg-type]
        written.append(path)
    return written


def add_agreement(metrics: dict, checkpoints: dict[str, str], cfg: EvalConfig, out_dir: Path, items: dict,
                  log=print) -> None:
    """Every entry against ``cfg.reference``'s tau = 1.0 outputs (:mod:`mars.evaluation.agreement`), over the
    items every tau decodes (the ``sweep_n`` subset of each benchmark's ``items``), so that each entry's drift is
    measured on the same items (and a teacher-forced pass over every item of every checkpoint, as costly as
    decoding them, is spared): the per-item measures go into those items' outputs, their means into the entries."""
    from mars.core.models import load_model
    from mars.evaluation import agreement

    if cfg.reference not in checkpoints:
        raise ConfigError(f"evaluate.reference: {cfg.reference!r} is not an evaluated checkpoint "
                          f"(have {', '.join(checkpoints)})")
    model, _ = load_model(checkpoints[cfg.reference], dtype=cfg.dtype, attn_implementation=cfg.attn_implementation,
                          device=cfg.device)
    memo: dict = {}  # outputs that several entries share are scored once
    subset = {bench: {it.id for it in cfg.swept(bench, its)} for bench, its in items.items()}
    for key_text, entry in metrics.items():
        key = MetricKey.parse(key_text)
        rows = read_jsonl(key.outputs_path(out_dir))
        ids = subset.get(key.benchmark)  # None: an lm-eval task, whose documents are the same at every tau
        measured = rows if ids is None else [r for r in rows if r["id"] in ids]
        reference = read_jsonl(MetricKey(cfg.reference, key.benchmark, 1.0).outputs_path(out_dir))
        entry.update(agreement.annotate(measured, reference, model, cfg.batch_size, memo), agreement_n=len(measured))
        write_jsonl(key.outputs_path(out_dir), rows)
        log(f"{key_text}: agrees with {cfg.reference} on {entry['agree_exact']:.1%} of {len(measured)} items, "
            f"matched prefix {entry['agree_prefix']:.1f} tokens; {cfg.reference} log-prob "
            f"{entry['ref_logprob']:.3f}/token")


def run(checkpoints: dict[str, str], cfg: EvalConfig, *, data_dir: str | None, out_dir: str | Path,
        metrics_path: str | Path, train_metrics_dir: str | Path | None = "metrics", tasks=None, log=print,
        work: str | Path | None = None) -> dict:
    """Evaluate every checkpoint; write per-item outputs, metrics, plot data, PNGs and the report. ``work``: keep
    each finished decoding there, and reuse the ones an interrupted run kept (:mod:`mars.evaluation.resume`)."""
    import torch

    from mars.evaluation import harness, plots
    from mars.core.models import load_model

    if not checkpoints:
        raise MarsError("no checkpoint to evaluate (give --checkpoint NAME=DIR)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = Path(out_dir)
    benchmarks, items = build_benchmarks(cfg, data_dir, tasks)
    # checked and loaded before any model: a hub data set offline fails here, in one line
    harness_tasks = harness.load_tasks(cfg.lm_eval) if cfg.lm_eval.tasks else None
    metrics: dict[str, dict] = {}
    resume = Resume(work)
    started = time.perf_counter()
    for name, path in checkpoints.items():
        # what the numbers are about: the gate copies it into its decision, promote checks it
        digest = sha256_tree(path) if Path(path).is_dir() else None
        model, tokenizer = load_model(path, dtype=cfg.dtype, attn_implementation=cfg.attn_implementation,
                                      device=cfg.device)
        entries = evaluate_model(name, model, tokenizer, benchmarks, items, cfg, out_dir, log=log, digest=digest,
                                 resume=resume)
        if harness_tasks is not None:
            entries.update(harness.evaluate_model(name, model, tokenizer, harness_tasks, cfg, out_dir, log=log))
        metrics.update({key: {**entry, "checkpoint_sha256": digest} for key, entry in entries.items()})
        del model
    if cfg.reference is not None:
        add_agreement(metrics, checkpoints, cfg, out_dir, items, log=log)
    write_json(metrics_path, metrics)
    write_plot_data(metrics, out_dir)
    plots.render_all(metrics, out_dir, train_metrics_dir=train_metrics_dir, checkpoints=checkpoints)
    log(f"evaluated {len(checkpoints)} checkpoint(s) x {len(benchmarks)} benchmark(s) x {len(cfg.taus)} tau(s) "
        f"in {time.perf_counter() - started:.1f} s -> {metrics_path}, {out_dir / 'report.md'}"
        + (f" ({resume.reused} decoding(s) taken from {work})" if resume.reused else ""))
    return metrics
