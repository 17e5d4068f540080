"""lm-evaluation-harness tasks in the ``evaluate`` stage: any lm-eval task names over the tau sweep.

``evaluate.lm_eval`` (:class:`LmEvalConfig`) lists lm-eval task, group or tag names; they run through
:class:`mars.evaluation.lm_eval_model.MarsLM` for every checkpoint and tau, next to the built-in
benchmarks, and give the same outputs:

- ``metrics/eval.json``: one ``<checkpoint>/<name>/tau=<tau>`` entry per requested task or group (a tag
  stands for its tasks, one entry each) with lm-eval's score (``metric``: the task's first metric and
  filter, or ``evaluate.lm_eval.metrics.NAME``), beside ``tokens_per_forward``, ``tokens``,
  ``forwards``, ``seconds``, ``tokens_per_s``, ``n``, ``tau``, ``block_size``: ``mars gate`` and the
  plots read them as they read a benchmark's;
- ``<out>/<checkpoint>/<name>/tau=<tau>.jsonl``: one line per lm-eval sample (the document, the
  filtered response, the metric) with its generation (token ids, forwards, finish reason);
- ``<out>/<checkpoint>/lm_eval/tau=<tau>.json``: lm-eval's own results (configs, versions, all
  metrics with their stderr).

The tasks are resolved and their data loaded once, before any model: :func:`check_tasks` fails with one
line when a task's data set lives on the Hugging Face hub and the hub cannot be reached (or its
scorer needs nltk data that is missing), instead of after the first checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars.core.atomic import write_json, write_jsonl
from mars.errors import ConfigError, MarsError
from mars.evaluation.metric_key import MetricKey
from mars.evaluation.metrics_entry import metrics_entry

# datasets' packaged builders: a task naming one reads local files (data_files), not the hub.
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}
# Task folders (in lm-eval 0.4.13's tasks/) whose scorers need nltk data at scoring time, i.e. after the
# whole generation run: ifeval and leaderboard/ifeval split sentences with punkt_tab, which they try to
# download when imported.
NLTK_DATA = {"ifeval": "tokenizers/punkt_tab"}
LOCAL_TASKS = ("mars_heldout", "mars_gsm")


@dataclass
class LmEvalConfig:
    """``evaluate.lm_eval`` in params.yaml."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task, group or tag names; [] = none
    num_fewshot: int | None = None  # None: each task's own
    limit: int | None = None  # documents per task (None: all); lm-eval warns that limited scores are for testing
    apply_chat_template: bool = True  # prompts through the tokenizer's chat template (instruct models)
    fewshot_as_multiturn: bool = True  # few-shot examples as chat turns (lm-eval's default with a chat template)
    include_path: list[str] = field(default_factory=list)  # task folders besides lm-eval's and mars's own
    metrics: dict[str, str] = field(default_factory=dict)  # NAME -> "metric,filter" that is the entry's score
    confirm_run_unsafe_code: bool = False  # tasks that execute generated code (humaneval*) refuse to run without

    def __post_init__(self):
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"tasks: duplicate names in {self.tasks}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit: must be >= 1 (or null for all documents), got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"num_fewshot: must be >= 0, got {self.num_fewshot}")
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ConfigError("fewshot_as_multiturn: needs apply_chat_template")
        for name, metric in self.metrics.items():
            if "," not in metric:
                raise ConfigError(f"metrics.{name}: expected 'metric,filter' as lm-eval names it (e.g. "
                                  f"'exact_match,strict-match'), got {metric!r}")


def task_manager(include_path: list[str] | tuple[str, ...] = (), names: list[str] | None = None):
    """lm-eval's task index: its own tasks, the local ones shipped here, then ``include_path``.

    Where every name in ``names`` is a plain task of the local folders, only those folders are indexed: lm-eval's own
    ~15,000 take ~10 s of a 2-core CPU to index, for each process that asks (a group or tag may gather
    lm-eval's tasks too, so it takes the whole index).
    """
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    from mars.evaluation.lm_eval_tasks import TASKS_DIR

    paths = [str(TASKS_DIR), *map(str, include_path)]
    if names:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(name in local.task_index and local.task_index[name].kind == Kind.TASK for name in names):
            return local
    return TaskManager(include_path=paths)


# ---- resolving names and checking data before any model ---------------------------------------------


def _leaves(name: str, index: dict, seen: tuple[str, ...] = ()) -> list[tuple[str, dict, Path | None]]:
    """``(task, config, yaml_path)`` of every leaf task under ``name`` (index configs: functions unresolved)."""
    from lm_eval.tasks._index import Kind

    entry = index.get(name)
    if entry is None or name in seen:
        return []
    if entry.kind == Kind.TAG:
        return [leaf for other, e in index.items() if name in e.tags for leaf in _leaves(other, index, seen + (name,))]
    if entry.kind == Kind.GROUP:
        out = []
        children = entry.cfg.get("task") or []
        for child in [children] if isinstance(children, (str, dict)) else children:
            if isinstance(child, dict):  # an inline task config, possibly over a known one
                base = index.get(child.get("task"))
                out.append((child.get("task", name), {**((base.cfg or {}) if base else {}), **child},
                            base.yaml_path if base else entry.yaml_path))
            else:
                out.extend(_leaves(child, index, seen + (name,)))
        return out
    return [(name, entry.cfg or {}, entry.yaml_path)]


def resolve(names: list[str], manager) -> dict[str, list[str]]:
    """Benchmark name -> its leaf tasks: a task or group keeps its name, a tag becomes one per task."""
    from lm_eval.tasks._index import Kind

    index = manager.task_index
    out: dict[str, list[str]] = {}
    for name in names:
        entry = index.get(name)
        if entry is None:
            raise MarsError(f"lm-eval task {name!r}: unknown to lm-eval (or to --include_path {manager.include_path}); "
                            "`mars lm-eval ls tasks` lists the known ones")
        leaves = [leaf for leaf, _, _ in _leaves(name, index)]
        if not leaves:
            raise MarsError(f"lm-eval task {name!r}: a {entry.kind.name.lower()} without tasks")
        if entry.kind == Kind.TAG:
            out.update({leaf: [leaf] for leaf in leaves})
        else:
            out[name] = leaves
    return out


def _hub_dataset(cfg: dict) -> str | None:
    """The hub data set a task config reads, or None for local data."""
    path = cfg.get("dataset_path")
    if cfg.get("custom_dataset") or not path or path in LOCAL_BUILDERS or Path(str(path)).expanduser().exists():
        return None
    return str(path)


def check_tasks(names: list[str], manager, confirm_run_unsafe_code: bool = False) -> dict[str, list[str]]:
    """Resolve ``names`` and check, with no model, that their data and scorers are there; returns
    :func:`resolve`'s map. A hub data set that cannot be reached fails here with one line."""
    resolved = resolve(names, manager)
    leaves = {leaf: (cfg, path) for name in names for leaf, cfg, path in _leaves(name, manager.task_index)}
    for leaf, (cfg, _) in leaves.items():
        if cfg.get("unsafe_code") and not confirm_run_unsafe_code:
            raise MarsError(f"lm-eval task {leaf}: it executes the generated code; allow it with "
                            "evaluate.lm_eval.confirm_run_unsafe_code=true (mars lm-eval: --confirm_run_unsafe_code "
                            "and HF_ALLOW_CODE_EVAL=1)")
    hub: dict[str, list[tuple[str, str | None]]] = {}
    for leaf, (cfg, _) in leaves.items():
        if (path := _hub_dataset(cfg)) is not None:
            hub.setdefault(path, []).append((leaf, cfg.get("dataset_name")))
    for path, users in hub.items():
        _check_hub_dataset(path, users, sorted(hub))
    for leaf, (_, yaml_path) in leaves.items():
        for folder, resource in NLTK_DATA.items():
            if yaml_path is not None and folder in yaml_path.parts:
                _check_nltk(leaf, resource)
    return resolved


def _check_hub_dataset(path: str, users: list[tuple[str, str | None]], all_hub: list[str]) -> None:
    import datasets

    leaf, config = users[0]
    try:  # the builder's metadata only: cheap online, and served from the cache offline
        datasets.load_dataset_builder(path, config)
    except Exception as err:  # connection errors come in many types (requests, httpx, OSError, hub errors)
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        others = [p for p in all_hub if p != path]
        raise MarsError(
            f"lm-eval task {leaf}: its data set {path}{'/' + config if config else ''} needs the Hugging Face hub, "
            f"which could not serve it ({type(err).__name__}: {reason}). Run it where the hub is reachable, or "
            f"with a filled HF_DATASETS_CACHE (and HF_DATASETS_OFFLINE=1); offline, the local tasks "
            f"{', '.join(LOCAL_TASKS)} run without it"
            + (f". Also on the hub: {', '.join(others)}" if others else "")
        ) from None


def _check_nltk(task: str, resource: str) -> None:
    import nltk

    try:
        nltk.data.find(resource)
        return
    except LookupError:
        pass
    if not nltk.download(resource.rsplit("/", 1)[-1], quiet=True):
        raise MarsError(f"lm-eval task {task}: its scorer needs nltk's {resource}, which is not installed and "
                        f"could not be downloaded: run `python -m nltk.downloader {resource.rsplit('/', 1)[-1]}` "
                        "where there is network (or point NLTK_DATA at a copy)")


@dataclass
class Tasks:
    """The checked, loaded tasks of one evaluate run, shared by every checkpoint and tau."""

    cfg: LmEvalConfig
    manager: Any
    benchmarks: dict[str, list[str]]  # benchmark name -> leaf tasks
    objects: list  # lm-eval Task / Group objects, as lm-eval's simple_evaluate takes them


def load_tasks(cfg: LmEvalConfig) -> Tasks:
    """Check, then build the tasks (their data sets load here, once)."""
    if cfg.confirm_run_unsafe_code:
        os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")  # the code_eval metric refuses without it
    manager = task_manager(cfg.include_path, names=list(cfg.tasks))
    benchmarks = check_tasks(cfg.tasks, manager, cfg.confirm_run_unsafe_code)
    loaded = manager.load(list(benchmarks))
    objects = [loaded["groups"].get(name) or loaded["tasks"][name] for name in benchmarks]
    return Tasks(cfg, manager, benchmarks, objects)


# ---- one checkpoint over the sweep ----------------------------------------------------------------------


def primary_metric(name: str, result: dict, configured: str | None) -> str:
    """The ``metric,filter`` of ``result`` (lm-eval's results for ``name``) that is the entry's score."""
    numbers = [k for k, v in result.items() if "," in k and "_stderr," not in k and isinstance(v, (int, float))]
    if configured is not None:
        if configured not in numbers:
            raise ConfigError(f"evaluate.lm_eval.metrics.{name}: {configured!r} is not among its metrics "
                              f"({', '.join(numbers)})")
        return configured
    if not numbers:
        raise MarsError(f"lm-eval task {name}: its results have no metric ({result})")
    return numbers[0]


def _rows(leaves: list[str], results: dict, generations: dict, metric: str) -> list[dict]:
    """One row per lm-eval sample of the primary metric's filter, with its generation(s)."""
    metric_name, _, filter_name = metric.partition(",")
    rows = []
    for leaf in leaves:
        for sample in results["samples"].get(leaf, []):
            if sample.get("filter") != filter_name:
                continue
            gens = generations.get((leaf, sample["doc_id"]), [])
            value = sample.get(metric_name)
            row = {"task": leaf, "doc_id": sample["doc_id"], "id": sample["doc"].get("id", f"{leaf}-{sample['doc_id']}"),
                   "prompt": sample["arguments"][0][0] if sample.get("arguments") else None, "reference": sample["target"],
                   "response": sample["filtered_resps"],
                   "score": float(value) if isinstance(value, (bool, int, float)) else value, "doc": sample["doc"]}
            if len(gens) == 1:
                g = gens[0]
                row.update({k: g[k] for k in ("prompt_token_ids", "token_ids", "text", "forwards", "tokens_per_forward",
                                              "finish_reason")})
            elif gens:
                row["generations"] = gens
            rows.append(json.loads(json.dumps(row, default=str)))  # documents may hold non-JSON values
    return rows


def entry_of(result: dict, metric: str, stats: list[dict], n: int, tau: float | None, block_size: int) -> dict:
    """The metrics/eval.json entry of one task or group: lm-eval's score beside the decoding work
    (``tau=None``: the lossless mode)."""
    stderr = result.get(metric.replace(",", "_stderr,", 1))
    entry = metrics_entry(result[metric], sum(s["tokens"] for s in stats), sum(s["forwards"] for s in stats),
                          sum(s["seconds"] for s in stats), n, tau, block_size)
    return {**entry, "metric": metric, "stderr": stderr if isinstance(stderr, (int, float)) else None,
            "harness": "lm-eval"}


def evaluate_model(name: str, model, tokenizer, tasks: Tasks, eval_cfg, out_dir: Path, log=print) -> dict:
    """Run the tasks on one loaded model over its sweep, and in lossless mode where ``eval_cfg.lossless``
    (``eval_cfg``: the :class:`EvalConfig` of :mod:`mars.evaluation.evaluate`); writes per-sample outputs,
    returns metrics entries."""
    from lm_eval import simple_evaluate

    from mars.evaluation.lm_eval_model import MarsLM

    cfg = tasks.cfg
    block_size = eval_cfg.block_size_for(name, model)
    entries: dict[str, dict] = {}
    for tau in eval_cfg.taus_for(model) + ([None] if eval_cfg.lossless else []):  # None: the lossless mode
        # allow_untrained: the AR baselines below tau = 1 are what the gate's speed check measures
        lm = MarsLM(model, tokenizer, tau=1.0 if tau is None else tau, mode="lossless" if tau is None else "tau",
                    block_size=block_size, b_cache=eval_cfg.b_cache, use_cache=eval_cfg.use_cache,
                    batch_size=eval_cfg.batch_size, allow_untrained=True, tree=eval_cfg.tree if tau is None else None)
        results = simple_evaluate(
            model=lm, tasks=tasks.objects, task_manager=tasks.manager, num_fewshot=cfg.num_fewshot, limit=cfg.limit,
            apply_chat_template=cfg.apply_chat_template, fewshot_as_multiturn=cfg.fewshot_as_multiturn,
            log_samples=True, confirm_run_unsafe_code=cfg.confirm_run_unsafe_code)  # lm-eval's seeds: comparable numbers
        generations: dict[tuple[str, int], list[dict]] = {}
        for g in lm.generations:
            generations.setdefault((g["task"], g["doc_id"]), []).append(g)
        for bench, leaves in tasks.benchmarks.items():
            key = MetricKey(name, bench, None if tau is None else float(tau))
            result = results["results"][bench]
            metric = primary_metric(bench, result, cfg.metrics.get(bench))
            write_jsonl(key.outputs_path(out_dir), _rows(leaves, results, generations, metric))
            n = sum(results["n-samples"][leaf]["effective"] for leaf in leaves)
            entry = entry_of(result, metric, [lm.stats[leaf] for leaf in leaves if leaf in lm.stats], n, tau, block_size)
            if tau is None and eval_cfg.tree is not None:
                entry["tree"] = eval_cfg.tree
            entries[key.format()] = entry
            log(f"{key.format()}: {metric} {entry['score']:.3f}  tokens/forward {entry['tokens_per_forward']:.2f}  "
                f"{entry['tokens_per_s']:.0f} tok/s  (lm-eval, {n} documents)")
        write_json(Path(out_dir) / name / "lm_eval" / f"{MetricKey(name, 'lm_eval', tau).point}.json",
                   json.loads(json.dumps({k: v for k, v in results.items() if k != "samples"}, default=str)))
    return entries
