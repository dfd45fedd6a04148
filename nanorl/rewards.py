"""
The reward hub: small graders that turn (response text, label) into a number.

--rm-type picks one: math | mc | exact | f1 | format, or a weighted mix such as "math+format:0.9,0.1",
which returns a dict of components plus their weighted "total" (every component gets logged).
A custom reward is a function fn(response, label, metadata) -> float | dict with a "total", loaded with
load_function("module:fn") or load_function("path/to/file.py:fn"); a remote one is an HTTP endpoint,
scored in batches with remote_rewards(url, payloads).

Every grader returns a number and never looks at anything but its arguments. safe_reward and
remote_rewards never raise: a broken reward becomes (None, reason), which the RL loop counts and drops,
because one bad sample must not kill a long run.
"""
import importlib
import importlib.util
import json
import math
import numbers
import os
import re
import string
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

# -----------------------------------------------------------------------------------------------
# extracting the final answer

# a number as written in text: optional sign, thousands groups or plain digits, decimals, an optional /b
_TEXT_NUMBER = re.compile(r"(?<![\d.)])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")


def _last_boxed(text):
    """Content of the last \\boxed{...}, nested braces included (unclosed: up to the end)."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    start = i + len("\\boxed{")
    depth = 1
    for k in range(start, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[start:k]
    return text[start:]


def _after_hashes(text):
    """The first line after the last ####, or None when there is no #### or nothing follows it."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.split("\n")[0].strip() or None


def extract_answer(text):
    """The final answer of a response: after the last ####, else the last \\boxed{...}, else the last number."""
    if text is None:
        return None
    text = str(text)
    answer = _after_hashes(text)
    if answer is None:
        answer = _last_boxed(text)
    if answer is None:
        nums = _TEXT_NUMBER.findall(text)
        answer = nums[-1] if nums else None
    return answer.strip() if answer is not None else None


# -----------------------------------------------------------------------------------------------
# numbers

_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")  # \frac{a}{b}, \dfrac, \tfrac
_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)(\d)")  # \frac12
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# sign, mantissa, optional "/ denominator": the *first* number of the cleaned string ("12 apples" -> 12)
_NUMBER = re.compile(r"([+-]?)\s*(\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*([+-]?)\s*(\d+(?:\.\d*)?|\.\d+))?")


def normalize_number(s):
    """'1,234' '-5' '3.50' '3/4' '\\frac{3}{4}' '45%' '$12' '12 apples.' 'x = 7' -> a float, or None.
    A percent sign is dropped ('45%' -> 45.0); math_reward also accepts 0.45 for it."""
    if s is None or isinstance(s, bool):
        return None
    if isinstance(s, numbers.Real):
        return float(s) if math.isfinite(s) else None
    s = str(s).strip()
    boxed = _last_boxed(s)
    if boxed is not None:
        s = boxed
    s = _FRAC.sub(r"\1/\2", s)
    s = _FRAC_SHORT.sub(r"\1/\2", s)
    for junk in ("{,}", "\\,", "\\!", "\\ ", "\\$", "\\%", "$", "€", "£", "¥", "₹"):
        s = s.replace(junk, "")
    s = s.replace("−", "-")  # unicode minus
    if "=" in s:
        s = s.rsplit("=", 1)[1]  # "x = 7": the right-hand side
    s = _THOUSANDS.sub("", s)
    m = _NUMBER.search(s)
    if not m:
        return None
    sign, num, den_sign, den = m.groups()
    value = float(sign + num)
    if den is not None:
        d = float(den_sign + den)
        if d == 0:
            return None
        value /= d
    return value if math.isfinite(value) else None


def _numbers_equal(a, b):
    # whole numbers compare exactly: a relative tolerance would call 109200001 equal to 109200000
    # (GSM8K has answers that big); anything else within 1e-6 relative, so 0.333333 matches 1/3
    if a.is_integer() and b.is_integer():
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _label_number(label):
    """A label is a bare answer ('1,000', '3/4', 7) or a full worked solution ending in '#### N' / \\boxed{}."""
    if isinstance(label, str) and ("####" in label or "\\boxed" in label):
        label = extract_answer(label)
    return normalize_number(label)


# -----------------------------------------------------------------------------------------------
# graders: (response, label) -> float

def math_reward(response, label):
    """1.0 when the response's final answer equals the label as a number, else 0.0."""
    answer = extract_answer(response)
    got, want = normalize_number(answer), _label_number(label)
    if got is None or want is None:
        return 0.0
    if _numbers_equal(got, want):
        return 1.0
    # "45%" for a label of 0.45 is right too (for a label of 45 the line above already said so)
    return 1.0 if "%" in answer and _numbers_equal(got / 100, want) else 0.0


_MC_ANSWER_IS = re.compile(r"(?i:answer)(?:\s+(?i:is))?\s*:?\s*(?:(?i:option|choice)\s*)?[(\[]?([A-J])\b")
_MC_ALONE = re.compile(r"^\s*[(\[]?([A-J])[)\]]?[.:]?\s*$")  # "B", "(B)", "B."
_MC_LEADING = re.compile(r"^\s*[(\[]?([A-J])[)\].:](?:\s|$)")  # "B) because...", "(C) ..."
_MC_PAREN = re.compile(r"[(\[]([A-J])[)\]]")
_MC_WORD = re.compile(r"\b([B-J]|A(?! [a-z]))\b")  # a standalone capital, but not the article in "A cat"


def extract_choice(text):
    """The multiple-choice letter (A-J) a response picks, or None. Explicit forms win over loose ones."""
    if text is None:
        return None
    text = str(text)
    m = _MC_ANSWER_IS.findall(text)
    if m:
        return m[-1]
    final = _after_hashes(text) or _last_boxed(text)
    for candidate in ([final] if final else []) + [text]:
        m = _MC_ALONE.match(candidate) or _MC_LEADING.match(candidate)
        if m:
            return m.group(1)
    for pattern in (_MC_PAREN, _MC_WORD):
        m = pattern.findall(text)
        if m:
            return m[-1]
    return None


def mc_reward(response, label):
    """Multiple choice: 1.0 when the letter the response picks ('B', '(B)', 'Answer: B', 'the answer is B.')
    is the label's letter."""
    got, want = extract_choice(response), extract_choice(str(label).strip().upper())
    return 1.0 if got is not None and got == want else 0.0


def _normalize_text(s):
    """SQuAD's answer normalisation: lowercase, no punctuation, no articles, single spaces."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in string.punctuation)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _final_text(response):
    """What exact/f1 compare: the #### or \\boxed{} answer when there is one, else the whole response."""
    response = "" if response is None else str(response)
    final = _after_hashes(response)
    if final is None:
        final = _last_boxed(response)
    return response if final is None else final


def exact_match(response, label):
    """1.0 when the normalised final answer equals the normalised label (or any of a list of labels)."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    got = _normalize_text(_final_text(response))
    return 1.0 if any(got == _normalize_text(l) for l in labels) else 0.0


def _f1(pred, gold):
    pred, gold = _normalize_text(pred).split(), _normalize_text(gold).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


def f1_reward(response, label):
    """SQuAD token F1 between the final answer and the label (the best over a list of labels)."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    got = _final_text(response)
    return max(_f1(got, l) for l in labels) if labels else 0.0


_FORMAT = re.compile(r"(?:^|\n)[ \t]*####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*$")


def format_reward(response, label=None):
    """1.0 when the response ends with a well-formed '#### N' line (N a plain number), else 0.0."""
    return 1.0 if response is not None and _FORMAT.search(str(response)) else 0.0


GRADERS = {"math": math_reward, "mc": mc_reward, "exact": exact_match, "f1": f1_reward, "format": format_reward}


def parse_rm_type(rm_type):
    """'math' -> [('math', 1.0)]; 'math+format:0.9,0.1' -> [('math', 0.9), ('format', 0.1)];
    'math+format' weighs every component 1.0."""
    names, _, weights = str(rm_type).partition(":")
    names = [n.strip() for n in names.split("+")]
    bad = [n for n in names if n not in GRADERS]
    if bad:
        raise ValueError(f"unknown rm_type component(s) {bad} in {rm_type!r}; valid: {', '.join(GRADERS)} "
                         f"(or a weighted mix like math+format:0.9,0.1)")
    try:
        w = [float(x) for x in weights.split(",")] if weights else [1.0] * len(names)
    except ValueError:
        raise ValueError(f"rm_type {rm_type!r}: weights must be numbers, like math+format:0.9,0.1") from None
    if len(w) != len(names):
        raise ValueError(f"rm_type {rm_type!r}: {len(names)} components but {len(w)} weights")
    return list(zip(names, w))


def compute_reward(rm_type, response, label, metadata=None):
    """A float for a single grader; a dict {component: value, ..., 'total': weighted sum} for a mix.
    metadata is accepted so built-in and custom rewards share one call signature; graders ignore it."""
    parts = parse_rm_type(rm_type)
    if len(parts) == 1 and "+" not in str(rm_type) and ":" not in str(rm_type):
        return GRADERS[parts[0][0]](response, label)
    out = {name: GRADERS[name](response, label) for name, _ in parts}
    out["total"] = sum(out[name] * w for name, w in parts)
    return out


# -----------------------------------------------------------------------------------------------
# custom reward functions

REWARD_SIGNATURE = "fn(response: str, label, metadata: dict | None) -> float | dict with a 'total'"


def load_function(path):
    """'module:function' or 'path/to/file.py:function' -> the callable, with an error that names the path
    and the expected signature when it can't be had."""
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"{path!r}: expected 'module:function' or 'path/to/file.py:function'")
    mod_name, fn_name = path.rsplit(":", 1)
    try:
        if mod_name.endswith(".py") or "/" in mod_name or os.sep in mod_name:
            if not os.path.isfile(mod_name):
                raise FileNotFoundError(f"no such file {mod_name!r}")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(mod_name))[0], mod_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:
        raise ImportError(f"{path!r}: could not import {mod_name!r} ({type(e).__name__}: {e}); "
                          f"expected a module defining {REWARD_SIGNATURE}") from e
    if not hasattr(module, fn_name):
        raise AttributeError(f"{path!r}: {mod_name!r} has no attribute {fn_name!r}; expected {REWARD_SIGNATURE}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise TypeError(f"{path!r}: {fn_name!r} is a {type(fn).__name__}, not a function; expected {REWARD_SIGNATURE}")
    return fn


def _check_reward(value):
    """(float or dict of floats, None) for a finite number or a dict of them with a 'total'; else (None, why)."""
    def number(v):
        if isinstance(v, (str, bytes)) or not isinstance(v, numbers.Real) and not hasattr(v, "__float__"):
            return None  # bools and numpy/torch scalars are fine, strings are not
        try:
            f = float(v)
        except Exception:  # a multi-element tensor, a complex, ...
            return None
        return f if math.isfinite(f) else None
    if isinstance(value, dict):
        if "total" not in value:
            return None, f"a dict reward needs a 'total' key, got keys {sorted(map(str, value))}"
        out = {}
        for k, v in value.items():
            out[k] = number(v)
            if out[k] is None:
                return None, f"reward component {k!r} is not a finite number: {v!r:.80}"
        return out, None
    f = number(value)
    return (f, None) if f is not None else (None, f"reward is not a finite number: {value!r:.80}")


def safe_reward(fn, *args):
    """Call a reward function: (value, None) when it gives a finite number (or a dict of them with a
    'total'), else (None, reason). Never raises."""
    try:
        value = fn(*args)
    except (Exception, SystemExit) as e:  # a reward calling exit() must not end training either
        return None, f"reward raised {type(e).__name__}: {e}"
    try:
        return _check_reward(value)
    except Exception as e:  # a weird object whose __repr__/__float__ blows up
        return None, f"reward returned an unusable {type(value).__name__}: {type(e).__name__}"


# -----------------------------------------------------------------------------------------------
# remote rewards: POST {payload} -> {"reward": number} or {"reward": {component: number, "total": ...}}

class _Retryable(Exception):
    pass


def _post_once(url, body, timeout):
    """One POST; the parsed reward, or raise _Retryable (worth another try) / ValueError (not)."""
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        if e.code >= 500 or e.code == 429:
            raise _Retryable(f"HTTP {e.code}") from None
        raise ValueError(f"HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out (TimeoutError is an OSError)
        reason = getattr(e, "reason", e)
        raise _Retryable(f"{type(reason).__name__}: {reason}") from None
    except Exception as e:  # http.client.RemoteDisconnected, IncompleteRead, ...
        raise _Retryable(f"{type(e).__name__}: {e}") from None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"malformed JSON response: {raw[:80]!r}") from None
    if not isinstance(data, dict) or "reward" not in data:
        raise ValueError(f"response has no 'reward' key: {raw[:80]!r}")
    reward = data["reward"]
    value, err = _check_reward(reward)
    if err is not None:
        raise ValueError(err)
    return value


def _post_with_retries(url, payload, timeout, retries, backoff):
    try:
        body = json.dumps(payload).encode()
    except (TypeError, ValueError) as e:
        return None, f"payload is not JSON-serializable: {e}"
    err = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))  # 0.5, 1, 2, ... so a restarting server gets room
        try:
            return _post_once(url, body, timeout), None
        except _Retryable as e:
            err = str(e)
        except Exception as e:  # a bad answer will not get better by asking again
            return None, str(e)
    return None, f"gave up after {retries + 1} attempts: {err}"


def remote_rewards(url, payloads, concurrency=8, timeout=10.0, retries=3, backoff=0.5):
    """POST each payload (a dict) as JSON to url, `concurrency` at a time; a list in payload order of
    (value, None) or (None, reason). Connection errors, 5xx/429 and timeouts are retried with exponential
    backoff; malformed answers are not. Never raises."""
    payloads = list(payloads)
    if not payloads:
        return []
    pool = ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(payloads))))
    try:
        futures = [pool.submit(_post_with_retries, url, p, timeout, retries, backoff) for p in payloads]
        results = []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:  # belt and braces: _post_with_retries already catches everything
                results.append((None, f"{type(e).__name__}: {e}"))
        return results
    finally:
        # never wait here for workers still blocked in a call: when --rollout-timeout interrupts this function the
        # rollout must end now, not when the last socket gives up
        pool.shutdown(wait=False, cancel_futures=True)
