"""``mars lm-eval``: lm-evaluation-harness's own command line, with the ``mars`` model registered.

lm-eval 0.4.13 finds ``--model`` names only in its registry, which imports fill (no entry points or
plugins), so the plain ``lm_eval`` command cannot know ``mars``. This verb imports
:mod:`mars.evaluation.lm_eval_model`, then hands its arguments to lm-eval's command line: every
``lm_eval`` option and subcommand works (``mars lm-eval --model mars --model_args
pretrained=DIR,tau=0.9,block_size=4,batch_size=16 --tasks gsm8k_cot``, ``mars lm-eval ls tasks``).
Two additions: the local tasks (``mars/evaluation/lm_eval_tasks``) are on ``--include_path``, and a run
checks its tasks before any model loads (:func:`mars.evaluation.harness.check_tasks`: a hub data set
offline fails with one line).
"""

from __future__ import annotations


def main(argv: list[str], verb: str = "lm-eval") -> int:
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    import mars.evaluation.lm_eval_model  # noqa: F401  (registers "mars")
    from mars.evaluation import harness
    from mars.evaluation.lm_eval_tasks import TASKS_DIR

    setup_logging()
    cli = HarnessCLI()
    commands = cli._subparsers.choices
    if len(argv) > 1 and argv[0] not in commands:  # lm-eval's legacy form: no subcommand means run
        argv = ["run", *argv]
    args = cli._parser.parse_args(argv)
    if args.command in commands:
        extra = [args.include_path] if args.include_path else []
        args.include_path = [str(TASKS_DIR), *extra]  # lm-eval's TaskManager takes a list
        if args.command == "run" and args.tasks:
            manager = harness.task_manager(extra, names=[n for n in args.tasks if not n.endswith(".yaml")])
            names = [m for name in args.tasks if not name.endswith(".yaml")  # a task file: lm-eval reads it
                     for m in (manager.match_tasks([name]) or [name])]
            harness.check_tasks(names, manager, getattr(args, "confirm_run_unsafe_code", False))
    cli.execute(args)
    return 0
