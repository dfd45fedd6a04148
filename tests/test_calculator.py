import time

import pytest

from nanorl import toolcalls
from nanorl.toolcalls import calculator


@pytest.mark.parametrize(
    "expr,want",
    [
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
    ],
)
def test_calculator(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize(
    "expr",
    [
        "1 / 0",
        "5 % 0",
        "x + 1",
        "__import__('os').system('ls')",
        "open('/etc/passwd').read()",
        "10 ** 100000",
        "9 ** 9 ** 9",
        "2 ** 2 ** 2 ** 2 ** 2",
        "'a' * 10 ** 9",
        "[].count(1)",
        "1 +",
        "",
        "(-8) ** (1 / 3)",
        "round(1, -10 ** 100)",
        "1" * 2000,
        "(" * 300 + "1" + ")" * 300,
        "lambda: 1",
        "().__class__",
        "'abc'.format(1)",
    ],
)
def test_calculator_errors_are_strings(expr):
    t = time.monotonic()
    out = calculator(expr)
    assert isinstance(out, str) and out.startswith("Error"), (expr, out)
    assert time.monotonic() - t < 1.0


def test_a_malformed_number_is_invalid_syntax_and_prints_nothing():
    """`3or 4` and `1if 1 else 2` parse in Python with a SyntaxWarning ("invalid decimal literal") that chat_rl used to
    print mid-run as `<unknown>:1: SyntaxWarning`: here they are invalid syntax, and no warning escapes."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert calculator("3or 4") == "Error: invalid syntax"
        assert calculator("1if 1 else 2") == "Error: invalid syntax"
        assert calculator("3 + 4") == "7"
    assert seen == []


def test_the_length_limit_bounds_every_literal():
    """_eval does not size-check a literal: the expression's length limit keeps it within both size limits (a hex
    digit is 4 bits, a string literal's value is no longer than its source)."""
    assert 4 * toolcalls._MAX_EXPR_CHARS <= toolcalls._MAX_INT_BITS
    assert toolcalls._MAX_EXPR_CHARS <= toolcalls._MAX_STR_CHARS
    n = toolcalls._MAX_EXPR_CHARS - 2
    assert calculator("0x" + "f" * n) == str(16**n - 1)
    assert calculator("'" + "a" * n + "'") == "a" * n
