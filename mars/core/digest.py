"""sha256 digests: how manifests, stage pointers and integrity checks name content.

Every hex digest in the project comes from here, so a file hashed by ``mars export`` and the same
file hashed again by ``mars promote`` or a downstream ``mars pull`` always agree.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks (``hashlib.file_digest``)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data`` (a document as written or read)."""
    return hashlib.sha256(data).hexdigest()


def sha256_chunks(chunks: Iterable[bytes]) -> str:
    """Hex sha256 of ``chunks`` concatenated, without building the whole byte string (an object read back
    from a store, a data set's records)."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def sha256_tree(root: str | Path, names: Iterable[str] | None = None) -> str:
    """One hex sha256 over files under ``root``: each file's path relative to ``root`` and its sha256,
    in path order, so renaming, adding, removing or editing any file changes it.

    ``names`` (paths relative to ``root``) limits it to those files; None: every file below ``root``.
    """
    root = Path(root)
    if names is None:
        names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    digest = hashlib.sha256()
    for name in sorted(names):
        digest.update(f"{name}\0{sha256_file(root / name)}\n".encode())
    return digest.hexdigest()


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a hex sha256 as these functions write it (64 lowercase hex digits)."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
