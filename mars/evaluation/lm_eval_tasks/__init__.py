"""lm-evaluation-harness tasks on data the project ships: they run offline, with no hub.

- ``mars_heldout``: the default profile's held-out suite (:func:`mars.training.suite.heldout`, 400 items,
  seed 0), scored per family as ``mars evaluate``'s ``heldout`` benchmark scores it;
- ``mars_gsm``: 100 ``reasoning-gym`` ``gsm_symbolic`` problems (seed 0), with the prompt and the
  final-number scorer of the ``gsm`` benchmark.

Each YAML reads its JSONL next to it (:mod:`.data`). ``mars lm-eval`` adds this folder to lm-eval's
``--include_path``; with plain ``lm_eval`` pass ``--include_path`` yourself.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
