"""Prompts the base model writes itself: the ``distill.self_prompts`` source (Magpie, Xu et al. 2024).

An instruction-tuned model given its chat template up to the start of a user turn, and nothing else,
writes a user's message: sampled, these are everyday requests in the model's own register (advice,
writing, code, planning), the kind of prompt MARS should be fast on and that no offline data set here
supplies. Each is kept when it ends with the template's end of turn (before any other special token)
within ``max_new_tokens``, is not
empty, is not a repeat (case and spacing ignored) and is not one of the evaluation prompts in ``exclude``;
the distillation then answers them greedily like every other prompt.

Sampling is seeded per batch (``seed`` and the batch's index), so the same model and settings give the
same prompts; batches are cached in the distillation's work folder under a fingerprint of both, and a
killed run samples only the batches it lacks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mars.core.atomic import read_json, write_json, write_jsonl
from mars.core.digest import sha256_file
from mars.errors import ConfigError, DataError, MarsError

FORMAT_VERSION = 2
BATCH = "batch-{:05d}.jsonl"


@dataclass
class SelfPromptsSource:
    n: int = 0  # prompts kept (0: off)
    max_new_tokens: int = 96  # per prompt; one that has not ended its turn by then is dropped
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 32
    seed: int = 0
    max_batches: int | None = None  # give up after this many batches (null: enough for 3n prompts)
    exclude: list[str] = field(default_factory=lambda: ["benchmarks/prompts"])  # .jsonl files or folders of
    # them: prompts never kept (the evaluation sets)

    def __post_init__(self):
        checks = {"n": self.n >= 0, "max_new_tokens": self.max_new_tokens >= 1, "batch_size": self.batch_size >= 1,
                  "temperature": self.temperature > 0, "top_p": 0 < self.top_p <= 1,
                  "max_batches": self.max_batches is None or self.max_batches >= 1}
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"{key}: invalid value {getattr(self, key)!r}")

    def batches(self) -> int:
        return self.max_batches or -(-3 * self.n // self.batch_size)


def normal(text: str) -> str:
    """What makes two prompts the same: case and runs of whitespace ignored."""
    return " ".join(text.lower().split())


def excluded(paths: list[str]) -> set[str]:
    """The normalised ``prompt`` of every row of the ``exclude`` files (a folder: its ``*.jsonl``)."""
    out: set[str] = set()
    for entry in paths:
        path = Path(entry)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not path.exists() or not files:
            raise DataError(f"distill.self_prompts.exclude: {entry}: no such file, or a folder without .jsonl files")
        for file in files:
            for line_no, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    out.add(normal(json.loads(line)["prompt"]))
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise DataError(f"{file}:{line_no}: expected a JSON object with a 'prompt' string") from None
    return out


def user_turn(tokenizer) -> tuple[str, str]:
    """The chat template's text before a user's message (system turn included) and the end-of-turn token after it."""
    marker = "\u2063MARS\u2063"
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("distill.self_prompts: the base's tokenizer has no chat template (the source needs an "
                          "instruction-tuned model)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    before, _, after = text.partition(marker)
    end = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    if not after or not end:
        raise ConfigError("distill.self_prompts: the chat template does not close the user turn")
    return before, tokenizer.convert_ids_to_tokens(end[0])


def _fingerprint(src: SelfPromptsSource, digest: str, dtype: str) -> dict:
    import torch
    import transformers

    sampling = {k: v for k, v in asdict(src).items() if k not in ("n", "max_batches", "exclude")}
    return {"format_version": FORMAT_VERSION, "generator_sha256": digest, "dtype": dtype, "sampling": sampling,
            "code_sha256": sha256_file(__file__), "torch": torch.__version__,
            "transformers": transformers.__version__}


def _sample(model, tokenizer, src: SelfPromptsSource, prefix: str, end_token: str, index: int) -> list[dict]:
    import torch

    ids = tokenizer(prefix, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
    ids = ids.repeat(src.batch_size, 1)
    end = tokenizer.convert_tokens_to_ids(end_token)
    # any other special token (end of text, a new turn's header) ends the sample too, and spoils it
    special = set(tokenizer.all_special_ids) - {end}
    torch.manual_seed(src.seed * 1_000_003 + index)  # each batch its own seed: a resumed run samples the same
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=src.temperature,
                         top_p=src.top_p, top_k=0, max_new_tokens=src.max_new_tokens,
                         eos_token_id=[end, *sorted(special)], pad_token_id=end)
    rows = []
    for k, seq in enumerate(out[:, ids.shape[1]:].tolist()):
        stop = next((i for i, t in enumerate(seq) if t == end or t in special), None)
        ended = stop is not None and seq[stop] == end
        text = tokenizer.decode(seq[:stop], skip_special_tokens=True)
        rows.append({"id": f"self-{index}-{k}", "prompt": text.strip(), "ended": ended})
    return rows


def generate(src: SelfPromptsSource, base: str | Path, work: str | Path, *, dtype: str, device: str, digest: str,
             log=print) -> tuple[list[dict], dict]:
    """``src.n`` prompts written by ``base`` (rows ``id``, ``prompt``) and the counts of what was dropped."""
    work = Path(work)
    skip = excluded(src.exclude)
    fingerprint = _fingerprint(src, digest, dtype)
    try:
        same = read_json(work / "fingerprint.json") == fingerprint
    except MarsError:
        same = False
    if not same:  # another model or sampling: its batches are not these
        for old in work.glob("batch-*.jsonl"):
            old.unlink()
        write_json(work / "fingerprint.json", fingerprint)
    kept: list[dict] = []
    seen: set[str] = set()
    counts = {"sampled": 0, "unended": 0, "empty": 0, "repeated": 0, "evaluation": 0}
    model = tokenizer = None
    for index in range(src.batches()):
        if len(kept) >= src.n:
            break
        path = work / BATCH.format(index)
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            if model is None:
                from mars.core.models import load_model

                model, tokenizer = load_model(base, dtype=dtype, device=device)
                prefix, end_token = user_turn(tokenizer)
            rows = _sample(model, tokenizer, src, prefix, end_token, index)
            write_jsonl(path, rows)  # atomic: a batch is whole or absent
        for row in rows:
            counts["sampled"] += 1
            key = normal(row["prompt"])
            reason = ("unended" if not row["ended"] else "empty" if not key else "repeated" if key in seen
                      else "evaluation" if key in skip else None)
            if reason is not None:
                counts[reason] += 1
                continue
            seen.add(key)
            if len(kept) < src.n:
                kept.append({"id": row["id"], "prompt": row["prompt"]})
    if len(kept) < src.n:
        raise DataError(f"distill.self_prompts: {len(kept)} usable prompts of {src.n} after {counts['sampled']} "
                        f"samples ({counts}); raise max_batches or max_new_tokens")
    log(f"self_prompts: {len(kept)} prompts kept of {counts['sampled']} sampled ({counts})")
    return kept, counts
