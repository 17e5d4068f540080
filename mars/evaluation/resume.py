"""What ``mars evaluate --work DIR`` keeps between runs: each finished decoding, so a killed evaluation resumes.

An evaluation of three checkpoints takes an hour on a CPU; a machine that goes away mid-way (DVC starts a
stage over, removing its outputs) would otherwise decode every entry again. Each ``<checkpoint>/<benchmark>/
<point>`` decoding, once finished, is written to the work folder: what was decoded per item (token ids,
text, forwards), then a small record with a fingerprint of everything that decides it (the checkpoint's
digest, the benchmark's config and items, the decoding settings, the decoding code and the library
versions) and the seconds it took. A later run takes a decoding whose fingerprint is the same and decodes
the others; scores, agreement and the gate's inputs are computed again from the text, so a scorer's fix
reaches every kept decoding.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import cache
from pathlib import Path

from mars.core.atomic import read_json, write_json, write_jsonl
from mars.core.digest import sha256_bytes
from mars.errors import MarsError
from mars.evaluation.metric_key import MetricKey


@cache
def decoder_version() -> dict:
    """The code and libraries that decide a decoding: mars.decoding's sources, model loading, torch and
    transformers versions."""
    import torch
    import transformers

    import mars.core.models
    import mars.decoding

    sources = sorted(Path(mars.decoding.__file__).parent.glob("*.py")) + [Path(mars.core.models.__file__)]
    code = sha256_bytes(b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in sources))
    return {"code_sha256": code, "torch": torch.__version__, "transformers": transformers.__version__}


def fingerprint(key: MetricKey, digest: str | None, bench, items: list, settings: dict) -> dict:
    """Everything that decides one decoding (``bench``: the benchmark object, ``items`` the ones decoded,
    ``settings`` the decoding's own: block size, dtype, attention, cache, batch size, tree)."""
    listed = json.dumps([[it.id, it.prompt] for it in items], ensure_ascii=False).encode()
    return {"key": key.format(), "checkpoint_sha256": digest, "benchmark": asdict(bench.config),
            "items_sha256": sha256_bytes(listed), "settings": settings, "decoder": decoder_version()}


class Resume:
    """The finished decodings under ``root`` (None: nothing kept, nothing reused)."""

    def __init__(self, root: str | Path | None):
        self.root = None if root is None else Path(root)
        self.reused = 0

    def _record(self, key: MetricKey) -> Path:
        return key.outputs_path(self.root).with_suffix(".json")

    def get(self, key: MetricKey, print_: dict, ids: list[str]) -> tuple[list[dict], float] | None:
        """The decoded rows (one per id of ``ids``, in order) and decoding seconds of ``key`` when a finished
        decoding with this fingerprint is kept."""
        if self.root is None or print_["checkpoint_sha256"] is None or not self._record(key).is_file():
            return None  # (a checkpoint without a digest, a hub name: nothing vouches that it is the same)
        try:
            record = read_json(self._record(key))
            if record.get("fingerprint") != print_:
                return None
            lines = key.outputs_path(self.root).read_text(encoding="utf-8").splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
        except (MarsError, OSError, ValueError):
            return None  # a half-written or foreign file: decode again
        if len(rows) != record.get("n") or [r.get("id") for r in rows] != ids:
            return None
        self.reused += 1
        return rows, float(record["seconds"])

    def put(self, key: MetricKey, print_: dict, rows: list[dict], seconds: float) -> None:
        """Keep a finished decoding: the rows first, then the record that vouches for them."""
        if self.root is None or print_["checkpoint_sha256"] is None:
            return
        self._record(key).unlink(missing_ok=True)  # killed between the two writes: no record vouches for the rows
        write_jsonl(key.outputs_path(self.root), rows)
        write_json(self._record(key), {"fingerprint": print_, "n": len(rows), "seconds": seconds})
