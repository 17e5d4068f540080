"""The ``prepare`` stage: instruction data -> tokenized, B-independent shards + stats; and reading them back.

Sources (``data.source``):
- ``builtin``: the project's own suite (:mod:`mars.training.suite`), train and held-out splits disjoint by content;
- a local ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file;
- a ``datasets`` name or a local dataset directory (``data.split`` is read; a name needs the hub or a
  filled HF cache).

A row is either ``prompt``/``response`` columns or a chat ``messages`` list (names in ``data.*_column``).
The base model's chat template is applied: the prompt is every turn before the last assistant turn,
rendered with ``add_generation_prompt=True``; the response is the last assistant text + EOS. A row whose
``finish_reason`` is ``"length"`` (``mars distill``'s field, OpenAI's name: the generator hit its token
limit) is a cut-off response and gets no EOS: the model learns to go on there, not to stop (counted as
``unterminated``). Both are tokenized once; the shards hold ``input_ids`` and ``prompt_len`` only, so one
prepare serves every B.

Bad rows are never dropped silently: bad JSON, non-UTF-8 bytes, wrong types, a missing or empty
response, an over-long example each count under their reason in ``stats.json`` (with the first rows
that had them, file and line). A source with no usable row is an error naming the file.
Over-long examples (prompt + response + EOS > ``max_length``) are skipped by default
(``overlong: skip``); ``overlong: truncate`` cuts the response to fit instead (the EOS is lost) and
counts it, and a prompt that alone does not fit is always skipped.

Output (written into a temp dir beside ``--out``, then swapped in): per split Parquet shards
``{split}-{i:05d}-of-{n:05d}.parquet`` with ``input_ids`` list<int32>, ``prompt_len`` int32,
``family``, ``id`` (+ ``prompt`` and ``response`` text in the held-out split), ``meta.json`` and
``stats.json``. :func:`load_split` reads a split back and checks it against ``meta.json``.
"""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from mars.training import suite
from mars.core.atomic import JSON_ERRORS, atomic_dir, json_problem, read_json
from mars.core.digest import sha256_tree
from mars.errors import ConfigError, DataError

FORMAT_VERSION = 1
SPLITS = ("train", "heldout")
BUILTIN = "builtin"
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_PROBLEMS_LISTED = 20  # per split, in stats.json; the counts cover every row


@dataclass
class DataConfig:
    source: str = BUILTIN  # builtin | path to .jsonl/.json/.parquet | datasets name or dataset dir
    n_train: int | None = 12000  # builtin: items generated; other sources: cap on rows (null = all)
    n_heldout: int = 400  # held-out items (builtin: spread evenly over families)
    seed: int = 0
    families: list[str] | None = None  # builtin families to use (null = all)
    max_length: int = 128  # prompt + response + EOS, in tokens
    overlong: Literal["skip", "truncate"] = "skip"
    heldout: str | None = None  # file source: held-out file; datasets: held-out split; null: carve n_heldout rows
    split: str = "train"  # datasets source: the split read as training data
    subset: str | None = None  # datasets source: configuration name
    prompt_column: str = "prompt"
    response_column: str = "response"
    messages_column: str = "messages"  # used when a row has it
    family_column: str = "family"  # optional in the data; rows without it are family "data"
    id_column: str = "id"  # optional in the data; rows without it get "<source>-<row>"
    rows_per_shard: int = 50_000

    def __post_init__(self):
        if self.n_train is not None and self.n_train < 1:
            raise ConfigError("n_train: must be positive (or null for every row)")
        if self.n_heldout < 0:
            raise ConfigError("n_heldout: must be >= 0")
        if self.max_length < 8:
            raise ConfigError("max_length: must be at least 8 tokens")
        if self.rows_per_shard < 1:
            raise ConfigError("rows_per_shard: must be positive")
        if self.source == BUILTIN:
            if self.n_train is None:
                raise ConfigError("n_train: the builtin source needs a number of items")
            if self.families is not None:
                suite.resolve_families(self.families)
        elif self.families is not None:
            raise ConfigError("families: only applies to source: builtin")


# ---- reading raw rows --------------------------------------------------------------------------------


@dataclass
class Problem:
    where: str
    reason: str
    detail: str = ""


@dataclass
class SplitStats:
    rows_read: int = 0
    blank_lines: int = 0  # JSONL lines with nothing on them (not rows)
    kept: int = 0
    truncated: int = 0
    unterminated: int = 0  # finish_reason "length": trained without EOS
    skipped: Counter = field(default_factory=Counter)
    problems: list[dict] = field(default_factory=list)
    families: Counter = field(default_factory=Counter)
    lengths: dict[str, list[int]] = field(default_factory=lambda: {"prompt": [], "response": [], "total": []})

    def skip(self, problem: Problem) -> None:
        self.skipped[problem.reason] += 1
        if len(self.problems) < MAX_PROBLEMS_LISTED:
            self.problems.append({"where": problem.where, "reason": problem.reason, "detail": problem.detail[:200]})

    def to_dict(self) -> dict:
        def summary(xs: list[int]) -> dict:
            if not xs:
                return {}
            s = sorted(xs)
            return {"mean": round(statistics.fmean(s), 2), "min": s[0], "p50": s[len(s) // 2],
                    "p95": s[min(len(s) - 1, int(0.95 * len(s)))], "max": s[-1]}

        return {
            "rows_read": self.rows_read,
            "blank_lines": self.blank_lines,
            "kept": self.kept,
            "skipped": dict(sorted(self.skipped.items())),
            "skipped_total": sum(self.skipped.values()),
            "truncated": self.truncated,
            "unterminated": self.unterminated,
            "families": dict(sorted(self.families.items())),
            "tokens": {k: summary(v) for k, v in self.lengths.items()},
            "problems": self.problems,
        }


BLANK = object()  # what a reader yields for a blank line of a JSONL file


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield where, Problem(where, "non_utf8", str(err))
                continue
            if not line.strip():
                yield where, BLANK  # not a row, but counted
                continue
            try:
                yield where, json.loads(line)
            except JSON_ERRORS as err:
                yield where, Problem(where, "bad_json", json_problem(err))


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except JSON_ERRORS as err:
        raise DataError(f"{path}: not a JSON file ({json_problem(err)}); use .jsonl for one object per line") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of objects at the top level")
    for i, row in enumerate(rows):
        yield f"{path}[{i}]", row


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}#row{i}", row


def _read_datasets(name: str, split: str, subset: str | None) -> Iterator[tuple[str, Any]]:
    try:
        import datasets

        ds = datasets.load_dataset(name, subset, split=split)
    except Exception as err:  # offline, unknown name or split: one clear line
        raise DataError(
            f"data.source: could not load datasets {name!r} split {split!r} "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}). "
            "The hub is unreachable from here: use a local .jsonl/.parquet file or source: builtin."
        ) from None
    for i, row in enumerate(ds):
        yield f"{name}[{split}]#{i}", row


def read_rows(source: str, split: str = "train", subset: str | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, row_or_problem)`` for every row of a file or ``datasets`` source."""
    path = Path(source)
    if path.is_dir():  # a local dataset directory (data files per split), read by `datasets`
        return _read_datasets(str(path), split, subset)
    if path.suffix in FILE_SUFFIXES or path.exists():
        if not path.is_file():
            raise DataError(f"{path}: no such data file")
        reader = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}.get(path.suffix)
        if reader is None:
            raise DataError(f"{path}: unsupported file type (use {', '.join(FILE_SUFFIXES)})")
        return reader(path)
    return _read_datasets(source, split, subset)


# ---- rows -> (prompt text, response text) ------------------------------------------------------------


@dataclass
class Record:
    where: str
    prompt: str  # the last user turn (what the evaluator shows the model)
    rendered_prompt: str  # the chat-templated prompt the tokens come from
    response: str
    family: str
    id: str
    ends: bool = True  # False: the response was cut off at a token limit (no EOS is trained)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")  # UnicodeDecodeError -> non_utf8
    if not isinstance(value, str):
        raise TypeError(type(value).__name__)
    value.encode("utf-8")  # a lone surrogate ("\ud800" in JSON) is no text: UnicodeEncodeError -> non_utf8
    return value


def render_prompt(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def to_record(row: Any, where: str, tokenizer, cfg: DataConfig, default_id: str) -> Record | Problem:
    """Validate one raw row; a :class:`Problem` names why it cannot be used."""
    if isinstance(row, Problem):
        return row
    if not isinstance(row, dict):
        return Problem(where, "not_an_object", type(row).__name__)
    try:
        family = _text(row[cfg.family_column]) if row.get(cfg.family_column) is not None else "data"
        rid = row.get(cfg.id_column)
        rid = default_id if rid is None else str(rid) if isinstance(rid, int) else _text(rid)
        messages = row.get(cfg.messages_column)
        if messages is not None:
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                return Problem(where, "bad_messages", f"{cfg.messages_column} must be a list of objects")
            turns = [{"role": _text(m.get("role")), "content": _text(m.get("content"))} for m in messages]
            if not turns or turns[-1]["role"] != "assistant":
                return Problem(where, "missing_response", "the last message is not an assistant turn")
            users = [t["content"] for t in turns[:-1] if t["role"] == "user"]
            if not users:
                return Problem(where, "missing_prompt", "no user turn before the last assistant turn")
            context, response, prompt = turns[:-1], turns[-1]["content"], users[-1]
        else:
            if row.get(cfg.prompt_column) is None:
                return Problem(where, "missing_prompt", f"no {cfg.prompt_column!r} (or {cfg.messages_column!r})")
            if row.get(cfg.response_column) is None:
                return Problem(where, "missing_response", f"no {cfg.response_column!r}")
            prompt, response = _text(row[cfg.prompt_column]), _text(row[cfg.response_column])
            context = [{"role": "user", "content": prompt}]
        finish = row.get("finish_reason")
        ends = finish is None or _text(finish) != "length"
    except UnicodeError as err:  # bytes that are not UTF-8, or a string holding a lone surrogate
        return Problem(where, "non_utf8", str(err))
    except TypeError as err:
        return Problem(where, "wrong_type", f"expected text, got {err}")
    if not prompt.strip():
        return Problem(where, "empty_prompt")
    if not response.strip():
        return Problem(where, "empty_response")
    return Record(where, prompt, render_prompt(tokenizer, context), response, family, rid, ends)


# ---- tokenizing --------------------------------------------------------------------------------------


def tokenize(records: list[Record], tokenizer, cfg: DataConfig, stats: SplitStats) -> list[dict]:
    """Rows for the shards; over-long ones are skipped or truncated (and counted)."""
    from tqdm.auto import tqdm

    eos = tokenizer.eos_token_id
    rows: list[dict] = []
    chunk = 1024
    for start in tqdm(range(0, len(records), chunk), desc="tokenize", unit="chunk", leave=False,
                      disable=len(records) <= 4 * chunk):
        part = records[start:start + chunk]
        prompts = tokenizer([r.rendered_prompt for r in part], add_special_tokens=False)["input_ids"]
        responses = tokenizer([r.response for r in part], add_special_tokens=False)["input_ids"]
        for rec, p, r in zip(part, prompts, responses):
            if rec.ends:
                r = r + [eos]
            if len(p) + len(r) > cfg.max_length:
                if cfg.overlong == "skip" or len(p) >= cfg.max_length:
                    reason = "too_long" if cfg.overlong == "skip" else "prompt_too_long"
                    stats.skip(Problem(rec.where, reason, f"{len(p)} + {len(r)} tokens > max_length {cfg.max_length}"))
                    continue
                r = r[: cfg.max_length - len(p)]
                stats.truncated += 1
            stats.unterminated += not rec.ends
            rows.append({"input_ids": p + r, "prompt_len": len(p), "family": rec.family, "id": rec.id,
                         "prompt": rec.prompt, "response": rec.response})
            stats.kept += 1
            stats.families[rec.family] += 1
            for key, n in (("prompt", len(p)), ("response", len(r)), ("total", len(p) + len(r))):
                stats.lengths[key].append(n)
    return rows


def _validate(rows: Iterator[tuple[str, Any]], tokenizer, cfg: DataConfig, stats: SplitStats,
              name: str) -> list[Record]:
    records = []
    for i, (where, row) in enumerate(rows):
        if row is BLANK:
            stats.blank_lines += 1
            continue
        stats.rows_read += 1
        rec = to_record(row, where, tokenizer, cfg, f"{name}-{i}")
        if isinstance(rec, Problem):
            stats.skip(rec)
        else:
            records.append(rec)
    if not records:
        reasons = ", ".join(f"{k}: {v}" for k, v in stats.skipped.items()) or "it is empty"
        raise DataError(f"{name}: no usable rows ({stats.rows_read} read; {reasons})")
    return records


def collect(cfg: DataConfig, tokenizer) -> tuple[dict[str, list[Record]], dict[str, SplitStats]]:
    """Validated records per split, and their stats so far."""
    stats = {s: SplitStats() for s in SPLITS}
    if cfg.source == BUILTIN:
        out = {}
        for split, n in (("train", cfg.n_train), ("heldout", cfg.n_heldout)):
            items = suite.generate(split, n, cfg.seed, cfg.families)
            rows = ((f"builtin:{split}:{it.id}", it.to_dict()) for it in items)
            out[split] = _validate(rows, tokenizer, cfg, stats[split], f"builtin {split}") if items else []
        return out, stats
    train = _validate(read_rows(cfg.source, cfg.split, cfg.subset), tokenizer, cfg, stats["train"], cfg.source)
    if cfg.heldout is not None:
        is_file = Path(cfg.heldout).suffix in FILE_SUFFIXES or Path(cfg.heldout).is_file()
        name = cfg.heldout if is_file else f"{cfg.source}[{cfg.heldout}]"
        rows = read_rows(cfg.heldout) if is_file else read_rows(cfg.source, cfg.heldout, cfg.subset)
        held = _validate(rows, tokenizer, cfg, stats["heldout"], name)[: cfg.n_heldout]
    else:
        # Carve the held-out rows out of the source by a seeded draw; the rest stays in source order.
        n_held = min(cfg.n_heldout, len(train) - 1)
        if len(train) - n_held < n_held:
            raise DataError(f"{cfg.source}: {len(train)} usable rows; holding out {n_held} of them (data.n_heldout="
                            f"{cfg.n_heldout}) would leave {len(train) - n_held} to train on: lower data.n_heldout "
                            f"(at most {len(train) // 2}) or give a held-out file (data.heldout)")
        order = list(range(len(train)))
        random.Random(f"mars-data:{cfg.seed}").shuffle(order)
        chosen = set(order[:n_held])
        held = [r for i, r in enumerate(train) if i in chosen]
        train = [r for i, r in enumerate(train) if i not in chosen]
        stats["heldout"].rows_read = len(held)
    # Disjoint by content: a training row whose prompt is also held out would leak the answer.
    held_prompts = {r.rendered_prompt for r in held}
    kept = []
    for r in train:
        if r.rendered_prompt in held_prompts:
            stats["train"].skip(Problem(r.where, "heldout_overlap", "same prompt as a held-out row"))
        else:
            kept.append(r)
    if cfg.n_train is not None:
        kept = kept[: cfg.n_train]
    return {"train": kept, "heldout": held}, stats


# ---- writing and reading shards ----------------------------------------------------------------------


def _schema(split: str):
    import pyarrow as pa

    fields = [("input_ids", pa.list_(pa.int32())), ("prompt_len", pa.int32()), ("family", pa.string()),
              ("id", pa.string())]
    if split == "heldout":
        fields += [("prompt", pa.string()), ("response", pa.string())]
    return pa.schema(fields)


def write_shards(rows: list[dict], split: str, out: Path, rows_per_shard: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema(split)
    n = max(1, -(-len(rows) // rows_per_shard))
    names = []
    for i in range(n):
        part = rows[i * rows_per_shard:(i + 1) * rows_per_shard]
        table = pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in part], schema=schema)
        name = f"{split}-{i:05d}-of-{n:05d}.parquet"
        pq.write_table(table, out / name)
        names.append(name)
    return names


def tokenizer_sha256(model_dir: str | Path) -> str:
    """sha256 over the tokenizer files of a checkpoint dir (the vocabulary the ids refer to)."""
    model_dir = Path(model_dir)
    names = ["tokenizer.json"]
    if not (model_dir / names[0]).is_file():
        names = [p.name for p in model_dir.iterdir() if p.name.startswith(("vocab", "merges", "tokenizer"))]
    return sha256_tree(model_dir, names)


def prepare(cfg: DataConfig, base: str | Path, out: str | Path) -> dict:
    """Tokenize ``cfg``'s source with ``base``'s tokenizer into ``out``; returns meta.json's content."""
    from transformers import AutoConfig

    from mars.core.mask_token import mask_token_id
    from mars.core.models import load_tokenizer

    base, out = Path(base), Path(out)
    if not (base / "config.json").is_file():
        raise DataError(f"{base}: not a base model directory (run `mars base --out {base}` first)")
    tokenizer = load_tokenizer(base)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{base}: the tokenizer has no chat template; prompts cannot be rendered")
    if tokenizer.eos_token_id is None:
        raise DataError(f"{base}: the tokenizer has no EOS token")
    mask_id = mask_token_id(AutoConfig.from_pretrained(base), tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    records, stats = collect(cfg, tokenizer)
    rows = {split: tokenize(records[split], tokenizer, cfg, stats[split]) for split in SPLITS}
    if not rows["train"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in stats["train"].skipped.items())
        raise DataError(f"{cfg.source}: no training example fits max_length {cfg.max_length} ({reasons})")

    meta = {
        "format_version": FORMAT_VERSION,
        "source": cfg.source,
        "base": str(base),
        "tokenizer_sha256": tokenizer_sha256(base),
        "vocab_size": len(tokenizer),
        "mask_token_id": mask_id,
        "pad_token_id": pad_id,
        "eos_token_id": tokenizer.eos_token_id,
        "max_length": cfg.max_length,
        "counts": {split: len(rows[split]) for split in SPLITS},
        "families": {split: dict(sorted(stats[split].families.items())) for split in SPLITS},
        "shards": {},
        "config": asdict(cfg),
    }
    stats_json = {"format_version": FORMAT_VERSION, "source": cfg.source, "max_length": cfg.max_length,
                  "overlong": cfg.overlong, "splits": {s: stats[s].to_dict() for s in SPLITS}}
    with atomic_dir(out) as tmp:
        for split in SPLITS:
            meta["shards"][split] = write_shards(rows[split], split, tmp, cfg.rows_per_shard)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "stats.json").write_text(json.dumps(stats_json, indent=2) + "\n")
    return meta


def load_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "meta.json"
    meta = read_json(path, f"run `mars prepare --out {data_dir}` first", DataError)
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format version {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}: "
                        "run `mars prepare` again")
    return meta


def load_split(data_dir: str | Path, split: str) -> list[dict]:
    """The rows of one split: ``input_ids`` (list of int), ``prompt_len``, ``family``, ``id``
    (+ ``prompt``/``response`` for held-out), checked against ``meta.json``."""
    import pyarrow.parquet as pq

    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    if split not in meta["shards"]:
        raise DataError(f"{data_dir}: no split {split!r} (has {', '.join(meta['shards'])})")
    rows: list[dict] = []
    for name in meta["shards"][split]:
        path = data_dir / name
        if not path.is_file():
            raise DataError(f"{path}: shard listed in meta.json is missing")
        rows.extend(pq.read_table(path).to_pylist())
    if len(rows) != meta["counts"][split]:
        raise DataError(f"{data_dir}: split {split!r} has {len(rows)} rows, meta.json says {meta['counts'][split]}")
    for i, row in enumerate(rows):
        if not 0 < row["prompt_len"] < len(row["input_ids"]) or len(row["input_ids"]) > meta["max_length"]:
            raise DataError(f"{data_dir}: split {split!r} row {i} ({row['id']}) has an invalid prompt_len/length")
    return rows


def check_tokenizer(meta: dict, tokenizer) -> None:
    """Raise DataError when ``tokenizer`` is not the one the data was prepared with (ids would differ)."""
    from mars.core.mask_token import MASK_TOKEN

    for key, actual in (("eos_token_id", tokenizer.eos_token_id), ("vocab_size", len(tokenizer))):
        if meta[key] != actual:
            raise DataError(f"prepared data has {key} {meta[key]}, the model's tokenizer {actual}: "
                            f"prepare again with this base (data was prepared from {meta['base']})")
    if tokenizer.convert_tokens_to_ids(MASK_TOKEN) != meta["mask_token_id"]:
        raise DataError(f"prepared data has mask_token_id {meta['mask_token_id']}, the model's tokenizer differs")
