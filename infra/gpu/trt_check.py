"""GPU check: build the TensorRT block forward of a MARS checkpoint, print its parity and latency.

Runs `mars export` (ONNX + TensorRT) on one CUDA machine and prints, from the manifest it writes:
the TensorRT engine's logits against PyTorch eager on the same GPU (same dtype and fp32) at prefix
lengths 0 .. max, the argmax agreement, and the latency of one block forward call, TensorRT vs eager.
The default profile's model takes well under 5 minutes (most of it the TensorRT build).

    pip install torch==2.13.0 torch-tensorrt==2.13.0   # CUDA wheels + TensorRT (NVIDIA index)
    pip install -e .                                     # the project
    python infra/gpu/trt_check.py                        # checkpoints/mars/final, else a stand-in
    python infra/gpu/trt_check.py --checkpoint DIR --out exports/mars -S export.trt_dtype=bfloat16

Without a trained checkpoint (a bare GPU machine) it builds the profile's base model with random
weights as a stand-in MARS checkpoint: timings depend on shapes only, and parity is measured all the
same. Exit status: 0 when the engine was built, 2 when CUDA or torch-tensorrt is missing (the reason
is printed: nothing pretends an engine was built), 1 on any other error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from mars.cli.options import add_params_arguments, params_from_args, stand_in_from_params
from mars.config import section
from mars.errors import MarsError
from mars.release.export import ExportConfig, export_checkpoint, tensorrt_unavailable_reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_params_arguments(parser)
    parser.add_argument("--checkpoint", default="checkpoints/mars/final",
                        help="MARS checkpoint (default: checkpoints/mars/final; a stand-in when missing)")
    parser.add_argument("--out", help="export directory to keep (default: a temp dir, removed at the end)")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    reason = tensorrt_unavailable_reason()
    if reason is not None:
        print(f"tensorrt: unavailable ({reason})")
        return 2
    import torch
    import torch_tensorrt

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, torch_tensorrt {torch_tensorrt.__version__}")
    params = params_from_args(args)
    cfg = section(params, "export", ExportConfig)
    cfg.tensorrt = True
    with tempfile.TemporaryDirectory(prefix="trt_check-") as tmp:
        checkpoint = Path(args.checkpoint)
        if not (checkpoint / "config.json").is_file():
            print(f"{checkpoint}: no checkpoint; building a stand-in (profile base model, random weights)")
            checkpoint = stand_in_from_params(params, Path(tmp) / "checkpoint")
        out = Path(args.out) if args.out else Path(tmp) / "export"
        try:
            manifest = export_checkpoint(checkpoint, out, cfg)
        except MarsError as err:
            print(f"trt_check: error: {err}", file=sys.stderr)
            return 1
        trt = manifest["tensorrt"]
        block = manifest["block"]
        print(f"\nblock forward: batch {block['batch_size']}, W {block['window']}, prefix axis "
              f"{json.dumps(trt.get('past_axis'))}, dtype {trt.get('dtype')}")
        print(f"onnx parity (fp32, onnxruntime CPU): max |logits diff| {manifest['onnx']['parity']['max_abs_logits']:.3g}")
        if trt["status"] != "built":
            print(f"tensorrt: {trt['status']} ({trt.get('reason', '')})")
            return 2
        print(f"tensorrt: built in {trt['build_s']} s -> {out / trt['file']}")
        print(f"{'prefix':>8} {'|d| vs eager same dtype':>24} {'|d| vs eager fp32':>18} {'argmax agree':>13}")
        for prefix, row in trt["parity"].items():
            print(f"{prefix:>8} {row['max_abs_logits_vs_eager_same_dtype']:>24.4g} "
                  f"{row['max_abs_logits_vs_eager_fp32']:>18.4g} {row['argmax_agreement_vs_eager_fp32']:>13.3f}")
        lat = trt["latency_ms"]
        print(f"latency per block forward: tensorrt {lat['tensorrt']:.3f} ms, pytorch eager {lat['eager']:.3f} ms "
              f"({lat['speedup']:.2f}x)")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
