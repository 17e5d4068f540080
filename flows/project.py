"""The DVC project the flow drives: stage order, temporary param overrides, lock records, commands.

Nothing here knows about Prefect, so the same helpers serve the flow, the scripts and the tests.
"""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mars.core.atomic import atomic_path
from mars.errors import MarsError

PARAMS_FILE = "params.yaml"
# Where the user's params.yaml waits while a run's overrides are applied. Its presence at start means a
# run died before restoring it: we stop rather than guess which version is the user's.
PARAMS_BACKUP = Path(".dvc/tmp/flow/params.yaml.orig")


class FlowError(MarsError):
    """The flow cannot run as asked (bad override, interrupted earlier run, unknown stage)."""


class StageFailed(MarsError):
    """A DVC stage exited non-zero; the message carries the stage's own last lines."""

    def __init__(self, stage: str, returncode: int, tail: Sequence[str]):
        self.stage, self.returncode, self.tail = stage, returncode, list(tail)
        shown = "\n".join(_error_lines(self.tail))
        super().__init__(f"stage {stage!r} failed (exit {returncode}):\n{shown}")


def _error_lines(lines: Sequence[str], last: int = 6, keep: int = 16) -> list[str]:
    """The lines that explain a failure, in order: every line mentioning an error, plus the last few."""
    start = len(lines) - last
    return [line for i, line in enumerate(lines) if i >= start or "error" in line.lower()][-keep:]


def find_root(start: str | os.PathLike = ".") -> Path:
    path = Path(start).resolve()
    for candidate in (path, *path.parents):
        if (candidate / ".dvc").is_dir():
            return candidate
    raise FlowError(f"{path}: not inside a DVC project (no .dvc/ folder here or above)")


def _atomic_write(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def overridden_params(root: Path, overrides: Sequence[str]) -> Iterator[None]:
    """Apply ``key=value`` overrides to params.yaml for the duration of a run, then restore it byte for byte.

    The overrides go through DVC's own parser, so they mean exactly what ``dvc exp run -S`` means
    (``key=value`` changes a key that exists, ``+key=value`` adds one, ``~key`` removes one). The stages
    see the overridden file and dvc.lock records what ran; afterwards params.yaml is the user's again,
    so the next plain ``dvc repro`` brings the outputs back in line with it.
    """
    if not overrides:
        yield
        return
    params, backup = root / PARAMS_FILE, root / PARAMS_BACKUP
    if backup.exists():
        raise FlowError(
            f"{backup}: an earlier flow run was interrupted before restoring {PARAMS_FILE}; this is the "
            f"user's version. Put it back (mv {backup} {params}) or delete it, then run again"
        )
    original = params.read_bytes()
    backup.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(backup, original)
    try:
        _atomic_write(params, _with_overrides(params, original, overrides))
        yield
    finally:
        _atomic_write(params, original)
        backup.unlink()


def _with_overrides(params: Path, original: bytes, overrides: Sequence[str]) -> bytes:
    from dvc.utils.hydra import apply_overrides

    fd, tmp = tempfile.mkstemp(dir=params.parent, prefix=".params-flow.", suffix=".yaml")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(original)
        try:
            apply_overrides(tmp, list(overrides))
        except Exception as err:  # DVC wraps Hydra's message; the cause names the key
            cause = err.__cause__ or err
            raise FlowError(f"{params}: overrides {list(overrides)} rejected: {cause}".strip()) from None
        return Path(tmp).read_bytes()
    finally:
        Path(tmp).unlink(missing_ok=True)


def load_raw_params(root: Path) -> dict:
    return yaml.safe_load((root / PARAMS_FILE).read_text()) or {}


def stage_plan(root: Path, target: str, include_target: bool = True) -> list[str]:
    """Stages `dvc repro TARGET` would visit, dependencies first, ties broken by their order in dvc.yaml."""
    import networkx as nx
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    file, _, name = target.rpartition(":")
    address = f"{root / (file or 'dvc.yaml')}:{name}"  # DVC resolves relative targets against the cwd
    with Repo(str(root)) as repo:
        try:
            (stage,) = repo.stage.collect(address)
        except (DvcException, ValueError) as err:
            raise FlowError(f"{root}/dvc.yaml: no single stage {target!r}: {err}") from None
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        order = {s: i for i, s in enumerate(repo.index.stages)}
        sub = graph.subgraph(nx.descendants(graph, stage) | {stage})
        ordered = nx.lexicographical_topological_sort(sub.reverse(), key=order.__getitem__)
        plan = [_address(root, s) for s in ordered]
    return plan if include_target else plan[:-1]


def _address(root: Path, stage) -> str:
    """``name`` for a stage of the root dvc.yaml, ``dir/dvc.yaml:name`` otherwise (as `dvc repro` takes it)."""
    file = Path(stage.dvcfile.path).resolve().relative_to(root).as_posix()
    return stage.name if file == "dvc.yaml" else f"{file}:{stage.name}"


def lock_record(root: Path, stage: str) -> dict[str, str]:
    """The outputs of ``stage`` as dvc.lock records them: {path: md5} (a dir's md5 ends in .dir)."""
    file, _, name = stage.rpartition(":")
    lock = root / (Path(file).parent if file else Path()) / "dvc.lock"
    if not lock.exists():
        return {}
    entry = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(name or stage, {})
    return {o["path"]: o.get("md5", "") for o in entry.get("outs", [])}


def default_remote(root: Path) -> str | None:
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return repo.config["core"].get("remote") or None


def git_revision(root: Path) -> str | None:
    """HEAD's commit, with ``+dirty`` when tracked files differ from it; None outside git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def command_env(progress_interval_s: float) -> dict[str, str]:
    """The stages' environment: this interpreter's bin/ first (so `mars` and `dvc` resolve to the
    project's install even when a worker was started without activating it), unbuffered output so
    lines reach the log as they are printed, and progress bars redrawn rarely (each redraw is a log line).
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TQDM_MININTERVAL", str(progress_interval_s))
    return env


@dataclass
class CommandResult:
    returncode: int
    tail: list[str] = field(default_factory=list)


def stream(cmd: Sequence[str], cwd: Path, env: dict[str, str], on_line: Callable[[str], None],
           keep: int = 400) -> CommandResult:
    """Run ``cmd``, passing each stdout/stderr line to ``on_line`` as it comes; keep the last ``keep``."""
    tail: collections.deque[str] = collections.deque(maxlen=keep)
    with subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace", bufsize=1) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:  # text mode splits on \r too, so progress bars arrive as lines
            line = raw.rstrip()
            if line:
                tail.append(line)
                on_line(line)
    return CommandResult(proc.returncode, list(tail))


def dvc_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def mars_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mars.cli", *args]


def stage_outcome(stage: str, lines: Sequence[str]) -> str:
    """What DVC did with a stage, from its own report: ran | restored (run cache) | unchanged."""
    name = stage.rpartition(":")[2]
    text = "\n".join(lines)
    if f"Stage '{name}' didn't change" in text or f"Stage '{stage}' didn't change" in text:
        return "unchanged"
    if "is cached - skipping run" in text:
        return "restored"
    return "ran"
