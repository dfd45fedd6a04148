"""The shape the code keeps: one concern per file, whole (up to ~700 lines), and no file so small that it only serves
another one; short functions; nanorl/ a package that never reaches into tasks/ or scripts/; no import cycles among
its modules, counting the imports inside functions. A rule broken here is named with the file and line."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 700, 80  # a whole concern fits in ~700 lines; a function in one screen
MIN_SATELLITE_LINES = 80  # a module shorter than this that only one other file imports belongs inside that file


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


def package_imports(path, names):
    """The nanorl modules (of `names`) this file imports, at any depth."""
    found = {m.split(".")[1] for m in imports_of(path) if m.startswith("nanorl.")}
    return (found & names) - {path.stem}


def test_the_package_never_imports_tasks_or_scripts():
    bad = [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in sources("nanorl")
        for m in sorted(imports_of(p))
        if m.split(".")[0] in ("tasks", "scripts")
    ]
    assert not bad, "\n".join(bad)


def find_cycle(graph):
    """One import cycle of graph {module: modules it imports} as a list (first == last), or None."""
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return None


def test_no_import_cycle_among_the_package_modules():
    # a lazy import inside a function counts: it hides the cycle from the loader, not from a reader, who has to hold
    # both files in mind to follow either
    names = {p.stem for p in sources("nanorl")}
    graph = {p.stem: package_imports(p, names) for p in sources("nanorl")}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_small_module_serves_a_single_file():
    # a module of a few dozen lines that one other file imports is part of that file's concern: one more file to open
    names = {p.stem for p in sources("nanorl")} - {"__init__"}
    users = {m: set() for m in names}
    for p in sources("nanorl", "scripts"):
        for m in package_imports(p, names):
            users[m].add(str(p.relative_to(ROOT)))
    satellites = [
        f"nanorl/{m}.py ({n} lines) only serves {next(iter(users[m]))}: it belongs inside it"
        for m in sorted(names)
        if (n := (ROOT / "nanorl" / f"{m}.py").read_text().count("\n")) < MIN_SATELLITE_LINES and len(users[m]) == 1
    ]
    assert not satellites, "\n".join(satellites)


def test_the_layout_checks_catch_what_they_claim(tmp_path):
    # the checkers themselves, on made-up modules: a long function, a tasks import, a cycle through a lazy import
    src = tmp_path / "m.py"
    src.write_text("import tasks.gsm8k\n\ndef f():\n" + "    x = 1\n" * 90)
    assert "tasks.gsm8k" in imports_of(src)
    fn = next(n for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.FunctionDef))
    assert fn.end_lineno - fn.lineno + 1 == 91
    (tmp_path / "a.py").write_text("from nanorl import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from nanorl.a import g\n")
    graph = {p.stem: package_imports(p, {"a", "b"}) for p in (tmp_path / "a.py", tmp_path / "b.py")}
    assert find_cycle(graph) == ["a", "b", "a"] and find_cycle({"a": {"b"}, "b": set()}) is None


def test_ruff_lints_and_formats_clean():
    # the style is the formatter's: `ruff format .` and `ruff check --fix .` make this pass
    for args in (["check", "."], ["format", "--check", "."]):
        out = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout[-3000:]}{out.stderr[-1000:]}"
