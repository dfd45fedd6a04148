"""
`python -m <module> ...` or `python <script.py> ...` for the tests, run in a fresh process forked from an interpreter
that has already imported torch (multiprocessing's forkserver, one per test worker). A test that starts a stage pays
~2.5 s for `import torch` and ~2 s for torch._dynamo (which every torch optimizer imports) in a new interpreter; the
suite starts a few hundred such processes. Everything after the imports is the real command's: its own process (its
pid, signals: a SIGKILL gives -9 as it does to a subprocess), its working directory, environment, argv and sys.path,
its stdout and stderr, its exit code (an uncaught exception goes to sys.excepthook and gives 1), its atexit
handlers.

`python -m torch.distributed.run` (torchrun) is warm too: its ranks are the real interpreters it starts. What it does
not cover, so the tests that need it start a real interpreter: interpreter start-up itself (a sitecustomize on
PYTHONPATH, -X options), bash. The pipeline and rehearsal tests run speedrun.sh as a user does.
"""

import atexit
import importlib.util
import io
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile

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
    # a pipe's buffering, as a subprocess's stdout: whatever a killed process had not flushed is lost
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), write_through=False)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
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
