import os
import socket
import threading
import time

import pytest

from nanorl.execution import MAX_OUTPUT_BYTES, ExecResult, calculator, execute_code


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
    assert r.success and r.stdout == f"{50 * 1024 ** 2}\n"


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
    code = ("import os, tempfile\n"
            "open('notes.txt', 'w').write('hi')\n"
            "with tempfile.NamedTemporaryFile() as f:\n"
            "    f.write(b'x')\n"  # tempfile needs create + delete inside the sandbox
            "os.mkdir('sub'); os.remove('notes.txt')\n"
            "print(os.getcwd()); print(sorted(os.listdir('.')))")
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
        for code in [f"import socket; socket.create_connection(('127.0.0.1', {port})).sendall(b'hi')",
                     f"import socket; s = socket.socket(); s.connect(('127.0.0.1', {port}))",
                     f"import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
                     f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/')",
                     "import socket; socket.getaddrinfo('example.com', 80)"]:
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


@pytest.mark.parametrize("expr,want", [
    ("2+3", "5"),
    ("(7 - 1) * 3 / 4", "4.5"),
    ("2 ** 10 % 1000", "24"),
    ("6 / 2", "3"),  # integer-valued floats print as ints
    ("-(3 - 10) // 2", "3"),
    ("-7 // 2", "-4"),
    ("0.1 + 0.2", "0.3"),
    ("2 ** 0.5", "1.41421356237"),
    ("17 % 5", "2"),
    ("--5", "5"),
    ("12 * 1.5", "18"),
    ("2 ** 100", "1267650600228229401496703205376"),
    ('"strawberry".count("r")', "3"),
    ('"Mississippi".lower().count("s")', "4"),
    ('len("hello")', "5"),
    ("round(3.14159, 2)", "3.14"),
    ("max(3, 9, 4)", "9"),
])
def test_calculator(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr", [
    "1 / 0", "5 % 0", "x + 1", "__import__('os').system('ls')", "open('/etc/passwd').read()",
    "10 ** 100000", "9 ** 9 ** 9", "2 ** 2 ** 2 ** 2 ** 2", "'a' * 10 ** 9", "[].count(1)", "1 +", "",
    "(-8) ** (1 / 3)", "round(1, -10 ** 100)", "1" * 2000, "(" * 300 + "1" + ")" * 300,
    "lambda: 1", "().__class__", "'abc'.format(1)",
])
def test_calculator_errors_are_strings(expr):
    t = time.monotonic()
    out = calculator(expr)
    assert isinstance(out, str) and out.startswith("Error"), (expr, out)
    assert time.monotonic() - t < 1.0
