"""A real S3 server for tests: SeaweedFS started through infra/s3/seaweedfs.sh (no mocks).

Fixtures (registered for every test module by ``pytest_plugins`` in conftest.py):

- ``s3_server`` (session): a running server. With ``MARS_TEST_S3_ENDPOINT``,
  ``MARS_TEST_S3_ACCESS_KEY`` and ``MARS_TEST_S3_SECRET_KEY`` set, that server is used as is;
  otherwise one is started on a free block of ports with its data in a temp dir, and stopped at the end.
- ``store_uri``: a fresh empty store, parametrized over a local directory and an S3 bucket (the
  AWS variables of the process point at the server while the test runs, so subprocesses inherit them).

:func:`launch` starts a private server a test may stop and restart (``server.stop()``/``start()``).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "infra" / "s3" / "seaweedfs.sh"
PORTS_PER_SERVER = 10  # the script gives the S3, master, volume, filer and admin servers PORT..PORT+9
REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    data_dir: Path | None = None  # None: a server this process did not start (never stopped here)
    port: int | None = None

    def env(self) -> dict[str, str]:
        """AWS variables that point boto3 and DVC at this server and nothing else."""
        isolated = str((self.data_dir or Path(os.devnull)).parent / "no-aws-config")
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
                "AWS_CONFIG_FILE": isolated, "AWS_SHARED_CREDENTIALS_FILE": isolated}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def make_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def _script(self, command: str) -> None:
        assert self.data_dir is not None, "not a server this test session started"
        env = {**os.environ, "MARS_S3_DIR": str(self.data_dir), "MARS_S3_PORT": str(self.port),
               "MARS_S3_BUCKET": "mars"}
        proc = subprocess.run([str(SCRIPT), command], env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"seaweedfs.sh {command} failed:\n{proc.stdout}\n{proc.stderr}")

    def start(self) -> None:
        self._script("start")

    def stop(self) -> None:
        self._script("stop")


def _free_port_block(n: int = PORTS_PER_SERVER) -> int:
    """A base port whose next ``n`` ports are free on 127.0.0.1 (random, to avoid other engineers' servers)."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports for SeaweedFS")


def launch(data_dir: Path) -> S3Server:
    """Start a private SeaweedFS with its data (and generated credentials) in ``data_dir``."""
    for _ in range(3):  # a port taken between the probe and the bind: try another block
        port = _free_port_block()
        server = S3Server(f"http://127.0.0.1:{port}", "", "", data_dir, port)
        try:
            server.start()
        except RuntimeError:
            server.stop()
            continue
        lines = (data_dir / "credentials").read_text().splitlines()
        creds = dict(line.split(" = ", 1) for line in lines if " = " in line)
        server.access_key, server.secret_key = creds["aws_access_key_id"], creds["aws_secret_access_key"]
        return server
    raise RuntimeError(f"SeaweedFS did not start; see {data_dir}/weed.log")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    if os.environ.get("MARS_TEST_S3_ENDPOINT"):
        yield S3Server(os.environ["MARS_TEST_S3_ENDPOINT"], os.environ["MARS_TEST_S3_ACCESS_KEY"],
                       os.environ["MARS_TEST_S3_SECRET_KEY"])
        return
    server = launch(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


def use_server(server: S3Server, monkeypatch) -> None:
    """Point this process's (and its subprocesses') AWS settings at ``server``."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "MARS_STORE_URI"):
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store_uri(request, tmp_path, monkeypatch) -> str:
    monkeypatch.delenv("MARS_STORE_URI", raising=False)
    if request.param == "file":
        return str(tmp_path / "store")
    server = request.getfixturevalue("s3_server")
    use_server(server, monkeypatch)
    return f"s3://{server.make_bucket()}/mars"
