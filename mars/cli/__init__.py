"""The ``mars`` command: one verb per pipeline stage, and the only place that parses argv or params.yaml.

Each verb has a module here (``mars.cli.train`` for ``mars train`` ...) with ``main(argv, verb) -> int``;
it reads its options and params sections into the library's typed configs, calls the library and
prints the result. A verb's module is imported only when the verb runs: importing transformers
costs ~10 s here, and ``mars --help`` should not pay it.
"""

from __future__ import annotations

import importlib
import sys

# verb -> (module, one-line help). The module's ``main`` owns the verb's arguments.
VERBS: dict[str, tuple[str, str]] = {
    "base": ("mars.cli.base", "build the base model of a profile (tiny: tokenizer + random init; smollm2: GGUF -> safetensors)"),
    "distill": ("mars.cli.distill", "the base model's own greedy responses to a prompt pool (self-distillation data)"),
    "prepare": ("mars.cli.prepare", "tokenize instruction data into B-independent dual-stream shards + stats"),
    "train": ("mars.cli.train", "train one stage: sft (AR), mars (MARS) or ar_control (AR continued)"),
    "generate": ("mars.cli.generate", "decode prompts with a MARS checkpoint at block size B and threshold tau"),
    "bench-decode": ("mars.cli.bench_decode", "side-by-side decoding speed against HF generate with KV cache"),
    "evaluate": ("mars.cli.evaluate", "score checkpoints on benchmarks over a tau sweep; metrics, plots, report"),
    "lm-eval": ("mars.cli.lm_eval", "lm-evaluation-harness's command line with the mars model (--model mars --model_args tau=...)"),
    "gate": ("mars.cli.gate", "decide promotion: MARS at tau=1.0 vs the AR baseline"),
    "export": ("mars.cli.export", "export the fixed-B block forward to ONNX (and TensorRT where CUDA is present)"),
    "promote": ("mars.cli.promote", "publish a gated release to the artifact store and move the stage pointer"),
    "pull": ("mars.cli.promote", "fetch and verify a promoted release into a directory"),
    "serve": ("mars.cli.serve", "OpenAI-compatible service of a release: continuous batching, tau per request and "
                                "under load"),
    "store": ("mars.cli.store", "list releases in the artifact store; point the DVC remote at it (configure-dvc)"),
    "params": ("mars.cli.params", "show and validate params.yaml as the stages see it"),
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
        return int(module.main(rest, verb=verb) or 0)
    except MarsError as err:
        # Expected failures (bad params, missing files, unreachable store) get one clear line,
        # not a traceback.
        print(f"mars {verb}: error: {err}", file=sys.stderr)
        return 1
