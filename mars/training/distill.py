"""The ``distill`` stage: a prompt pool -> the base model's own greedy responses (self-distillation data).

Trained on its own outputs, L_AR keeps the model where it was and L_mask learns to predict what this
model will say, which is what tokens/forward rewards (DESIGN.md section 3; Medusa-2 and EAGLE train on
the target model's outputs the same way).

Prompt sources (``distill.*``, each on when it asks for rows), pooled in this order:

- ``reasoning_gym``: the train split of the ``tasks:`` families with ``pool: true``
  (:mod:`mars.training.tasks`; the held-out split is the ``reasoning`` benchmark's, disjoint);
- ``builtin``: prompts of the built-in suite's train split (:mod:`mars.training.suite`);
- ``jsonl``: a JSONL file of prompts;
- ``datasets``: a column of a ``datasets`` data set (a hub name needs the hub: offline that fails
  with a message saying so) or a local dataset directory;
- ``self_prompts``: user messages the base writes itself after its chat template's user-turn header
  (:mod:`mars.training.self_prompts`), evaluation prompts left out.

Decoding: :func:`mars.decoding.generate.generate` at tau = 1.0 (greedy AR exactly), batched, in the
configured dtype (``auto``: bfloat16 where the CPU or GPU has bf16 matrix units; distil in the dtype
you evaluate in). Responses that hit ``max_new_tokens`` are counted and kept or dropped
(``hit_limit``).

Resumable: the pool is cut into shards of ``rows_per_shard`` consecutive prompts, each decoded and
written atomically into the work folder under a fingerprint of the run (pool, generator digest,
decoding settings). A killed run decodes only the shards it lacks; a changed pool or model starts
over. The finished output (written atomically) is ``train.jsonl`` (``prompt``, ``response``,
``family``, ``id``, ``source``, ``finish_reason``, ``response_tokens``: what ``mars prepare`` reads)
and ``manifest.json`` (counts, the generator's digest and the decoding settings). A disabled stage
writes a manifest that says so and no data.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from mars.core.atomic import JSON_ERRORS, atomic_dir, json_problem, read_json, write_json, write_jsonl
from mars.core.digest import sha256_chunks
from mars.errors import ConfigError, DataError, MarsError
from mars.training.self_prompts import SelfPromptsSource
from mars.training.tasks import TasksConfig

FORMAT_VERSION = 1
FINGERPRINT = "fingerprint.json"
SHARD = "shard-{:05d}.jsonl"
OUTPUT = "train.jsonl"
MANIFEST = "manifest.json"


@dataclass
class ReasoningGymSource:
    enabled: bool = False  # the train split of tasks.families with pool: true (tasks.n_train each)


@dataclass
class BuiltinSource:
    n: int = 0  # prompts from the built-in suite's train split (0: off)
    seed: int = 0
    families: list[str] | None = None  # null: all


@dataclass
class JsonlSource:
    path: str | None = None  # a .jsonl file, one object per line (null: off)
    prompt_column: str = "prompt"
    family_column: str = "family"  # optional per row (default family "jsonl")
    id_column: str = "id"  # optional per row (default "<file stem>-<line>")
    n: int | None = None  # cap on rows (null: all)


@dataclass
class DatasetsSource:
    name: str | None = None  # hub name or local dataset directory (null: off)
    subset: str | None = None
    split: str = "train"
    prompt_column: str = "prompt"  # text, or a chat list: its first user turn is the prompt
    n: int | None = 1000  # cap on rows (null: all)


@dataclass
class DistillConfig:
    """The ``distill:`` section of params.yaml."""

    enabled: bool = False  # false: the stage writes a manifest that says so (the tiny profile trains on its suite)
    reasoning_gym: ReasoningGymSource = field(default_factory=ReasoningGymSource)
    builtin: BuiltinSource = field(default_factory=BuiltinSource)
    jsonl: JsonlSource = field(default_factory=JsonlSource)
    datasets: DatasetsSource = field(default_factory=DatasetsSource)
    self_prompts: SelfPromptsSource = field(default_factory=SelfPromptsSource)
    max_new_tokens: int = 96
    hit_limit: Literal["keep", "drop"] = "drop"  # responses that reached max_new_tokens (no EOS): counted either way
    batch_size: int = 16
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 where the hardware has bf16 units)
    device: str = "cpu"
    threads: int | None = None  # torch CPU threads (null: torch's default)
    rows_per_shard: int = 128  # prompts per resumable shard

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.rows_per_shard < 1:
            raise ConfigError("max_new_tokens, batch_size, rows_per_shard: must be positive")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: expected auto | float32 | bfloat16 | float16, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads: must be >= 1, got {self.threads}")
        if self.builtin.n < 0:
            raise ConfigError(f"builtin.n: must be >= 0, got {self.builtin.n}")


# ---- the prompt pool ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    id: str
    family: str
    source: str
    prompt: str


def _reasoning_gym(tasks: TasksConfig, counts: dict) -> list[Prompt]:
    from mars.training import tasks as rg

    out = []
    for name in tasks.pool_families():
        entries, dropped = rg.train(tasks, name)
        counts["heldout_overlap_dropped"][name] = dropped
        out += [Prompt(f"{name}-train-{i}", name, "reasoning_gym", e["question"]) for i, e in enumerate(entries)]
    return out


def _builtin(src: BuiltinSource) -> list[Prompt]:
    from mars.training import suite

    return [Prompt(it.id, it.family, "builtin", it.prompt) for it in suite.train(src.n, src.seed, src.families)]


def _jsonl(src: JsonlSource) -> list[Prompt]:
    path = Path(src.path)
    if not path.is_file():
        raise DataError(f"distill.jsonl.path: {path}: no such file")
    out = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except JSON_ERRORS as err:
                raise DataError(f"{path}:{line_no}: not valid JSON ({json_problem(err)})") from None
            prompt = row.get(src.prompt_column) if isinstance(row, dict) else None
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{path}:{line_no}: no text in column {src.prompt_column!r}")
            rid = row.get(src.id_column)
            out.append(Prompt(str(rid) if rid is not None else f"{path.stem}-{line_no}",
                              str(row.get(src.family_column) or "jsonl"), "jsonl", prompt))
            if src.n is not None and len(out) == src.n:
                break
    return out


def _first_user_turn(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for turn in value:
            if isinstance(turn, dict) and turn.get("role") == "user" and isinstance(turn.get("content"), str):
                return turn["content"]
    return None


def _datasets(src: DatasetsSource) -> list[Prompt]:
    import datasets

    where = f"distill.datasets.name: {src.name!r}"
    try:
        if Path(src.name).exists():
            data = datasets.load_from_disk(src.name)
            data = data[src.split] if isinstance(data, datasets.DatasetDict) else data
        else:
            data = datasets.load_dataset(src.name, src.subset, split=src.split)
    except (OSError, ConnectionError, ValueError) as err:
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise DataError(f"{where} could not be loaded ({first}). A data set name needs the Hugging Face hub, "
                        "which is unreachable from here: use a local dataset directory or a jsonl file of prompts, "
                        "or fill the HF cache (HF_HOME) on a machine with network") from None
    if src.prompt_column not in data.column_names:
        raise DataError(f"{where} has no column {src.prompt_column!r} (has {', '.join(data.column_names)})")
    out = []
    for i, value in enumerate(data[src.prompt_column]):
        prompt = _first_user_turn(value)
        if prompt and prompt.strip():
            out.append(Prompt(f"{Path(src.name).name}-{src.split}-{i}", "datasets", "datasets", prompt))
        if src.n is not None and len(out) == src.n:
            break
    return out


def build_pool(cfg: DistillConfig, tasks: TasksConfig, self_prompts: list[dict] | None = None) -> tuple[list[Prompt], dict]:
    """Every prompt of the enabled sources, in a fixed order, ids unique; and the pool's counts. ``self_prompts``:
    what the base wrote (:func:`mars.training.self_prompts.generate`; it needs the model, this does not)."""
    counts: dict = {"heldout_overlap_dropped": {}}
    pool: list[Prompt] = []
    if cfg.reasoning_gym.enabled:
        if not tasks.pool_families():
            raise ConfigError("distill.reasoning_gym.enabled: tasks.families has no family with pool: true")
        pool += _reasoning_gym(tasks, counts)
    if cfg.builtin.n:
        pool += _builtin(cfg.builtin)
    if cfg.jsonl.path is not None:
        pool += _jsonl(cfg.jsonl)
    if cfg.datasets.name is not None:
        pool += _datasets(cfg.datasets)
    pool += [Prompt(r["id"], "self_prompts", "self_prompts", r["prompt"]) for r in self_prompts or []]
    if not pool:
        raise ConfigError("distill: enabled, but no prompt source is on "
                          "(reasoning_gym, builtin, jsonl, datasets, self_prompts)")
    ids = Counter(p.id for p in pool)
    repeated = [i for i, c in ids.items() if c > 1]
    if repeated:
        raise DataError(f"distill: prompt ids repeat across the pool (e.g. {repeated[0]!r}); give each row a unique id")
    counts["prompts"] = len(pool)
    counts["by_source"] = dict(Counter(p.source for p in pool))
    counts["by_family"] = dict(sorted(Counter(p.family for p in pool).items()))
    return pool, counts


# ---- the generator ----------------------------------------------------------------------------------


def model_digest(model_dir: str | Path) -> str:
    """sha256 over the files that decide the generator's outputs: config, weights, tokenizer
    (``base.json``, a build log, is left out)."""
    from mars.core.digest import sha256_tree

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise DataError(f"{model_dir}: not a model directory (no config.json)")
    names = [p.name for p in model_dir.iterdir() if p.is_file() and p.name != "base.json"]
    return sha256_tree(model_dir, names)


def decoding_settings(cfg: DistillConfig) -> dict:
    import torch

    from mars.core.models import resolve_dtype

    return {"tau": 1.0, "max_new_tokens": cfg.max_new_tokens, "dtype": resolve_dtype(cfg.dtype, cfg.device),
            "device": cfg.device, "batch_size": cfg.batch_size, "torch": torch.__version__}


def _fingerprint(pool: list[Prompt], digest: str, settings: dict, rows_per_shard: int) -> dict:
    pool_sha256 = sha256_chunks(json.dumps([p.id, p.family, p.source, p.prompt]).encode() + b"\n" for p in pool)
    # batch_size and torch only change how fast the same greedy tokens come (in fp32; in bf16 batch
    # composition can flip a near-tie): recorded in the manifest, but a resume may change them
    fixed = {k: v for k, v in settings.items() if k not in ("batch_size", "torch")}
    return {"format_version": FORMAT_VERSION, "pool_sha256": pool_sha256, "prompts": len(pool),
            "generator_sha256": digest, "decoding": fixed, "rows_per_shard": rows_per_shard}


def _prepare_work(work: Path, fingerprint: dict) -> list[int]:
    """The work folder for this run, and the shards already done (a different run's are removed; the sampled
    self-prompts in their folder have a fingerprint of their own)."""
    path = work / FINGERPRINT
    if path.is_file():
        try:
            same = read_json(path) == fingerprint
        except MarsError:
            same = False
        if not same:
            for old in [path, *work.glob("shard-*.jsonl")]:
                old.unlink()
    work.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        write_json(path, fingerprint)
    return sorted(int(p.stem.split("-")[1]) for p in work.glob("shard-*.jsonl"))


def _shard_rows(part: list[Prompt], gens) -> list[dict]:
    return [{"id": p.id, "family": p.family, "source": p.source, "prompt": p.prompt, "response": g.text,
             "finish_reason": g.finish_reason, "response_tokens": len(g.token_ids), "token_ids": g.token_ids}
            for p, g in zip(part, gens)]


def distill(cfg: DistillConfig, tasks: TasksConfig, base: str | Path, out: str | Path, work: str | Path,
            progress: bool = True, log=print) -> dict:
    """Decode the pool with ``base`` into ``out`` (resuming from ``work``); returns the manifest."""
    out, work = Path(out), Path(work)
    if not cfg.enabled:
        manifest = {"format_version": FORMAT_VERSION, "enabled": False}
        with atomic_dir(out) as tmp:
            write_json(tmp / MANIFEST, manifest)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)  # a declared output of the stage
        return manifest

    import torch

    from mars.core.models import load_model
    from mars.decoding.generate import generate

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    settings = decoding_settings(cfg)
    digest = model_digest(base)
    written = None
    if cfg.self_prompts.n:
        from mars.training import self_prompts

        written, dropped = self_prompts.generate(cfg.self_prompts, base, work / "self_prompts", dtype=settings["dtype"],
                                                 device=cfg.device, digest=digest, log=log)
    pool, counts = build_pool(cfg, tasks, written)
    if written is not None:
        counts["self_prompts"] = dropped
    fingerprint = _fingerprint(pool, digest, settings, cfg.rows_per_shard)
    done = set(_prepare_work(work, fingerprint))
    shards = [pool[i:i + cfg.rows_per_shard] for i in range(0, len(pool), cfg.rows_per_shard)]
    todo = [k for k in range(len(shards)) if k not in done]
    if done:
        log(f"distill: resuming, {len(done)} of {len(shards)} shards already decoded")
    started = time.perf_counter()
    if todo:
        model, tokenizer = load_model(base, dtype=settings["dtype"], device=cfg.device)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pool), initial=len(pool) - sum(len(shards[k]) for k in todo), desc="distill",
                       unit="prompt", dynamic_ncols=True)
        for k in todo:
            gens = generate(model, tokenizer, [p.prompt for p in shards[k]], tau=1.0,
                            max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size)
            write_jsonl(work / SHARD.format(k), _shard_rows(shards[k], gens))  # atomic: a shard is whole or absent
            if bar is not None:
                bar.update(len(shards[k]))
                bar.set_postfix(tok_s=f"{gens.tokens / max(gens.seconds, 1e-9):.0f}", refresh=False)
        if bar is not None:
            bar.close()
        del model
    return _finish(cfg, pool, counts, shards, work, out, fingerprint, settings, time.perf_counter() - started)


def _finish(cfg, pool, counts, shards, work, out, fingerprint, settings, seconds) -> dict:
    rows = []
    for k, part in enumerate(shards):
        with open(work / SHARD.format(k), encoding="utf-8") as fh:
            got = [json.loads(line) for line in fh if line.strip()]
        if [r["id"] for r in got] != [p.id for p in part]:
            raise DataError(f"{work / SHARD.format(k)}: rows differ from the pool (remove {work} and run again)")
        rows += got
    hit = [r for r in rows if r["finish_reason"] == "length"]
    empty = [r for r in rows if not r["response"].strip()]
    kept = [r for r in rows if (cfg.hit_limit == "keep" or r["finish_reason"] != "length") and r["response"].strip()]
    if not kept:
        raise DataError(f"distill: no usable response out of {len(rows)} (hit the limit: {len(hit)}, empty: {len(empty)})")
    manifest = {
        "format_version": FORMAT_VERSION, "enabled": True, "rows": len(kept), **counts,
        "hit_limit": {"count": len(hit), "policy": cfg.hit_limit, "max_new_tokens": cfg.max_new_tokens},
        "empty_dropped": len(empty),
        "kept_by_family": dict(sorted(Counter(r["family"] for r in kept).items())),
        "response_tokens_mean": round(sum(r["response_tokens"] for r in kept) / len(kept), 2),
        "generator_sha256": fingerprint["generator_sha256"], "pool_sha256": fingerprint["pool_sha256"],
        "decoding": settings, "decode_seconds_this_run": round(seconds, 1), "config": asdict(cfg),
    }
    with atomic_dir(out) as tmp:
        write_jsonl(tmp / OUTPUT, ({k: v for k, v in r.items() if k != "token_ids"} for r in kept))
        write_json(tmp / MANIFEST, manifest)
    return manifest


def read_rows(out: str | Path) -> list[dict]:
    """The rows of a finished distillation (``train.jsonl``)."""
    path = Path(out) / OUTPUT
    if not path.is_file():
        raise DataError(f"{path}: no such file (run `mars distill` first)")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
