"""The local tasks' data: written from the project's own generators, read by lm-eval from this folder.

lm-eval hands a task's ``data_files`` to ``datasets.load_dataset`` as they are, and relative paths
resolve against the working directory. So the YAMLs name their files relative to this folder and load
them through :func:`load` (lm-eval's ``custom_dataset`` hook): the tasks work from any directory.
After changing a generator, rewrite the files with ``python -m mars.evaluation.lm_eval_tasks.data``
(a test fails while they are stale).
"""

from __future__ import annotations

from mars.evaluation.lm_eval_tasks import TASKS_DIR

HELDOUT_FILE, GSM_FILE = "mars_heldout.jsonl", "mars_gsm.jsonl"
# The default profile's held-out split (data.n_heldout, data.seed) and the gsm benchmark's item pool.
HELDOUT_ITEMS, GSM_ITEMS, SEED = 400, 100, 0
GSM_DATASET = "gsm_symbolic"


def heldout_rows(n: int = HELDOUT_ITEMS, seed: int = SEED) -> list[dict]:
    from mars.training import suite

    return [{"id": it.id, "family": it.family, "prompt": it.prompt, "response": it.response}
            for it in suite.heldout(n, seed)]


def gsm_rows(n: int = GSM_ITEMS, seed: int = SEED) -> list[dict]:
    """The ids are those of ``mars evaluate``'s ``gsm`` benchmark for the same seed."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(GSM_DATASET, size=n, seed=seed)
    return [{"id": f"{GSM_DATASET}-{seed}-{i}", "question": row["question"], "answer": str(row["answer"])}
            for i, row in enumerate(ds)]


FILES = {HELDOUT_FILE: heldout_rows, GSM_FILE: gsm_rows}


def write() -> None:
    from mars.core.atomic import write_jsonl

    for name, rows in FILES.items():
        write_jsonl(TASKS_DIR / name, rows())


def load(data_files: dict[str, str], **_):
    """``custom_dataset`` of the local tasks: their JSONL files, named relative to this folder.

    lm-eval calls it with the task's metadata and ``dataset_kwargs`` as keywords; only
    ``data_files`` is ours, the rest (version, model arguments) is not about the data.
    """
    import datasets

    return datasets.load_dataset("json", data_files={split: str(TASKS_DIR / name) for split, name in data_files.items()})


if __name__ == "__main__":
    write()
