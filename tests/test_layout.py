"""The shape the code keeps: small files, short functions, nanorl/ a package that never reaches into tasks/ or
scripts/, no import cycles among its modules. A rule broken here is named with the file and line."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 700, 80  # one concern per file, whole: ~700 lines at most


def sources(*dirs):
    return sorted(p for d in dirs for p in (ROOT / d).glob("*.py"))


def test_files_and_functions_stay_small():
    too_long = []
    for path in sources("nanorl", "scripts"):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines (max {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)


def imports_of(path):
    """Top-level module names this file imports (at any depth: a lazy import inside a function counts too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_package_never_imports_tasks_or_scripts():
    bad = [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in sources("nanorl")
        for m in sorted(imports_of(p))
        if m.split(".")[0] in ("tasks", "scripts")
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_among_the_package_modules():
    # module-level imports only: a cycle there is what breaks (or reorders) loading; lazy imports are allowed
    names = {p.stem for p in sources("nanorl")}
    graph = {}
    for p in sources("nanorl"):
        deps = set()
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] == "nanorl":
                    deps |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("nanorl.")}
        graph[p.stem] = (deps & names) - {p.stem}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [" -> ".join(c) for c in map(cycle_from, sorted(graph)) if c]
    assert not cycles, "\n".join(cycles)


def test_the_layout_checks_catch_what_they_claim(tmp_path):
    # the checkers themselves, on a made-up module: a long function and a tasks import are found
    src = tmp_path / "m.py"
    src.write_text("import tasks.gsm8k\n\ndef f():\n" + "    x = 1\n" * 90)
    assert "tasks.gsm8k" in imports_of(src)
    fn = next(n for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.FunctionDef))
    assert fn.end_lineno - fn.lineno + 1 == 91


def test_ruff_lints_and_formats_clean():
    # the style is the formatter's: `ruff format .` and `ruff check --fix .` make this pass
    for args in (["check", "."], ["format", "--check", "."]):
        out = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout[-3000:]}{out.stderr[-1000:]}"
