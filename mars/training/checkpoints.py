"""The checkpoints a training run writes into its folder, and which of them a resume may load.

Step checkpoints (``<out>/steps/step-NNNNNNNN``) hold model, optimizer, scheduler, RNG states and the
step (which fixes the data position); they are written to a temporary folder and renamed, so a
killed run leaves either a complete checkpoint or none. A resume loads only what the trainer wrote,
in forms that run no code: weights through safetensors, optimizer and RNG states through
``torch.load(weights_only=True)``, step and scheduler state as JSON (:func:`check_step_checkpoint`
refuses anything else before it is read), and only a checkpoint of the same run (the fingerprint
the trainer saves with it, :func:`resume_from`). The final model is a ``save_pretrained`` folder
(``<out>/final``) with the tokenizer and a ``mars`` section in its config.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

from mars.core.atomic import atomic_dir, read_json, replace_dir
from mars.core.checkpoint_info import CheckpointInfo
from mars.errors import MarsError

STEP_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
TORCH_STATE_SUFFIXES = (".bin", ".pkl", ".pt")  # accelerate's optimizer / RNG / grad-scaler files


def step_dir(out: Path, step: int) -> Path:
    return out / "steps" / f"{STEP_PREFIX}{step:08d}"


def complete_checkpoints(out: Path) -> list[Path]:
    """Finished step checkpoints under ``out/steps``, oldest first (temporary folders are skipped)."""
    root = out / "steps"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def resolve_resume(resume: str, out: Path) -> Path | None:
    if resume == "no":
        return None
    if resume == "auto":
        found = complete_checkpoints(out)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise MarsError(f"--resume {resume}: not a training checkpoint (no {STATE_FILE}); use no, auto or a "
                        f"{out / 'steps'}/{STEP_PREFIX}* folder")
    return path


def _refusal(ckpt: Path) -> str:
    return f"refusing to resume from {ckpt} (--resume no starts over)"


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__


def _check_state(ckpt: Path, state: object) -> None:
    """Refuse a state file without what a resume reads from it (step, fingerprint, scheduler state)."""
    where = f"{ckpt / STATE_FILE}"
    if not isinstance(state, dict):
        raise MarsError(f"{where}: expected a JSON object, got {type(state).__name__}; {_refusal(ckpt)}")
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise MarsError(f"{where}: 'step' missing or not an integer >= 0; {_refusal(ckpt)}")
    for key in ("fingerprint", "scheduler"):
        if not isinstance(state.get(key), dict):
            raise MarsError(f"{where}: {key!r} missing or not an object (written by an older trainer?); "
                            f"{_refusal(ckpt)}")


def check_step_checkpoint(ckpt: Path) -> None:
    """Refuse a step checkpoint that holds anything but what this trainer writes, in a form that loads
    without running code: the state file (JSON, checked by :func:`_check_state`), safetensors weights,
    and torch files (optimizer state, RNG states) that load with ``weights_only=True``.

    A crafted pickle (one that would run code when unpickled) fails the weights-only load here, before
    accelerate reads anything; an unexpected file is refused whatever it holds, and a file named
    ``.safetensors`` must have a safetensors header that covers it.
    """
    from accelerate.utils import load as weights_only_load  # torch.load(weights_only=True) + numpy RNG arrays
    from safetensors import safe_open

    refuse = _refusal(ckpt)
    for path in sorted(p for p in ckpt.rglob("*") if not p.is_dir()):
        if path.name == STATE_FILE:
            continue
        if path.suffix == ".safetensors" and not path.is_symlink():
            try:
                with safe_open(path, framework="pt"):  # reads and checks the header only
                    pass
            except Exception as err:  # SafetensorError (a bad or short header), OSError
                raise MarsError(f"{path}: not a safetensors file ({_first_line(err)}); {refuse}") from None
            continue
        if path.is_symlink() or path.suffix not in TORCH_STATE_SUFFIXES:
            raise MarsError(f"{path}: not a file this trainer writes into a step checkpoint; {refuse}")
        try:
            weights_only_load(path, map_location="cpu", mmap=True)
        except Exception as err:  # UnpicklingError for a forbidden global; anything else is not ours either
            raise MarsError(f"{path}: holds more than tensors and plain data ({_first_line(err)}); {refuse}") from None


def resume_from(resume: str, out: Path, fingerprint: dict, stage: str, main: bool) -> tuple[Path, dict] | None:
    """The step checkpoint to resume from and its state (None: start over), checked before anything is loaded.

    ``resume`` is no, auto or a checkpoint folder. A checkpoint whose saved fingerprint differs from the
    run's ``fingerprint`` belongs to another run: refused when named, passed over (with a note) by auto.
    """
    ckpt = resolve_resume(resume, out)
    if ckpt is None:
        return None
    state = read_json(ckpt / STATE_FILE)
    _check_state(ckpt, state)
    diff = ", ".join(k for k in fingerprint if state["fingerprint"].get(k) != fingerprint[k])
    if diff and resume != "auto":
        raise MarsError(f"cannot resume from {ckpt}: it belongs to a run with different {diff}; "
                        "use --resume no (or auto) to start over")
    if diff:  # auto after a param/data change (dvc exp run -S ...): these steps are of another run
        if main:
            print(f"train {stage}: not resuming {ckpt} (different {diff}); starting over", file=sys.stderr)
        return None
    check_step_checkpoint(ckpt)
    return ckpt, state


def load_scheduler_state(scheduler, ckpt: Path, state: dict) -> None:
    """Restore ``scheduler`` from ``state``; one it cannot take (a key missing, a value of another type)
    is refused in one line, not a traceback from torch."""
    try:
        scheduler.load_state_dict(state["scheduler"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise MarsError(f"{ckpt / STATE_FILE}: the scheduler state does not load ({type(err).__name__}: "
                        f"{_first_line(err)}); {_refusal(ckpt)}") from None


class _TiedWeightsNote(logging.Filter):
    """Drop accelerate's per-save note about tied embeddings (safetensors stores a shared tensor once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


logging.getLogger("accelerate.utils.other").addFilter(_TiedWeightsNote())


def save_step(accelerator, out: Path, step: int, fingerprint: dict, scheduler: dict, keep: int) -> None:
    dest = step_dir(out, step)
    tmp = dest.with_name(f".tmp-{dest.name}")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # left over from a killed run
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # the state file is the completion marker: written last, then the folder is renamed into place
        state = {"step": step, "fingerprint": fingerprint, "scheduler": scheduler}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        replace_dir(tmp, dest)
        for old in complete_checkpoints(out)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def save_final(accelerator, model, tokenizer, final: Path, info: CheckpointInfo, run: dict) -> None:
    """The trained LM of ``model`` (the prepared trainer's LossModel, LM at ``.lm``) as ``final``."""
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)  # gathers FSDP / ZeRO shards; every process must call it
    if accelerator.is_main_process:
        state = {k.removeprefix("lm."): v for k, v in state.items()}
        unwrapped = accelerator.unwrap_model(model).lm
        info.write_to(unwrapped.config)
        with atomic_dir(final) as tmp:
            unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "mars_run.json").write_text(json.dumps({**run, "mars": info.to_dict()}, indent=2, default=str))
    accelerator.wait_for_everyone()
