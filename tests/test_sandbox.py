"""The HumanEval sandbox: generated code can fail only itself."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from pathlib import Path

import pytest

from mars.evaluation import sandbox
from mars.evaluation.sandbox import SandboxLimits, humaneval_program, run_many, run_python

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
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and _in_uid_range(int(e.name))]


def _in_uid_range(pid: int) -> bool:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False
    return sandbox._UID_LOW <= uid < sandbox._UID_HIGH


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


def test_files_written_past_the_guard_are_swept_from_the_temp_dirs():
    if not sandbox.isolation().dedicated_uid:
        pytest.skip("no dedicated uid here: files cannot be told apart by owner")
    target = Path("/tmp") / f"mars-escape-{uuid.uuid4().hex}"
    result = run_python(f"open({str(target)!r}, 'w').write('x')\n", SandboxLimits(timeout_s=3.0, guard=False))
    assert result.passed  # the OS allowed it (world-writable dir) ...
    assert not target.exists()  # ... and the sweep removed it


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
    if not guard and not sandbox.isolation().network_namespace:
        pytest.skip("no network namespace here: only the guard blocks sockets")
    port, accepted = listener
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')\n"
    result = run_python(code, SandboxLimits(timeout_s=5.0, guard=guard))
    assert not result.passed
    assert accepted == []


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
