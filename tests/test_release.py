"""Releases: promote a gated export + checkpoint, pull it verified, survive crashes, races and tampering.

Every behaviour runs against a local directory store and a real S3 server (SeaweedFS); the inputs are
small fake export/checkpoint directories (the store moves files, it does not make them), except the
round trip at the end, which decodes with a real tiny model pulled back from S3.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gate_evidence import decide as gate_decide
from s3_server import REPO, launch, use_server

from mars.core.digest import sha256_tree
from mars.cli.promote import main as promote_cli
from mars.cli.store import main as store_cli
from mars.release.promote import (IntegrityError, ReleaseError, list_releases, manifest_key, pointer_key, promote,
                          pull, rollback)
from mars.core.atomic import temp_prefix
from mars.evaluation.gate import Override, sign
from mars.release.store import StoreConfig, StoreError, object_key, open_store

MB = 1024 * 1024
MARS = {"block_size": 4, "mask_token_id": 95, "objective": "mars", "w_ar": 1.0, "stage": "mars",
        "block_offset": "fixed", "base": "tiny"}
PROD = {"stage": "prod", "by": "tester"}  # an explicit, recorded move of the production stage
SPEED_TAU = 0.8  # the gates here check the score at tau 0.8 too: a release's default tau


def _bytes(seed: str, size: int) -> bytes:
    return hashlib.shake_256(seed.encode()).digest(size)


def make_inputs(root: Path, seed: str, weights_size: int = 20_000, passing: bool = True,
                override: Override | None = None) -> dict:
    """A fake MARS checkpoint and export of it, distinct per ``seed``, and a real gate decision on them (an
    evaluation that passes, or fails, under ``root``: tests/gate_evidence.py)."""
    ckpt, export = root / "checkpoint", root / "export"
    for d in (ckpt, export):
        d.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "mars": MARS}))
    (ckpt / "model.safetensors").write_bytes(_bytes(f"weights-{seed}", weights_size))
    (ckpt / "tokenizer.json").write_text(json.dumps({"model": "bpe", "seed": seed}))
    (ckpt / "tokenizer_config.json").write_text("{}")
    (export / "model.onnx").write_bytes(_bytes(f"onnx-{seed}", 5000))
    (export / "config.json").write_text(json.dumps({"mars": MARS}))
    (export / "manifest.json").write_text(json.dumps({"format_version": 1, "mars": MARS,
                                                      "checkpoint": {"sha256": sha256_tree(ckpt)}}))
    gate = gate_decide(root, ckpt, export, passing=passing, speed_tau=SPEED_TAU, override=override)
    return {"gate": gate, "export": export, "checkpoint": ckpt}


def expected_tree(inputs: dict) -> dict[str, bytes]:
    """What a pull of ``inputs`` must produce (release path -> bytes)."""
    tree = {}
    for group in ("export", "checkpoint"):
        tree.update({f"{group}/{p.name}": p.read_bytes() for p in inputs[group].iterdir()})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        tree[f"tokenizer/{name}"] = (inputs["checkpoint"] / name).read_bytes()
    return tree


def pulled_tree(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*")
            if p.is_file() and p.name != "release.json"}


def quiet(*_args) -> None:
    pass


def run_mars(verb: str, *args: str, cwd: Path, params: dict | None = None, env: dict | None = None,
             wait: bool = True):
    """``mars VERB ...`` in a subprocess with its own params file (store section ``params``)."""
    params_file = cwd / f"params-{verb}.yaml"
    params_file.write_text(json.dumps({"store": params or {}}))
    cmd = [sys.executable, "-m", "mars.cli", verb, "--params", str(params_file), *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def promote_args(inputs: dict, store_uri: str) -> list[str]:
    return ["--gate", str(inputs["gate"]), "--export", str(inputs["export"]), "--checkpoint",
            str(inputs["checkpoint"]), "--store", store_uri, "--stage", "prod", "--by", "tester"]


def wait_for_partial_upload(store, proc, timeout: float = 90) -> None:
    """Block until ``proc`` is visibly midway through uploading an object (temp file / open multipart upload)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"promote ended before the upload was caught midway: {proc.communicate()}"
        if store.uri.startswith("s3://"):
            if store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads"):
                return
        elif any(p.stat().st_size > 0 for p in (store.root / "objects").rglob(".*.tmp")):
            return
        time.sleep(0.05)
    raise AssertionError("no upload in progress seen")


def assert_serves(store_uri: str, inputs: dict, dest: Path, **kwargs) -> dict:
    manifest = pull(open_store(store_uri), "mars", dest, log=quiet, **kwargs)
    assert pulled_tree(dest) == expected_tree(inputs)
    return manifest


# ---------------------------------------------------------------------------------------------
def test_promote_pull_history_and_rollback(store_uri, tmp_path):
    store = open_store(StoreConfig(uri=store_uri))
    first, second = make_inputs(tmp_path / "a", "a"), make_inputs(tmp_path / "b", "b")
    pointer = promote(store, **first, **PROD, repo=REPO, log=quiet)
    assert (pointer["version"], pointer["previous"]) == ("v1", None)

    dest = tmp_path / "service" / "model"
    assert promote_cli(["mars", "--stage", "prod", "--to", str(dest), "--store", store_uri, "--params",
                str(REPO / "params.yaml")], verb="pull") == 0
    assert pulled_tree(dest) == expected_tree(first)
    manifest = json.loads((dest / "release.json").read_bytes())
    assert hashlib.sha256((dest / "release.json").read_bytes()).hexdigest() == pointer["manifest_sha256"]
    assert {k: manifest[k] for k in ("name", "version", "stage", "block_size", "tau", "mask_token_id")} == \
        {"name": "mars", "version": "v1", "stage": "prod", "block_size": 4, "tau": 0.8, "mask_token_id": 95}
    assert manifest["gate"] == json.loads(first["gate"].read_text()) and manifest["engines"] == {"onnx": "export/model.onnx"}
    assert manifest["published_by"] == "tester" and pointer["moved_by"] == "tester"
    assert manifest["files"]["export/model.onnx"] == {
        "sha256": hashlib.sha256(_bytes("onnx-a", 5000)).hexdigest(), "size": 5000}
    assert len(manifest["source"]["git_commit"]) == 40

    pointer = promote(store, **second, **PROD, log=quiet)
    assert (pointer["version"], pointer["previous"]) == ("v2", "v1")
    assert_serves(store_uri, second, dest)  # the earlier pull is replaced as a whole
    assert_serves(store_uri, first, tmp_path / "pinned", stage=None, version="v1")

    rollback(store, version="v1", **PROD, log=quiet)
    assert_serves(store_uri, first, dest)
    lines = list_releases(store, "mars")
    assert [line.split()[:2] for line in lines] == [["mars", "v1"], ["mars", "v2"]]
    assert lines[0].endswith("files=9  <- prod") and lines[1].endswith("files=9")
    with pytest.raises(ReleaseError, match=r"no release mars v7 \(releases: v1, v2\)"):
        rollback(store, version="v7", **PROD, log=quiet)


def test_promote_checks_gate_inputs_and_names_before_uploading(tmp_path):
    store = open_store(str(tmp_path / "store"))
    inputs = make_inputs(tmp_path / "f", "f", passing=False)
    with pytest.raises(ReleaseError, match=rf"{inputs['gate']}: the gate did not pass"):
        promote(store, **inputs, **PROD, log=quiet)
    assert not (tmp_path / "store").exists()  # nothing uploaded

    # the same failing evaluation, overridden at the gate (`mars gate --override REASON --override-by WHO`)
    gate_decide(tmp_path / "f", inputs["checkpoint"], inputs["export"], passing=False, speed_tau=SPEED_TAU,
                override=Override(True, "hotfix", "lead"))
    promote(store, **inputs, **PROD, log=quiet)
    manifest = open_store(str(tmp_path / "store")).get_json(manifest_key("mars", "v1"))[0]
    assert manifest["gate"]["override"]["by"] == "lead" and manifest["gate"]["overridden"] is True

    other = make_inputs(tmp_path / "o", "o")
    with pytest.raises(ReleaseError, match="made from a different checkpoint"):
        promote(store, gate=other["gate"], export=other["export"], checkpoint=inputs["checkpoint"], **PROD,
                log=quiet)
    with pytest.raises(ReleaseError, match=r"release name '\.\./x': use letters"):
        promote(store, **other, **PROD, name="../x", log=quiet)
    with pytest.raises(ReleaseError, match=r"stage 'a/b': use letters"):
        pull(store, "mars", tmp_path / "out", stage="a/b", log=quiet)
    other["gate"].unlink()
    with pytest.raises(ReleaseError, match="no gate decision"):
        promote(store, **other, **PROD, log=quiet)


def test_pull_refuses_tampered_or_partial_releases(store_uri, tmp_path):
    store = open_store(StoreConfig(uri=store_uri))
    first, second = make_inputs(tmp_path / "a", "a"), make_inputs(tmp_path / "b", "b")
    promote(store, **first, **PROD, log=quiet)
    dest = tmp_path / "model"
    assert_serves(store_uri, first, dest)
    promote(store, **second, **PROD, log=quiet)

    weights = hashlib.sha256((second["checkpoint"] / "model.safetensors").read_bytes()).hexdigest()
    overwrite(store, object_key(weights), b"\x00" * 20_000)
    tampered = rf"{object_key(weights)} \(checkpoint/model.safetensors\): sha256 mismatch"
    with pytest.raises(IntegrityError, match=tampered):
        pull(store, "mars", dest, log=quiet)
    assert pulled_tree(dest) == expected_tree(first)  # the earlier pull is untouched
    assert not [p.name for p in dest.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left

    overwrite(store, object_key(weights), b"\x00" * 100)  # a partial object
    with pytest.raises(IntegrityError, match="100 bytes, the release records 20000"):
        pull(store, "mars", tmp_path / "fresh", log=quiet)
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(IntegrityError, match="refusing to roll prod back to v2"):
        rollback(store, version="v2", **PROD, log=quiet)

    assert_serves(store_uri, first, tmp_path / "v1", stage=None, version="v1")  # the previous release still serves
    rollback(store, version="v1", **PROD, log=quiet)
    assert_serves(store_uri, first, dest)

    manifest, _ = store.get_json(manifest_key("mars", "v1"))
    manifest["files"]["export/model.onnx"]["sha256"] = weights  # point a file at other bytes
    overwrite(store, manifest_key("mars", "v1"), json.dumps(manifest).encode())
    with pytest.raises(IntegrityError, match=r"manifests?.*does not match the stage pointer"):
        pull(store, "mars", dest, log=quiet)


def overwrite(store, key: str, data: bytes) -> None:
    """Change a stored object behind the store's back."""
    if store.uri.startswith("s3://"):
        store.client.put_object(Bucket=store.bucket, Key=store._key(key), Body=data)
    else:
        (store.root / key).write_bytes(data)


def test_promote_killed_midway_leaves_the_previous_release(store_uri, tmp_path):
    store = open_store(StoreConfig(uri=store_uri))
    first = make_inputs(tmp_path / "a", "a")
    promote(store, **first, **PROD, log=quiet)
    big = make_inputs(tmp_path / "big", "big", weights_size=24 * MB)
    slow = {"max_bandwidth_mb": 6, "multipart_threshold_mb": 5, "multipart_chunk_mb": 5}
    proc = run_mars("promote", *promote_args(big, store_uri), cwd=tmp_path, params=slow, wait=False)
    try:
        wait_for_partial_upload(store, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert store.get_json(pointer_key("mars", "prod"))[0]["version"] == "v1"
    assert assert_serves(store_uri, first, tmp_path / "served")["version"] == "v1"
    weights = hashlib.sha256((big["checkpoint"] / "model.safetensors").read_bytes()).hexdigest()
    assert object_key(weights) not in store.list("objects/")
    # the leftovers do not get in the way of the next promote
    rc, out, err = run_mars("promote", *promote_args(big, store_uri), cwd=tmp_path)
    assert rc == 0, err
    assert "promoted mars v2 -> prod" in out
    assert_serves(store_uri, big, tmp_path / "served")


@pytest.mark.s3
def test_server_stopped_during_promote(tmp_path, monkeypatch):
    server = launch(tmp_path / "seaweedfs")
    try:
        use_server(server, monkeypatch)
        uri = f"s3://{server.make_bucket()}/mars"
        store = open_store(uri)
        first = make_inputs(tmp_path / "a", "a")
        promote(store, **first, **PROD, log=quiet)
        big = make_inputs(tmp_path / "big", "big", weights_size=24 * MB)
        params = {"max_bandwidth_mb": 6, "multipart_threshold_mb": 5, "multipart_chunk_mb": 5, "max_attempts": 2,
                  "connect_timeout_s": 2}
        proc = run_mars("promote", *promote_args(big, uri), cwd=tmp_path, params=params, wait=False)
        wait_for_partial_upload(store, proc)
        server.stop()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert f"mars promote: error: {uri}/objects/sha256/" in err and "upload failed" in err
        assert err.count("\n") == 1  # one clear line, no traceback
        assert not any(s in out + err for s in (server.secret_key, server.access_key, server.endpoint))
        server.start()
        assert assert_serves(uri, first, tmp_path / "served")["version"] == "v1"
    finally:
        server.stop()


@pytest.mark.s3
def test_credentials_and_bucket_errors_name_what_failed_and_leak_nothing(s3_server, monkeypatch, tmp_path):
    use_server(s3_server, monkeypatch)
    bucket = s3_server.make_bucket()
    inputs = make_inputs(tmp_path / "a", "a")
    uri = f"s3://{bucket}/mars"
    rc, out, err = run_mars("promote", *promote_args(inputs, uri), cwd=tmp_path)
    assert rc == 0, err
    secrets = (s3_server.secret_key, s3_server.access_key)
    wrong = {"AWS_SECRET_ACCESS_KEY": "0" * 40}
    outputs = [out, err]
    for verb, args in (("promote", promote_args(inputs, uri)),
                       ("pull", ["mars", "--to", str(tmp_path / "x"), "--store", uri])):
        rc, out, err = run_mars(verb, *args, cwd=tmp_path, env=wrong)
        assert rc == 1 and f"s3://{bucket}" in err and "access denied" in err, err
        assert "0" * 40 not in out + err
        outputs += [out, err]
    rc, out, err = run_mars("promote", *promote_args(inputs, "s3://no-such-bucket/mars"), cwd=tmp_path)
    assert rc == 1 and "s3://no-such-bucket: no such bucket" in err, err
    outputs += [out, err]

    pulled = tmp_path / "pulled"
    pull(open_store(uri), "mars", pulled, log=quiet)
    stored = [open_store(uri).get_bytes(key) for key in open_store(uri).list("") if not key.startswith("objects/")]
    files = [p.read_bytes() for p in pulled.rglob("*") if p.is_file()]
    for blob in [o.encode() for o in outputs] + stored + files:
        assert not any(s.encode() in blob for s in secrets)
        assert s3_server.endpoint.encode() not in blob


def test_racing_promotes_end_with_one_coherent_release(store_uri, tmp_path):
    store = open_store(StoreConfig(uri=store_uri))
    promote(store, **make_inputs(tmp_path / "base", "base"), **PROD, log=quiet)
    racers = [make_inputs(tmp_path / name, name, weights_size=2 * MB) for name in ("x", "y")]
    procs = [run_mars("promote", *promote_args(inputs, store_uri), cwd=tmp_path / name, wait=False)
             for name, inputs in zip(("x", "y"), racers)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    versions = {store.get_json(manifest_key("mars", v))[0]["files"]["checkpoint/model.safetensors"]["sha256"]: v
                for v in ("v2", "v3")}
    assert len(versions) == 2  # each racer got its own release; none overwrote the other
    served = pull(store, "mars", tmp_path / "served", log=quiet)
    winner = next(i for i in racers if served["version"] == versions[
        hashlib.sha256((i["checkpoint"] / "model.safetensors").read_bytes()).hexdigest()])
    assert pulled_tree(tmp_path / "served") == expected_tree(winner)


@pytest.mark.slow
@pytest.mark.s3
def test_round_trip_of_a_real_model_through_s3(s3_server, monkeypatch, tmp_path):
    """Promote a real tiny MARS checkpoint and its ONNX export, pull it elsewhere, decode with both."""
    import torch
    from conftest import tiny_model

    from mars.decoding.generate import generate
    from mars.decoding.onnx_backend import ExportedBlock
    from mars.release.export import ExportConfig, export_checkpoint
    from mars.core.mask_token import add_mask_token
    from mars.core.models import load_model
    from mars.training.base import train_tokenizer

    use_server(s3_server, monkeypatch)
    uri = f"s3://{s3_server.make_bucket()}/mars"
    texts = [f"{a} plus {b} is {a + b}. the cat sat on the mat." for a in range(30) for b in range(3)]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    model = tiny_model("llama", vocab=len(tokenizer) + 8)
    info = add_mask_token(model, tokenizer)
    model.config.mars = {**MARS, "mask_token_id": info.token_id}
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    ckpt = tmp_path / "checkpoints" / "mars" / "final"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    export_checkpoint(ckpt, tmp_path / "exports" / "mars",
                      ExportConfig(batch_size=2, window=8, max_context=64, tensorrt=False, latency_iters=1), log=quiet)
    gate = gate_decide(tmp_path / "gate", ckpt, tmp_path / "exports" / "mars", speed_tau=SPEED_TAU)

    promote(open_store(uri), gate=gate, export=tmp_path / "exports" / "mars", checkpoint=ckpt, **PROD, log=quiet)
    dest = tmp_path / "elsewhere" / "release"
    manifest = pull(open_store(uri), "mars", dest, log=quiet)

    prompts = ["3 plus 4 is", "the cat"]
    kwargs = dict(tau=manifest["tau"], max_new_tokens=12, block_size=manifest["block_size"])
    with torch.no_grad():
        reference = generate(model, tokenizer, prompts, **kwargs)
        pulled_model, pulled_tokenizer = load_model(dest / "checkpoint", dtype="float32")
        from_checkpoint = generate(pulled_model, pulled_tokenizer, prompts, **kwargs)
    engine = ExportedBlock(dest / "export")  # verifies the export's own checksums, loads model.onnx
    from_export = engine.generate(prompts, **kwargs)
    assert [r.token_ids for r in from_checkpoint] == [r.token_ids for r in reference]
    assert [r.token_ids for r in from_export] == [r.token_ids for r in reference]
    assert all(len(r.token_ids) > 0 for r in reference)


# ---- trust boundaries (issue 16): each test is the attack --------------------------------------------
def test_the_gate_binds_the_model_it_judged(tmp_path):
    """Promote refuses another model under a passed gate, a decision naming nothing, an anonymous override."""
    store = open_store(str(tmp_path / "store"))
    judged, other = make_inputs(tmp_path / "judged", "judged"), make_inputs(tmp_path / "other", "other")
    with pytest.raises(ReleaseError, match=r"this checkpoint \(sha256 \w+\.\.\.\) is not the one the gate judged"):
        promote(store, gate=judged["gate"], export=other["export"], checkpoint=other["checkpoint"], **PROD,
                log=quiet)
    export_only = make_inputs(tmp_path / "copy", "judged")  # the same checkpoint, another export of it
    (export_only["export"] / "model.onnx").write_bytes(b"not the judged engine")
    with pytest.raises(ReleaseError, match=r"this export \(sha256 \w+\.\.\.\) is not the one the gate judged"):
        promote(store, gate=judged["gate"], export=export_only["export"], checkpoint=judged["checkpoint"], **PROD,
                log=quiet)
    hand_written = tmp_path / "hand.json"
    hand_written.write_text(json.dumps({"passed": True}))
    with pytest.raises(ReleaseError, match="names no checkpoint sha256"):
        promote(store, gate=hand_written, export=judged["export"], checkpoint=judged["checkpoint"], **PROD,
                log=quiet)
    anonymous = {**json.loads(judged["gate"].read_text()), "passed": False,
                 "override": {"enabled": True, "reason": "ship it", "by": ""}}
    hand_written.write_text(json.dumps(anonymous))
    with pytest.raises(ReleaseError, match="no override recording a reason and who"):
        promote(store, gate=hand_written, export=judged["export"], checkpoint=judged["checkpoint"], **PROD,
                log=quiet)
    assert not store.list("stages/")  # nothing was published
    assert promote(store, **judged, **PROD, log=quiet)["version"] == "v1"


def test_a_stored_object_altered_in_place_never_reaches_a_stage_pull_refuses(tmp_path):
    """Fault injection: same-size corruption of stored objects and manifests, then promote, rollback and
    pull by version. After every step prod still points at a release a pull accepts."""
    store = open_store(str(tmp_path / "store"))
    first, second = make_inputs(tmp_path / "a", "a"), make_inputs(tmp_path / "b", "b")
    promote(store, **first, **PROD, log=quiet)
    promote(store, **second, **PROD, log=quiet)

    def prod_serves() -> str:
        return pull(store, "mars", tmp_path / "service", log=quiet)["version"]

    weights = hashlib.sha256((first["checkpoint"] / "model.safetensors").read_bytes()).hexdigest()
    overwrite(store, object_key(weights), b"\x01" * 20_000)  # same size, other bytes
    with pytest.raises(IntegrityError, match="sha256 mismatch.*refusing to roll prod back to v1"):
        rollback(store, version="v1", **PROD, log=quiet)
    assert prod_serves() == "v2"
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        pull(store, "mars", tmp_path / "pinned", stage=None, version="v1", log=quiet)

    pointer = promote(store, **first, **PROD, log=quiet)  # a re-promote re-uploads the altered object
    assert pointer["version"] == "v3" and prod_serves() == "v3"
    assert_serves(str(store.root), first, tmp_path / "pinned", stage=None, version="v1")  # repaired, v1 too

    manifest, _ = store.get_json(manifest_key("mars", "v2"))
    manifest["tau"] = 0.1  # an edited manifest (its objects all intact)
    overwrite(store, manifest_key("mars", "v2"), json.dumps(manifest).encode())
    with pytest.raises(IntegrityError, match="does not match the release's seal"):
        pull(store, "mars", tmp_path / "pinned-v2", stage=None, version="v2", log=quiet)
    with pytest.raises(IntegrityError, match="does not match the release's seal"):
        rollback(store, version="v2", **PROD, log=quiet)
    assert prod_serves() == "v3"


def test_killed_promote_and_pull_leave_nothing_the_next_run_does_not_remove(tmp_path):
    store = open_store(str(tmp_path / "store"))
    inputs = make_inputs(tmp_path / "a", "a")
    promote(store, **inputs, **PROD, log=quiet)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that belonged to a run that is gone
    alive = os.getpid()
    weights = hashlib.sha256((inputs["checkpoint"] / "model.safetensors").read_bytes()).hexdigest()
    objects = (store.root / object_key(weights)).parent
    host = temp_prefix("x").split("-")[1]
    leftovers = {
        "upload": objects / f".{weights}.tmp-{host}-{dead.pid}-abc.tmp",
        "pull": tmp_path / f".service.tmp-{host}-{dead.pid}-abc",
        "swap": tmp_path / f".service.old-{host}-{dead.pid}-123",
    }
    live = objects / f".{weights}.tmp-{host}-{alive}-abc.tmp"  # a promote still running: kept
    leftovers["upload"].write_bytes(b"partial")
    live.write_bytes(b"partial")
    for key in ("pull", "swap"):
        leftovers[key].mkdir()
        (leftovers[key] / "model.onnx").write_bytes(b"partial")
    (store.root / object_key(weights)).unlink()  # so that the next promote uploads this object again
    promote(store, **inputs, **PROD, log=quiet)
    pull(store, "mars", tmp_path / "service", log=quiet)
    assert not any(p.exists() for p in leftovers.values())
    assert live.exists()


def test_a_dvc_experiment_publishes_to_staging_and_never_moves_prod(tmp_path):
    """`dvc exp run` runs the pipeline's own promote command: staging moves, prod does not; a promote
    stage edited to say --stage prod is refused inside the experiment."""
    import yaml
    from project_copy import init_repo

    root, store_dir = tmp_path / "project", tmp_path / "store"
    inputs = make_inputs(tmp_path / "inputs", "exp")
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["promote"]
    for src, dest in ((inputs["gate"], "metrics/gate.json"), (inputs["export"], "exports/mars"),
                      (inputs["checkpoint"], "checkpoints/mars/final")):
        (root / dest).parent.mkdir(parents=True, exist_ok=True)
        src.rename(root / dest)
    (root / "params.yaml").write_text(yaml.safe_dump({"store": {"uri": str(store_dir), "stage": "prod"}, "knob": 1}))
    deps = ["metrics/gate.json", "exports/mars", "checkpoints/mars/final"]
    dvc_yaml = {"stages": {"promote": {"cmd": stage["cmd"], "deps": deps, "params": ["store", "knob"]}}}
    (root / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml))
    init_repo(root)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MARS_STORE_URI", None)

    def exp_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dvc", "exp", "run", *args], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)

    run = exp_run("-S", "knob=2")
    assert run.returncode == 0, run.stdout + run.stderr
    store = open_store(str(store_dir))
    assert store.get_json(pointer_key("mars", "staging"))[0]["version"] == "v1"
    assert "stages/mars/prod.json" not in store.list("stages/")

    dvc_yaml["stages"]["promote"]["cmd"] = stage["cmd"].replace("--stage staging", "--stage prod")
    (root / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml))
    run = exp_run("-S", "knob=3")
    assert run.returncode != 0
    assert "stage prod: not moved from a DVC experiment" in run.stdout + run.stderr
    assert "stages/mars/prod.json" not in store.list("stages/")
    # the params cannot say which stage is production: with store.stage set elsewhere, prod still does not move
    run = exp_run("-S", "knob=4", "-S", "store.stage=prod2")
    assert run.returncode != 0
    assert "stage prod: not moved from a DVC experiment" in run.stdout + run.stderr
    assert "stages/mars/prod.json" not in store.list("stages/")
    assert store.get_json(pointer_key("mars", "staging"))[0]["version"] == "v1"


def test_inside_a_dvc_experiment_promote_and_rollback_move_staging_only(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "store"))
    inputs = make_inputs(tmp_path / "a", "a")
    assert promote(store, **inputs, **PROD, log=quiet)["version"] == "v1"
    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")
    for stage in ("prod", "prod2", "canary"):
        with pytest.raises(ReleaseError, match=rf"stage {stage}: not moved from a DVC experiment \(exp-1\)"):
            promote(store, **inputs, stage=stage, by="exp", log=quiet)
        with pytest.raises(ReleaseError, match=rf"stage {stage}: not moved from a DVC experiment \(exp-1\)"):
            rollback(store, version="v1", stage=stage, by="exp", log=quiet)
    assert promote(store, **inputs, stage="staging", by="exp", log=quiet)["version"] == "v1"
    assert sorted(store.list("stages/")) == ["stages/mars/prod.json", "stages/mars/staging.json"]
    assert store.get_json(pointer_key("mars", "prod"))[0]["moved_by"] == "tester"


def test_the_same_gated_files_are_one_release_whichever_stage_gets_them(tmp_path):
    """The pipeline publishes to staging, the flow's release step then moves prod: to that release, not a copy;
    a re-run with nothing changed moves nothing."""
    store = open_store(str(tmp_path / "store"))
    inputs = make_inputs(tmp_path / "a", "a")
    assert promote(store, **inputs, stage="staging", by="dvc", log=quiet)["version"] == "v1"
    pointer = promote(store, **inputs, **PROD, log=quiet)
    assert (pointer["version"], pointer["moved_by"], pointer["previous"]) == ("v1", "tester", None)
    again = promote(store, **inputs, **PROD, log=quiet)
    assert again == pointer and store.list("releases/mars/") == ["releases/mars/v1/manifest.json",
                                                                  "releases/mars/v1/seal.json"]
    other = make_inputs(tmp_path / "b", "b")
    assert promote(store, **other, **PROD, log=quiet)["version"] == "v2"


# ---- issue 45: what a killed or broken write leaves must neither hide the store nor block it --------
def store_ls(store_uri: str, *args: str, capsys) -> list[str]:
    assert store_cli(["ls", *args, "--store", store_uri, "--params", str(REPO / "params.yaml")], verb="store") == 0
    return capsys.readouterr().out.splitlines()


def test_store_ls_lists_what_a_pull_takes_and_survives_a_corrupt_manifest(tmp_path, capsys):
    store = open_store(str(tmp_path / "store"))
    for seed in ("a", "b", "c"):
        promote(store, **make_inputs(tmp_path / seed, seed), **PROD, log=quiet)
    manifest, _ = store.get_json(manifest_key("mars", "v3"))
    # a promote killed after its manifest, before its seal; and a manifest gone bad on disk
    store.put_json(manifest_key("mars", "v4"), {**manifest, "version": "v4"}, if_absent=True)
    overwrite(store, manifest_key("mars", "v1"), b'{"name": "mars", "version": "v1", "files": {')
    lines = store_ls(store.uri, "mars", capsys=capsys)
    assert [line.split()[:2] for line in lines[:3]] == [["mars", "v1"], ["mars", "v2"], ["mars", "v3"]]
    assert lines[0].startswith("mars v1  unreadable: ") and "does not match the release's seal" in lines[0]
    assert lines[1].endswith("files=9") and lines[2].endswith("files=9  <- prod")
    assert len(lines) == 4 and "1 incomplete release not listed (v4)" in lines[3] and "--all" in lines[3]

    every = store_ls(store.uri, "mars", "--all", capsys=capsys)
    assert every[:3] == lines[:3] and every[3].startswith("mars v4  incomplete: no seal") and len(every) == 4
    with pytest.raises(IntegrityError, match="has no seal"):  # as a pull decides
        pull(store, "mars", tmp_path / "v4", stage=None, version="v4", log=quiet)


def test_a_corrupt_stage_pointer_is_listed_and_replaced_by_the_next_promote_or_rollback(tmp_path, capsys):
    store = open_store(str(tmp_path / "store"))
    first, second = make_inputs(tmp_path / "a", "a"), make_inputs(tmp_path / "b", "b")
    promote(store, **first, **PROD, log=quiet)
    overwrite(store, pointer_key("mars", "prod"), b'{"version": "v')
    lines = store_ls(store.uri, capsys=capsys)
    assert lines[0].endswith("files=9")  # no stage marker: the pointer says nothing readable
    assert lines[1].startswith("mars prod: unreadable stage pointer: ") and "not valid JSON" in lines[1]
    with pytest.raises(IntegrityError, match=r"not valid JSON .*`mars promote --stage prod` \(or --rollback"):
        pull(store, "mars", tmp_path / "out", log=quiet)  # a pull never follows it

    said: list[str] = []
    assert promote(store, **second, **PROD, log=said.append)["version"] == "v2"
    warning = [line for line in said if line.startswith("warning:")]
    assert len(warning) == 1 and str(store.root / pointer_key("mars", "prod")) in warning[0]
    assert "replacing" in warning[0]
    assert_serves(store.uri, second, tmp_path / "served")

    overwrite(store, pointer_key("mars", "prod"), b"")
    said.clear()
    rollback(store, version="v1", **PROD, log=said.append)
    assert said[0].startswith("warning:") and "not valid JSON" in said[0]
    assert_serves(store.uri, first, tmp_path / "served")
    assert store_ls(store.uri, capsys=capsys)[0].endswith("<- prod")


def test_leftovers_of_a_killed_upload_go_with_the_next_promote_of_anything(tmp_path):
    store = open_store(str(tmp_path / "store"))
    big = make_inputs(tmp_path / "big", "big", weights_size=24 * MB)
    slow = {"max_bandwidth_mb": 6}
    proc = run_mars("promote", *promote_args(big, store.uri), cwd=tmp_path, params=slow, wait=False)
    try:
        wait_for_partial_upload(store, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    partial = list((store.root / "objects").rglob(".*.tmp"))
    assert partial
    said: list[str] = []
    # other files: this promote never uploads (and so never sweeps) the objects those were parts of
    promote(store, **make_inputs(tmp_path / "a", "a"), **PROD, log=said.append)
    assert not [p for p in partial if p.exists()]
    assert any(f"removed {len(partial)} leftover" in line for line in said), said


def test_a_sweep_the_store_refuses_does_not_stop_the_promote(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "store"))

    def denied(*_args, **_kwargs):
        raise StoreError("s3://bucket/objects/sha256: list uploads failed: access denied (AccessDenied)")

    monkeypatch.setattr(store, "sweep_leftovers", denied)
    said: list[str] = []
    assert promote(store, **make_inputs(tmp_path / "a", "a"), **PROD, log=said.append)["version"] == "v1"
    assert said[0] == "warning: leftovers of killed uploads not swept: s3://bucket/objects/sha256: list uploads " \
                      "failed: access denied (AccessDenied)"


# ---- issue 45: promote derives the gate's verdict again from the evidence the decision names ------------
def refused(store, inputs: dict, decision: dict, match: str, where: Path) -> None:
    """``decision`` written to ``where`` and promoted with ``inputs``' files is refused in one line."""
    where.write_text(json.dumps(decision))
    with pytest.raises(ReleaseError, match=match) as err:
        promote(store, gate=where, export=inputs["export"], checkpoint=inputs["checkpoint"], **PROD, log=quiet)
    assert "\n" not in str(err.value)


def test_a_decision_whose_verdict_does_not_follow_from_its_evidence_is_refused(tmp_path):
    store = open_store(str(tmp_path / "store"))
    failed = make_inputs(tmp_path / "f", "f", passing=False)
    decision, forged = json.loads(failed["gate"].read_text()), tmp_path / "forged.json"
    follows = r"forged\.json: '{}' does not follow from its own evidence and rule"
    refused(store, failed, {**decision, "passed": True}, follows.format("passed"), forged)
    refused(store, failed, {**decision, "passed": True, "checks_passed": True, "failures": [],
                            "checks": [{**c, "passed": True} for c in decision["checks"]]},
            follows.format("passed"), forged)
    # a hand-written decision: the two sha256s are plain file hashes anyone can compute
    refused(store, failed, {"passed": True, "artifacts": decision["artifacts"]},
            r"forged\.json: names no evidence", forged)
    # an override added by hand: it counts only as the gate recorded it (in its config)
    by_hand = {"enabled": True, "reason": "ship it", "by": "mallory"}
    refused(store, failed, {**decision, "passed": True, "overridden": True, "override": by_hand},
            follows.format("passed"), forged)
    # a looser rule than the one the checks were made with (under which it would pass)
    loose = {**decision["config"], "tolerance": 1.0, "max_score_drop": 1.0}
    refused(store, failed, {**decision, "config": loose, "passed": True,
                            "checks_passed": True, "failures": []}, follows.format("checks"), forged)

    passed = make_inputs(tmp_path / "p", "p")
    decision = json.loads(passed["gate"].read_text())
    refused(store, passed, {**decision, "speed_tau": 0.1}, follows.format("speed_tau"), forged)  # a lower tau floor
    assert not store.list("stages/")  # nothing was published
    assert promote(store, **passed, **PROD, log=quiet)["version"] == "v1"


def test_evidence_edited_or_gone_after_the_gate_is_refused(tmp_path):
    store = open_store(str(tmp_path / "store"))
    inputs = make_inputs(tmp_path / "a", "a")
    outputs = tmp_path / "a" / "eval" / "mars" / "a" / "tau=1.0.jsonl"
    original = outputs.read_bytes()
    outputs.write_bytes(original.replace(b'"score": 0.0', b'"score": 1.0', 1))
    with pytest.raises(ReleaseError, match=r"tau=1\.0\.jsonl: not the per-item outputs the gate decided on"):
        promote(store, **inputs, **PROD, log=quiet)
    outputs.unlink()
    with pytest.raises(ReleaseError, match=r"tau=1\.0\.jsonl: no such file, yet the gate decided on it"):
        promote(store, **inputs, **PROD, log=quiet)
    outputs.write_bytes(original)
    metrics = tmp_path / "a" / "eval.json"
    metrics.write_text(metrics.read_text() + " ")
    with pytest.raises(ReleaseError, match=r"eval\.json: not the metrics the gate decided on"):
        promote(store, **inputs, **PROD, log=quiet)
    assert not store.list("stages/")


def test_with_a_signing_key_only_a_decision_the_gate_signed_promotes(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "store"))
    unsigned = make_inputs(tmp_path / "u", "u")  # the gate ran without a key
    monkeypatch.setenv("MARS_GATE_KEY", "the operator's key")
    with pytest.raises(ReleaseError, match=r"gate\.json: the decision is not signed \(MARS_GATE_KEY is set"):
        promote(store, **unsigned, **PROD, log=quiet)

    signed = make_inputs(tmp_path / "s", "s")
    decision, forged = json.loads(signed["gate"].read_text()), tmp_path / "forged.json"
    assert decision["signature"]["alg"] == "hmac-sha256"
    bad = r"forged\.json: the decision's signature does not verify with MARS_GATE_KEY"
    refused(store, signed, {**decision, "signature": sign(decision, "another key")}, bad, forged)
    # a failing decision overridden by hand in its config too derives again: only the signature tells
    failed = make_inputs(tmp_path / "f", "f", passing=False)
    failing = json.loads(failed["gate"].read_text())
    by_hand = {"enabled": True, "reason": "ship it", "by": "mallory"}
    refused(store, failed, {**failing, "passed": True, "overridden": True, "override": by_hand,
                            "config": {**failing["config"], "override": by_hand}}, bad, forged)
    assert not store.list("stages/")

    assert promote(store, **signed, **PROD, log=quiet)["version"] == "v1"
    monkeypatch.delenv("MARS_GATE_KEY")  # without a key nothing changes: signed or not, a standing decision promotes
    assert promote(store, **unsigned, **PROD, log=quiet)["version"] == "v2"
