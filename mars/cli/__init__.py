"""The ``mars`` command: one verb per pipeline stage.

Each verb lives in its own module, which exposes ``cli(argv: list[str]) -> int`` and parses its own
arguments. Modules are imported only when their verb runs: importing transformers costs ~10 s here.
"""

from __future__ import annotations

import importlib
import sys

# verb -> (module, one-line help). The module's ``cli`` owns the verb's arguments.
VERBS: dict[str, tuple[str, str]] = {
    "base": ("mars.training.base", "build the base model of a profile (tiny: tokenizer + random init; smollm2: GGUF -> safetensors)"),
    "prepare": ("mars.training.data", "tokenize instruction data into B-independent dual-stream shards + stats"),
    "train": ("mars.training.trainer", "train one stage: sft (AR), mars (MARS) or ar_control (AR continued)"),
    "generate": ("mars.decoding.loop", "decode prompts with a MARS checkpoint at block size B and threshold tau"),
    "bench-decode": ("mars.decoding.speed", "side-by-side decoding speed against HF generate with KV cache"),
    "evaluate": ("mars.evaluation.evaluate", "score checkpoints on benchmarks over a tau sweep; metrics, plots, report"),
    "gate": ("mars.evaluation.gate", "decide promotion: MARS at tau=1.0 vs the AR baseline"),
    "export": ("mars.release.export", "export the fixed-B block forward to ONNX (and TensorRT where CUDA is present)"),
    "promote": ("mars.release.promote", "publish a gated release to the artifact store and move the stage pointer"),
    "pull": ("mars.release.promote", "fetch and verify a promoted release into a directory"),
    "store": ("mars.release.store", "list releases in the artifact store; point the DVC remote at it (configure-dvc)"),
    "params": ("mars.config", "show or validate params.yaml as the stages see it"),
}


def _usage() -> str:
    width = max(map(len, VERBS))
    lines = ["usage: mars VERB [options]   (mars VERB --help for a verb's options)", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {help_}" for verb, (_, help_) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if argv[0] in {"-V", "--version"}:
        from mars import __version__

        print(f"mars {__version__}")
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"mars: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    from mars.errors import MarsError

    try:
        return int(module.cli(rest, verb=verb) or 0)
    except MarsError as err:
        # Expected failures (bad params, missing files, unreachable store) get one clear line,
        # not a traceback.
        print(f"mars {verb}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
