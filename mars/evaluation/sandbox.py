"""Run untrusted generated Python (HumanEval completions) so that it can fail only itself.

Every program runs in a fresh process, in its own session, inside a temporary working directory, with
these layers (each one alone stops some attacks; together they contain the usual ones):

- a private filesystem view (mount namespace + pivot_root): the program sees its working directory
  (read-write), the interpreter's own files and the system libraries (read-only), an empty private
  /tmp and /dev with null/zero/random only; no /etc (but the loader cache), no /home or /root, no
  /proc, so neither other files nor other processes' environments are reachable, whatever the
  permissions on them; and a private network namespace (no interface but a down loopback);
- no capabilities at all: as root each run gets a dedicated, random uid (processes, files and the
  RLIMIT_NPROC budget are counted against it; root itself is exempt from RLIMIT_NPROC, so a fork bomb
  run as root would not be bounded), the bounding set is emptied and ``no_new_privs`` is set; when
  the run is over every process of that uid is killed, even those that left the session. Without
  root the namespaces come from a user namespace mapping only our own uid;
- resource limits (setrlimit): address space, CPU seconds, process count, file size, open files, no
  core dumps; and a wall-clock timeout after which the whole process group is killed;
- a minimal environment (nothing of ours is inherited); output is read as it comes, only its first
  bytes are held, a program writing past ``max_output_kb`` is stopped, and what is kept is truncated and
  scrubbed of anything that looks like a credential (:func:`mars.core.redact.redact_secrets`);
- a Python guard (:mod:`.sandbox_runner`) installed before the program runs: writes outside the
  working directory, process creation, signals, sockets and ``ctypes`` raise
  ``PermissionError``/``ImportError``.

A program passes only when the harness, after the program's last statement, hands back a random
per-run nonce it was given on stdin: exit status 0 alone is not enough (a completion that exits 0
before the tests, by ``sys.exit``, ``os._exit`` through ``ctypes`` or any other way, must not pass).
The program could dig the nonce out of the harness's frames, as it could undo the guard; that is a
deliberate attack on its own score, which the OS layers do not bound.

The guard alone is not a security boundary (Python code can always find a way around it); the OS
layers are what bound a determined program. Where the kernel refuses the namespaces (no root and no
unprivileged user namespaces), :func:`run_python` refuses to run anything (:class:`SandboxUnavailable`)
rather than run it with read access to the machine. :func:`isolation` says what this machine gives.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import os
import platform
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mars.core.redact import redact_secrets
from mars.errors import ConfigError, MarsError

# Linux constants (uapi headers); ctypes has no names for them.
_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH = 2
_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_CAP_VERSION_3 = 0x20080522
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# statvfs flag -> mount flag: a read-only bind remount must keep the source mount's locked flags.
_ST_TO_MS = {os.ST_RDONLY: _MS_RDONLY, os.ST_NOSUID: _MS_NOSUID, os.ST_NODEV: _MS_NODEV, os.ST_NOEXEC: _MS_NOEXEC,
             os.ST_NOATIME: _MS_NOATIME, os.ST_NODIRATIME: _MS_NODIRATIME, os.ST_RELATIME: _MS_RELATIME}
# Unprivileged uids far above any real account, one per run so runs never share a process budget.
_UID_LOW, _UID_HIGH = 1_500_000_000, 2_000_000_000
# What the private root shows read-only besides the interpreter's prefixes: the shared libraries (and the
# loader's cache of where they are), those that exist here.
_SYSTEM_PATHS = ("/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/lib", "/lib32", "/lib64", "/libx32",
                 "/etc/ld.so.cache")
_DEVICES = ("null", "zero", "full", "random", "urandom")
SANDBOX_DIR = "/sandbox"  # where the run directory appears inside the private root (cwd and HOME)
_NOT_ISOLATED = 125  # launcher exit status when a layer could not be set up (nothing ran)
_OUTPUT_LIMIT = 4096  # characters of each stream stored in an ExecResult
# Raw bytes of each stream held while the program runs: redaction can shorten text, so more than is stored.
_CAPTURE_LIMIT = 4 * _OUTPUT_LIMIT
_NONCE_BYTES = 16
_RUNNER = Path(__file__).with_name("sandbox_runner.py")  # the sandboxed interpreter's main script


class SandboxUnavailable(MarsError):
    """This machine cannot isolate generated code; nothing is run."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. ``guard`` turns the in-process Python guard off (tests of the OS layers)."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_kb: int = 1024  # stdout or stderr past this stops the program (only the first bytes are kept)
    guard: bool = True

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be > 0, got {self.timeout_s}")
        for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files", "max_output_kb"):
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


# ---- the OS layers (run in the launcher process, between fork and exec) -------------------------------
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _ok(_libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _bind(source: str, target: str, readonly: bool) -> None:
    _mount(source, target, None, _MS_BIND | _MS_REC)
    if readonly:  # a bind mount takes ro only on remount, which must repeat the source's locked flags
        kept = os.statvfs(source).f_flag
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        flags |= sum(ms for st, ms in _ST_TO_MS.items() if kept & st)
        _mount(None, target, None, flags)


def _mount_point(path: str, directory: bool) -> None:
    if directory:
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()


def _enter_namespaces(as_root: bool) -> None:
    """Private mount, network and IPC namespaces: as root directly, otherwise inside a user namespace
    that maps only our own uid and gid."""
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | (0 if as_root else _CLONE_NEWUSER)
    _ok(_libc().unshare(flags), "unshare")
    if not as_root:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _private_root(new_root: str, workdir: str, readonly: list[str], tmp_mb: int) -> None:
    """Make ``new_root`` (an empty directory) the root: ``readonly`` paths at their own place,
    ``workdir`` at ``SANDBOX_DIR`` (read-write), a private /tmp and /dev; the old root detached."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here propagates to the host
    _mount("tmpfs", new_root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
    # the private /tmp first: an interpreter that lives under /tmp (a venv in a CI clone) is bound on top
    _mount_point(new_root + "/tmp", True)
    _mount("tmpfs", new_root + "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={tmp_mb}m")
    for path in readonly:
        inside = new_root + path
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib stays a link
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            os.symlink(os.readlink(path), inside)
            continue
        _mount_point(inside, os.path.isdir(path))
        _bind(path, inside, readonly=True)
    _mount_point(new_root + SANDBOX_DIR, True)
    _bind(workdir, new_root + SANDBOX_DIR, readonly=False)
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _mount_point(f"{new_root}/dev/{name}", False)
            _bind(f"/dev/{name}", f"{new_root}/dev/{name}", readonly=False)
    os.mkdir(new_root + "/.old")
    machine = platform.machine()
    if machine not in _SYS_PIVOT_ROOT:
        raise OSError(0, f"pivot_root: unknown syscall number on {machine}")
    _ok(_libc().syscall(_SYS_PIVOT_ROOT[machine], new_root.encode(), (new_root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _ok(_libc().umount2(b"/.old", _MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _drop_privileges(uid: int | None, last_cap: int) -> None:
    """No capability left, none to regain: bounding set emptied, then (as root) a dedicated uid, which
    clears the rest (no PR_SET_KEEPCAPS), or (in a user namespace) an empty capset; no_new_privs."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = _libc()
    for cap in range(last_cap + 1):
        _ok(libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _ok(libc.capset(ctypes.byref(Header(_CAP_VERSION_3, 0)), (Data * 2)()), "capset")
    _ok(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _user_process_count(uid: int) -> int:
    return sum(1 for _ in _pids_of_uid(uid))


def _launch_main() -> None:
    """Entry point of the launcher process (``python -c``): limits, namespaces, no privileges, then exec.

    A layer that cannot be set up ends the launcher with status ``_NOT_ISOLATED`` and the reason on
    stderr, before any of the program runs.
    """
    import resource

    spec = json.loads(sys.argv[1])
    uid = spec["uid"]
    try:
        last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        # Without a dedicated uid the NPROC budget is shared with the user's other processes.
        nproc = spec["max_processes"] + (0 if uid is not None else _user_process_count(os.getuid()))
        _enter_namespaces(as_root=os.geteuid() == 0)
        _private_root(spec["root"], spec["workdir"], spec["readonly"], spec["max_file_mb"])
        _drop_privileges(uid, last_cap)
    except OSError as err:
        sys.stderr.write(f"sandbox: cannot isolate the program: {err}\n")
        sys.stderr.flush()
        os._exit(_NOT_ISOLATED)
    limits = {
        resource.RLIMIT_AS: spec["memory_mb"] * 1024 * 1024,
        resource.RLIMIT_CPU: int(spec["timeout_s"]) + 1,
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
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after the uid change, which clears it
    env = {"PATH": "/usr/bin:/bin", "HOME": SANDBOX_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
           "PYTHONHASHSEED": "0", "MARS_SANDBOX_GUARD": "1" if spec["guard"] else "0",
           "MARS_SANDBOX_RESULT_FD": str(spec["result_fd"])}
    os.chdir(SANDBOX_DIR)
    os.execve(spec["python"], [spec["python"], "-I", "-B", "runner.py"], env)


def _readonly_paths() -> list[str]:
    """The system libraries and this interpreter's prefixes (venv and base), outermost paths only."""
    paths = [p for p in _SYSTEM_PATHS if os.path.lexists(p)]
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    prefixes.add(os.path.dirname(os.path.realpath(sys.executable)))
    for prefix in sorted(prefixes):
        covered = any(prefix == p or prefix.startswith(p.rstrip("/") + "/") for p in paths if not os.path.islink(p))
        if prefix != "/" and not covered:
            paths.append(prefix)
    return paths


def _pids_of_uid(uid: int, zombies: bool = True):
    """Processes of ``uid``; zombies (dead, waiting for a parent, maybe a slow init, to reap them) count
    toward RLIMIT_NPROC but need no kill."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as fh:
                for line in fh:
                    if line.startswith("State:") and line.split()[1] == "Z" and not zombies:
                        break
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            yield int(entry.name)
                        break
        except (OSError, ValueError):
            continue


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb keeps making new ones)."""
    for _ in range(100):
        pids = list(_pids_of_uid(uid, zombies=False))
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- running programs -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Isolation:
    """What this machine gives: a private root (and network) and, as root, a dedicated uid per run."""

    private_root: bool
    dedicated_uid: bool
    reason: str = ""  # why there is no private root

    def describe(self) -> str:
        if not self.private_root:
            return f"none ({self.reason})"
        parts = ["private root", "network namespace", "no capabilities", "rlimits", "process-group kill",
                 "python guard"]
        if self.dedicated_uid:
            parts.insert(2, "dedicated uid")
        return ", ".join(parts)


_ISOLATION: Isolation | None = None


def isolation() -> Isolation:
    """Which layers this machine gives, probed once by running a trivial program with all of them."""
    global _ISOLATION
    if _ISOLATION is None:
        as_root = os.geteuid() == 0
        probe = _run("print('isolated')", SandboxLimits(timeout_s=60), dedicated_uid=as_root)
        ok = probe.passed and probe.stdout.strip() == "isolated"
        reason = "" if ok else ((probe.stderr.strip().splitlines() or [probe.status])[-1])
        _ISOLATION = Isolation(private_root=ok, dedicated_uid=as_root and ok, reason=reason)
    return _ISOLATION


def _kept(data: bytes) -> str:
    """Program output as it may be stored: scrubbed of credentials, then cut to ``_OUTPUT_LIMIT``."""
    text = redact_secrets(data[:_CAPTURE_LIMIT].decode("utf-8", "replace"))
    return text if len(text) <= _OUTPUT_LIMIT else text[:_OUTPUT_LIMIT] + "\n...[truncated]"


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> ExecResult:
    """Run ``source`` as a Python program in the sandbox; passed == it ran to its end (the harness handed
    back the run's nonce) and exited 0, within the time and output limits.

    Raises :class:`SandboxUnavailable` where the program cannot be isolated (see :func:`isolation`).
    """
    iso = isolation()
    if not iso.private_root:
        raise SandboxUnavailable(f"generated code cannot be isolated on this machine ({iso.reason}); refusing to "
                                 "run it with read access to the machine's files (needs root or unprivileged "
                                 "user namespaces: sysctl kernel.unprivileged_userns_clone=1 / "
                                 "user.max_user_namespaces > 0)")
    return _run(source, limits, dedicated_uid=iso.dedicated_uid)


def _run(source: str, limits: SandboxLimits, dedicated_uid: bool) -> ExecResult:
    uid = secrets.randbelow(_UID_HIGH - _UID_LOW) + _UID_LOW if dedicated_uid else None
    base = Path(tempfile.mkdtemp(prefix="mars-sandbox-"))
    workdir, root = base / "work", base / "root"
    start = time.perf_counter()
    try:
        workdir.mkdir()
        root.mkdir()
        (workdir / "program.py").write_text(source, encoding="utf-8")
        shutil.copyfile(_RUNNER, workdir / "runner.py")
        if uid is not None:
            for path in (workdir, workdir / "program.py", workdir / "runner.py"):
                os.chown(path, uid, uid)
        spec = {"uid": uid, "workdir": str(workdir), "root": str(root), "readonly": _readonly_paths(),
                "python": sys.executable, "guard": limits.guard,
                **{k: v for k, v in dataclasses.asdict(limits).items() if k != "guard"}}
        nonce = secrets.token_hex(_NONCE_BYTES).encode()
        why, returncode, out, err, result = _execute(spec, limits, uid, nonce)
        seconds = time.perf_counter() - start
        stdout, stderr = _kept(out.data), _kept(err.data)
        if why == "timeout":
            return ExecResult(False, "timeout", None, seconds, stdout, stderr)
        if why is not None:
            stderr += f"\nsandbox: {why}: the program was stopped\n"
            return ExecResult(False, "failed", returncode, seconds, stdout, stderr)
        finished = bytes(result.data) == nonce
        if returncode == 0 and not finished:
            stderr += "\nsandbox: the program exited 0 but never reached its end: counted as a failure\n"
        passed = returncode == 0 and finished
        return ExecResult(passed, "passed" if passed else "failed", returncode, seconds, stdout, stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@dataclasses.dataclass
class _Stream:
    """One pipe from the program: its first ``keep`` bytes are held, ``stop`` bytes are allowed in all."""

    name: str
    keep: int
    stop: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    seen: int = 0


def _execute(spec: dict, limits: SandboxLimits, uid: int | None, nonce: bytes):
    """Start the launcher, hand it ``nonce`` on stdin, drain its stdout, stderr and result pipe within the
    limits, then kill whatever is left of the run. Returns (why it was stopped or None, exit status,
    stdout, stderr, result) with the streams as :class:`_Stream`."""
    stop = limits.max_output_kb * 1024
    out, err = _Stream("stdout", _CAPTURE_LIMIT, stop), _Stream("stderr", _CAPTURE_LIMIT, stop)
    result = _Stream("the result pipe", len(nonce), len(nonce))
    result_r, result_w = os.pipe()
    launcher = "from mars.evaluation.sandbox import _launch_main; _launch_main()"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", launcher, json.dumps({**spec, "result_fd": result_w})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(result_w,),
            start_new_session=True, cwd=spec["workdir"], env=_launcher_env(),
        )
    except BaseException:
        os.close(result_r)
        raise
    finally:
        os.close(result_w)  # the launcher has its own; ours would keep the pipe from ever closing
    with proc, open(result_r, "rb", buffering=0) as result_pipe:
        deadline = time.monotonic() + limits.timeout_s
        try:
            proc.stdin.write(nonce)
            proc.stdin.close()
        except BrokenPipeError:  # the launcher already ended (it could not isolate the program)
            pass
        why = _drain({proc.stdout.fileno(): out, proc.stderr.fileno(): err, result_pipe.fileno(): result},
                     deadline)
        if why is None:  # every pipe closed: the program ended, or closed them and goes on
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                why = "timeout"
        _kill_group(proc.pid)  # past a limit, or children left behind by a program that exited
        if uid is not None:
            _kill_uid(uid)
        proc.wait()
    return why, proc.returncode, out, err, result


def _drain(streams: dict[int, _Stream], deadline: float) -> str | None:
    """Read every pipe until it closes, holding only what each keeps (a program can write far more than
    the evaluator should hold). Returns None once all are closed, else why the program must be stopped:
    "timeout" past ``deadline``, or which pipe went past its ``stop``."""
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                stream = streams[key.fd]
                stream.seen += len(chunk)
                stream.data += chunk[: stream.keep - len(stream.data)]
                if stream.seen > stream.stop:
                    return f"{stream.name} past {stream.stop} bytes"
    return None


def _launcher_env() -> dict[str, str]:
    """What the launcher needs to import this module; none of our other variables (secrets) go along."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = package_root
    return env


def humaneval_program(problem: dict, completion: str) -> str:
    """The program that passes iff ``completion`` (the body after the prompt) passes the problem's tests."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_many(sources: list[str], limits: SandboxLimits = SandboxLimits(), workers: int = 2) -> list[ExecResult]:
    """Run several programs, ``workers`` at a time (each still in its own sandbox)."""
    isolation()  # probe once before the threads start
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda src: run_python(src, limits), sources))
