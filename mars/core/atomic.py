"""Atomic writes and checked reads of the files the stages hand to each other.

Every output is built beside its destination (same folder, so the final rename is atomic on one
filesystem) and moved into place only when complete: a crash or an error leaves the previous
output as it was. A run killed outright (SIGKILL, power loss) cannot clean up, so temporary names
carry the host and process that made them (:func:`temp_prefix`), and the next write of the same
output removes what dead processes of this host left behind (:func:`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from mars.errors import MarsError


_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def temp_prefix(name: str, kind: str = "tmp") -> str:
    """The start of a temporary name for ``name``: ``.NAME.KIND-HOST-PID-`` (``kind``: tmp or old)."""
    return f".{name}.{kind}-{_HOST}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _abandoned(entry: os.DirEntry, host: str, pid: int, older_than_s: float | None) -> bool:
    if host == _HOST:
        return not _alive(pid)
    if older_than_s is None:
        return False
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > older_than_s
    except FileNotFoundError:  # finished meanwhile (renamed into place)
        return False


def sweep_stale(directory: str | Path, name: str | None = None, older_than_s: float | None = None) -> list[Path]:
    """Remove the temporaries of ``name`` (of any name: None) in ``directory`` whose process (on this host)
    is gone; returns them.

    Another host's leftovers on a shared folder are kept, their process cannot be checked from here,
    unless ``older_than_s`` is given and they were last modified longer ago than that.
    """
    pattern = re.compile(rf"^\.{'.+' if name is None else re.escape(name)}\.(?:tmp|old)-([^-]+)-(\d+)-")
    removed = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None or not _abandoned(entry, match.group(1), int(match.group(2)), older_than_s):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            Path(entry.path).unlink(missing_ok=True)
        removed.append(Path(entry.path))
    return removed


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temp folder beside ``out``; on success it replaces ``out``, on error it is removed.

    An existing ``out`` is swapped aside and deleted only once the new one is in place.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out.parent, out.name)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name), dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; outputs are ordinary shared folders
    try:
        yield tmp
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out`` (same parent); an existing ``out`` is swapped aside
    first and deleted only once ``tmp`` is in place, or put back if the move fails."""
    old = None
    if out.exists():
        old = out.with_name(f"{temp_prefix(out.name, 'old')}{time.time_ns()}")
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp file path beside ``path``; it replaces ``path`` when the block ends without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path.parent, path.name)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


# What json.loads raises on input it cannot take: ValueError (bad syntax, bytes that are not UTF-8, an integer
# past Python's digit limit) and RecursionError (nesting deeper than the interpreter's recursion limit).
JSON_ERRORS = (ValueError, RecursionError)


def json_problem(err: Exception) -> str:
    """Why a text is not JSON that can be read, in a few words (for a message naming where)."""
    return "nested too deeply" if isinstance(err, RecursionError) else str(err)


def read_json(path: str | Path, missing_hint: str = "", error: type[MarsError] = MarsError) -> Any:
    """Parse a JSON file; a missing, unreadable or malformed file raises ``error`` naming the path (and the fix)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        hint = f" ({missing_hint})" if missing_hint else ""
        raise error(f"{path}: no such file{hint}") from None
    except OSError as err:  # a directory, no permission
        raise error(f"{path}: cannot read ({err.strerror or err})") from None
    except JSON_ERRORS as err:
        raise error(f"{path}: not valid JSON ({json_problem(err)})") from None
