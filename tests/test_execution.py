import ast
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nanorl.execution import GUARD_WARNING, MAX_OUTPUT_BYTES, ExecResult, _probe_bwrap, execute_code

ROOT = Path(__file__).resolve().parent.parent
BWRAP = _probe_bwrap() is None
if not BWRAP:  # without bubblewrap the default refuses to run model code: the tests that can, run under the guard
    os.environ.setdefault("NANORL_SANDBOX", "guard")


def test_stdout_captured():
    r = execute_code("print('hello')\nprint(sum(range(10)))")
    assert r == ExecResult(success=True, stdout="hello\n45\n", stderr="", error="")


def test_exception_captured_in_stderr_and_error():
    r = execute_code("def f():\n    raise ValueError('boom')\nprint('before')\nf()")
    assert not r.success and not r.timeout and not r.memory_exceeded
    assert r.stdout == "before\n"
    assert r.error == "ValueError: boom"
    assert "Traceback" in r.stderr and "line 2" in r.stderr and "_run" not in r.stderr  # no sandbox frames
    r = execute_code("def f(:\n  pass")
    assert not r.success and r.error.startswith("SyntaxError")


def test_exit_status():
    assert execute_code("import sys; sys.exit(0)").success
    r = execute_code("import sys; sys.exit(3)")
    assert not r.success and r.error == "exit status 3"


def test_timeout_kills_and_keeps_partial_output():
    t = time.monotonic()
    r = execute_code("print('started')\nwhile True:\n    pass", timeout=1.0)
    assert time.monotonic() - t < 3.0
    assert r.timeout and not r.success and r.error == "timed out after 1s"
    assert r.stdout == "started\n"  # unbuffered: what came before the timeout is kept
    t = time.monotonic()
    r = execute_code("import time; time.sleep(60)", timeout=0.5)  # sleeping uses no CPU: only the wall clock stops it
    assert r.timeout and time.monotonic() - t < 2.5


def test_memory_limit():
    r = execute_code("x = bytearray(1024 ** 3)\nprint('allocated')", max_memory_mb=256)
    assert not r.success and r.memory_exceeded and "memory limit" in r.error and r.stdout == ""
    r = execute_code("x = [0] * (10 ** 9)", max_memory_mb=256)
    assert r.memory_exceeded
    # an ordinary allocation under the limit is fine
    r = execute_code("x = bytearray(50 * 1024 ** 2)\nprint(len(x))", max_memory_mb=256)
    assert r.success and r.stdout == f"{50 * 1024**2}\n"


def test_no_writes_or_deletes_outside_the_sandbox(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    attempts = [
        f"open({str(victim)!r}, 'w').write('gone')",
        f"open({str(victim)!r}, 'a').write('more')",
        f"import pathlib; pathlib.Path({str(victim)!r}).write_text('gone')",
        f"import os; os.remove({str(victim)!r})",
        f"import os; os.unlink({str(victim)!r})",
        f"import os; os.rename({str(victim)!r}, 'stolen.txt')",
        f"import os; os.open({str(victim)!r}, os.O_WRONLY | os.O_TRUNC)",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
        f"import os; os.symlink({str(victim)!r}, 'link')",
        f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')",
        f"import os; os.mkdir({str(tmp_path / 'newdir')!r})",
        "import os; os.system('touch /tmp/nanorl_pwned')",
        "import subprocess; subprocess.run(['true'])",
        "import os; os.kill(os.getppid(), 9)",
        "import os; os.fork()",
    ]
    for code in attempts:
        r = execute_code(code)
        assert not r.success and r.error.startswith("PermissionError"), (code, r.error)
    assert victim.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


def test_fresh_workdir_is_usable_and_deleted():
    code = (
        "import os, tempfile\n"
        "open('notes.txt', 'w').write('hi')\n"
        "with tempfile.NamedTemporaryFile() as f:\n"
        "    f.write(b'x')\n"  # tempfile needs create + delete inside the sandbox
        "os.mkdir('sub'); os.remove('notes.txt')\n"
        "print(os.getcwd()); print(sorted(os.listdir('.')))"
    )
    r1, r2 = execute_code(code), execute_code(code)
    assert r1.success and r2.success, (r1.error, r2.error)
    cwd1, listing = r1.stdout.splitlines()
    assert listing == "['main.py', 'sub']"
    assert cwd1 != r2.stdout.splitlines()[0]  # each run gets its own directory
    assert not os.path.exists(cwd1)  # ... which is gone afterwards


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        for code in [
            f"import socket; socket.create_connection(('127.0.0.1', {port})).sendall(b'hi')",
            f"import socket; s = socket.socket(); s.connect(('127.0.0.1', {port}))",
            f"import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
            f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/')",
            "import socket; socket.getaddrinfo('example.com', 80)",
        ]:
            r = execute_code(code)
            assert not r.success and "network access is disabled" in r.error, (code, r.error)
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever connected
    finally:
        server.close()


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("NANORL_SECRET_TOKEN", "hunter2")
    r = execute_code("import os; print('NANORL_SECRET_TOKEN' in os.environ, os.environ.get('HOME') == os.getcwd())")
    assert r.success and r.stdout == "False True\n"


def test_output_is_capped():
    r = execute_code("import sys\nprint('x' * 5_000_000)\nsys.stderr.write('e' * 5_000_000)")
    assert r.success
    assert MAX_OUTPUT_BYTES <= len(r.stdout) < MAX_OUTPUT_BYTES + 100 and r.stdout.endswith("bytes dropped]")
    assert len(r.stderr) < MAX_OUTPUT_BYTES + 100


def test_concurrent_calls_from_threads():
    results = [None] * 6

    def work(i):
        results[i] = execute_code(f"print({i} * {i})")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)]


# -----------------------------------------------------------------------------------------------
# escapes that got out of the in-process guard: under bubblewrap each one must fail to get out.
# The fallback guard is run against the same probes where that is safe, to show each probe does detect an escape.

needs_bwrap = pytest.mark.skipif(not BWRAP, reason="bubblewrap namespaces are not available here")

# start a detached child that inherits stdout, the way subprocess does it but past the guard (3.11+ signature); the
# child is this interpreter sleeping (the sandbox has no /bin/sleep), and the code waits until it shows in /proc
_SPAWN = (
    "import _posixsubprocess, os, time\n"
    "def spawn(argv, setsid):\n"
    "    r, w = os.pipe()\n"
    "    return _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (), None, None,\n"
    "        -1, -1, -1, -1, -1, -1, r, w, True, setsid, -1, None, None, -1, -1, None, False)\n"
    "def sleeper(marker):\n"
    f"    return [{sys.executable!r}, '-c', 'import time; time.sleep(' + marker + ')']\n"
    "def running(marker, n):\n"
    "    for _ in range(200):\n"
    "        seen = 0\n"
    "        for p in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
    "            try: seen += marker.encode() in open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "            except OSError: pass\n"
    "        if seen >= n: break\n"
    "        time.sleep(0.01)\n"
    "    return seen\n"
)


def _marker(seconds, mode):
    """A sleep length no other test process uses: xdist runs the bwrap and guard cases side by side, and each
    counts the sleepers whose command line holds its marker (fixed width, so one is never a prefix of another)."""
    return f"{seconds}.{os.getpid():08d}{'12'[mode == 'guard']}"


def _processes_with(marker):
    """Host pids whose command line contains `marker`."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except (OSError, ValueError):
            pass
    return pids


def _reap(marker):
    for pid in _processes_with(marker):
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def _trainer(code, mode, secret):
    """Run execute_code(code) in a separate "trainer" process with a secret in its environment, as chat_rl
    would; (trainer survived, what the sandboxed code printed)."""
    script = (
        "import os, sys; from nanorl.execution import execute_code\n"
        f"r = execute_code(sys.stdin.read().replace('TRAINER_PID', str(os.getpid())), timeout=5, mode={mode!r})\n"
        "print(repr(r.stdout + r.stderr)); print('trainer alive')"
    )
    env = {**os.environ, "NANORL_SECRET_TOKEN": secret, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-c", script], input=code, capture_output=True, text=True, env=env, timeout=30)
    return p.stdout.strip().endswith("trainer alive"), p.stdout


_KILL_PARENT = (
    "import os, signal\n"
    "for pid in {os.getppid(), TRAINER_PID}:  # the caller, seen from inside and by its host pid\n"
    "    try: signal.pidfd_send_signal(os.pidfd_open(pid), 9)\n"
    "    except OSError as e: print('refused', e)\n"
    "import time; time.sleep(0.5); print('sent')"
)
_READ_ENVIRON = (
    "import os\n"
    "for pid in [p for p in os.listdir('/proc') if p.isdigit()] + [str(os.getppid()), 'TRAINER_PID']:\n"
    "    try: env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')\n"
    "    except OSError: continue\n"
    "    print([v for v in env if v.startswith(b'NANORL_SECRET_TOKEN=')])"
)


@pytest.mark.parametrize("mode", ["bwrap", "guard"])
def test_escape_kill_the_trainer_and_read_its_secrets(mode):
    if mode == "bwrap" and not BWRAP:
        pytest.skip("bubblewrap namespaces are not available here")
    alive, out = _trainer(_KILL_PARENT, mode, "hunter2")
    assert alive == (mode == "bwrap"), out  # the guard lets pidfd_send_signal kill the caller
    alive, out = _trainer(_READ_ENVIRON, mode, "hunter2")
    assert alive and ("hunter2" in out) == (mode == "guard"), out  # the guard shows /proc/<ppid>/environ


@pytest.mark.parametrize("mode", ["bwrap", "guard"])
def test_escape_setsid_child_survives_the_kill(mode):
    if mode == "bwrap" and not BWRAP:
        pytest.skip("bubblewrap namespaces are not available here")
    marker = _marker(31, mode)
    code = (
        _SPAWN + f"spawn(sleeper('{marker}'), True)\nspawn(sleeper('{marker}'), False)\n"
        f"print('spawned', running('{marker}', 2))"
    )
    try:
        r = execute_code(code, timeout=4, mode=mode)
        assert r.success and r.stdout == "spawned 2\n", r  # both children ran
        deadline = time.monotonic() + 3
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        # bwrap: the namespace's init died, and every process in it; the guard's group kill misses the setsid one
        assert len(_processes_with(marker)) == (0 if mode == "bwrap" else 1)
    finally:
        _reap(marker)


@pytest.mark.parametrize("mode", ["bwrap", "guard"])
def test_escape_background_child_holding_stdout(mode):
    if mode == "bwrap" and not BWRAP:
        pytest.skip("bubblewrap namespaces are not available here")
    marker = _marker(27, mode)
    code = _SPAWN + f"spawn(sleeper('{marker}'), True)\nprint('done', running('{marker}', 1))"
    threads = threading.active_count()
    try:
        t = time.monotonic()
        r = execute_code(code, timeout=5, mode=mode)
        assert time.monotonic() - t < 2.0  # the drain deadline, not the sleeper, ends the read
        assert r.success and r.stdout == "done 1\n", r  # the output is kept (and the child ran)
        assert threading.active_count() == threads  # no reader left behind in the caller
        if mode == "bwrap":  # the namespace's init died, so the kernel kills the sleeper: wait for it (a busy machine
            deadline = time.monotonic() + 3  # can take longer than a fixed pause to reap it)
            while _processes_with(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _processes_with(marker) == []
    finally:
        _reap(marker)


@pytest.mark.parametrize("mode", ["bwrap", "guard"])
def test_escape_writes_outside_the_workdir(tmp_path, mode):
    if mode == "bwrap" and not BWRAP:
        pytest.skip("bubblewrap namespaces are not available here")
    targets = [tmp_path / f"{i}.txt" for i in range(4)]
    codes = [
        f"import io; io.FileIO({str(targets[0])!r}, 'w').write(b'x')",
        f"import _io; _io.open({str(targets[1])!r}, 'w').write('x')",
        f"import sqlite3; c = sqlite3.connect({str(targets[2])!r}); c.execute('create table t(x)'); c.commit()",
        f"import sys; del sys.modules['posix']; import posix; posix.system('echo x > {targets[3]}')",
    ]
    for code in codes:
        execute_code(code, mode=mode)
    written = [p.exists() for p in targets]
    assert written == ([False] * 4 if mode == "bwrap" else [True] * 4)  # the guard lets all four through


@needs_bwrap
def test_escape_root_filesystem_is_read_only():
    # outside the hidden /tmp, the host's files are there to read but not to change
    r = execute_code(
        "import io\nfor p in ['/etc/nanorl_pwned', '/usr/nanorl_pwned', '/dev/shm/nanorl_pwned']:\n"
        "    try: io.FileIO(p, 'w'); print('wrote', p)\n"
        "    except OSError as e: print(type(e).__name__)"
    )
    assert r.success and "wrote /etc" not in r.stdout and "wrote /usr" not in r.stdout, r
    assert not os.path.exists("/etc/nanorl_pwned") and not os.path.exists("/usr/nanorl_pwned")


@pytest.mark.parametrize("mode", ["bwrap", "guard"])
def test_escape_network_past_the_guard(mode):
    if mode == "bwrap" and not BWRAP:
        pytest.skip("bubblewrap namespaces are not available here")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    codes = [
        f"import socket; s = socket.socket.__mro__[1](); s.connect(('127.0.0.1', {port})); s.send(b'hi')",
        f"import sys; del sys.modules['_socket']; import _socket; s = _socket.socket(); "
        f"s.connect(('127.0.0.1', {port})); s.send(b'hi')",
    ]
    try:
        connected = 0
        for code in codes:
            execute_code(code, mode=mode)
            try:
                server.accept()[0].close()
                connected += 1
            except TimeoutError:
                pass
        assert connected == (0 if mode == "bwrap" else 2)
    finally:
        server.close()


@needs_bwrap
def test_no_view_of_the_host():
    r = execute_code(
        "import os\nprint(os.getpid(), os.getppid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(sorted(os.listdir('/tmp')), os.getuid())"
    )
    pids, tmp = r.stdout.splitlines()
    assert pids == "2 1 ['1', '2']"  # bwrap's init and the program: nothing else exists
    # /tmp holds only its own directory, and the way down to the interpreter when that lives under /tmp (a venv in a
    # clone under /tmp is mounted back read-only); uid nobody
    names, uid = tmp.rsplit(" ", 1)
    interpreter = {
        p.split("/")[2]
        for p in (os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix))
        if p.startswith("/tmp/")
    }
    names = ast.literal_eval(names)
    assert (
        uid == "65534"
        and [n for n in names if n.startswith("nanorl_exec_")]
        and set(names) - interpreter == {n for n in names if n.startswith("nanorl_exec_")}
    ), tmp


# -----------------------------------------------------------------------------------------------
# no kernel sandbox: model code does not run unless the guard is asked for by name

_MODE_SCRIPT = (
    "from nanorl.execution import execute_code, sandbox_mode\n"
    "print(sandbox_mode(), sandbox_mode(), execute_code('print(6 * 7)').stdout.strip())"
)
_REFUSAL = (
    "error: model-written code runs only in the bubblewrap sandbox, which does not work here ({why}): "
    "install the bubblewrap package (apt-get install bubblewrap), or set NANORL_SANDBOX=guard to run it under "
    "the weaker in-process guard\n"
)


def _without_bwrap(tmp_path, broken):
    """An environment whose PATH has no bwrap (broken=False) or a bwrap that fails as it does without user
    namespaces (broken=True); python still runs (by its full path)."""
    fake = tmp_path / "fakebin"
    fake.mkdir(exist_ok=True)
    if broken:
        (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        (fake / "bwrap").chmod(0o755)
    return {
        **os.environ,
        "PATH": str(fake),
        "PYTHONPATH": str(ROOT),
        "NANORL_SANDBOX": "",
        "NANORL_BASE_DIR": str(tmp_path / "base"),
    }


@pytest.mark.parametrize(
    "broken,why",
    [(False, "bwrap not found"), (True, "bwrap probe failed: bwrap: No permissions to create new namespace")],
)
def test_no_bubblewrap_refuses_in_one_line(tmp_path, broken, why):
    env = _without_bwrap(tmp_path, broken)
    script = "from nanorl.execution import require_sandbox\nrequire_sandbox()\nprint('ran')"
    for want in ("", "bwrap"):  # the default and NANORL_SANDBOX=bwrap: the same refusal
        env["NANORL_SANDBOX"] = want
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
        assert (p.returncode, p.stdout, p.stderr) == (1, "", _REFUSAL.format(why=why))
    # execute_code itself does not run the code either (the script's early check is what makes it one line)
    p = subprocess.run([sys.executable, "-c", _MODE_SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert (
        p.returncode == 1
        and p.stdout == ""
        and p.stderr.rstrip().splitlines()[-1]
        == "nanorl.execution.SandboxUnavailable: " + _REFUSAL.format(why=why)[len("error: ") :].rstrip()
    )


def test_guard_asked_for_by_name_warns_once_and_runs(tmp_path):
    env = {**_without_bwrap(tmp_path, False), "NANORL_SANDBOX": "guard"}
    p = subprocess.run([sys.executable, "-c", _MODE_SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert p.stdout == "guard guard 42\n" and p.stderr == GUARD_WARNING + "\n", p.stderr
    for names in (
        "read every file",
        "environment",
        "kill this process",
        "outlive",
        "outside its directory",
        "network",
    ):  # the warning names what the guard does not stop
        assert names in GUARD_WARNING
    env["NANORL_SANDBOX"] = "chroot"
    p = subprocess.run(
        [sys.executable, "-c", "from nanorl.execution import require_sandbox; require_sandbox()"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (p.returncode, p.stderr) == (1, "error: NANORL_SANDBOX must be 'bwrap' or 'guard', got 'chroot'\n")


@pytest.mark.parametrize(
    "cmd", [["scripts.chat_eval", "-a", "HumanEval"], ["scripts.chat_rl", "--multi-turn", "--tool", "python"]]
)
def test_scripts_that_run_model_code_stop_at_their_start(tmp_path, cmd):
    # no checkpoint exists: the refusal comes before any model is looked for, as one line and no traceback. (chat_eval
    # with other tasks beside HumanEval skips only HumanEval: tests/test_chat_eval.py)
    p = subprocess.run(
        [sys.executable, "-m", *cmd],
        capture_output=True,
        text=True,
        env=_without_bwrap(tmp_path, True),
        timeout=300,
        cwd=ROOT,
    )
    why = "bwrap probe failed: bwrap: No permissions to create new namespace"
    assert p.returncode == 1 and p.stderr.endswith(_REFUSAL.format(why=why)) and "Traceback" not in p.stderr, p.stderr


# -----------------------------------------------------------------------------------------------
# what the code can see under bubblewrap: the interpreter, the system's libraries, its own directory; no host files


@needs_bwrap
def test_the_hosts_files_are_not_there(tmp_path):
    from nanorl.common import get_base_dir

    secret = f"nanorl-secret-{os.getpid()}"
    home = Path(os.path.expanduser("~"))
    planted = [
        home / f".nanorl_test_netrc_{os.getpid()}",  # ~/.netrc, ~/.ssh, the HF token live here
        Path(get_base_dir()) / f"nanorl_test_secret_{os.getpid()}",
    ]  # the checkpoints
    venv = Path(os.path.realpath(sys.prefix))
    beside_venv = [str(p) for p in sorted(venv.parent.iterdir())[:20] if p.is_file() and p != venv]  # read, not written
    try:
        for p in planted:
            p.write_text(f"machine api.wandb.ai login user password {secret}\n")
        # the project (a clone may hold the venv it runs), what lies beside the interpreter's prefix, host accounts
        files = [str(p) for p in planted] + [str(ROOT / "pyproject.toml")] + beside_venv + ["/etc/shadow", "/etc/hosts"]
        code = (
            "import os\n"
            f"for p in {files!r}:\n"
            "    try: print(p, open(p).read())\n"
            "    except OSError as e: print(p, type(e).__name__)\n"
            f"for d in {[str(home), get_base_dir()]!r}:\n"
            "    try: print(d, os.listdir(d))\n"
            "    except OSError as e: print(d, type(e).__name__)\n"
            "print(sorted(os.listdir('/etc')))\n"
            "print(open('/etc/passwd').read() == f'nobody:x:65534:65534:nobody:{os.getcwd()}:/bin/false\\n')\n"
            "import pwd; print(pwd.getpwuid(os.getuid()).pw_dir == os.getcwd() == os.environ['HOME'])\n"
            "print(sorted(os.listdir(os.environ['HOME'])))"
        )
        r = execute_code(code)
        assert r.success, r
        lines = r.stdout.splitlines()
        assert secret not in r.stdout
        for line in lines[: len(files)]:
            assert line.endswith("FileNotFoundError"), line  # not there at all, not merely forbidden
        for line in lines[len(files) : len(files) + 2]:  # the home and checkpoint directories: absent, or only the
            assert "nanorl_test" not in line, line  # way down to an interpreter that lives there (pyenv in ~)
        assert lines[-4] == "['group', 'ld.so.cache', 'passwd']"  # of /etc, only what ld.so and pwd read
        assert lines[-3:] == ["True", "True", "['main.py']"]  # one synthetic user, whose home is the fresh work dir
    finally:
        for p in planted:
            p.unlink(missing_ok=True)


@needs_bwrap
def test_the_interpreter_has_what_it_needs():
    # the same module path as the host's interpreter started the same way, and its C modules load (their libraries
    # were found); numpy too where it is installed
    host = subprocess.run(
        [sys.executable, "-I", "-c", "import sys; print(sys.path)"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    ).stdout
    code = (
        "import sys; print(sys.path)\n"
        "import ssl, sqlite3, decimal, zlib, hashlib, lzma, bz2, json\n"
        "print(hashlib.sha256(b'x').hexdigest()[:8], decimal.Decimal('1.1') + 1, len(ssl.OPENSSL_VERSION) > 0)"
    )
    r = execute_code(code)
    assert r.success and r.stdout == host + "2d711642 2.1 True\n", r
    try:
        import numpy  # noqa: F401
    except ImportError:
        return
    r = execute_code("import numpy as np; print(int(np.arange(10).sum()), float(np.linalg.norm([3.0, 4.0])))")
    assert r.success and r.stdout == "45 5.0\n", r


def test_the_mount_list_never_takes_a_whole_home_tmp_or_etc(monkeypatch):
    # an interpreter installed straight into one of these would bring all of it into the sandbox: no plan, so the
    # probe fails and nothing runs (the refusal above)
    import nanorl.sandbox as sb

    for p in (os.path.expanduser("~"), os.path.dirname(os.path.realpath(os.path.expanduser("~"))), "/tmp", "/etc"):
        monkeypatch.setattr(sb, "_interpreter_paths", lambda p=p: [p])
        with pytest.raises(RuntimeError, match="which would show the sandbox the host's files"):
            sb._make_plan()
    monkeypatch.setattr(sb, "_interpreter_paths", lambda: ["/usr/lib"])
    opts = sb._make_plan()[1]
    assert opts[:2] == ["--tmpfs", "/tmp"] and opts[-3:] == ["--ro-bind", "/usr/lib", "/usr/lib"]


@needs_bwrap
def test_an_interpreter_that_lives_under_tmp(tmp_path):
    # a CI clone's venv lives under /tmp, which the sandbox replaces with an empty one: the venv is mounted back
    venv = tmp_path / "clone" / ".venv"
    if not str(venv).startswith("/tmp/"):
        pytest.skip("pytest's temporary directory is not under /tmp here")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    script = (
        "from nanorl.execution import execute_code, sandbox_mode\n"
        "r = execute_code('import os, sys, json, ssl; print(sys.prefix, sorted(os.listdir(\"/tmp\")))')\n"
        "print(sandbox_mode(), r.stdout.strip() or r.error)"
    )
    p = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NANORL_SANDBOX": ""},
    )
    assert p.returncode == 0, p.stderr
    mode, prefix, tmp = p.stdout.strip().split(" ", 2)
    top = str(venv).split("/")[2]  # /tmp/<top>/...: the way down to the venv, beside the run's own directory
    assert (mode, prefix) == ("bwrap", str(venv)), p.stdout + p.stderr
    assert sorted(n for n in ast.literal_eval(tmp) if not n.startswith("nanorl_exec_")) == [top], tmp
