"""
The reward hub: small graders that turn (response text, label) into a number.

--rm-type picks one: math | mc | exact | f1 | format, or a weighted mix such as "math+format:0.9,0.1",
which returns a dict of components plus their weighted "total" (every component gets logged).
"""
import math
import re
import string
from collections import Counter

_NUM = r"-?\$?\s*\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?%?"


def _last_boxed(text):
    """Content of the last \\boxed{...}, nested braces included."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 0, i + len("\\boxed")
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k]
    return None


def extract_answer(text):
    """The final answer of a response: what follows the last ####, else the last \\boxed{}, else the last number."""
    if text is None:
        return None
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.split("\n")[0].strip() or None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    nums = re.findall(_NUM, text)
    return nums[-1].strip() if nums else None


def normalize_number(s):
    """'1,234' '-5' '3.50' '3/4' '\\frac{3}{4}' '45%' '$12' '12 apples.' -> a float, or None."""
    if s is None:
        return None
    s = str(s).strip()
    m = re.search(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if m:
        a, b = normalize_number(m.group(1)), normalize_number(m.group(2))
        return a / b if a is not None and b not in (None, 0) else None
    m = re.search(_NUM, s)
    if not m:
        return None
    tok = m.group(0).replace("$", "").replace(",", "").replace(" ", "")
    pct = tok.endswith("%")
    tok = tok.rstrip("%")
    try:
        if "/" in tok:
            a, b = tok.split("/")
            val = float(a) / float(b)
        else:
            val = float(tok)
    except (ValueError, ZeroDivisionError):
        return None
    return val / 100 if pct else val


def math_reward(response, label):
    """1.0 when the response's final number equals the label's (relative tolerance 1e-9: tight enough that
    192000000 != 192000001, loose enough that a rounded 0.3333333333 matches 1/3), else 0.0."""
    got, want = normalize_number(extract_answer(response)), normalize_number(label)
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12) else 0.0


def mc_reward(response, label):
    """Multiple choice: the letter the response picks (A-J), in forms like 'B', '(B)', 'Answer: B'."""
    text = response.strip()
    m = re.search(r"(?:answer\s*(?:is)?\s*:?\s*)\(?([A-J])\)?\b", text, re.IGNORECASE) or \
        re.search(r"^\(?([A-J])\)?\.?$", text) or re.findall(r"\b([A-J])\b", text)
    if isinstance(m, list):
        letter = m[-1] if m else None
    else:
        letter = m.group(1) if m else None
    return 1.0 if letter is not None and letter.upper() == str(label).strip().upper() else 0.0


def _normalize_text(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(response, label):
    return 1.0 if _normalize_text(response) == _normalize_text(str(label)) else 0.0


def f1_reward(response, label):
    """Token-overlap F1 after SQuAD-style normalisation."""
    pred, gold = _normalize_text(response).split(), _normalize_text(str(label)).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold or common == 0:
        return float(pred == gold)
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


def format_reward(response, label=None):
    """1.0 when the response ends with a well-formed '#### N' line."""
    return 1.0 if re.search(r"####\s*-?[\d,]+(?:\.\d+)?\s*$", response.strip()) else 0.0


GRADERS = {"math": math_reward, "mc": mc_reward, "exact": exact_match, "f1": f1_reward, "format": format_reward}


def parse_rm_type(rm_type):
    """'math' -> [('math', 1.0)]; 'math+format:0.9,0.1' -> [('math', 0.9), ('format', 0.1)]."""
    names, _, weights = rm_type.partition(":")
    names = names.split("+")
    bad = [n for n in names if n not in GRADERS]
    if bad:
        raise ValueError(f"unknown --rm-type component(s) {bad}; valid: {', '.join(GRADERS)} (or a mix like math+format:0.9,0.1)")
    w = [float(x) for x in weights.split(",")] if weights else [1.0] * len(names)
    if len(w) != len(names):
        raise ValueError(f"--rm-type {rm_type!r}: {len(names)} components but {len(w)} weights")
    return list(zip(names, w))


def compute_reward(rm_type, response, label, metadata=None):
    """A float for a single grader, a dict {component: value, ..., 'total': weighted sum} for a mix."""
    parts = parse_rm_type(rm_type)
    if len(parts) == 1 and "+" not in rm_type:
        return GRADERS[parts[0][0]](response, label)
    out = {name: GRADERS[name](response, label) for name, _ in parts}
    out["total"] = sum(out[name] * w for name, w in parts)
    return out


def safe_reward(fn, *args):
    """Call a reward function; (value, None) when it returns a finite number (or a dict of them with a
    'total'), else (None, reason). Never raises: one bad reward must not kill a long run."""
    try:
        value = fn(*args)
    except Exception as e:
        return None, f"raised {type(e).__name__}: {e}"
    vals = value.values() if isinstance(value, dict) else [value]
    if isinstance(value, dict) and "total" not in value:
        return None, "a dict reward needs a 'total' key"
    for v in vals:
        if not isinstance(v, (int, float)) or not math.isfinite(v):  # bools count as 0/1
            return None, f"not a finite number: {v!r}"
    return ({k: float(v) for k, v in value.items()} if isinstance(value, dict) else float(value)), None
