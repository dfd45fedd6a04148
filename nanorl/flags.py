"""
The command line of every script: argparse that shows each default in --help and answers a bad flag in one line, the
number types that check a value as it is parsed, slime's spellings of our flags, and loading a user's function that a
flag names ("module:function" or "path/to/file.py:function").
"""

import argparse
import importlib
import importlib.util
import inspect
import math
import os
import sys

# -----------------------------------------------------------------------------------------------
# flags: every default shown in --help, every number checked when it is parsed, errors on one line


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every flag's help, unless the help already says what its default is."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


# slime's spellings of our flags: the scripts that have the flag accept them too, unlisted in --help (docs/rl.md)
SLIME_NAMES = {
    "--num-rollout": "--num-rollouts",
    "--rollout-max-response-len": "--max-new-tokens",
    "--rollout-temperature": "--temperature",
    "--eval-interval": "--eval-every",
    "--save-interval": "--save-every",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with every default in --help, and a bad flag answered with one line (no usage dump), exit 2.
    A leading `--` is dropped: `torchrun ... -m scripts.X -- --flag` hands the script its flags after one.
    aliases: {another spelling: our flag}, read as our flag (e.g. SLIME_NAMES)."""

    def __init__(self, aliases=None, **kwargs):
        super().__init__(formatter_class=HelpFormatter, **kwargs)
        self.aliases = aliases or {}

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        args = args[1:] if args[:1] == ["--"] else args
        return super().parse_known_args([self.our_name(a) for a in args], namespace)

    def our_name(self, arg):
        """--rollout-temperature 0.7 and --rollout-temperature=0.7 as --temperature."""
        name, eq, value = arg.partition("=")
        return self.aliases[name] + eq + value if name in self.aliases else arg

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def number_in(kind, lo=None, hi=None, lo_open=False):
    """An argparse `type=`: parses an int or float and keeps it within [lo, hi] ((lo, hi] with lo_open), else
    argparse names the flag with the allowed range. NaN and infinities never pass."""
    what = "an integer" if kind is int else "a number"
    allowed = " and ".join(
        c
        for c in (
            (f"> {lo}" if lo_open else f">= {lo}") if lo is not None else "",
            f"<= {hi}" if hi is not None else "",
        )
        if c
    )

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (
            not math.isfinite(value)
            or (lo is not None and (value <= lo if lo_open else value < lo))
            or (hi is not None and value > hi)
        ):
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {what} {allowed}")
        return value

    parse.__name__ = f"{kind.__name__} {allowed}"  # argparse's fallback message uses the name
    return parse


positive_int = number_in(int, 1)
nonneg_int = number_in(int, 0)
positive_float = number_in(float, 0, lo_open=True)
nonneg_float = number_in(float, 0)
fraction = number_in(float, 0, 1)  # a share of something, 0..1
int_or_off = number_in(int, -1)  # intervals and limits where -1 (or 0) means "off" / "all"


def batch_or_auto(text):
    """An argparse `type=` for --device-batch-size: a positive number of rows, or "auto" (fit_batch picks it)."""
    return text if text == "auto" else positive_int(text)


def tag_name(text):
    """An argparse `type=` for a checkpoint tag (--model-tag, --output-tag): one directory name under a stage's
    checkpoints, so "../x" or "a/b" cannot write or read outside it."""
    if not text or text in (".", "..") or "/" in text or "\\" in text or text.startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a tag: one directory name, e.g. d4 or my-run")
    return text


def int_list(text):
    """An argparse `type=` for a comma-separated list of positive integers, e.g. --pass-k 1,4."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text} must hold integers >= 1")
    return values


# -----------------------------------------------------------------------------------------------
# plugins: a user function named on the command line as "module:function" or "path/to/file.py:function"


def load_function(path, expected_params, flag):
    """Import a user function and check its signature before any GPU work starts; errors name the flag."""
    if ":" not in path:
        raise ValueError(f"{flag} {path!r}: expected 'module:function' or 'file.py:function'")
    mod_name, fn_name = path.rsplit(":", 1)
    try:
        if mod_name.endswith(".py") or os.path.sep in mod_name:
            spec = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
            if spec is None:
                raise ImportError(f"no such file {mod_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:
        raise ValueError(f"{flag} {path!r}: could not import {mod_name!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, fn_name, None)
    expected = f"{fn_name}({', '.join(expected_params)})"
    if not callable(fn):
        raise ValueError(f"{flag} {path!r}: {mod_name!r} has no function {fn_name!r}; expected {expected}")
    try:
        inspect.signature(fn).bind(*expected_params)
    except TypeError as e:
        raise ValueError(f"{flag} {path!r}: wrong signature {inspect.signature(fn)}; expected {expected}") from e
    return fn
