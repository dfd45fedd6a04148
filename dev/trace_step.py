"""
One synchronous RL step as it really runs: the project lines it executes (nanorl/, scripts/, tasks/), the functions
it enters and the calls between files, printed as the markdown tables docs/rl.md holds.

The run is built outside the trace, by scripts/chat_rl.py's own build_run from its flags; then one RLRun.step runs
under sys.settrace (and threading.settrace), which counts each executed line once per file. Without --base-dir the
model is the chat_rl tests' tiny random one (tests/tiny_checkpoints.py: a 600-token tokenizer, one 32-wide
layer), made in a temporary directory.

    python dev/trace_step.py                                        # chat_rl --levels 1,2 on the tiny random model
    python dev/trace_step.py --base-dir ~/.cache/nanorl -- --levels 1,2 --model-tag d20   # a model of your own

tests/test_rl_run.py runs trace_step on the tiny model and compares it with docs/rl.md's tables.
"""

import argparse
import ast
import contextlib
import inspect
import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("nanorl/", "scripts/", "tasks/")
FLAGS = ["--levels", "1,2"]  # `python -m scripts.chat_rl --levels 1,2`: every other flag at its default


def build_run(flags):
    """chat_rl's run of these flags, its models read from NANORL_BASE_DIR -> RLRun."""
    sys.path.insert(0, str(ROOT))
    from scripts import chat_rl

    parser = chat_rl.make_parser()
    run, _ = chat_rl.build_run(parser.parse_args(flags), parser)
    return run


def tiny_model(base):
    """The tokenizer and random SFT checkpoint "t" the chat_rl tests start from, made under base."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_checkpoints import save_random_sft, train_tokenizer

    env = {**os.environ, "NANORL_BASE_DIR": str(base), "OMP_NUM_THREADS": "1"}
    train_tokenizer(env)
    save_random_sft(env)


def trace_step(run, step=0):
    """Run run.step(step) under the tracer -> {"lines": {file: n}, "executed": {file: {line number}}, "functions":
    {file: {qualname}}, "calls": {(caller file, caller, callee file, callee)}, "parameters": {(file, qualname): n}}:
    every call whose nearest project caller sits in another file (torch's wrappers and hooks in between are skipped),
    and how many parameters each function entered declares (self and *args, **kwargs included)."""
    where, lines, functions, calls, parameters = {}, defaultdict(set), defaultdict(set), set(), {}

    def project_file(code):
        if code not in where:
            path = code.co_filename
            rel = os.path.relpath(path, ROOT) if path.startswith(str(ROOT)) else ""
            where[code] = rel if rel.startswith(PROJECT) else None
        return where[code]

    def on_line(frame, event, arg):
        if event == "line":
            lines[where[frame.f_code]].add(frame.f_lineno)
        return on_line

    def on_call(frame, event, arg):
        here = project_file(frame.f_code)
        if here is None:
            return None  # not a project frame: its lines are not counted (the calls it makes still are)
        functions[here].add(frame.f_code.co_qualname)
        code = frame.f_code
        star = bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
        parameters[here, code.co_qualname] = code.co_argcount + code.co_kwonlyargcount + star
        back = frame.f_back
        while back is not None and project_file(back.f_code) is None:
            back = back.f_back
        if back is not None and where[back.f_code] != here:
            calls.add((where[back.f_code], back.f_code.co_qualname, here, frame.f_code.co_qualname))
        return on_line

    threading.settrace(on_call)
    sys.settrace(on_call)
    try:
        run.step(step)
    finally:
        sys.settrace(None)
        threading.settrace(None)
    executed, lines = dict(lines), {f: len(n) for f, n in lines.items()}
    return {
        "lines": lines,
        "executed": executed,
        "functions": dict(functions),
        "calls": calls,
        "parameters": parameters,
    }


def widest_returns(functions):
    """{file: {qualname}} as the trace gives them -> {(file, qualname): the most values one of the function's return
    statements gives back (a tuple's length, else 1; 0 when it returns nothing)}, read from each file's syntax tree."""
    out = {}
    for f, names in functions.items():
        defs = {}

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defs[prefix + child.name] = child
                    local = "." if isinstance(child, ast.ClassDef) else ".<locals>."
                    visit(child, prefix + child.name + local)
                else:
                    visit(child, prefix)

        def own_returns(node):  # the function's own: not those of the functions defined inside it
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Return) and child.value is not None:
                    yield len(child.value.elts) if isinstance(child.value, ast.Tuple) else 1
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    yield from own_returns(child)

        visit(ast.parse((ROOT / f).read_text()), "")
        for q in names & defs.keys():
            out[f, q] = max(own_returns(defs[q]), default=0)
    return out


def tables(trace):
    """The trace -> docs/rl.md's two markdown tables: one row per file (most lines first), then one row per pair of
    files with the calls from one into the other."""
    lines, functions, calls = trace["lines"], trace["functions"], trace["calls"]
    files = sorted(lines, key=lambda f: (-lines[f], f))
    out = ["| file | lines | functions |", "|---|---|---|"]
    out += [f"| `{f}` | {lines[f]} | {len(functions[f])} |" for f in files]
    total = sum(len(functions[f]) for f in files)
    out += [f"| {len(files)} files | {sum(lines.values())} | {total} |", ""]
    pairs = defaultdict(set)
    for a, f, b, g in calls:
        pairs[a, b].add(f"`{f}` -> `{g}`")
    out += ["| from | to | calls |", "|---|---|---|"]
    for a, b in sorted(pairs, key=lambda p: (files.index(p[0]), files.index(p[1]))):
        out.append(f"| `{a}` | `{b}` | {', '.join(sorted(pairs[a, b]))} |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(
        description=__doc__.strip().split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--base-dir", default=None, help="NANORL_BASE_DIR holding the model (default: the tiny one, in a temp dir)"
    )
    p.add_argument("flags", nargs="*", help=f"chat_rl's flags, after -- (default: {' '.join(FLAGS)})")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.base_dir or tmp).resolve()
        if args.base_dir is None:
            tiny_model(base)
        os.environ["NANORL_BASE_DIR"] = str(base)
        with contextlib.redirect_stdout(sys.stderr):  # what the run prints; the tables alone go to stdout
            trace = trace_step(build_run(args.flags or FLAGS))
    print(tables(trace))


if __name__ == "__main__":
    main()
