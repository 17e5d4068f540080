"""The HumanEval sandbox: generated code can fail only itself."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from mars.evaluation import sandbox
from mars.evaluation.sandbox import SandboxLimits, humaneval_program, run_many, run_python

REPO = Path(__file__).resolve().parents[1]
FAST = SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=8)
PROBLEM = {
    "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}


def sandbox_processes() -> list[int]:
    """Processes still running under a sandbox uid (there must be none once a run returns)."""
    if not sandbox.isolation().dedicated_uid:
        return []
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and _running_in_uid_range(int(e.name))]


def _running_in_uid_range(pid: int) -> bool:
    """Zombies are dead already: whether init has reaped them yet is up to init."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return sandbox._UID_LOW <= uid < sandbox._UID_HIGH and state != "Z"


def test_a_correct_completion_passes_and_a_wrong_one_fails():
    good, bad = run_many(
        [humaneval_program(PROBLEM, "    return a + b\n"), humaneval_program(PROBLEM, "    return a - b\n")], FAST
    )
    assert good.passed and good.status == "passed"
    assert not bad.passed and bad.status == "failed" and "AssertionError" in bad.stderr


def test_syntax_errors_and_exceptions_fail():
    result = run_python(humaneval_program(PROBLEM, "    return a +\n"), FAST)
    assert not result.passed and "SyntaxError" in result.stderr


def test_exiting_early_with_status_zero_is_a_failure():
    result = run_python(humaneval_program(PROBLEM, "    import sys; sys.exit(0)\n"), FAST)
    assert not result.passed and result.returncode == 3


def test_exiting_zero_through_ctypes_before_the_checks_is_a_failure():
    """Exit status 0 is not a pass: the program must reach the end, where the harness writes its nonce."""
    attack = ("    return a - b\n"
              "import sys\n"
              "sys.modules.pop('ctypes', None)\n"
              "sys.modules.pop('_ctypes', None)\n"
              "import ctypes\n"
              "ctypes.CDLL(None)._exit(0)\n")
    result = run_python(humaneval_program(PROBLEM, attack), FAST)
    assert result.returncode == 0  # the attack did exit 0 ...
    assert not result.passed and result.status == "failed"  # ... and still failed
    assert "never reached its end" in result.stderr


def test_a_flood_of_output_is_stopped_without_being_held():
    """300 MB to stdout: the evaluator holds only what it keeps, stops the program past the output limit
    and reports why (its own peak memory is measured in a fresh interpreter)."""
    flood = "import sys\nchunk = 'x' * 2**20\nfor _ in range(300):\n    sys.stdout.write(chunk)\n"
    probe = ("import json, resource, sys\nfrom mars.evaluation.sandbox import SandboxLimits, isolation, run_python\n"
             "isolation()\nbefore = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
             "r = run_python(sys.argv[1], SandboxLimits(timeout_s=20.0))\n"
             "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
             "print(json.dumps({'grew_kb': after - before, 'status': r.status, 'stdout': len(r.stdout),"
             " 'stderr': r.stderr[-300:], 'seconds': r.seconds}))\n")
    proc = subprocess.run([sys.executable, "-c", probe, flood], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["grew_kb"] < 20 * 1024, out  # not the 300 MB the program wrote
    assert out["status"] == "failed" and out["stdout"] <= sandbox._OUTPUT_LIMIT + 100
    assert "stdout past" in out["stderr"] and out["seconds"] < 15


def test_a_correct_program_may_print_more_than_is_kept():
    code = "for i in range(5000):\n    print('line', i)\n"  # ~50 KB: under the stop, over what is kept
    result = run_python(code, FAST)
    assert result.passed and "[truncated]" in result.stdout


def test_an_infinite_loop_times_out():
    result = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=1.5))
    assert result.status == "timeout" and not result.passed
    assert result.seconds < 10
    assert sandbox_processes() == []


def test_unbounded_allocation_hits_the_memory_limit():
    result = run_python("x = []\nwhile True:\n    x.append(' ' * 10**7)\n", FAST)
    assert not result.passed
    assert result.status == "timeout" or "MemoryError" in result.stderr


def test_a_fork_bomb_is_refused_by_the_guard():
    result = run_python("import os\nwhile True:\n    os.fork()\n", FAST)
    assert not result.passed and "PermissionError" in result.stderr
    assert sandbox_processes() == []


def test_a_fork_bomb_past_the_guard_is_bounded_by_the_os_and_killed():
    if not sandbox.isolation().dedicated_uid:
        pytest.skip("no dedicated uid here: without it only the guard stops fork bombs")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(bomb, SandboxLimits(timeout_s=2.0, memory_mb=256, max_processes=8, guard=False))
    assert result.status == "timeout" and not result.passed
    assert sandbox_processes() == []


@pytest.mark.parametrize("where", ["private", "world_writable"])
def test_writes_outside_the_working_directory_are_refused(tmp_path, where):
    target = (tmp_path / "escaped.txt") if where == "private" else Path("/tmp") / f"mars-escape-{uuid.uuid4().hex}"
    code = f"with open({str(target)!r}, 'w') as fh:\n    fh.write('x')\n"
    result = run_python(code, FAST)
    assert not result.passed and "PermissionError" in result.stderr
    assert not target.exists()


def test_files_written_past_the_guard_land_in_the_runs_private_tmp():
    target = Path("/tmp") / f"mars-escape-{uuid.uuid4().hex}"
    result = run_python(f"open({str(target)!r}, 'w').write('x')\n", SandboxLimits(timeout_s=3.0, guard=False))
    assert result.passed  # the OS allowed it (its own /tmp) ...
    assert not target.exists()  # ... which is not the machine's


def test_writes_inside_the_working_directory_are_allowed():
    code = "with open('scratch.txt', 'w') as fh:\n    fh.write('ok')\nprint(open('scratch.txt').read())\n"
    result = run_python(code, FAST)
    assert result.passed and result.stdout.strip() == "ok"


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    accepted: list = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@pytest.mark.parametrize("guard", [True, False])
def test_no_network(listener, guard):
    port, accepted = listener
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')\n"
    result = run_python(code, SandboxLimits(timeout_s=5.0, guard=guard))
    assert not result.passed
    assert accepted == []


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)


# ---- attacks on the machine's secrets (issue 16): the program must not read anything outside its run
@pytest.fixture
def secret_file():
    """A credentials file in the home directory of the user running the evaluation."""
    path = Path.home() / f".mars-sandbox-probe-{uuid.uuid4().hex}" / "credentials"
    path.parent.mkdir(mode=0o700)
    path.write_text("[default]\naws_secret_access_key = probe-secret-value\n")
    path.chmod(0o600)
    yield path
    path.unlink()
    path.parent.rmdir()


@pytest.mark.parametrize("guard", [True, False])
def test_system_files_are_not_readable(guard):
    code = "print(open('/etc/shadow').read())\n" if Path("/etc/shadow").exists() else "print(open('/etc/passwd').read())\n"
    result = run_python(code, SandboxLimits(timeout_s=5.0, guard=guard))
    assert not result.passed and "root:" not in result.stdout


@pytest.mark.parametrize("guard", [True, False])
def test_files_under_the_home_directory_are_not_readable_or_listable(secret_file, guard):
    code = (f"import os\nprint(sorted(os.listdir({str(secret_file.parent.parent)!r})))\n"
            f"print(open({str(secret_file)!r}).read())\n")
    result = run_python(code, SandboxLimits(timeout_s=5.0, guard=guard))
    assert not result.passed and "probe-secret-value" not in result.stdout
    assert secret_file.parent.name not in result.stdout


def test_the_evaluators_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("MARS_PROBE_TOKEN", "probe-env-secret")
    code = ("import os\nprint(dict(os.environ))\n"
            "for pid in ('self', str(os.getppid()), '1'):\n"
            "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError as err:\n        print('no', pid, err)\n")
    result = run_python(code, SandboxLimits(timeout_s=5.0, guard=False))
    assert result.passed and "probe-env-secret" not in result.stdout and "MARS_PROBE_TOKEN" not in result.stdout


def test_no_capability_is_left_and_root_cannot_be_regained():
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
data = (ctypes.c_uint32 * 6)()
assert libc.capget(ctypes.byref(Header(0x20080522, 0)), data) == 0
print("caps", list(data))
print("bounding", [c for c in range(41) if libc.prctl(23, c, 0, 0, 0) == 1])
try:
    os.setuid(0)
    print("setuid worked")
except PermissionError:
    print("setuid refused")
"""
    result = run_python(code, SandboxLimits(timeout_s=5.0, guard=False))
    assert result.passed, result.stderr
    assert "caps [0, 0, 0, 0, 0, 0]" in result.stdout and "bounding []" in result.stdout
    assert "setuid refused" in result.stdout or os.geteuid() != 0


def test_stored_output_is_scrubbed_of_credentials_and_truncated():
    code = ("import sys\nsys.stderr.write('AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\\n'\n"
            "  'key id AKIAIOSFODNN7EXAMPLE, token ghp_abcdefghijklmnopqrstuvwxyz0123456789\\n'\n"
            "  '-----BEGIN RSA PRIVATE KEY-----\\nMIIEowIBAAKCAQEA\\n-----END RSA PRIVATE KEY-----\\n')\n"
            "sys.stderr.write('x' * 100000)\nraise SystemExit(1)\n")
    result = run_python(code, SandboxLimits(timeout_s=5.0, guard=False))
    for secret in ("wJalrXUtnFEMI", "AKIAIOSFODNN7EXAMPLE", "ghp_abcdef", "MIIEowIBAAKCAQEA"):
        assert secret not in result.stderr
    assert "AWS_SECRET_ACCESS_KEY=[REDACTED]" in result.stderr and len(result.stderr) < 5000


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or not shutil.which("setpriv"),
                    reason="needs root (to become another user) and a system python3")
def test_an_unprivileged_user_gets_the_same_isolation():
    """Without root the namespaces come from a user namespace: the same private view, so neither the
    machine's files nor the evaluator's environment (same uid: /proc/PID/environ) are readable."""
    program = ("import os\nprint(sorted(os.listdir('/')))\n"
               "for path in (f'/proc/{os.getppid()}/environ', '/etc/passwd'):\n"
               "    try:\n        print(open(path, 'rb').read())\n"
               "    except OSError as err:\n        print('refused', path, type(err).__name__)\n")
    probe = ("import sys\nfrom mars.evaluation.sandbox import SandboxLimits, isolation, run_python\n"
             "iso = isolation()\nprint('isolation', iso.private_root, iso.dedicated_uid, iso.reason)\n"
             "r = run_python(sys.argv[1], SandboxLimits(timeout_s=10, guard=False))\n"
             "print('program', r.status, r.stdout, r.stderr[-300:])\n")
    # the other user imports mars from a world-readable copy: a checkout under `mktemp -d` (mode 0700, as a
    # CI clone may be) is closed to it
    readable = Path(tempfile.mkdtemp(prefix="mars-probe-"))
    try:
        os.chmod(readable, 0o755)
        shutil.copytree(REPO / "mars", readable / "mars", ignore=shutil.ignore_patterns("__pycache__"))
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                               "-c", probe, program], capture_output=True, text=True, timeout=120, cwd="/",
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(readable), "HOME": "/nonexistent",
                                   "MARS_PROBE_TOKEN": "probe-env-secret"})
    finally:
        shutil.rmtree(readable)
    assert proc.returncode == 0, proc.stderr
    assert "isolation True False" in proc.stdout, proc.stdout
    assert "program passed" in proc.stdout and "refused /etc/passwd" in proc.stdout
    assert "probe-env-secret" not in proc.stdout and "root:" not in proc.stdout
