"""Run untrusted generated Python (HumanEval completions) so that it can fail only itself.

Every program runs in a fresh process, in its own session, inside a temporary working directory, with
these layers (each one alone stops some attacks; together they contain the usual ones):

- resource limits (setrlimit): address space, CPU seconds, process count, file size, open files, no
  core dumps; and a wall-clock timeout after which the whole process group is killed;
- when we are root: a dedicated, random uid per run (processes, files and the RLIMIT_NPROC budget
  are all counted against it; root itself is exempt from RLIMIT_NPROC, so a fork bomb run as root
  would not be bounded). It keeps one capability, CAP_DAC_READ_SEARCH, so that it can read the
  interpreter under a private home directory, but it can write only where "other" may: its own
  working directory and the world-writable temp dirs, which are swept for its files afterwards;
  when the run is over every process of that uid is killed, even those that left the session;
- a private network namespace (no interface but a down loopback) when the kernel allows it;
- a Python guard installed before the program runs: writes outside the working directory, process
  creation, signals, sockets and ``ctypes`` raise ``PermissionError``/``ImportError``; ``sys.exit``
  from the program counts as a failure (a completion that exits 0 before the tests must not pass).

The guard alone is not a security boundary (Python code can always find a way around it); the OS
layers are what bound a determined program. :func:`isolation` says which layers this machine gives.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mars.errors import ConfigError

# Linux constants (uapi headers); ctypes has no names for them.
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_KEEPCAPS = 8
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_RAISE = 2
_CAP_DAC_READ_SEARCH = 2
_CAP_VERSION_3 = 0x20080522
# Unprivileged uids far above any real account, one per run so runs never share a process budget.
_UID_LOW, _UID_HIGH = 1_500_000_000, 2_000_000_000
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
_OUTPUT_LIMIT = 4096


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. ``guard`` turns the in-process Python guard off (tests of the OS layers)."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    guard: bool = True

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be > 0, got {self.timeout_s}")
        for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class ExecResult:
    """What one program did. ``status``: passed | failed | timeout."""

    passed: bool
    status: str
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Runs as the sandboxed interpreter's main script: installs the guard, then executes program.py.
_RUNNER = r'''
import builtins, io, os, sys

ROOT = os.path.realpath(os.getcwd())
GUARD = os.environ.pop("MARS_SANDBOX_GUARD", "1") == "1"
EXIT = os._exit  # kept before the guard blocks it


def _inside(path):
    if isinstance(path, int):  # an already open descriptor
        return True
    path = os.fsdecode(os.fspath(path))
    real = os.path.realpath(os.path.join(ROOT, path))
    return real == ROOT or real.startswith(ROOT + os.sep)


def _deny(what, path=None):
    raise PermissionError(13, "sandbox: " + what + " is not allowed", None if path is None else str(path))


def _install_guard():
    real_open = builtins.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+") and not _inside(file):
            _deny("writing outside the working directory", file)
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = guarded_open

    real_os_open = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & write_flags and not _inside(path):
            _deny("writing outside the working directory", path)
        return real_os_open(path, flags, *args, **kwargs)

    os.open = guarded_os_open

    def path_guard(name):
        real = getattr(os, name)

        def guarded(*args, **kwargs):
            for arg in args[:2]:
                if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(arg):
                    _deny("os." + name + " outside the working directory", arg)
            return real(*args, **kwargs)

        return guarded

    for name in ("remove", "unlink", "rmdir", "removedirs", "mkdir", "makedirs", "rename", "renames",
                 "replace", "chmod", "chown", "lchown", "truncate", "symlink", "link", "utime",
                 "mkfifo", "mknod", "chdir", "chroot"):
        if hasattr(os, name):
            setattr(os, name, path_guard(name))

    def blocked(what):
        def refuse(*args, **kwargs):
            _deny(what)
        return refuse

    import posix
    for module in (os, posix):
        for name in ("fork", "forkpty", "vfork", "system", "popen", "kill", "killpg", "_exit", "abort",
                     "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                     "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
                     "spawnvpe", "posix_spawn", "posix_spawnp", "setuid", "setgid", "putenv",
                     "unsetenv", "register_at_fork"):
            if hasattr(module, name):
                setattr(module, name, blocked("os." + name))

    import socket
    def no_socket(*args, **kwargs):
        _deny("network access")
    socket.socket = socket.create_connection = socket.socketpair = socket.fromfd = no_socket
    import shutil
    shutil.rmtree = shutil.move = blocked("shutil")
    for name in ("ctypes", "_ctypes", "subprocess", "_posixsubprocess", "multiprocessing", "pty",
                 "resource", "_socket"):
        sys.modules[name] = None  # `import name` now raises ImportError


with open("program.py", encoding="utf-8") as fh:
    code = compile(fh.read(), "program.py", "exec")
if GUARD:
    _install_guard()
try:
    exec(code, {"__name__": "__main__", "__builtins__": builtins})
except SystemExit as exc:
    sys.stderr.write("sandbox: the program called sys.exit(%r): counted as a failure\n" % (exc.code,))
    sys.stderr.flush()
    EXIT(3)
'''



def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _unshare_network(as_root: bool) -> bool:
    """Enter a private network namespace (as root directly; otherwise inside a user namespace)."""
    libc = _libc()
    flags = _CLONE_NEWNET if as_root else (_CLONE_NEWUSER | _CLONE_NEWNET)
    return libc.unshare(flags) == 0


def _drop_to_uid(uid: int) -> None:
    """setuid to ``uid`` keeping only CAP_DAC_READ_SEARCH (as an ambient capability, so it survives exec)."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = _libc()
    if libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    keep = 1 << _CAP_DAC_READ_SEARCH
    data = (Data * 2)(Data(keep, keep, keep), Data(0, 0, 0))
    if libc.capset(ctypes.byref(Header(_CAP_VERSION_3, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_RAISE)")


def _user_process_count(uid: int) -> int:
    return sum(1 for _ in _pids_of_uid(uid))


def _launch_main() -> None:
    """Entry point of the launcher process (``python -c``): limits, namespaces, uid, then exec."""
    import resource

    spec = json.loads(sys.argv[1])
    as_root = os.geteuid() == 0
    uid = spec["uid"]
    mem = spec["memory_mb"] * 1024 * 1024
    cpu = int(spec["timeout_s"]) + 1
    # Without a dedicated uid the NPROC budget is shared with the user's other processes.
    nproc = spec["max_processes"] + (0 if uid is not None else _user_process_count(os.getuid()))
    limits = {
        resource.RLIMIT_AS: mem,
        resource.RLIMIT_CPU: cpu,
        resource.RLIMIT_NPROC: nproc,
        resource.RLIMIT_FSIZE: spec["max_file_mb"] * 1024 * 1024,
        resource.RLIMIT_NOFILE: spec["max_open_files"],
        resource.RLIMIT_CORE: 0,
    }
    for which, value in limits.items():
        hard = resource.getrlimit(which)[1]
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        # CPU: SIGXCPU at the soft limit, SIGKILL one second later at the hard one.
        new_hard = soft + 1 if which == resource.RLIMIT_CPU else soft
        resource.setrlimit(which, (soft, new_hard if hard == resource.RLIM_INFINITY else min(new_hard, hard)))
    if spec["network_namespace"]:
        _unshare_network(as_root)
    if uid is not None:
        _drop_to_uid(uid)
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    env = {"PATH": "/usr/bin:/bin", "HOME": spec["workdir"], "TMPDIR": spec["workdir"], "LANG": "C.UTF-8",
           "PYTHONHASHSEED": "0", "MARS_SANDBOX_GUARD": "1" if spec["guard"] else "0"}
    os.chdir(spec["workdir"])
    os.execve(sys.executable, [sys.executable, "-I", "-B", "runner.py"], env)


def _pids_of_uid(uid: int):
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            yield int(entry.name)
                        break
        except (OSError, ValueError):
            continue


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb keeps making new ones)."""
    for _ in range(100):
        pids = list(_pids_of_uid(uid))
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _sweep_files(uid: int) -> None:
    """Remove whatever ``uid`` created in the world-writable temp dirs (a guard-free program can write there)."""

    def walk(directory: str, depth: int) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid:
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass
            elif stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH and depth < 3:
                walk(entry.path, depth + 1)

    for root in _WORLD_WRITABLE:
        walk(root, 0)


@dataclasses.dataclass(frozen=True)
class Isolation:
    dedicated_uid: bool
    network_namespace: bool

    def describe(self) -> str:
        parts = ["rlimits", "process-group kill", "python guard"]
        if self.dedicated_uid:
            parts.insert(1, "dedicated uid")
        if self.network_namespace:
            parts.insert(1, "network namespace")
        return ", ".join(parts)


_ISOLATION: Isolation | None = None


def isolation() -> Isolation:
    """Which OS layers this machine gives (probed once, in a throwaway process)."""
    global _ISOLATION
    if _ISOLATION is None:
        probe = (
            "import os, sys\n"
            "from mars.evaluation.sandbox import _unshare_network, _drop_to_uid\n"
            "net = int(_unshare_network(os.geteuid() == 0))\n"
            "if os.geteuid() == 0:\n"
            "    try:\n"
            f"        _drop_to_uid({_UID_LOW})\n"
            "        os.execv(sys.executable, [sys.executable, '-c', 'import sys; print(sys.argv[1], 1)', str(net)])\n"
            "    except OSError:\n"
            "        pass\n"
            "print(net, 0)\n"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout.split()
        net, uid = (out + ["0", "0"])[:2]
        _ISOLATION = Isolation(dedicated_uid=uid == "1", network_namespace=net == "1")
    return _ISOLATION


def _truncate(data: bytes) -> str:
    text = data.decode("utf-8", "replace")
    return text if len(text) <= _OUTPUT_LIMIT else text[:_OUTPUT_LIMIT] + "\n...[truncated]"


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> ExecResult:
    """Run ``source`` as a Python program in the sandbox; passed == exit status 0 within the time limit."""
    iso = isolation()
    uid = secrets.randbelow(_UID_HIGH - _UID_LOW) + _UID_LOW if iso.dedicated_uid else None
    workdir = Path(tempfile.mkdtemp(prefix="mars-sandbox-"))
    start = time.perf_counter()
    try:
        (workdir / "program.py").write_text(source, encoding="utf-8")
        (workdir / "runner.py").write_text(_RUNNER, encoding="utf-8")
        if uid is not None:
            os.chown(workdir, uid, uid)
            for name in ("program.py", "runner.py"):
                os.chown(workdir / name, uid, uid)
        spec = {"uid": uid, "workdir": str(workdir), "network_namespace": iso.network_namespace,
                "guard": limits.guard, **{k: v for k, v in dataclasses.asdict(limits).items() if k != "guard"}}
        launcher = "from mars.evaluation.sandbox import _launch_main; _launch_main()"
        proc = subprocess.Popen(
            [sys.executable, "-c", launcher, json.dumps(spec)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, cwd=workdir,
        )
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            if uid is not None:
                _kill_uid(uid)
            stdout, stderr = proc.communicate()
        _kill_group(proc.pid)  # children left behind by a program that exited
        if uid is not None:
            _kill_uid(uid)
            _sweep_files(uid)
        seconds = time.perf_counter() - start
        if timed_out:
            return ExecResult(False, "timeout", None, seconds, _truncate(stdout), _truncate(stderr))
        passed = proc.returncode == 0
        return ExecResult(passed, "passed" if passed else "failed", proc.returncode, seconds,
                          _truncate(stdout), _truncate(stderr))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def humaneval_program(problem: dict, completion: str) -> str:
    """The program that passes iff ``completion`` (the body after the prompt) passes the problem's tests."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_many(sources: list[str], limits: SandboxLimits = SandboxLimits(), workers: int = 2) -> list[ExecResult]:
    """Run several programs, ``workers`` at a time (each still in its own sandbox)."""
    isolation()  # probe once before the threads start
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda src: run_python(src, limits), sources))
