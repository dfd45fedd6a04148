"""
`python -m <module> ...` or `python <script.py> ...` for the tests, run in a fresh process forked from an interpreter
that has already imported torch (multiprocessing's forkserver, one per test worker). A test that starts a stage pays
~2.5 s for `import torch` and ~2 s for torch._dynamo (which every torch optimizer imports) in a new interpreter; the
suite starts a few hundred such processes. Everything after the imports is the real command's: its own process (its
pid, signals: a SIGKILL gives -9 as it does to a subprocess), its working directory, environment, argv and sys.path,
its stdout and stderr, its exit code (an uncaught exception goes to sys.excepthook and gives 1), its atexit
handlers.

`python -m torch.distributed.run` (torchrun) is warm too, and so are its ranks: torchrun's launcher runs in such a
process, and where it would start a rank `python -u ...` in a new interpreter it forks itself instead (_start_rank):
the rank has its own process and session (the launcher's signals to it and its exit code as with Popen), the
environment torchrun gives it (RANK, WORLD_SIZE, MASTER_PORT, ...), Python's own signal handlers and no exit function
of the launcher's. Torch was imported before that environment was set: a torch setting read at import time comes from
the test's environment (the launcher's), which is the ranks' but for torchrun's own variables. What none of this
covers, so the tests that need it start a real interpreter: interpreter start-up itself (a sitecustomize on
PYTHONPATH, -X options), bash. The pipeline and rehearsal tests run speedrun.sh as a user does.
"""

import atexit
import importlib.util
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["torch", "torch._dynamo"])


def _child(argv, env, cwd, out, err):
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    if argv[:2] == ["-m", "torch.distributed.run"]:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

        subprocess_handler.SubprocessHandler._popen = _start_rank
    _main(argv, cwd, unbuffered=False)


def _main(argv, cwd, unbuffered):
    """Run `python ARGV` in this process (its fds 1 and 2 already in place) and exit with its code."""
    # a pipe's buffering, as a subprocess's stdout: whatever a killed process had not flushed is lost (-u: nothing)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True, write_through=unbuffered)
    code = 0
    try:
        if argv[0] == "-m":
            sys.path[0] = cwd  # as `python -m` puts it, and argv[0] the module's file (error lines name it)
            sys.argv = [importlib.util.find_spec(argv[1]).origin, *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""  # as `python -c` puts it
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` puts it
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter reports it: through sys.excepthook (nanorl's prints a UserError's line)
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Rank:
    """What torchrun's launcher reads of a rank's Popen (pid, poll, wait), for a rank forked from the launcher."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _start_rank(handler, args, env):
    """torchrun's SubprocessHandler._popen, in the warm launcher: a rank `python -u ...` is forked from it (torch already
    imported) instead of a new interpreter; it runs in its own session, as Popen(start_new_session=True) starts it."""
    if args[0] != sys.executable or args[1] != "-u":
        return subprocess.Popen(args, env=env, stdout=handler._stdout, stderr=handler._stderr, start_new_session=True)
    sys.stdout.flush()  # or the child writes the launcher's unflushed lines again
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Rank(pid)
    try:
        os.setsid()
        # the launcher's handlers (torchrun turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into an exception) and exit
        # functions are not the rank's: a new interpreter has Python's own
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        atexit._clear()
        for fd, f in ((1, handler._stdout), (2, handler._stderr)):
            if f is not None:
                os.dup2(f.fileno(), fd)
        os.environ.clear()
        os.environ.update(env)
        _main(list(args[2:]), os.getcwd(), unbuffered=True)
    finally:
        os._exit(1)


def run(cmd, cwd=None, env=None, timeout=None, check=False, capture_output=True, text=False):
    """subprocess.run(cmd, cwd=..., env=..., capture_output=True, text=..., timeout=..., check=...) -> its
    CompletedProcess, for cmd = [sys.executable, "-m" module | "-c" code | script, ...]; any other command (torchrun,
    bash, another interpreter) goes to subprocess.run itself."""
    assert capture_output, "warm_python.run captures stdout and stderr, as the tests' subprocess.run calls do"
    if cmd[0] != sys.executable or cmd[1] in ("-X", "-u", "-I"):
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, check=check, capture_output=True, text=text)
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        env = dict(os.environ if env is None else env)
        p = _context.Process(target=_child, args=(cmd[1:], env, str(cwd or os.getcwd()), out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(cmd, timeout)
        with open(out, "rb") as f, open(err, "rb") as g:
            stdout, stderr = f.read(), g.read()
    if text:
        stdout, stderr = stdout.decode(), stderr.decode()
    result = subprocess.CompletedProcess(cmd, p.exitcode, stdout, stderr)
    if check:
        result.check_returncode()
    return result
