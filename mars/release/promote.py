"""Releases: ``mars promote`` publishes a gated model to the store, ``mars pull`` fetches it verified.

Store layout (see :mod:`mars.release.store` for the URI and the object store):

- ``objects/sha256/..``                       every file, once, under the hash of its bytes
- ``releases/<name>/<version>/manifest.json`` one per release, never rewritten: file list with
  sha256 and size, gate decision (with the sha256 of the checkpoint and export it judged), block
  size B, default tau (and the tau floor a server may lower it to), source revision, who published it
- ``releases/<name>/<version>/seal.json``     the sha256 of that manifest, written once right after it
- ``stages/<name>/<stage>.json``              the stage pointer: version + sha256 of its manifest, who
  moved it, when, and how (promote | rollback)

Only a gated release is published: the gate decision must name the sha256 of the checkpoint and of
the export it judged (``mars gate --export``), and the files promoted must be exactly those. A
promote uploads the objects (an object already stored is read back and reused only if it holds
exactly the bytes listed, else uploaded again), then creates the manifest (create-only: racing
promotes get distinct versions) and its seal, and only then replaces the stage pointer, one
whole-object write. A crash at any point leaves the pointer on the previous release, whose objects
are untouched, so it stays pullable. A pull checks the manifest against the pointer's hash (a pull
by version and a rollback against the release's seal) and every file against the manifest, and
renames the finished directory into place; a rollback reads every object back before it moves the
pointer, so no pointer ever lands on a release a pull would refuse.

Stages: the pipeline's promote stage publishes to ``staging`` (:data:`STAGING`); the production
stage (``store.stage``, ``prod``: what services pull) moves only by an explicit act, recorded with
who did it, and never from inside a DVC experiment: there a promote or rollback moves ``staging`` only,
whatever the params say (:func:`guard_experiment`).

What a promote trusts of the gate decision (:func:`gate_decision`): nothing it cannot check. The verdict
is derived again from the evidence the decision names (the metrics and every per-item output, each by
sha256) with the rule it recorded, so a flipped ``passed``, a hand-written decision or an override added
by hand is refused; where ``MARS_GATE_KEY`` is set, the decision must carry the signature `mars gate`
made with that key.

A pulled release directory::

    DIR/release.json      the manifest (its sha256 is the pointer's manifest_sha256)
    DIR/export/           the export as `mars export` wrote it (model.onnx, manifest.json, engine if built)
    DIR/checkpoint/       the MARS checkpoint (save_pretrained + tokenizer files)
    DIR/tokenizer/        the tokenizer alone, for a service that only runs the export
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
from pathlib import Path, PurePosixPath

from mars.core.atomic import JSON_ERRORS, atomic_dir, json_problem, read_json
from mars.core.checkpoint_info import CheckpointInfo
from mars.core.digest import is_sha256, sha256_bytes, sha256_file, sha256_tree
from mars.errors import MarsError
from mars.evaluation.gate import rederive, signing_key, verify_signature
from mars.release.store import IntegrityError, NotFound, Store, StoreError, iter_files

RELEASE_FORMAT = 1
MANIFEST_FILE = "release.json"
GROUPS = ("export", "checkpoint", "tokenizer")
# What a Hugging Face tokenizer saves; copied out of the checkpoint into tokenizer/.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
ENGINE_SUFFIXES = {".onnx": "onnx", ".engine": "tensorrt", ".plan": "tensorrt", ".ep": "torch_tensorrt"}
VERSION_RE = re.compile(r"^v(\d+)$")
STAGING = "staging"  # where `mars promote` publishes unless told --stage (the pipeline's promote stage)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ReleaseError(MarsError):
    pass


class Unsealed(IntegrityError):
    """A release manifest without its seal: a promote killed between the two (or an altered store)."""


def _plain(kind: str, value: str) -> str:
    """Names become store keys (and paths in a directory store): no '/', '..' or odd characters."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ReleaseError(f"{kind} {value!r}: use letters, digits, '.', '_' or '-' (starting with a letter or digit)")
    return value


def manifest_key(name: str, version: str) -> str:
    return f"releases/{_plain('release name', name)}/{_plain('version', version)}/manifest.json"


def seal_key(name: str, version: str) -> str:
    return f"releases/{_plain('release name', name)}/{_plain('version', version)}/seal.json"


def pointer_key(name: str, stage: str) -> str:
    return f"stages/{_plain('release name', name)}/{_plain('stage', stage)}.json"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# -- what goes into a release -----------------------------------------------------------------------
def gate_decision(path: str | Path, repo: str | Path = ".") -> dict:
    """The gate's decision file, if it allows promotion (``passed: true`` or an override recording reason
    and who), names what it judged (the sha256 of the checkpoint and of the export) and stands: its
    verdict derived again from the evidence it names (paths relative to ``repo``) with the rule it
    recorded (:func:`mars.evaluation.gate.rederive`), and, where ``MARS_GATE_KEY`` is set, signed with it."""
    path = Path(path)
    gate = read_json(path, "no gate decision: run `mars gate` first", ReleaseError)
    if not isinstance(gate, dict) or "passed" not in gate:
        raise ReleaseError(f"{path}: not a gate decision (no 'passed' key)")
    key = signing_key()
    if key is not None:
        try:
            verify_signature(gate, key, path)
        except MarsError as err:
            raise ReleaseError(f"{err}; refusing to promote") from None
    override = gate.get("override")
    overridden = isinstance(override, dict) and override.get("enabled") is True and \
        str(override.get("reason") or "").strip() and str(override.get("by") or "").strip()
    if gate["passed"] is not True and not overridden:
        raise ReleaseError(f"{path}: the gate did not pass (passed: {gate['passed']!r}, no override recording a "
                           "reason and who made it); refusing to promote")
    artifacts = gate.get("artifacts") if isinstance(gate.get("artifacts"), dict) else {}
    for kind in ("checkpoint", "export"):
        if not is_sha256((artifacts.get(kind) or {}).get("sha256") if isinstance(artifacts.get(kind), dict) else None):
            raise ReleaseError(f"{path}: the decision names no {kind} sha256, so it does not say what it judged "
                               "(a hand-written or older decision?); run `mars gate --export EXPORT` after "
                               "`mars evaluate` and `mars export`")
    try:
        rederive(gate, path, root=repo)
    except MarsError as err:
        raise ReleaseError(str(err)) from None
    return gate


def tau_floor(decision: dict, tau: float) -> float:
    """The lowest tau the gate measured and accepted, for a server that lowers tau under load: its
    ``speed_tau`` when the score check there ran and passed (not overridden), else ``tau`` (no lower tau
    was vouched for); never above ``tau``."""
    speed = decision.get("speed_tau")
    checked = [c for c in decision.get("checks", []) if c.get("name") == "score_at_speed_tau"]
    if speed is not None and decision.get("checks_passed") is True and checked and all(c.get("passed") for c in checked):
        return min(float(speed), tau)
    return tau


def check_gated(decision: dict, gate: str | Path, checkpoint: Path, export: Path) -> None:
    """Refuse a checkpoint or export other than the ones the gate decision judged (by sha256)."""
    for kind, path in (("checkpoint", checkpoint), ("export", export)):
        judged, actual = decision["artifacts"][kind]["sha256"], sha256_tree(path)
        if actual != judged:
            raise ReleaseError(f"{path}: this {kind} (sha256 {actual[:12]}...) is not the one the gate judged "
                               f"({gate}: {judged[:12]}...); refusing to promote it: promote what was evaluated "
                               "and gated, or evaluate and gate this one")


def guard_experiment(stage: str) -> None:
    """Experiments publish to :data:`STAGING` only: inside ``dvc exp run`` (DVC_EXP_NAME set) a promote or
    rollback to any other stage is refused, whatever the params say (``store.stage`` is a param an
    experiment can set, so it cannot tell which stage is production)."""
    experiment = os.environ.get("DVC_EXP_NAME")
    if experiment and stage != STAGING:
        raise ReleaseError(f"stage {stage}: not moved from a DVC experiment ({experiment}): an experiment "
                           f"publishes to {STAGING} only, whatever the params say; publish to --stage {STAGING} "
                           "and move prod explicitly (`mars promote --stage prod` outside the experiment, or the "
                           "scheduled flow)")


def check_export(export: Path, checkpoint: Path, block_size: int) -> dict:
    """The export's manifest, after checking it was made from ``checkpoint`` (same files, same B)."""
    manifest = export / "manifest.json"
    info = read_json(manifest, "not an export: run `mars export`", ReleaseError)
    try:
        exported_from = str(info["checkpoint"]["sha256"])
    except (TypeError, KeyError):
        raise ReleaseError(f"{manifest}: not an export manifest (no checkpoint.sha256)") from None
    exported_b = CheckpointInfo.from_section(info.get("mars"), str(manifest)).block_size
    if exported_b != block_size:
        raise ReleaseError(f"{manifest}: block_size {exported_b} differs from the checkpoint's {block_size} "
                           f"({checkpoint}/config.json): export the checkpoint you promote")
    if exported_from != sha256_tree(checkpoint):
        raise ReleaseError(f"{manifest}: the export was made from a different checkpoint than {checkpoint} "
                           "(checkpoint.sha256 differs): export the checkpoint you promote")
    return info


def source_revision(repo: Path = Path(".")) -> dict:
    """The git commit (and whether the tree was dirty) and the dvc.lock hash the release came from."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    lock = repo / "dvc.lock"
    return {
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        "dvc_lock_sha256": sha256_file(lock) if lock.is_file() else None,
    }


def collect_files(export: Path, checkpoint: Path, tokenizer: Path | None) -> dict[str, Path]:
    """Release path -> local file, for the three groups of a release."""
    for label, path in (("export", export), ("checkpoint", checkpoint), ("tokenizer", tokenizer)):
        if path is not None and not path.is_dir():
            raise ReleaseError(f"{path}: {label} directory does not exist")
    files = {f"export/{p.relative_to(export).as_posix()}": p for p in iter_files(export)}
    files.update({f"checkpoint/{p.relative_to(checkpoint).as_posix()}": p for p in iter_files(checkpoint)})
    tok_dir = tokenizer or checkpoint
    tok_files = [p for p in iter_files(tok_dir) if tokenizer is not None or p.name in TOKENIZER_FILES]
    if not tok_files:
        raise ReleaseError(f"{tok_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])} ...); pass --tokenizer")
    files.update({f"tokenizer/{p.relative_to(tok_dir).as_posix()}": p for p in tok_files})
    return files


# -- promote / rollback ---------------------------------------------------------------------------
def _versions(store: Store, name: str) -> list[str]:
    found = set()
    for key in store.list(f"releases/{name}/"):
        parts = key.split("/")
        if len(parts) == 4 and parts[3] == "manifest.json" and VERSION_RE.match(parts[2]):
            found.add(parts[2])
    return sorted(found, key=lambda v: int(v[1:]))


def _read_pointer(store: Store, name: str, stage: str) -> dict | None:
    """The stage pointer, or None where there is none; an unreadable one raises IntegrityError."""
    try:
        return store.get_json(pointer_key(name, stage))[0]
    except NotFound:
        return None


def _move_pointer(store: Store, name: str, stage: str, version: str, manifest_sha256: str, action: str,
                  by: str, log) -> dict:
    try:
        current = _read_pointer(store, name, stage)
    except IntegrityError as err:  # moving the stage is how it gets repaired: a pull refuses it meanwhile
        log(f"warning: {err}: replacing the unreadable stage pointer (the version it held is unknown)")
        current = None
    pointer = {"name": name, "stage": stage, "version": version, "manifest_sha256": manifest_sha256,
               "moved_at": _now(), "moved_by": by, "action": action,
               "previous": current.get("version") if current else None}
    store.put_json(pointer_key(name, stage), pointer)
    return pointer


def promote(store: Store, *, gate: str | Path, export: str | Path, checkpoint: str | Path, by: str,
            tokenizer: str | Path | None = None, name: str = "mars", stage: str = STAGING,
            tau: float | None = None, repo: str | Path = ".", log=print) -> dict:
    """Publish a gated release and move ``stage`` to it; returns the stage pointer written.

    ``by`` (who publishes: a person, or the scheduled flow's run) is recorded in the manifest and the pointer.
    """
    _plain("release name", name), _plain("stage", stage)
    if not by or not by.strip():
        raise ReleaseError("promote: say who publishes (by)")
    guard_experiment(stage)
    decision = gate_decision(gate, repo)
    export, checkpoint = Path(export), Path(checkpoint)
    model = CheckpointInfo.read(checkpoint)
    block_size = model.block_size
    files = collect_files(export, checkpoint, Path(tokenizer) if tokenizer else None)
    check_export(export, checkpoint, block_size)
    check_gated(decision, gate, checkpoint, export)
    if tau is None:  # the tau the gate vouched for: its speed check's if it ran one, else the lossless one
        tau = decision.get("speed_tau") if decision.get("speed_tau") is not None else decision.get("tau", 1.0)
    store.check(create=True)
    try:
        leftovers = store.sweep_leftovers()
    except StoreError as err:  # housekeeping (S3 may deny listing uploads): never what stops a promote
        log(f"warning: leftovers of killed uploads not swept: {err}")
    else:
        if leftovers:
            log(f"removed {len(leftovers)} leftover(s) of killed uploads from {store.uri}")

    entries, uploaded, uploaded_bytes = {}, 0, 0
    for rel, path in files.items():
        size = path.stat().st_size
        digest = sha256_file(path)
        entries[rel] = {"sha256": digest, "size": size}
        if store.put_object(path, digest, size):
            uploaded, uploaded_bytes = uploaded + 1, uploaded_bytes + size
    engines = {}
    for rel in entries:
        kind = ENGINE_SUFFIXES.get(PurePosixPath(rel).suffix)
        if rel.startswith("export/") and kind:
            engines.setdefault(kind, rel)

    manifest = {
        "format": RELEASE_FORMAT,
        "name": name,
        "stage": stage,
        "created_at": _now(),
        "block_size": block_size,
        "tau": float(tau),
        "tau_floor": tau_floor(decision, float(tau)),
        "mask_token_id": model.mask_token_id,
        "model": model.to_dict(),
        "engines": engines,
        "gate": decision,
        "source": source_revision(Path(repo)),
        "published_by": by,
        "files": entries,
    }
    total = sum(e["size"] for e in entries.values())
    try:
        current = _read_pointer(store, name, stage)
    except IntegrityError:  # unreadable: moving the stage replaces it (and says so)
        current = None
    same = _same_release(store, name, stage, manifest, current)
    if same is not None:  # these very files under this very decision: that release, not a copy of it
        version, manifest_sha256 = same
        if current and current.get("version") == version and current.get("manifest_sha256") == manifest_sha256:
            log(f"{name} {stage} already at {version} ({len(entries)} files, {total / 2**20:.1f} MB): unchanged")
            return current
        pointer = _move_pointer(store, name, stage, version, manifest_sha256, "promote", by, log)
        log(f"promoted {name} {version} (published before, same files and gate decision) -> {stage} in "
            f"{store.uri}: {uploaded} uploaded, previous: {pointer['previous'] or 'none'}")
        return pointer
    # Claim the next free version: the manifest write is create-only, a concurrent promote that
    # took the same number makes this one try the next.
    for _ in range(100):
        versions = _versions(store, name)
        version = f"v{int(versions[-1][1:]) + 1 if versions else 1}"
        written, manifest_sha256 = store.put_json(manifest_key(name, version), {**manifest, "version": version},
                                                  if_absent=True)
        if written:
            break
    else:
        raise ReleaseError(f"{store.where(f'releases/{name}/')}: could not claim a new version "
                           "(too many concurrent promotes)")
    store.put_json(seal_key(name, version), {"manifest_sha256": manifest_sha256}, if_absent=True)
    pointer = _move_pointer(store, name, stage, version, manifest_sha256, "promote", by, log)
    log(f"promoted {name} {version} -> {stage} in {store.uri}: {len(entries)} files ({total / 2**20:.1f} MB), "
        f"{uploaded} uploaded ({uploaded_bytes / 2**20:.1f} MB), previous: {pointer['previous'] or 'none'}")
    return pointer


# What makes two publications the same release (not who published it, when, from which stage or commit).
_RELEASE_CONTENT = ("format", "name", "block_size", "tau", "tau_floor", "mask_token_id", "model", "engines", "gate",
                    "files")


def _same_release(store: Store, name: str, stage: str, manifest: dict,
                  current: dict | None) -> tuple[str, str] | None:
    """(version, manifest sha256) of the release ``stage`` points at (``current``), or of the newest one, if
    it holds the same content as ``manifest`` (verified as a pull would: pointer or seal; its objects were
    just checked)."""
    versions = _versions(store, name)
    candidates = [(current.get("version"), stage)] if current else []
    candidates += [(versions[-1], None)] if versions else []
    for version, via in candidates:
        try:
            found, data = resolve_release(store, name, stage=via, version=None if via else version)
        except (NotFound, IntegrityError):
            continue
        if all(found.get(k) == manifest.get(k) for k in _RELEASE_CONTENT):
            return found["version"], sha256_bytes(data)
    return None


def rollback(store: Store, *, version: str, by: str, name: str = "mars", stage: str = STAGING, log=print) -> dict:
    """Move ``stage`` back to an earlier release after verifying it as a pull would: its manifest against
    its seal, and every object read back against the manifest. ``by`` is recorded in the pointer."""
    if not by or not by.strip():
        raise ReleaseError("rollback: say who moves the stage (by)")
    guard_experiment(stage)
    try:
        manifest, data = resolve_release(store, name, version=version)
    except NotFound:
        if _read_seal(store, name, version) is not None:
            raise
        known = ", ".join(_versions(store, name)) or "none"
        raise ReleaseError(f"{store.where(manifest_key(name, version))}: no release {name} {version} "
                           f"(releases: {known})") from None
    for rel, entry in manifest["files"].items():
        try:
            store.verify_object(entry["sha256"], entry["size"], label=rel)
        except (NotFound, IntegrityError) as err:
            raise IntegrityError(f"{err}; refusing to roll {stage} back to {version}") from None
    pointer = _move_pointer(store, name, stage, version, sha256_bytes(data), "rollback", by, log)
    log(f"rolled {name} {stage} back to {version} (was {pointer['previous'] or 'none'})")
    return pointer


# -- pull -----------------------------------------------------------------------------------------
def _manifest_files(manifest: dict, where: str) -> dict:
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise IntegrityError(f"{where}: release manifest lists no files")
    for rel, entry in files.items():
        parts = PurePosixPath(rel).parts
        if PurePosixPath(rel).is_absolute() or ".." in parts or not parts or parts[0] not in GROUPS:
            raise IntegrityError(f"{where}: unsafe file path {rel!r} in the manifest, refused")
        if not isinstance(entry, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256"))) \
                or not isinstance(entry.get("size"), int):
            raise IntegrityError(f"{where}: bad entry for {rel!r} in the manifest, refused")
    return files


def _read_seal(store: Store, name: str, version: str) -> str | None:
    try:
        seal = store.get_json(seal_key(name, version))[0].get("manifest_sha256")
    except NotFound:
        return None
    return seal if is_sha256(seal) else None


def resolve_release(store: Store, name: str, stage: str | None = None,
                    version: str | None = None) -> tuple[dict, bytes]:
    """The verified manifest (and its exact bytes) of ``version``, or of what ``stage`` points to: its
    sha256 must be the pointer's (by stage) or the release's seal (by version)."""
    store.check()
    if version is None:
        stage = stage or "prod"
        repair = f"`mars promote --stage {stage}` (or --rollback VERSION) replaces it"
        try:
            pointer = _read_pointer(store, name, stage)
        except IntegrityError as err:
            raise IntegrityError(f"{err}; {repair}") from None
        if pointer is None:
            raise NotFound(f"{store.where(pointer_key(name, stage))}: no release of {name} at stage {stage}")
        version, expected, against = pointer.get("version"), pointer.get("manifest_sha256"), "stage pointer's"
        if not isinstance(version, str) or not VERSION_RE.match(version):
            raise IntegrityError(f"{store.where(pointer_key(name, stage))}: bad stage pointer; {repair}")
    else:
        expected, against = _read_seal(store, name, version), "release's seal"
        if expected is None and store.size(manifest_key(name, version)) is not None:
            raise Unsealed(f"{store.where(seal_key(name, version))}: release {name} {version} has no seal "
                           "(an unfinished promote, or an altered store): refused")
    key = manifest_key(name, version)
    data = store.get_bytes(key)
    if sha256_bytes(data) != expected:
        raise IntegrityError(f"{store.where(key)}: manifest does not match the {against} sha256: "
                             "tampered or corrupt, refused")
    try:
        manifest = json.loads(data)
    except JSON_ERRORS as err:
        raise IntegrityError(f"{store.where(key)}: not valid JSON ({json_problem(err)}; corrupt manifest)") from None
    if not isinstance(manifest, dict) or manifest.get("name") != name or manifest.get("version") != version:
        raise IntegrityError(f"{store.where(key)}: manifest is not {name} {version}, refused")
    _manifest_files(manifest, store.where(key))
    return manifest, data


def pull(store: Store, name: str, dest: str | Path, *, stage: str | None = "prod", version: str | None = None,
         log=print) -> dict:
    """Download a release into ``dest``, verifying every file; ``dest`` appears complete or not at all.

    An existing ``dest`` is replaced only if it holds a previous pull (a release.json).
    """
    dest = Path(dest).absolute()
    if dest.exists() and not (dest.is_dir() and (not any(dest.iterdir()) or (dest / MANIFEST_FILE).is_file())):
        raise ReleaseError(f"{dest}: exists and is not a pulled release; refusing to replace it")
    manifest, data = resolve_release(store, name, stage, version)
    with atomic_dir(dest) as tmp:
        for rel, entry in manifest["files"].items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            store.get_object(entry["sha256"], entry["size"], target, label=rel)
        (tmp / MANIFEST_FILE).write_bytes(data)
    log(f"pulled {name} {manifest['version']} ({stage if version is None else 'pinned'}) from {store.uri} "
        f"into {dest}: {len(manifest['files'])} files verified")
    return manifest


def list_releases(store: Store, name: str | None = None, incomplete: bool = False) -> list[str]:
    """One line per release (newest last), marking where each stage points.

    A release is listed as a pull by version takes it (manifest checked against its seal): one that fails
    that check is listed as unreadable, with why. An unsealed release (a promote killed between manifest
    and seal), which pull and rollback refuse, is listed only with ``incomplete``, else counted in a note.
    An unreadable stage pointer gets a line of its own.
    """
    names = [name] if name else sorted({k.split("/")[1] for k in store.list("releases/") if k.count("/") >= 3})
    lines = []
    for n in names:
        stages: dict[str, list[str]] = {}
        broken = []
        for key in store.list(f"stages/{n}/"):
            stage = PurePosixPath(key).stem
            try:
                pointer = _read_pointer(store, n, stage)
            except IntegrityError as err:
                broken.append(f"{n} {stage}: unreadable stage pointer: {err}; `mars promote --stage {stage}` "
                              "(or --rollback VERSION) replaces it")
                continue
            if pointer:
                stages.setdefault(pointer.get("version"), []).append(stage)
        hidden = []
        for version in _versions(store, n):
            marks = f"  <- {', '.join(sorted(stages[version]))}" if version in stages else ""
            try:
                manifest, _ = resolve_release(store, n, version=version)
            except Unsealed:
                if incomplete:
                    lines.append(f"{n} {version}  incomplete: no seal, an unfinished promote (pull and rollback "
                                 f"refuse it){marks}")
                else:
                    hidden.append(version)
                continue
            except (IntegrityError, NotFound) as err:
                lines.append(f"{n} {version}  unreadable: {err}{marks}")
                continue
            gate = manifest.get("gate", {})
            verdict = "override" if gate.get("overridden") or not gate.get("passed") else "pass"
            lines.append(f"{n} {version}  {manifest.get('created_at')}  B={manifest.get('block_size')} "
                         f"tau={manifest.get('tau')} gate={verdict} "
                         f"files={len(manifest.get('files', {}))}{marks}")
        if hidden:
            one = len(hidden) == 1
            lines.append(f"{n}: {len(hidden)} incomplete release{'' if one else 's'} not listed "
                         f"({', '.join(hidden)}): unfinished promote{'' if one else 's'}, refused by pull; "
                         f"`mars store ls --all` lists {'it' if one else 'them'}")
        lines += broken
    return lines
