"""The artifact store: one code path over a local directory (the default) and S3.

A store is a URI: a plain path or ``file://PATH`` (embedded default, no server), or
``s3://BUCKET/PREFIX`` through boto3 (AWS or any S3-compatible server such as SeaweedFS). It holds

- content-addressed objects ``objects/sha256/<2 hex>/<sha256>`` (a file is stored once, under the
  hash of its bytes; a re-promote of an unchanged checkpoint uploads nothing once each stored
  object has been read back and found to hold exactly those bytes), and
- small JSON documents (release manifests, stage pointers) written whole.

Every write is atomic: a directory store writes a temp file and renames it; S3 shows an object only
once its PUT (or multipart upload) completes. ``put_json(..., if_absent=True)`` creates a document
only where none exists (``If-None-Match: *`` on S3, a hard link on disk), so racing writers cannot
overwrite each other.

Credentials come only from the standard AWS chain (environment, shared credentials file, profile,
instance role); the endpoint URL and region from params (``store.endpoint_url``, ``store.region``)
or the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_REGION``). None of them is printed or
written anywhere: errors name the bucket and key, never the endpoint or keys, and any credential
value that would reach a message is redacted.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from mars.core.atomic import JSON_ERRORS, json_problem, sweep_stale, temp_prefix
from mars.core.digest import sha256_bytes, sha256_chunks, sha256_file
from mars.errors import ConfigError, MarsError

MB = 1024 * 1024
OBJECTS = "objects/sha256"
CHUNK = 1 * MB
# A partial upload whose writer cannot be asked whether it still runs (another host's temp file, any S3
# multipart upload) is taken as abandoned after a day: far longer than an upload runs.
ABANDONED_AFTER_S = 24 * 3600


class StoreError(MarsError):
    """A store operation failed; the message names the store location (bucket/key or path)."""


class NotFound(StoreError):
    """The object or document does not exist."""


class NoSuchBucket(StoreError):
    """The S3 bucket itself is missing: not an absent object, so no caller takes it for one."""


class IntegrityError(StoreError):
    """An object's bytes do not match the size or sha256 it was recorded with."""


@dataclass
class StoreConfig:
    # Where releases live: a path / file://PATH, or s3://BUCKET/PREFIX. $MARS_STORE_URI wins over it.
    uri: str = "store"
    # S3 only. None: the standard AWS resolution (AWS_ENDPOINT_URL, AWS_REGION, profile config).
    endpoint_url: str | None = None
    region: str | None = None
    # A named AWS profile (credentials file); None: AWS_PROFILE or the default chain. Keys never go here.
    profile: str | None = None
    # Files above the threshold go up in parallel parts of chunk size (S3 minimum part: 5 MB).
    multipart_threshold_mb: int = 64
    multipart_chunk_mb: int = 16
    # Attempts per request on transient errors (connection, 5xx, throttling), exponential backoff.
    max_attempts: int = 5
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    # Cap on transfer speed in MB/s (shared links); None: unlimited.
    max_bandwidth_mb: float | None = None
    # Files at least this large get a progress bar (on a terminal).
    progress_min_mb: int = 32
    # The release name `mars promote` / `mars pull` use; the production stage `mars pull` follows (promote
    # publishes to staging unless told `--stage prod`, and never moves this stage inside `dvc exp run`).
    name: str = "mars"
    stage: str = "prod"
    # The DVC remote that `mars store configure-dvc` points at <store>/dvc.
    dvc_remote: str = "store"

    def __post_init__(self) -> None:
        if not self.uri:
            raise ConfigError("uri: must not be empty")
        if self.uri.startswith("s3://") and not self.uri[5:].split("/", 1)[0]:
            raise ConfigError(f"uri: {self.uri!r} names no bucket (expected s3://BUCKET/PREFIX)")
        if "://" in self.uri and not self.uri.startswith(("s3://", "file://")):
            raise ConfigError(f"uri: {self.uri!r}: only file:// paths and s3:// are supported")
        if self.multipart_chunk_mb < 5:
            raise ConfigError("multipart_chunk_mb: S3 parts must be at least 5 MB")
        if self.multipart_threshold_mb < self.multipart_chunk_mb:
            raise ConfigError("multipart_threshold_mb: must be at least multipart_chunk_mb")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts: must be at least 1")
        if self.max_bandwidth_mb is not None and self.max_bandwidth_mb <= 0:
            raise ConfigError("max_bandwidth_mb: must be positive (or null for unlimited)")
        for key in ("name", "stage"):
            value = getattr(self, key)
            if not value or "/" in value or value.startswith("."):
                raise ConfigError(f"{key}: {value!r} must be a plain name (no '/', not starting with '.')")


def object_key(sha256: str) -> str:
    return f"{OBJECTS}/{sha256[:2]}/{sha256}"


def _progress(total: int, desc: str, min_bytes: int):
    """A tqdm bar for transfers of at least ``min_bytes`` (shown on terminals only), else a no-op."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                disable=None if total >= min_bytes else True, file=sys.stderr)


class Store:
    """Objects and JSON documents under one root. Use :func:`open_store`; keys are '/'-separated."""

    uri: str

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg

    # -- backend primitives -------------------------------------------------------------------
    def where(self, key: str) -> str:
        """The human-readable location of ``key``, for messages (no endpoint, no credentials)."""
        raise NotImplementedError

    def size(self, key: str) -> int | None:
        """Size in bytes of ``key``, or None when it does not exist."""
        raise NotImplementedError

    def _upload(self, src: Path, key: str, sha256: str, size: int) -> None:
        raise NotImplementedError

    def _download(self, key: str, dest: Path, size: int) -> None:
        raise NotImplementedError

    def get_bytes(self, key: str) -> bytes:
        raise NotImplementedError

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write ``data`` at ``key`` whole; with ``if_absent``, only where nothing exists (False then)."""
        raise NotImplementedError

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (complete objects only), sorted."""
        raise NotImplementedError

    def check(self, create: bool = False) -> None:
        """Fail early, naming the store, when it cannot be used (no bucket, no access, no directory).

        ``create``: a directory store is created (the embedded default needs no setup); a bucket never is.
        """
        raise NotImplementedError

    def _read_chunks(self, key: str) -> Iterator[bytes]:
        """The bytes of object ``key`` in chunks, without a local copy."""
        raise NotImplementedError

    def sweep_leftovers(self, older_than_s: float = ABANDONED_AFTER_S) -> list[str]:
        """Remove what killed writes left (never listed, so never part of a release); returns where they were.

        A write still in progress is kept: on disk, one of a live process of this host, or of another
        host modified within ``older_than_s``; on S3, a multipart upload started within ``older_than_s``.
        """
        raise NotImplementedError

    # -- content-addressed objects ---------------------------------------------------------------
    def object_sha256(self, key: str) -> str:
        """The sha256 of the bytes stored at ``key`` now (read back in full: a size says nothing about content)."""
        return sha256_chunks(self._read_chunks(key))

    def put_object(self, src: Path, sha256: str, size: int) -> bool:
        """Store file ``src`` under its hash; False when the object is already there with exactly those bytes.

        An existing object is read back and hashed before it is reused: one altered in place (same size)
        is uploaded again, so a release never refers to bytes other than the ones it lists.
        """
        key = object_key(sha256)
        if self.size(key) == size and self.object_sha256(key) == sha256:
            return False
        self._upload(src, key, sha256, size)
        return True

    def _check_size(self, sha256: str, size: int, label: str) -> tuple[str, str]:
        """(key, description) of object ``sha256`` after checking it is stored with ``size`` bytes."""
        key = object_key(sha256)
        what = f"{self.where(key)}" + (f" ({label})" if label else "")
        stored = self.size(key)
        if stored is None:
            raise NotFound(f"{what}: object missing from the store")
        if stored != size:
            raise IntegrityError(f"{what}: object has {stored} bytes, the release records {size}: partial or "
                                 "altered object, refused")
        return key, what

    def verify_object(self, sha256: str, size: int, label: str = "") -> None:
        """Raise (NotFound / IntegrityError) unless object ``sha256`` is stored with exactly its bytes."""
        key, what = self._check_size(sha256, size, label)
        got = self.object_sha256(key)
        if got != sha256:
            raise IntegrityError(f"{what}: sha256 mismatch (got {got}): corrupt or tampered object, refused")

    def get_object(self, sha256: str, size: int, dest: Path, label: str = "") -> None:
        """Download the object ``sha256`` to ``dest`` and verify it; a short or altered object is refused."""
        key, what = self._check_size(sha256, size, label)
        self._download(key, dest, size)
        got = sha256_file(dest)
        if got != sha256:
            dest.unlink(missing_ok=True)
            raise IntegrityError(f"{what}: sha256 mismatch (got {got}): corrupt or tampered object, refused")

    # -- JSON documents ---------------------------------------------------------------------------
    def get_json(self, key: str) -> tuple[dict, str]:
        """The document at ``key`` and the sha256 of its bytes."""
        data = self.get_bytes(key)
        try:
            doc = json.loads(data)
        except JSON_ERRORS as err:
            raise IntegrityError(f"{self.where(key)}: not valid JSON ({json_problem(err)}; corrupt document)") from None
        if not isinstance(doc, dict):
            raise IntegrityError(f"{self.where(key)}: expected a JSON object")
        return doc, sha256_bytes(data)

    def put_json(self, key: str, doc: dict, *, if_absent: bool = False) -> tuple[bool, str]:
        """Write ``doc``; returns (written, sha256 of the bytes written)."""
        data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        return self.put_bytes(key, data, if_absent=if_absent), sha256_bytes(data)


# ---------------------------------------------------------------------------------------------
class DirStore(Store):
    """A store in a local (or mounted network) directory."""

    def __init__(self, cfg: StoreConfig, root: Path):
        super().__init__(cfg)
        self.root = root.expanduser().absolute()
        self.uri = str(self.root)

    def where(self, key: str) -> str:
        return str(self.root / key)

    def size(self, key: str) -> int | None:
        try:
            return (self.root / key).stat().st_size
        except FileNotFoundError:
            return None

    def check(self, create: bool = False) -> None:
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        if not self.root.is_dir():
            raise NotFound(f"{self.root}: store directory does not exist")

    def _temp(self, key: str) -> Path:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(path.parent, path.name)  # what a killed promote left of this object
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=".tmp", dir=path.parent)
        os.close(fd)
        return Path(tmp)

    def sweep_leftovers(self, older_than_s: float = ABANDONED_AFTER_S) -> list[str]:
        removed = []
        for area in ("objects", "releases", "stages"):  # not dvc/: DVC's remote, DVC's business
            for folder, _, _ in os.walk(self.root / area):
                removed += sweep_stale(folder, older_than_s=older_than_s)
        return [str(path) for path in removed]

    def _read_chunks(self, key: str) -> Iterator[bytes]:
        try:
            with open(self.root / key, "rb") as fh:
                yield from iter(lambda: fh.read(CHUNK), b"")
        except FileNotFoundError:
            raise NotFound(f"{self.where(key)}: no such object") from None

    def _copy(self, src: Path, dest: Path, size: int, desc: str) -> None:
        """Chunked copy with the bandwidth cap and progress bar the S3 path has too."""
        limit = self.cfg.max_bandwidth_mb * MB if self.cfg.max_bandwidth_mb else None
        start, done = time.monotonic(), 0
        with open(src, "rb") as fin, open(dest, "wb") as fout, \
                _progress(size, desc, self.cfg.progress_min_mb * MB) as bar:
            for chunk in iter(lambda: fin.read(CHUNK), b""):
                fout.write(chunk)
                done += len(chunk)
                bar.update(len(chunk))
                if limit:
                    ahead = done / limit - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
            fout.flush()
            os.fsync(fout.fileno())

    def _upload(self, src: Path, key: str, sha256: str, size: int) -> None:
        tmp = self._temp(key)
        try:
            self._copy(src, tmp, size, f"upload {src.name}")
            os.replace(tmp, self.root / key)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _download(self, key: str, dest: Path, size: int) -> None:
        self._copy(self.root / key, dest, size, f"download {dest.name}")

    def get_bytes(self, key: str) -> bytes:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{self.where(key)}: no such document") from None

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        tmp = self._temp(key)
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            if not if_absent:
                os.replace(tmp, self.root / key)
                return True
            try:  # link() fails if the name exists: an atomic create-if-absent
                os.link(tmp, self.root / key)
                return True
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")  # dot files are in-flight temp files
        )


# ---------------------------------------------------------------------------------------------
class S3Store(Store):
    """A store under ``s3://bucket/prefix``."""

    def __init__(self, cfg: StoreConfig, bucket: str, prefix: str):
        super().__init__(cfg)
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        session = boto3.session.Session(profile_name=cfg.profile) if cfg.profile else boto3.session.Session()
        self._secrets = _credential_values(session)
        self.client = session.client(
            "s3",
            endpoint_url=cfg.endpoint_url,
            region_name=cfg.region or session.region_name or "us-east-1",
            config=Config(
                retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
                connect_timeout=cfg.connect_timeout_s,
                read_timeout=cfg.read_timeout_s,
                # path-style: S3-compatible servers rarely have wildcard DNS for bucket hosts
                s3={"addressing_style": "path"} if cfg.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") else None,
            ),
        )
        self.transfer = TransferConfig(
            multipart_threshold=cfg.multipart_threshold_mb * MB,
            multipart_chunksize=cfg.multipart_chunk_mb * MB,
            max_bandwidth=int(cfg.max_bandwidth_mb * MB) if cfg.max_bandwidth_mb else None,
            num_download_attempts=cfg.max_attempts,
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def _fail(self, err: Exception, key: str | None, action: str) -> StoreError:
        """A one-line error naming bucket/key and what to check; never the endpoint or the keys."""
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConnectionError,
                                         NoCredentialsError, PartialCredentialsError)

        where = self.where(key) if key is not None else f"s3://{self.bucket}"
        if isinstance(err, ClientError):
            error = err.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return NoSuchBucket(f"s3://{self.bucket}: {action} failed: no such bucket (create it, or fix "
                                    "store.uri)")
            if code in ("NoSuchKey", "404", "NotFound"):
                return NotFound(f"{where}: no such object")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden",
                        "ExpiredToken", "InvalidToken"):
                return StoreError(f"{where}: {action} failed: access denied ({code}); check the AWS credentials "
                                  "(AWS_PROFILE / AWS_ACCESS_KEY_ID / shared credentials file)")
            text = self._redact(str(error.get("Message") or code))
            return StoreError(f"{where}: {action} failed: {code or status}: {text}")
        if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
            return StoreError(f"{where}: {action} failed: no usable AWS credentials (set AWS_PROFILE or "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
        if isinstance(err, BotoConnectionError):
            return StoreError(f"{where}: {action} failed: S3 endpoint unreachable after {self.cfg.max_attempts} "
                              f"attempts ({type(err).__name__}); check store.endpoint_url / AWS_ENDPOINT_URL "
                              "and that the server is up")
        if isinstance(err, BotoCoreError):
            return StoreError(f"{where}: {action} failed: {type(err).__name__}")
        return StoreError(f"{where}: {action} failed: {type(err).__name__}: {self._redact(str(err))}")

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _call(self, action: str, key: str | None, fn: Callable, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except (ClientError, BotoCoreError) as err:
            raise self._fail(err, key, action) from None

    def check(self, create: bool = False) -> None:
        try:
            self._call("head bucket", None, self.client.head_bucket, Bucket=self.bucket)
        except NotFound:  # HEAD has no error body: a bare 404 here means the bucket
            raise NoSuchBucket(f"s3://{self.bucket}: no such bucket (create it, or fix store.uri)") from None

    def size(self, key: str) -> int | None:
        try:
            head = self._call("head", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        except NotFound:
            return None
        return int(head["ContentLength"])

    def _transfer(self, action: str, key: str, start: Callable, size: int, desc: str) -> None:
        from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager
        from botocore.exceptions import BotoCoreError, ClientError

        with _progress(size, desc, self.cfg.progress_min_mb * MB) as bar, \
                create_transfer_manager(self.client, self.transfer) as manager:
            try:
                start(manager, [ProgressCallbackInvoker(bar.update)]).result()
            except (ClientError, BotoCoreError) as err:
                raise self._fail(err, key, action) from None

    def _upload(self, src: Path, key: str, sha256: str, size: int) -> None:
        # The server checks the SHA-256 of what it received (per part for multipart uploads).
        extra = {"ChecksumAlgorithm": "SHA256"}
        self._transfer("upload", key, lambda m, subs: m.upload(str(src), self.bucket, self._key(key), extra, subs),
                       size, f"upload {src.name}")

    def _download(self, key: str, dest: Path, size: int) -> None:
        self._transfer("download", key, lambda m, subs: m.download(self.bucket, self._key(key), str(dest), None, subs),
                       size, f"download {dest.name}")

    def get_bytes(self, key: str) -> bytes:
        resp = self._call("get", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        return self._call("get", key, resp["Body"].read)

    def sweep_leftovers(self, older_than_s: float = ABANDONED_AFTER_S) -> list[str]:
        # Only objects go up in parts; an aborted upload's parts are deleted (they are billed until then).
        cutoff = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=older_than_s)
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                             Prefix=self._key(f"{OBJECTS}/"))
        removed = []
        for page in self._call("list uploads", OBJECTS, lambda: list(pages)):
            for upload in page.get("Uploads", []):
                if upload["Initiated"] < cutoff:
                    self._call("abort upload", None, self.client.abort_multipart_upload, Bucket=self.bucket,
                               Key=upload["Key"], UploadId=upload["UploadId"])
                    removed.append(f"s3://{self.bucket}/{upload['Key']}")
        return removed

    def _read_chunks(self, key: str) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError, ClientError

        resp = self._call("get", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        try:
            yield from resp["Body"].iter_chunks(CHUNK)
        except (ClientError, BotoCoreError) as err:
            raise self._fail(err, key, "get") from None

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        from botocore.exceptions import ClientError

        kwargs = dict(Bucket=self.bucket, Key=self._key(key), Body=data, ContentType="application/json",
                      ChecksumAlgorithm="SHA256")
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        try:
            self.client.put_object(**kwargs)
        except ClientError as err:
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if if_absent and (status == 412 or err.response.get("Error", {}).get("Code") == "PreconditionFailed"):
                return False
            raise self._fail(err, key, "put") from None
        except Exception as err:
            raise self._fail(err, key, "put") from None
        return True

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        root = self._key("")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        for page in self._call("list", prefix, lambda: list(pages)):
            keys += [obj["Key"][len(root):] for obj in page.get("Contents", [])]
        return sorted(keys)


def _credential_values(session) -> list[str]:
    """The secret strings of the session's credentials, so messages can redact them (never shown)."""
    try:
        creds = session.get_credentials()
    except Exception:
        return []
    if creds is None:
        return []
    frozen = creds.get_frozen_credentials()
    return [v for v in (frozen.secret_key, frozen.token, frozen.access_key) if v]


def open_store(cfg: StoreConfig | str) -> Store:
    """The store at ``cfg.uri`` (a StoreConfig, or a bare URI with default settings)."""
    if isinstance(cfg, str):
        cfg = StoreConfig(uri=cfg)
    uri = cfg.uri
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[5:].partition("/")
        return S3Store(cfg, bucket, prefix)
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return DirStore(cfg, Path(uri))


def iter_files(root: Path) -> Iterator[Path]:
    """Regular files under ``root``, sorted, skipping dot files (temp files of unfinished writes)."""
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            yield path


# -- DVC remote ------------------------------------------------------------------------------------
def dvc_remote_url(cfg: StoreConfig) -> str:
    """Where DVC keeps its cache in the store: ``<store>/dvc``."""
    store = open_store(cfg) if cfg.uri.startswith("s3://") else None
    if store is not None:
        return f"s3://{store.bucket}/{store._key('dvc')}"
    root = cfg.uri[len("file://"):] if cfg.uri.startswith("file://") else cfg.uri
    return str(Path(root).expanduser().absolute() / "dvc")


def configure_dvc(cfg: StoreConfig, repo: str | Path = ".", remote: str | None = None, default: bool = True) -> str:
    """Point DVC remote ``remote`` of ``repo`` at ``<store>/dvc``, so ``dvc push/pull`` share the store.

    The remote URL goes into ``.dvc/config`` (committed); the endpoint, which differs between
    machines, into ``.dvc/config.local``. Credentials are not written: DVC reads the same standard
    AWS chain (environment, profile) as the store.
    """
    remote = remote or cfg.dvc_remote
    url = dvc_remote_url(cfg)

    def dvc(*args: str) -> None:
        # the DVC of this interpreter (a dependency of mars), not whichever `dvc` PATH finds, if any
        proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True)
        if proc.returncode != 0:
            raise MarsError(f"dvc {' '.join(args[:3])} in {repo}: {proc.stderr.strip() or proc.stdout.strip()}")

    dvc("remote", "add", "--force", *(["--default"] if default else []), remote, url)
    if url.startswith("s3://"):
        endpoint = cfg.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            dvc("remote", "modify", "--local", remote, "endpointurl", endpoint)
        if cfg.region:
            dvc("remote", "modify", remote, "region", cfg.region)
        if cfg.profile:
            dvc("remote", "modify", "--local", remote, "profile", cfg.profile)
    return url
