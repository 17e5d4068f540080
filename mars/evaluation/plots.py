"""Offline pictures and the markdown report of an evaluation.

``dvc plots show`` writes HTML that loads vega from a CDN, so the pictures are also rendered here with
matplotlib (Agg, no display, no network): accuracy vs tokens/forward per benchmark (one curve per
checkpoint, points labelled with tau) and the training curves from ``metrics/train_<stage>.tsv``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from mars.core.atomic import atomic_path, write_text
from mars.evaluation.metric_key import MetricKey, sweep_order

FIGURES = "figures"  # PNGs; eval/plots/ holds only the dvc plots data series


def _save(fig, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (atomically) and free it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def by_benchmark(metrics: dict) -> dict[str, dict[str, list[dict]]]:
    """benchmark -> checkpoint -> entries: the tau sweep from 1.0 down, then the lossless point."""
    out: dict[str, dict[str, list[dict]]] = {}
    for key, entry in metrics.items():
        ckpt, bench, _ = MetricKey.parse(key)
        out.setdefault(bench, {}).setdefault(ckpt, []).append(entry)
    for per_ckpt in out.values():
        for rows in per_ckpt.values():
            rows.sort(key=lambda e: sweep_order(e["tau"]))
    return out


def plot_accuracy_vs_speed(bench: str, per_ckpt: dict[str, list[dict]], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for ckpt, rows in per_ckpt.items():
        sweep = [r for r in rows if r["tau"] is not None]
        xs, ys = [r["tokens_per_forward"] for r in sweep], [100 * r["score"] for r in sweep]
        color = ax.plot(xs, ys, marker="o", label=ckpt)[0].get_color()
        for r, x, y in zip(sweep, xs, ys):
            ax.annotate(f"{r['tau']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        for r in rows:  # the lossless mode: the tau = 1.0 output, off the curve in tokens/forward
            if r["tau"] is None:
                x, y = r["tokens_per_forward"], 100 * r["score"]
                ax.plot([x], [y], marker="*", markersize=12, linestyle="none", color=color)
                ax.annotate("lossless", (x, y), textcoords="offset points", xytext=(6, -10), fontsize=8)
    ax.set_xlabel("tokens / forward")
    ax.set_ylabel("score (%)")
    ax.set_title(f"{bench}: accuracy vs decoding speed (labels: tau; star: lossless)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def read_train_tsv(path: Path) -> dict[str, list[float]]:
    """Columns of a trainer TSV as floats (empty cells -> nan)."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        cols: dict[str, list[float]] = {name: [] for name in reader.fieldnames or []}
        for row in reader:
            for name in cols:
                try:
                    cols[name].append(float(row[name]))
                except (TypeError, ValueError):
                    cols[name].append(math.nan)
    return cols


def running_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` finite values (nan where none yet)."""
    out, total, kept = [], 0.0, []
    for v in values:
        if not math.isnan(v):
            kept.append(v)
            total += v
            if len(kept) > window:
                total -= kept.pop(0)
        out.append(total / len(kept) if kept else math.nan)
    return out


def plot_training(tsvs: dict[str, Path], path: Path) -> Path | None:
    curves = {stage: read_train_tsv(p) for stage, p in tsvs.items()}
    curves = {s: c for s, c in curves.items() if c.get("step")}
    if not curves:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for stage, cols in curves.items():
        for ax, name in zip(axes, ("loss", "l_mask", "l_ar")):
            values = cols.get(name, [])
            # AR stages have no noisy stream: their l_mask column is all zero, not a curve
            if not values or all(math.isnan(v) or v == 0 for v in values):
                continue
            # per-step losses of small batches are noisy: the raw steps faint, a running mean on top
            raw = ax.plot(cols["step"], values, alpha=0.2, linewidth=0.8)[0]
            ax.plot(cols["step"], running_mean(values, max(1, len(values) // 50)), color=raw.get_color(),
                    label=stage)
    for ax, name in zip(axes, ("loss", "l_mask (noisy stream)", "l_ar (clean stream)")):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if any(line.get_label() and not line.get_label().startswith("_") for line in ax.lines):
            ax.legend()
    return _save(fig, path)


def _table(per_ckpt: dict[str, list[dict]]) -> list[str]:
    # agreement with evaluate.reference (mars.evaluation.agreement), where it was measured, over its items
    agreement = any("agree_exact" in r for rows in per_ckpt.values() for r in rows)
    extra = " agrees % (items) | matched prefix | ref log-prob |" if agreement else ""
    lines = ["| checkpoint | tau | score | tokens/forward | forwards | seconds | tokens/s | n |" + extra,
             "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if agreement else "")]
    for ckpt, rows in per_ckpt.items():
        for r in rows:
            tau = "lossless" if r["tau"] is None else f"{r['tau']:g}"
            more = (f" {100 * r['agree_exact']:.1f} ({r.get('agreement_n', r['n'])}) | {r['agree_prefix']:.1f} | "
                    f"{r['ref_logprob']:.3f} |" if agreement else "")
            # a tau = 1.0 entry taken from the lossless decode (fp32) has no time of its own
            timing = ("from lossless | - " if r.get("derived_from") else
                      f"{r['seconds']:.2f} | {r['tokens_per_s']:.0f}")
            lines.append(f"| {ckpt} | {tau} | {100 * r['score']:.1f} | {r['tokens_per_forward']:.2f} | "
                         f"{r['forwards']} | {timing} | {r['n']} |" + more)
    return lines


def write_report(metrics: dict, out_dir: Path, images: dict[str, Path], training: Path | None,
                 checkpoints: dict[str, str] | None = None) -> Path:
    lines = ["# MARS evaluation report", ""]
    if checkpoints:
        lines += ["Checkpoints: " + ", ".join(f"`{n}` ({p})" for n, p in checkpoints.items()), ""]
    lines += ["Scores in %, greedy decoding; tokens/forward = generated tokens / decoding forward passes "
              "(tau = 1.0 is plain AR: 1.00; lossless gives the tau = 1.0 output with the mask slots as verified "
              "drafts). Per-item outputs: `<checkpoint>/<benchmark>/tau=<tau>.jsonl` and `lossless.jsonl`.", ""]
    for bench, per_ckpt in by_benchmark(metrics).items():
        lines += [f"## {bench}", ""] + _table(per_ckpt) + [""]
        if bench in images:
            lines += [f"![{bench}: accuracy vs tokens/forward]({images[bench].relative_to(out_dir).as_posix()})", ""]
    if training is not None:
        lines += ["## Training curves", "", f"![training curves]({training.relative_to(out_dir).as_posix()})", ""]
    path = out_dir / "report.md"
    write_text(path, "\n".join(lines))
    return path


def render_all(metrics: dict, out_dir: str | Path, *, train_metrics_dir: str | Path | None = None,
               checkpoints: dict[str, str] | None = None) -> Path:
    """Every PNG and report.md under ``out_dir``; returns the report's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = {bench: plot_accuracy_vs_speed(bench, per_ckpt, out_dir / FIGURES / f"{bench}.png")
              for bench, per_ckpt in by_benchmark(metrics).items()}
    tsvs = {}
    if train_metrics_dir is not None and Path(train_metrics_dir).is_dir():
        tsvs = {p.stem.removeprefix("train_"): p for p in sorted(Path(train_metrics_dir).glob("train_*.tsv"))}
    training = plot_training(tsvs, out_dir / FIGURES / "training.png") if tsvs else None
    return write_report(metrics, out_dir, images, training, checkpoints)
