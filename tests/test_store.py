"""The artifact store: the same behaviour over a local directory and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from s3_server import use_server

from mars.config import ConfigError, load_params
from mars.core.atomic import temp_prefix
from mars.core.digest import sha256_file
from mars.cli.options import store_config
from mars.release.store import (IntegrityError, NoSuchBucket, NotFound, StoreConfig, StoreError, configure_dvc,
                                object_key, open_store)

MB = 1024 * 1024


def _file(path: Path, size: int, seed: int = 0) -> tuple[Path, str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(hashlib.shake_256(f"{seed}".encode()).digest(size))
    return path, sha256_file(path)


def _overwrite_object(store, sha256: str, data: bytes) -> None:
    """Change a stored object behind the store's back (what bit rot or an attacker would do)."""
    key = object_key(sha256)
    if store.uri.startswith("s3://"):
        store.client.put_object(Bucket=store.bucket, Key=store._key(key), Body=data)
    else:
        (store.root / key).write_bytes(data)


@contextlib.contextmanager
def closed_port():
    """A port nothing listens on: bound (so no one else takes it) but never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_objects_are_content_addressed_and_stored_once(store_uri, tmp_path):
    store = open_store(StoreConfig(uri=store_uri))
    src, digest = _file(tmp_path / "a.bin", 3000)
    assert store.put_object(src, digest, 3000) is True
    assert store.put_object(src, digest, 3000) is False  # already there: nothing uploaded
    assert store.list("objects/") == [object_key(digest)]
    store.get_object(digest, 3000, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()


def test_large_file_round_trip_goes_up_in_parts(store_uri, tmp_path):
    cfg = StoreConfig(uri=store_uri, multipart_threshold_mb=5, multipart_chunk_mb=5)
    store = open_store(cfg)
    src, digest = _file(tmp_path / "big.bin", 12 * MB, seed=1)
    store.put_object(src, digest, 12 * MB)
    if store.uri.startswith("s3://"):  # a multipart object's ETag is "<md5 of part md5s>-<parts>"
        etag = store.client.head_object(Bucket=store.bucket, Key=store._key(object_key(digest)))["ETag"]
        assert etag.strip('"').endswith("-3")
    store.get_object(digest, 12 * MB, tmp_path / "back.bin")
    assert sha256_file(tmp_path / "back.bin") == digest


def test_documents_can_be_created_only_once(store_uri):
    store = open_store(StoreConfig(uri=store_uri))
    written, first = store.put_json("releases/x/v1/manifest.json", {"a": 1}, if_absent=True)
    assert written
    written, _ = store.put_json("releases/x/v1/manifest.json", {"a": 2}, if_absent=True)
    assert not written
    assert store.get_json("releases/x/v1/manifest.json") == ({"a": 1}, first)
    store.put_json("stages/x/prod.json", {"v": 1})
    store.put_json("stages/x/prod.json", {"v": 2})  # pointers are replaced whole
    assert store.get_json("stages/x/prod.json")[0] == {"v": 2}
    with pytest.raises(NotFound, match="stages/x/dev.json"):
        store.get_json("stages/x/dev.json")


def test_altered_or_short_objects_are_refused(store_uri, tmp_path):
    store = open_store(StoreConfig(uri=store_uri))
    src, digest = _file(tmp_path / "w.bin", 4096)
    store.put_object(src, digest, 4096)
    _overwrite_object(store, digest, b"\0" * 4096)  # same size, other bytes
    with pytest.raises(IntegrityError, match=rf"{object_key(digest)} \(checkpoint/w.bin\): sha256 mismatch"):
        store.get_object(digest, 4096, tmp_path / "got.bin", label="checkpoint/w.bin")
    assert not (tmp_path / "got.bin").exists()
    _overwrite_object(store, digest, src.read_bytes()[:1000])  # a partial object
    with pytest.raises(IntegrityError, match="1000 bytes, the release records 4096"):
        store.get_object(digest, 4096, tmp_path / "got.bin")
    with pytest.raises(NotFound, match=object_key("0" * 64)):
        store.get_object("0" * 64, 1, tmp_path / "none.bin")


@pytest.mark.parametrize("data, problem", [(b"{", "Expecting property name"), (b"[" * 100_000, "nested too deeply"),
                                           (b'{"v": ' + b"9" * 5000 + b"}", "4300 digits")])
def test_a_document_that_is_not_json_is_one_integrity_error_naming_it(tmp_path, data, problem):
    store = open_store(str(tmp_path / "store"))
    store.put_bytes("stages/mars/prod.json", data)
    with pytest.raises(IntegrityError, match=rf"prod\.json: not valid JSON \(.*{problem}.*; corrupt document\)"):
        store.get_json("stages/mars/prod.json")


def test_unfinished_writes_are_invisible(tmp_path):
    store = open_store(StoreConfig(uri=f"file://{tmp_path / 'store'}"))
    src, digest = _file(tmp_path / "a.bin", 100)
    store.put_object(src, digest, 100)
    # what a killed upload leaves behind: a temp file next to where the object would go
    (store.root / object_key(digest)).with_name(".deadbeef.123.tmp").write_bytes(b"partial")
    assert store.list("objects/") == [object_key(digest)]


def test_leftovers_of_killed_uploads_are_swept_and_uploads_in_progress_kept(store_uri, tmp_path):
    """What a killed upload leaves, never part of a release: a temp file (directory store) or an open
    multipart upload (S3). Those of a dead process on this host go at once; those whose writer cannot
    be checked (another host's, any S3 upload) once they are older than the threshold."""
    store = open_store(StoreConfig(uri=store_uri))
    src, digest = _file(tmp_path / "a.bin", 100)
    store.put_object(src, digest, 100)
    if store_uri.startswith("s3://"):
        key = store._key(object_key("1" * 64))
        upload = store.client.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]
        store.client.upload_part(Bucket=store.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"partial")
        assert store.sweep_leftovers() == []  # it may still be running
        assert store.sweep_leftovers(older_than_s=0) == [f"s3://{store.bucket}/{key}"]
        assert not store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads")
    else:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        host = temp_prefix("x").split("-")[1]
        folder = (store.root / object_key(digest)).parent
        gone = {folder / f".{'2' * 64}.tmp-{host}-{dead.pid}-a.tmp",
                store.root / f"stages/mars/.prod.json.tmp-{host}-{dead.pid}-b.tmp"}
        running = folder / f".{'3' * 64}.tmp-{host}-{os.getpid()}-c.tmp"
        foreign = folder / f".{'4' * 64}.tmp-otherhost-{dead.pid}-d.tmp"  # its pid says nothing here
        for path in gone | {running, foreign}:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"partial")
        assert sorted(store.sweep_leftovers()) == sorted(map(str, gone))
        assert running.exists() and foreign.exists()
        assert store.sweep_leftovers(older_than_s=0) == [str(foreign)]
        assert running.exists()
    assert store.list("objects/") == [object_key(digest)]  # the stored object is never touched


def test_directory_store_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(NotFound, match=str(tmp_path / "nowhere")):
        open_store(str(tmp_path / "nowhere")).check()


@pytest.mark.s3
def test_the_test_server_takes_writes_in_more_buckets_than_the_disk_has_gib_free(s3_server):
    # weed sizes its volume slots (one per bucket) by free disk unless told; on a fuller CI disk the
    # suite's ~20 buckets ran out and uploads failed with "InternalError" (infra/s3/seaweedfs.sh)
    client = s3_server.client()
    for _ in range(24):
        client.put_object(Bucket=s3_server.make_bucket(), Key="k", Body=b"x")


@pytest.mark.s3
def test_s3_failures_name_the_bucket_and_key_and_never_the_secret(s3_server, monkeypatch, tmp_path):
    use_server(s3_server, monkeypatch)
    bucket = s3_server.make_bucket()
    src, digest = _file(tmp_path / "a.bin", 100)

    # a missing bucket is its own error, never taken for a missing object (which callers treat as "absent")
    assert not issubclass(NoSuchBucket, NotFound)
    with pytest.raises(NoSuchBucket, match=r"s3://no-such-bucket-x: no such bucket"):
        open_store("s3://no-such-bucket-x/p").check()
    with pytest.raises(NoSuchBucket, match=r"s3://no-such-bucket-x: upload failed: no such bucket"):
        open_store("s3://no-such-bucket-x/p").put_object(src, digest, 100)
    with pytest.raises(NoSuchBucket, match=r"s3://no-such-bucket-x: get failed: no such bucket"):
        open_store("s3://no-such-bucket-x/p").get_json("stages/mars/prod.json")

    wrong = "wrong" + s3_server.secret_key[5:]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    with pytest.raises(StoreError) as err:
        open_store(f"s3://{bucket}/p").put_object(src, digest, 100)
    message = str(err.value)
    assert f"s3://{bucket}/p/{object_key(digest)}" in message and "access denied" in message
    assert wrong not in message and s3_server.secret_key not in message and s3_server.access_key not in message
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)

    # nothing listens on the endpoint: transient errors are retried, then reported without the URL
    with closed_port() as port:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        with pytest.raises(StoreError, match=rf"s3://{bucket}: head bucket failed: S3 endpoint unreachable after 2 "
                                             "attempts") as err:
            open_store(StoreConfig(uri=f"s3://{bucket}/p", max_attempts=2, connect_timeout_s=1)).check()
        assert str(port) not in str(err.value)


def test_store_uri_comes_from_params_unless_overridden(tmp_path, monkeypatch):
    params_file = tmp_path / "params.yaml"
    params_file.write_text("store:\n  uri: s3://bucket/prefix\n  max_attempts: 3\n")
    monkeypatch.delenv("MARS_STORE_URI", raising=False)
    assert store_config(load_params(params_file)).uri == "s3://bucket/prefix"
    monkeypatch.setenv("MARS_STORE_URI", str(tmp_path / "elsewhere"))
    cfg = store_config(load_params(params_file))
    assert (cfg.uri, cfg.max_attempts) == (str(tmp_path / "elsewhere"), 3)
    assert store_config(load_params(params_file), uri="file:///x").uri == "file:///x"
    with pytest.raises(ConfigError, match="store.uri: 'gs://b': only file:// paths and s3:// are supported"):
        store_config({"store": {"uri": "gs://b"}})
    with pytest.raises(ConfigError, match="store.multipart_chunk_mb: S3 parts must be at least 5 MB"):
        store_config({"store": {"multipart_chunk_mb": 1}})
    with pytest.raises(ConfigError, match=r"store: unknown key 'secret_key'"):
        store_config({"store": {"secret_key": "x"}})


def test_dvc_push_lands_in_the_store(store_uri, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    cfg = StoreConfig(uri=store_uri)
    url = configure_dvc(cfg, repo)
    assert url == (f"{store_uri}/dvc" if store_uri.startswith("s3://") else str(Path(store_uri) / "dvc"))
    assert "endpointurl" not in (repo / ".dvc" / "config").read_text()  # machine-specific: config.local
    (repo / "data.txt").write_text("tracked by dvc\n")
    for cmd in (["add", "data.txt"], ["push"]):
        proc = subprocess.run([sys.executable, "-m", "dvc", *cmd], cwd=repo, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    md5 = hashlib.md5(b"tracked by dvc\n").hexdigest()
    assert f"dvc/files/md5/{md5[:2]}/{md5[2:]}" in open_store(cfg).list("dvc/")
    secrets = [os.environ.get("AWS_SECRET_ACCESS_KEY")] if store_uri.startswith("s3://") else []
    for config in (repo / ".dvc").glob("config*"):
        assert not any(s and s in config.read_text() for s in secrets)
