"""
The bubblewrap command line for one sandboxed run of model-written code (nanorl/execution.py runs it).

Each run gets its own user, PID, network, mount, IPC and UTS namespaces and an empty read-only root that holds only
what the interpreter needs: its executable and every symlink on the way to it, its stdlib and site-packages, the
system's shared libraries and the directories of whatever else it maps (a pyenv libpython, numpy's OpenBLAS),
/etc/ld.so.cache, and a one-user /etc/passwd and /etc/group fed through pipes. The work directory and an empty /tmp
are the only writable places. The mount list is worked out once per process; it refuses a list that would bring a
whole home directory, /tmp or /etc along.
"""

import os
import shutil
import subprocess
import sys
import threading

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
            return _mirror(os.path.normpath(os.path.join(cur, target, *parts[i + 1 :])), links, binds, hops + 1)
        cur = nxt
    if os.path.exists(cur):
        binds.add(cur)


# run by the interpreter itself: import every lib-dynload module and numpy, then list the files mapped into memory
# (what ld.so found, dlopen included: libpython, libssl, numpy's OpenBLAS, locales, gconv)
_LIST_MAPPED = r"""
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
"""


def _library_dirs():
    """Directories of the files the interpreter maps when it loads its C modules and numpy's."""
    try:
        out = subprocess.run(
            [sys.executable, "-I", "-c", _LIST_MAPPED],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"},
        ).stdout
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
    paths = [
        p
        for p in sys.path + site.getsitepackages() + code_dirs  # a zipped stdlib on sys.path is a file
        if p
        and os.path.exists(p)
        and any(os.path.abspath(p) == r or os.path.abspath(p).startswith(r + "/") for r in roots)
    ]
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


def bwrap_argv(workdir, etc_fds):
    """bwrap's arguments for one run whose only writable places are `workdir` and an empty /tmp; etc_fds: read ends
    of pipes holding the sandbox's /etc/passwd and /etc/group."""
    global _plan
    with _plan_lock:
        if _plan is None:
            _plan = _make_plan()
    bwrap, opts = _plan
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        *opts,
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--ro-bind-data",
        str(etc_fds[0]),
        "/etc/passwd",
        "--ro-bind-data",
        str(etc_fds[1]),
        "/etc/group",
        "--remount-ro",
        "/",
        "--bind",
        workdir,
        workdir,
        "--chdir",
        workdir,
    ]
    if os.geteuid() == 0:
        argv += ["--cap-drop", "ALL"]
    return argv + ["--"]


def etc_pipes(workdir):
    """Read ends of two pipes holding a one-user /etc/passwd (uid 65534, home = the work directory) and /etc/group:
    pwd and getpass work, and nothing of the host's accounts shows."""
    fds = []
    for text in (f"nobody:x:65534:65534:nobody:{workdir}:/bin/false\n", "nogroup:x:65534:\n"):
        r, w = os.pipe()
        os.write(w, text.encode())  # far below a pipe's buffer: never blocks
        os.close(w)
        fds.append(r)
    return fds
