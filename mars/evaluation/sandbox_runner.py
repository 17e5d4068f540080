"""The harness that runs inside the sandbox as the interpreter's main script (copied into each run's
directory by :mod:`mars.evaluation.sandbox`; the evaluator never imports it to run it).

It installs the guard, executes program.py, then writes the nonce it read from stdin to the result
descriptor: the evaluator's proof that the program ran to its end, which exit status 0 alone is not.
"""

import builtins
import io
import os
import sys

ROOT = os.path.realpath(os.getcwd())
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


def main():
    guard = os.environ.pop("MARS_SANDBOX_GUARD", "1") == "1"
    result_fd = int(os.environ.pop("MARS_SANDBOX_RESULT_FD"))
    # a local, not a global of this module (which the program reaches as sys.modules["__main__"])
    nonce = os.read(0, 64)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the program's stdin is empty
    with open("program.py", encoding="utf-8") as fh:
        code = compile(fh.read(), "program.py", "exec")
    if guard:
        _install_guard()
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        sys.stderr.write("sandbox: the program called sys.exit(%r): counted as a failure\n" % (exc.code,))
        sys.stderr.flush()
        EXIT(3)
    os.write(result_fd, nonce)


if __name__ == "__main__":
    main()
