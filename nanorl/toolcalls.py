"""
Tool use in an assistant turn: the one reader of its markup, the one runner of a call, and the default tool (the
calculator: a Python arithmetic expression, or a simple string method call, evaluated from its AST, with no eval).

The model calls a tool as <|python_start|>source<|python_end|>; the tool's result is forced in after it as
<|output_start|>result<|output_end|>; <|assistant_end|> (or <|bos|>) ends the turn. Everything that reads
generated tokens goes through here: the engine and nanorl/multiturn.py find and run calls with
ToolMarkup.open_call / run_tool / ToolMarkup.output_tokens; the chat CLI and the web server turn tokens into
text with MarkupStream (streamed) or assistant_parts (all at once, the inverse of the tokenizer's rendering).

    stream = MarkupStream(tokenizer)            # kinds "text" | "python" | "python_output"
    for t in tokens: pieces += stream.push(t)   # [(kind, text), ...] as soon as the bytes make characters
    pieces += stream.flush()
    MarkupStream(tokenizer, inline=True)        # one kind, "text", with calls shown as <<source=result>>
"""

import ast
import math
import operator
import threading
import warnings

# --- the default tool: the calculator ------------------------------------------------------------
# A Python arithmetic expression (or a simple string method call) evaluated from its AST, with no eval, bounded in
# size and time, always answered with a string (the result, or "Error: ...").

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
    # a literal needs no _check_size: calculator's length limit keeps it within both size limits (at most
    # _MAX_EXPR_CHARS characters, 4 bits each in hex; tests/test_calculator.py holds the limits to that)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):  # no bool, complex or bytes
        return node.value
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
        # "3or 4" parses with a SyntaxWarning (printed mid-run): a malformed number is invalid syntax here, and
        # nothing is printed
        with warnings.catch_warnings(action="error", category=SyntaxWarning):
            tree = ast.parse(expr, mode="eval")
        return _format(_eval(tree.body))
    except ZeroDivisionError:
        return "Error: division by zero"
    except SyntaxError:
        return "Error: invalid syntax"
    except Exception as e:  # ValueError, OverflowError, TypeError, RecursionError, MemoryError...
        return f"Error: {e}" if isinstance(e, ValueError) and str(e) else f"Error: {type(e).__name__}: {e}"


# --- running a call, reading the markup -----------------------------------------------------------


def run_tool(source, tool=calculator, timeout=1.0, max_chars=200):
    """Run tool(source) -> str in a daemon thread. A failure or a timeout comes back as an error string, never an
    exception: the model sees it as the tool's output. A thread cannot be killed, so a runaway tool keeps its thread
    until it returns; the caller only stops waiting (the calculator is bounded)."""
    result = [f"Error: timed out after {timeout}s"]

    def target():
        try:
            result[0] = str(tool(source))
        except Exception as e:
            result[0] = f"Error: {type(e).__name__}: {e}"

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0][:max_chars]


class ToolMarkup:
    """The special tokens of tool use for one tokenizer, and the rules that read them."""

    def __init__(self, tokenizer):
        sp = tokenizer.encode_special
        self.tokenizer = tokenizer
        self.python_start, self.python_end = sp("<|python_start|>"), sp("<|python_end|>")
        self.output_start, self.output_end = sp("<|output_start|>"), sp("<|output_end|>")
        # the turn's end; an open model's tokenizer may lack some of these tokens (None), which then never match
        self.stops = frozenset(t for t in (sp("<|assistant_end|>"), tokenizer.get_bos_token_id()) if t is not None)
        # the kind of text each marker opens (closing markers go back to plain text)
        self.kinds = {
            self.python_start: "python",
            self.python_end: "text",
            self.output_start: "python_output",
            self.output_end: "text",
        }
        self.inline = {self.python_start: "<<", self.python_end: "", self.output_start: "=", self.output_end: ">>"}

    def open_call(self, tokens):
        """tokens end with <|python_end|>: the source of the call it closes, or None when it closes none (no
        <|python_start|> before it, or a call already closed or answered since the last one)."""
        start = next((k for k in range(len(tokens) - 2, -1, -1) if tokens[k] == self.python_start), None)
        if start is None or {self.python_end, self.output_end} & set(tokens[start + 1 : -1]):
            return None
        return self.tokenizer.decode(tokens[start + 1 : -1])

    def output_tokens(self, result):
        """The tokens that force a tool's result in: <|output_start|>result<|output_end|>."""
        return [self.output_start] + self.tokenizer.encode(result) + [self.output_end]


class MarkupStream:
    """Generated tokens -> (kind, text) pieces as they come. Holds back the bytes of a UTF-8 character split across
    tokens and drops the stop tokens. inline=False: kinds "text", "python", "python_output", and a marker token
    ends the piece before it (the piece is returned even when empty, so a caller sees every block boundary);
    inline=True: everything is "text" with calls shown as <<source=result>> (GSM8K's calculator notation)."""

    def __init__(self, tokenizer, inline=False):
        self.markup = tokenizer if isinstance(tokenizer, ToolMarkup) else ToolMarkup(tokenizer)
        self.tokenizer, self.inline = self.markup.tokenizer, inline
        self.kind, self.buf = "text", []

    def push(self, token):
        m = self.markup
        if token in m.stops:
            return self._nonempty(self.flush())
        if token in m.kinds:
            if self.inline:
                return self._nonempty([("text", self._take() + m.inline[token])])
            out, self.kind = [(self.kind, self._take())], m.kinds[token]
            return out
        self.buf.append(token)
        text = self.tokenizer.decode(self.buf)
        if text.endswith("\ufffd") and len(self.buf) < 8:
            return []  # probably half a character: wait for the rest
        self.buf = []
        return [(self.kind, text)]

    def flush(self):
        """Whatever is held back, as a (possibly empty) piece of the current kind."""
        return [(self.kind, self._take())]

    def text(self, token):
        """push() as one string (for a terminal)."""
        return "".join(t for _, t in self.push(token))

    def text_flush(self):
        """flush() as one string."""
        return self._take()

    def _take(self):
        text = self.tokenizer.decode(self.buf) if self.buf else ""
        self.buf = []
        return text

    @staticmethod
    def _nonempty(pieces):
        return [p for p in pieces if p[1]]


def assistant_parts(tokenizer, tokens):
    """Generated tokens -> assistant content parts [{"type": "text"|"python"|"python_output", "text"}],
    the inverse of Tokenizer.render_conversation's assistant turn. Stops at <|assistant_end|> / <|bos|>."""
    stream = MarkupStream(tokenizer)
    parts, kind, text = [], "text", ""

    def close():
        if text or kind != "text":  # an empty tool call is still a tool call
            parts.append({"type": kind, "text": text})

    for t in tokens:
        if t in stream.markup.stops:
            break
        for _kind, piece in stream.push(t):
            text += piece
        if t in stream.markup.kinds:  # the marker closed the block before it
            close()
            kind, text = stream.kind, ""
    text += stream.flush()[0][1]
    close()
    return parts
