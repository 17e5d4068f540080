"""Block forward latency on CPU: the exported graph on onnxruntime vs the PyTorch model in eager mode.

Both run the same call (batch x W window against a prefix KV cache, the step of the block-level cache
decoder) on the same inputs with the same number of threads; the script prints the median latency of
each at a few prefix lengths and the ratio PyTorch / onnxruntime (> 1: onnxruntime is faster).

    python benchmarks/bench_export.py                          # default model (see below)
    python benchmarks/bench_export.py --export exports/mars    # an existing export
    python benchmarks/bench_export.py --checkpoint checkpoints/mars/final -S export.batch_size=8

Without --export/--checkpoint it uses exports/mars, else checkpoints/mars/final (exported to a temp
dir), else the default profile's base model (`model:` in params.yaml, random weights: latency does
not depend on them) turned into a MARS checkpoint in a temp dir.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mars.cli.options import add_params_arguments, params_from_args, stand_in_from_params
from mars.config import section
from mars.decoding.onnx_backend import ExportedBlock
from mars.release.export import ExportConfig, block_forward, example_inputs, export_checkpoint
from mars.core.models import load_model


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_params_arguments(parser)
    parser.add_argument("--export", help="an export directory (mars export output)")
    parser.add_argument("--checkpoint", help="a MARS checkpoint to export first (into a temp dir)")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per measurement (median)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for both runtimes")
    args = parser.parse_args(argv)
    params = params_from_args(args)
    cfg = section(params, "export", ExportConfig)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench_export-") as tmp:
        export_dir = Path(args.export) if args.export else None
        checkpoint = Path(args.checkpoint) if args.checkpoint else None
        if export_dir is None and checkpoint is None:
            if Path("exports/mars/manifest.json").is_file():
                export_dir = Path("exports/mars")
            elif Path("checkpoints/mars/final/config.json").is_file():
                checkpoint = Path("checkpoints/mars/final")
            else:
                print("bench_export: no export or MARS checkpoint here; using the default base model", file=sys.stderr)
                checkpoint = stand_in_from_params(params, Path(tmp) / "checkpoint")
        if export_dir is None:
            export_dir = Path(tmp) / "export"
            cfg.tensorrt = False
            export_checkpoint(checkpoint, export_dir, cfg, log=lambda msg: print(msg, file=sys.stderr))

        engine = ExportedBlock(export_dir, intra_op_threads=args.threads)
        model, _ = load_model(engine.manifest["checkpoint"]["path"] if checkpoint is None else checkpoint)
        module, spec = block_forward(model), engine.spec
        n_params = sum(p.numel() for p in model.parameters())
        print(f"block forward: {type(model).__name__} {n_params / 1e6:.2f}M params, batch {spec.batch_size}, "
              f"W {spec.window}, {args.threads} thread(s), median of {args.iters} calls")
        print(f"{'prefix':>8} {'pytorch eager ms':>17} {'onnxruntime ms':>15} {'ratio':>7}")
        ratios = []
        for prefix in sorted({0, spec.max_prefix // 2, spec.max_prefix}):
            inputs = example_inputs(spec, [prefix] * spec.batch_size, prefix,
                                    generator=torch.Generator().manual_seed(0))
            arrays = [t.numpy() for t in inputs]
            with torch.inference_mode():
                eager = median_ms(lambda: module(*inputs), args.iters)
            ort = median_ms(lambda: engine(*arrays), args.iters)
            ratios.append(eager / ort)
            print(f"{prefix:>8} {eager:>17.3f} {ort:>15.3f} {eager / ort:>6.2f}x")
        print(f"onnxruntime vs PyTorch eager: {statistics.geometric_mean(ratios):.2f}x faster (geometric mean)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
