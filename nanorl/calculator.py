"""
The calculator tool: a Python arithmetic expression (or a simple string method call) evaluated from its AST, with no
eval, bounded in size and time, always answered with a string (the result, or "Error: ...").
"""

import ast
import math
import operator
import warnings

_MAX_EXPR_CHARS = 1000
_MAX_INT_BITS = 4096  # ~1233 digits: big enough for any homework, small enough that nothing can crawl
_MAX_STR_CHARS = 10_000
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_STR_METHODS = {
    "count",
    "find",
    "rfind",
    "index",
    "rindex",
    "startswith",
    "endswith",
    "lower",
    "upper",
    "strip",
    "lstrip",
    "rstrip",
    "replace",
    "title",
    "capitalize",
    "isdigit",
    "isalpha",
    "isupper",
    "islower",
}
_FUNCTIONS = {"len": len, "abs": abs, "round": round, "min": min, "max": max}


def _is_num(v):
    return type(v) in (int, float)


def _check_size(v):
    if type(v) is int and v.bit_length() > _MAX_INT_BITS:
        raise ValueError("number too large")
    if isinstance(v, str) and len(v) > _MAX_STR_CHARS:
        raise ValueError("string too long")
    return v


def _eval(node):
    if isinstance(node, ast.Constant) and (_is_num(node.value) or isinstance(node.value, str)):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        if not _is_num(v):
            raise ValueError("unary minus needs a number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if not (_is_num(a) and _is_num(b)):
            raise ValueError("arithmetic needs numbers")  # no "a" * 10**9
        if isinstance(node.op, ast.Pow) and abs(a) > 1 and abs(b) * math.log2(abs(a)) > _MAX_INT_BITS:
            raise ValueError("exponent too large")  # refuse before computing, not after
        if (
            isinstance(node.op, ast.Mult)
            and type(a) is int
            and type(b) is int
            and a.bit_length() + b.bit_length() > _MAX_INT_BITS + 1
        ):
            raise ValueError("number too large")
        r = _BINOPS[type(node.op)](a, b)
        if isinstance(r, complex):
            raise ValueError("result is not a real number")
        return _check_size(r)
    if isinstance(node, ast.Call) and not node.keywords:
        args = [_eval(a) for a in node.args]
        if isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
            if node.func.id == "round" and len(args) > 1 and not (type(args[1]) is int and abs(args[1]) <= 100):
                raise ValueError("round() takes at most 100 digits")  # round(x, -10**100) would crawl
            return _check_size(_FUNCTIONS[node.func.id](*args))
        if isinstance(node.func, ast.Attribute) and node.func.attr in _STR_METHODS:
            obj = _eval(node.func.value)
            if isinstance(obj, str) and all(isinstance(a, str) or type(a) is int for a in args):
                return _check_size(getattr(obj, node.func.attr)(*args))
    raise ValueError(f"unsupported expression: {ast.unparse(node)[:60]}")


def _format(v):
    if type(v) is float and math.isfinite(v):
        if v.is_integer() and abs(v) < 1e16:
            return str(int(v))  # 6/2 -> "3", not "3.0"
        return f"{v:.12g}"  # 0.1+0.2 -> "0.3": a language model should not see float noise
    return str(v)


def calculator(expr: str) -> str:
    """Evaluate a Python arithmetic expression (or a simple string method call) safely; the result or
    'Error: ...' as a string. Never raises, never hangs."""
    try:
        expr = str(expr).strip()
        if len(expr) > _MAX_EXPR_CHARS:
            return f"Error: expression longer than {_MAX_EXPR_CHARS} characters"
        with warnings.catch_warnings():  # "3or 4" parses with a SyntaxWarning (printed mid-run): a malformed number
            warnings.simplefilter("error", SyntaxWarning)  # is invalid syntax here, and nothing is printed
            tree = ast.parse(expr, mode="eval")
        return _format(_eval(tree.body))
    except ZeroDivisionError:
        return "Error: division by zero"
    except SyntaxError:
        return "Error: invalid syntax"
    except Exception as e:  # ValueError, OverflowError, TypeError, RecursionError, MemoryError...
        return f"Error: {e}" if isinstance(e, ValueError) and str(e) else f"Error: {type(e).__name__}: {e}"
