"""A training run's metrics: one TSV row per optimizer step, and a JSON summary of its final step."""

from __future__ import annotations

import csv
from pathlib import Path

from mars.core.atomic import write_json, write_text

METRIC_COLUMNS = ("step", "epoch", "loss", "l_mask", "l_ar", "lr", "tokens_per_s")
SUMMARY_COLUMNS = ("step", "epoch", "loss", "l_mask", "l_ar", "lr")  # tokens_per_s left out: not reproducible


class MetricsLog:
    """One TSV row per optimizer step (``dvc plots`` reads it); a resumed run continues it.

    Resuming from step N keeps rows 1..N and drops rows a killed run logged after its last checkpoint,
    so the file holds each step once. The file is a ``persist`` DVC output: ``dvc repro`` leaves it in
    place for the resumed run to continue.
    """

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        kept = []
        if resume_step and path.is_file():
            with path.open() as fh:
                kept = [r for r in csv.DictReader(fh, delimiter="\t") if int(r["step"]) <= resume_step]
        lines = ["\t".join(METRIC_COLUMNS)] + ["\t".join(r[c] for c in METRIC_COLUMNS) for r in kept]
        write_text(path, "\n".join(lines) + "\n")
        self.fh = path.open("a")

    def write(self, row: dict) -> None:
        self.fh.write("\t".join(_fmt(row[c]) for c in METRIC_COLUMNS) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def _fmt(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def summary_path(metrics_path: Path) -> Path:
    """``metrics/train_<stage>.json`` beside the TSV: the final step's numbers, for ``dvc metrics`` and
    ``dvc exp show`` (which read JSON summaries, not per-step TSVs)."""
    return Path(metrics_path).with_suffix(".json")


def step_summary(last: dict) -> dict:
    """The reproducible part of a logged step (its throughput left out)."""
    return {c: last[c] for c in SUMMARY_COLUMNS if c in last}


def write_summary(metrics_path: Path, last: dict) -> Path:
    """The summary of a finished run whose final step logged ``last`` (empty: a run of 0 steps)."""
    path = summary_path(metrics_path)
    write_json(path, step_summary(last) if last else {"step": 0})
    return path
