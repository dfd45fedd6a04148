"""
Bad input ends a script in one line, not a traceback.

The loaders raise a UserError (a flag, a file, a row the user can fix; the message names it) and the hook below,
installed when nanorl is imported, prints `<script>.py: error: <message>` on stderr and exits 1, the way argparse
answers a bad flag. Every other exception is a bug or a failure we did not foresee and keeps its full traceback;
NANORL_DEBUG=1 shows the traceback of a UserError too. A missing dependency (torch, say: a shell that has not activated
.venv) is one line too, saying so.

Each UserError is also the builtin error it used to be (ValueError, FileNotFoundError, RuntimeError), so code that
catches those, and tests that expect them, see no change.
"""

import json
import os
import sys


class UserError(Exception):
    """Input the user can fix; the message is one line naming the flag, file or row at fault."""

    every_rank = False  # under torchrun rank 0 speaks for its node; True where each rank's own file is at fault


class BadValue(UserError, ValueError):
    """A flag's value or a file's content that cannot work (a vocab too small, a row without an answer)."""


class MissingFile(UserError, FileNotFoundError):
    """A file, directory or checkpoint the input names is not there."""


class Unreadable(UserError, RuntimeError):
    """A file is there but cannot be read (truncated, empty, garbage), or a data source is out of reach."""


def _prog():
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return f"{name}: " if name.endswith(".py") else ""


# pyproject.toml's dependencies (and pydantic, fastapi's): one of them missing means the wrong python is running
DEPENDENCIES = (
    "torch", "safetensors", "tiktoken", "numpy", "pyarrow", "datasets", "wandb", "rustbpe", "fastapi", "uvicorn",
    "pydantic",
)  # fmt: skip


def missing_dependency(value):
    """The line for a ModuleNotFoundError of a dependency: this python is not nanorl's environment (a new shell that
    has not activated .venv); None for any other module."""
    name = (getattr(value, "name", None) or "").split(".")[0]
    if name not in DEPENDENCIES:
        return None
    return (
        f"no module named {name!r} in {sys.executable}: run nanorl in its virtual environment, "
        "`source .venv/bin/activate` first (bash speedrun.sh created it)"
    )


def excepthook(kind, value, tb, fallback=None):
    """One line for a UserError; anything else, or NANORL_DEBUG=1, goes to `fallback` (the hook that was there
    before: the full traceback). Under torchrun every rank meets the same bad input, so the first rank of each node
    speaks (another node may lack a file this one has) and the others stay quiet, unless the fault is in the rank's
    own file (its optimizer or extra state)."""
    fallback = fallback or sys.__excepthook__
    debug = os.environ.get("NANORL_DEBUG", "") not in ("", "0")
    if issubclass(kind, ModuleNotFoundError) and missing_dependency(value) and not debug:
        print(f"{_prog()}error: {missing_dependency(value)}", file=sys.stderr, flush=True)
        return
    if not issubclass(kind, UserError) or debug:
        return fallback(kind, value, tb)
    rank, local_rank = int(os.environ.get("RANK", 0) or 0), int(os.environ.get("LOCAL_RANK", 0) or 0)
    if rank == 0 or local_rank == 0 or value.every_rank:
        print(f"{f'[rank {rank}] ' if rank else ''}{_prog()}error: {value}", file=sys.stderr, flush=True)


def install_excepthook():
    """Route uncaught exceptions through excepthook; once, keeping whatever hook was installed before."""
    if getattr(sys.excepthook, "nanorl", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        excepthook(kind, value, tb, previous)

    hook.nanorl = True
    sys.excepthook = hook


def read_json_object(path, what="file"):
    """A JSON object from `path`; a missing file, invalid JSON or another kind of value is one line naming it."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise MissingFile(f"{what} {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Unreadable(f"{what} {path} is corrupt (not JSON: {e})") from e
    if not isinstance(obj, dict):
        raise Unreadable(f"{what} {path} is corrupt: it holds a JSON {type(obj).__name__}, not an object")
    return obj
