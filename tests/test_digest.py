"""Digests: one definition of how files and folders are named by their content."""

from __future__ import annotations

import hashlib

from mars.core.digest import sha256_bytes, sha256_chunks, sha256_file, sha256_tree


def test_file_and_bytes_digests_are_plain_sha256(tmp_path):
    data = bytes(range(256)) * 5000  # over one read chunk
    (tmp_path / "f.bin").write_bytes(data)
    assert sha256_file(tmp_path / "f.bin") == hashlib.sha256(data).hexdigest() == sha256_bytes(data)


def test_tree_digest_changes_with_any_name_or_content_and_ignores_listing_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "sub" / "w.bin").write_bytes(b"weights")
    whole = sha256_tree(tmp_path)
    assert whole == sha256_tree(tmp_path, ["sub/w.bin", "a.json"])
    assert sha256_tree(tmp_path, ["a.json"]) != whole
    (tmp_path / "sub" / "w.bin").write_bytes(b"weightz")
    edited = sha256_tree(tmp_path)
    assert edited != whole
    (tmp_path / "sub" / "w.bin").rename(tmp_path / "sub" / "v.bin")
    assert sha256_tree(tmp_path) not in (whole, edited)


def test_a_stream_of_chunks_digests_as_their_concatenation():
    chunks = [b"3:5,6,7;", b"2:9,9;", b""]
    assert sha256_chunks(chunks) == sha256_bytes(b"".join(chunks)) == sha256_chunks(iter(chunks))
